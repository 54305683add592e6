#!/usr/bin/env bash
# Run 38 (issues 10 and 11): where the device time of a step goes, kernel by kernel (benchmarks/kernel_profile.py,
# a jax.profiler trace; kernel durations, not launch gaps). Carry `.whl`.
# (1) bench_moe: one layer's experts at N = 1, 2, 16, the grouped (ours) and dense blocks traced;
# (2) 26B-A4B decode at B = 1, 2, 16 with its kernels (B = 16 never finished inside run 21's limit);
# (3) E2B decode and speculative step at B = 2 with their kernels (issue 10: 730 / 946 kernels per step).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run38
{
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
  run env OUT=$res timeout 100 python3 benchmarks/bench_moe.py --tokens 1 2 16 --no-tokamax --sweep-at --profile
  run env OUT=$res timeout 230 python3 benchmarks/bench_decode.py --models 26b --batch 1 2 16 --context 4096 --profile
  mv "$res/bench_decode.json" "$res/bench_decode_26b.json"
  run env OUT=$res timeout 90 python3 benchmarks/bench_decode.py --models e2b --batch 2 --context 4096 --profile
  run env OUT=$res timeout 110 python3 benchmarks/bench_spec.py --models e2b --batch 2 --context 4096 --profile
  echo "== $(date +%T) done"
} > "$out/run38.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run38.log" | tail -n 230
