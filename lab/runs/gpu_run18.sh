#!/usr/bin/env bash
# Run 18 (issue 9, planned): the realized speedup of the shipped pair with every figure from one call, against the
# projection from step times measured in the same call. Carry `.whl/` and acceptance_prompts.json (git-ignored;
# benchmarks/acceptance.py --prompts-out writes it). About 8 minutes:
# (1) the pair's decode and speculative steps at B = 1, 8, 32 (bench_spec.py: the projection L x t_decode / t_spec);
# (2) `generate` at batch 1, an engine with the assistant vs one without (realized_speedup.py, fixed in 729f9a4);
# (3) the server under load, spec vs plain, C = 1, 8, 32, 96 requests per level (bench_serve.py).
# Few files come back from $OUT: everything but the log goes into one tarball.
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"; res=/tmp/run18; mkdir -p "$res/logs"
run() { echo "== $(date +%T) $*"; "$@"; echo "== rc=$?"; }
{
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
  OUT=$res run timeout 110 python3 benchmarks/bench_spec.py --models demo --batch 1 8 32 --context 256 --repeats 100
  run timeout 130 python3 benchmarks/realized_speedup.py --prompts acceptance_prompts.json --max-new-tokens 128 \
      --bench-spec "$res/bench_spec.json" --out "$res/realized_bf16.json"
  run timeout 260 python3 benchmarks/bench_serve.py --concurrency 1,8,32 --requests-per-level 96 --max-tokens 128 \
      --out "$res/bench_serve.json" --log-dir "$res/logs"
  echo "== $(date +%T) done"
} > "$out/run18.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W1201\|^I1201" "$out/run18.log" | tail -n 80
