#!/usr/bin/env bash
# Run 45 (issues 10 and 12), one call under 580 s. Carry `.whl`.
# (1) lab/probes/probe_decode_variants.py at E2B, B = 2 and 16: kernels per step and pipelined time of the decode
#     program as it is, against one change at a time: no split-K (3 of a layer's 21 kernels are split-K reductions
#     in run 44's HLO), cuBLAS GEMMs, q/k/v normed as one array (4 norm / RoPE fusions per layer today), and two
#     other ways to hand each layer its per-layer input (35 `wrapped_slice` copies today). One process, one machine:
#     the ratios are what counts.
# (2) With the time left: why the speculative engine's async step is slower than its synchronous one (run 43: 10.9
#     vs 5.7 ms at E2B B = 1). XLA logs each command-buffer update ("Updated N commands in T us") under
#     TF_CPP_VMODULE; the benchmark prints which engine runs when.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run45
end=570
{
  run env OUT=$res timeout $(lim 400) python3 lab/probes/probe_decode_variants.py --model e2b --batch 2 16 \
      --deadline 330
  run env OUT=$res TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 TF_CPP_MIN_LOG_LEVEL=0 \
      timeout $(lim 100) python3 benchmarks/bench_host_overhead.py --model e2b --batch 1 --context 1024 \
      --steps 40 --spec \
      > "$res/host_overhead_spec_vmodule.log" 2>&1
  echo "== rc=$? (the log: host_overhead_spec_vmodule.log)"
  grep -v "Updated\|command_buffer\|command_executor" "$res/host_overhead_spec_vmodule.log" | tail -n 30
  grep -c "Updated" "$res/host_overhead_spec_vmodule.log"
  echo "== $(date +%T) done"
} > "$out/run45.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12" "$out/run45.log" | grep -v "^{'variant'" | tail -n 80
