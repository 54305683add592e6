#!/usr/bin/env bash
# Run 19 (issues 10 and 12, planned), no wheels needed: (1) the engine's host overhead per step against its program
# alone on the real E2B shape, plain and speculative, B = 1, 2, 16 (bench_host_overhead.py; goal <= 5 % at B = 1);
# (2) kernels per program for E2B and 31B at B = 2 and 16 (kernel_count.py), one process at a time. Results in one
# tarball beside the log (few files come back from $OUT).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"; res=/tmp/run19; mkdir -p "$res"
run() { echo "== $(date +%T) $*"; "$@"; echo "== rc=$?"; }
{
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
  OUT=$res run timeout 200 python3 benchmarks/bench_host_overhead.py --model e2b --batch 1 2 16 --context 1024
  mv "$res/bench_host_overhead.json" "$res/host_overhead_plain.json" 2>/dev/null
  OUT=$res run timeout 200 python3 benchmarks/bench_host_overhead.py --model e2b --batch 1 2 16 --context 1024 --spec
  mv "$res/bench_host_overhead.json" "$res/host_overhead_spec.json" 2>/dev/null
  OUT=$res run timeout 150 python3 benchmarks/kernel_count.py --models e2b 31b --batch 2 16
  echo "== $(date +%T) done"
} > "$out/run19.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W1201\|^I1201" "$out/run19.log" | tail -n 60
