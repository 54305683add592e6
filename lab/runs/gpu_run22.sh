#!/usr/bin/env bash
# Run 22 (issue 11): the grouped-matmul kernel with contiguous block loads (run 21's gather loads ran at
# 0.2-1.3 TB/s). Carry `.whl`. About 5.5 minutes: (1) the kernel tests and the MoE parity on the GPU; (2) bench_moe
# (N = 1, 2, 16, 2048; tilings swept at 2 and 2048); (3) 26B-A4B decode at B = 2, 16 against the touched-experts
# roofline; (4) the speculative step / decode at B = 2, k = 4.
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"; res=/tmp/run22; mkdir -p "$res"
run() { echo "== $(date +%T) $*"; "$@"; echo "== rc=$?"; }
{
  OUT=$res run timeout 110 bash scripts/gpu_suite.sh tests/test_grouped_matmul.py tests/test_parity_target.py \
      -k "grouped or a26b"
  export PYTHONPATH=$PWD:/tmp/site
  OUT=$res run timeout 70 python3 benchmarks/bench_moe.py --tokens 1 2 16 2048 --no-tokamax --repeats 30
  OUT=$res run timeout 90 python3 benchmarks/bench_decode.py --models 26b --batch 2 16 --context 4096
  OUT=$res run timeout 95 python3 benchmarks/bench_spec.py --models 26b --batch 2 --k 4 --context 4096
  echo "== $(date +%T) done"
} > "$out/run22.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W1201\|^I1201\|Autotuning" "$out/run22.log" | tail -n 70
