#!/usr/bin/env bash
# Run 14 (issue 9, planned): the shipped pair measured on the H200, everything in one call (~8 minutes), with .whl/
# carried and acceptance_prompts.json in the tree (benchmarks/acceptance.py --prompts-out writes it on the CPU):
# (1) the server under load at concurrency 1, 8, 32, spec vs plain (serve_load.py); (2) `generate` at batch 1,
# spec vs plain, against the projection from the pair's step times measured just before (bench_spec.py +
# realized_speedup.py); (3) the README's server command, cold and warm start (serve_check.py).
# Each part writes its JSON under $OUT as it finishes, so a part cut short does not lose the ones before it.
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TQDM_DISABLE=1
out=${OUT:-/tmp/out}; mkdir -p "$out/logs"
run() { echo "== $*"; "$@"; echo "== rc=$?"; }
{
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
  run timeout 230 python3 benchmarks/serve_load.py --concurrency 1,8,32 --max-tokens 128 \
      --out "$out/serve_load.json" --log-dir "$out/logs"
  run timeout 80 python3 benchmarks/bench_spec.py --models demo --batch 1 8 32 --context 256 --repeats 50
  run timeout 90 python3 benchmarks/realized_speedup.py --prompts acceptance_prompts.json \
      --bench-spec "$out/bench_spec.json" --out "$out/realized_speedup.json"
  run timeout 120 python3 benchmarks/serve_check.py --runs cold warm
} > "$out/run14.log" 2>&1
(cd "$out" && tar cf logs.tar logs serve_*.log 2>/dev/null; rm -rf logs serve_cold.log serve_warm.log)
grep -E "^== |speedup|tok/s|\|" "$out/run14.log" | tail -60
