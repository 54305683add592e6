#!/usr/bin/env bash
# Run 21 (issue 11): the routed-expert MoE path on the H200. Carry `.whl`, `.whl_tk` (tokamax and its missing
# dependencies) and `.baseline` (the tree before issue 11: `git archive e20cfd3 gemma4_mtp_jax benchmarks | tar x -C
# .baseline --exclude='*demo_pair*'`). About 9 minutes, in priority order:
# (1) the kernel and MoE tests compiled on the GPU (grouped matmul, parity, speculative, engine);
# (2) bench_moe.py: one layer's experts, dense / ours / ragged_dot / tokamax, N = 1 .. 2048;
# (3) 26B-A4B decode at B = 1, 2, 4, 16 against the roofline of the experts touched;
# (4) the speculative step / decode at k = 4, B = 2 (the projected speedup);
# (5) before: the dense-expert tree's decode at B = 2; prefill of 2048 tokens after and before.
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    .whl_tk/*.whl || exit 1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"; res=/tmp/run21; mkdir -p "$res"
run() { echo "== $(date +%T) $*"; "$@"; echo "== rc=$?"; }
{
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
  OUT=$res run timeout 200 bash scripts/gpu_suite.sh tests/test_grouped_matmul.py tests/test_parity_target.py \
      tests/test_speculative.py -k "grouped or a26b or routed or kernel or tiles"
  export PYTHONPATH=$PWD:/tmp/site
  OUT=$res run timeout 100 python3 benchmarks/bench_moe.py --tokens 1 2 4 10 16 2048
  OUT=$res run timeout 150 python3 benchmarks/bench_decode.py --models 26b --batch 1 2 4 16 --context 4096
  OUT=$res run timeout 110 python3 benchmarks/bench_spec.py --models 26b --batch 2 --k 4 --context 4096
  OUT=$res run timeout 60 python3 benchmarks/bench_prefill.py --models 26b --prompt 2048 --repeats 3
  mv "$res/bench_prefill.json" "$res/bench_prefill_after.json" 2>/dev/null
  export PYTHONPATH=$PWD/.baseline:/tmp/site
  mkdir -p "$res/before"
  OUT=$res/before run timeout 70 python3 .baseline/benchmarks/bench_decode.py --models 26b --batch 2 --context 4096
  OUT=$res/before run timeout 60 python3 .baseline/benchmarks/bench_prefill.py --models 26b --prompt 2048 --repeats 3
  echo "== $(date +%T) done"
} > "$out/run21.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W1201\|^I1201\|^W1202\|^I1202" "$out/run21.log" | tail -n 90
