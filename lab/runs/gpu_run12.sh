#!/usr/bin/env bash
# Run 12 (issue 9): the trained demo pair on the H200. (1) The README's server command with default flags: cold and
# warm start, chat plain and streaming, SIGTERM -> 0 (serve_check.py). (2) Decode and speculative step of the pair
# alone (bench_spec.py --models demo). (3) `generate` at batch 1, spec vs plain, against the projection from (2)
# (realized_speedup.py). (4) The server under load at concurrency 1, 8, 32, spec vs plain (serve_load.py).
# Runs on the machine run 11 trained on (runs/demo is still there): installs that pair into the package first.
# Needs .whl/ (scripts/fetch_gpu_wheels.sh) and .corpus/ (scripts/fetch_demo_corpus.sh) carried.
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
out=${OUT:-/tmp/out}; mkdir -p "$out" "$out/logs"
L=${ACCEPTANCE_LENGTH:-3.0}
{
  git log --oneline -1 2>/dev/null; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
  echo "== install"; python3 -m gemma4_mtp_jax.train_demo --corpus .corpus/text --out runs/demo --install || exit 1
  echo "== serve_check"; timeout 130 python3 benchmarks/serve_check.py --runs cold warm
  echo "== bench_spec"; timeout 90 python3 benchmarks/bench_spec.py --models demo --batch 1 8 32 --context 256 \
      --acceptance-length "$L" --repeats 50
  echo "== realized_speedup"; timeout 100 python3 benchmarks/realized_speedup.py --corpus .corpus/text \
      --bench-spec "$out/bench_spec.json" --out "$out/realized_speedup.json"
  echo "== serve_load"; timeout 200 python3 benchmarks/serve_load.py --concurrency 1,8,32 --max-tokens 128 \
      --out "$out/serve_load.json" --log-dir "$out/logs"
} 2>&1 | tr '\r' '\n' > "$out/run12.log"
(cd "$out" && tar cf logs.tar logs && rm -rf logs)
grep -v -E "it/s|step/s" "$out/run12.log" | tail -60
