#!/usr/bin/env bash
# Run 46 (issues 10 and 12), one call under 500 s. Carry `.whl`.
# (1) probe_decode_variants.py, now timing round-robin over 7 rounds (run 45 timed each variant once in turn, and
#     two variants with identical kernels differed by 8-11 %): E2B B = 2, 16 as the model is, with split K forced to
#     1 (run 45: 730 -> 642 kernels at B = 2), and with q/k/v normed as one array; then 31B B = 2, 16 with and without
#     split K, since forcing it off could cost the large matmuls their SM occupancy.
# (2) probe_dispatch.py --spec under TF_CPP_VMODULE: run 45 logged 207 updates of all 965 command-buffer nodes of the
#     speculative program in one benchmark (5.4 ms of host time each), where decode's updates are skipped. Which
#     buffers move, and whether inputs placed on the device once stop the updates.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run46
end=490
{
  run env OUT=$res timeout $(lim 150) python3 lab/probes/probe_decode_variants.py --model e2b --batch 2 16 \
      --variants model no_split_k joint_norm --rounds 7
  mv "$res/probe_decode_variants.json" "$res/probe_decode_variants_e2b.json"
  run env OUT=$res TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 TF_CPP_MIN_LOG_LEVEL=0 \
      timeout $(lim 90) python3 lab/probes/probe_dispatch.py --spec --context 1024 --repeats 40 \
      > "$res/probe_dispatch_spec_vmodule.log" 2>&1
  echo "== rc=$? (log: probe_dispatch_spec_vmodule.log)"
  grep -v "Updated\|command_buffer\|command_executor\|^I12\|^W12" "$res/probe_dispatch_spec_vmodule.log" | tail -n 12
  grep -o "Updated [0-9]* commands in [0-9]* μs (skipped [0-9]*" "$res/probe_dispatch_spec_vmodule.log" \
      | awk '{print $2, "skipped", $7}' | sort | uniq -c
  run env OUT=$res timeout $(lim 220) python3 lab/probes/probe_decode_variants.py --model 31b --batch 2 16 \
      --variants model no_split_k --rounds 5
  mv "$res/probe_decode_variants.json" "$res/probe_decode_variants_31b.json"
  echo "== $(date +%T) done"
} > "$out/run46.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12" "$out/run46.log" | tail -n 80
