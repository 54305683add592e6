#!/usr/bin/env bash
# Run 23 (issue 12, planned, not yet run): the server at E2B's real shapes and the prefix cache's TTFT. Carry `.whl`.
# (1) E2B random weights (--load-format dummy), random 512-token prompts, 128 tokens each (ignore-EOS), spec vs plain
#     at C = 1, 8, 32, 64 (goal: spec >= 1.3x plain tok/s at C = 64);
# (2) the demo pair, plain, prompts behind a shared 2048-token prefix, prefix cache on vs off (goal: TTFT cut >= 5x).
# Results in one tarball beside the log.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run23
{
  run timeout 330 python3 benchmarks/bench_serve.py --random-weights e2b --dataset random --input-len 512 \
      --output-len 128 --ignore-eos --concurrency 1,8,32,64 --requests-per-level 128 \
      --server-arg=--max-model-len=1024 --out "$res/serve_e2b.json" --log-dir "$res/logs"
  for cache in on off; do
    flag=--enable-prefix-caching; [ "$cache" = off ] && flag=--no-enable-prefix-caching
    run timeout 120 python3 benchmarks/bench_serve.py --assistant-modes plain --dataset random \
        --random-prefix-len 2048 --input-len 64 --output-len 16 --ignore-eos --concurrency 1,8 \
        --requests-per-level 32 --server-arg=--max-model-len=2304 --server-arg=$flag \
        --out "$res/prefix_$cache.json" --log-dir "$res/logs"
  done
  echo "== $(date +%T) done"
} > "$out/run23.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12" "$out/run23.log" | tail -n 80
