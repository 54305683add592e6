#!/usr/bin/env bash
# Run 42 (planned; issues 10 and 11), one call of about 5 minutes. Carry `.whl`.
# (1) E2B decode and speculative step at B = 2 with their kernels, after the verify attention tiling of ca092b2
#     (run 38: 24 us per sliding layer in the verify against 7.4 in decode; spec / decode pipelined 1.46);
# (2) 26B-A4B decode at B = 1, 2, 4, synchronised and pipelined, against the roofline of the experts touched
#     (issue 11's goal: >= 70 % at every B; run 40: 49 % at B = 2, 102 % at B = 16, pipelined);
# (3) the 26B speculative step at B = 2 (run 39 ran out of time before it).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run42
trap 'tar czf "$out/results.tar.gz" -C "$res" .' EXIT
{
  run env OUT=$res timeout 100 python3 benchmarks/bench_spec.py --models e2b --batch 2 --context 4096 --profile
  mv "$res/bench_spec.json" "$res/bench_spec_e2b.json"
  run env OUT=$res timeout 130 python3 benchmarks/bench_decode.py --models 26b --batch 1 2 4 --context 4096
  run env OUT=$res timeout 120 python3 benchmarks/bench_spec.py --models 26b --batch 2 --context 4096 --profile
  echo "== $(date +%T) done"
} > "$out/run42.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run42.log" | grep -v "^      " | tail -n 80
