#!/usr/bin/env bash
# Run 34 (issue 12's host overhead, issue 10's kernel table), after the fix: no step program holds a `lax.cond`
# (greedy and sampled batches run separate variants) and every step program is compiled with
# xla_gpu_command_buffer_update_mode=SKIP_TEMP (step.compiler_options). Carry `.whl`.
# (1) probe_dispatch with XLA's command-buffer log: the option reaches XLA (no full re-record), calls return early;
# (2) bench_host_overhead, E2B B = 1 and 2, plain and speculative: engine step vs the program pipelined (<= 5 %);
# (3) kernel counts of E2B B = 2: decode, verify, speculative and the sampled variants.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run34
{
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 \
      run env OUT=$res timeout 120 python3 lab/probes/probe_dispatch.py --tag fixed 2> "$res/logs/fixed_vlog.txt"
  grep -E "Updated [0-9]+ commands" "$res/logs/fixed_vlog.txt" | sed -E 's/.*\] //' | sort | uniq -c | sort -rn | head
  for spec in "" --spec; do
    run env OUT=$res timeout 200 python3 benchmarks/bench_host_overhead.py --model e2b --batch 1 2 --context 1024 \
        --steps 40 $spec
    mv "$res/bench_host_overhead.json" "$res/host_overhead${spec:+_spec}.json"
  done
  run env OUT=$res timeout 200 python3 benchmarks/kernel_count.py --models e2b --batch 2 \
      --programs decode verify speculative decode_sampled speculative_sampled
  echo "== $(date +%T) done"
} > "$out/run34.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run34.log" | tail -n 80
