#!/usr/bin/env bash
# Run 49 (planned; issues 10 and 12), one call under 590 s. Carry `.whl`. Run it after the GPU suite (BUILD.md's two
# calls): run 48 ran only 114 tests under the VMM allocator that SKIP_TEMP in XLA_FLAGS brings.
# With the step programs no longer re-recording their command buffers (run 48):
# (1) bench_spec E2B B = 2, 16: spec / decode, synchronised and pipelined (issue 10: <= 1.20 and <= 1.35; run 44:
#     1.24 pipelined at B = 2, when every call still re-recorded most nodes);
# (2) the trained demo pair served, spec vs plain, C = 1, 8, 32, 64 (issue 12: spec >= 1.3x plain at C = 64; run
#     29 measured it while the speculative engine was host-bound);
# (3) bench_host_overhead E2B B = 2 (run 48 measured B = 1 only).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run49
end=580
{
  run env OUT=$res timeout $(lim 150) python3 benchmarks/bench_spec.py --models e2b --batch 2 16 --context 4096
  run timeout $(lim 200) python3 benchmarks/bench_serve.py --dataset chat --concurrency 1,8,32,64 --max-tokens 128 \
      --out "$res/serve_demo.json" --log-dir "$res/logs"
  for spec in "" --spec; do
    run env OUT=$res timeout $(lim 90) python3 benchmarks/bench_host_overhead.py --model e2b --batch 2 \
        --context 1024 --steps 40 $spec
    mv "$res/bench_host_overhead.json" "$res/host_overhead_b2${spec:+_spec}.json"
  done
  echo "== $(date +%T) done"
} > "$out/run49.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run49.log" | tail -n 80
