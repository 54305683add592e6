#!/usr/bin/env bash
# Run 28 (issue 12): the server at E2B's real shapes (random bf16 weights, --load-format dummy). Carry `.whl`.
# (1) random 512-token prompts, 128 tokens each (ignore-EOS), spec vs plain at C = 1, 8, 32, 64
#     (goal: spec >= 1.3x plain output tok/s at C = 64);
# (2) plain at C = 8 while a 4096-token prompt arrives every second (goal: the streams' inter-chunk p99 <= 2x p50);
# (3) a shared 2048-token prefix + 64 tokens, C = 1, prefix cache on vs off (goal: TTFT cut >= 5x), hits recorded.
# Results in one tarball beside the log.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run28
{
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  run timeout 330 python3 benchmarks/bench_serve.py --random-weights e2b --dataset random --input-len 512 \
      --output-len 128 --ignore-eos --concurrency 1,8,32,64 \
      --server-arg=--max-model-len=1024 --out "$res/serve_e2b.json" --log-dir "$res/logs"
  run timeout 120 python3 benchmarks/bench_serve.py --random-weights e2b --assistant-modes plain --dataset random \
      --input-len 128 --output-len 256 --ignore-eos --concurrency 8 --requests-per-level 24 \
      --long-prompt-len 4096 --long-prompt-interval 1 --server-arg=--max-model-len=4352 \
      --out "$res/long_prompts_e2b.json" --log-dir "$res/logs"
  for cache in on off; do
    flag=--enable-prefix-caching; [ "$cache" = off ] && flag=--no-enable-prefix-caching
    run timeout 65 python3 benchmarks/bench_serve.py --random-weights e2b --assistant-modes plain --dataset random \
        --random-prefix-len 2048 --input-len 64 --output-len 16 --ignore-eos --concurrency 1 \
        --requests-per-level 16 --server-arg=--max-model-len=2304 --server-arg=$flag \
        --out "$res/prefix_e2b_$cache.json" --log-dir "$res/logs"
  done
  echo "== $(date +%T) done"
} > "$out/run28.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12" "$out/run28.log" | tail -n 120
