#!/usr/bin/env bash
# Run 23 (issue 12, planned, not yet run): the server at E2B's real shapes. Carry `.whl`. (The prefix-cache part
# first planned here ran as run 25, with the demo pair.)
# (1) E2B random weights (--load-format dummy), random 512-token prompts, 128 tokens each (ignore-EOS), spec vs plain
#     at C = 1, 8, 32, 64 (goal: spec >= 1.3x plain tok/s at C = 64);
# (2) plain at C = 8 while a 4096-token prompt arrives every second (goal: the streams' inter-chunk p99 <= 2x p50).
# Results in one tarball beside the log.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run23
{
  run timeout 330 python3 benchmarks/bench_serve.py --random-weights e2b --dataset random --input-len 512 \
      --output-len 128 --ignore-eos --concurrency 1,8,32,64 --requests-per-level 128 \
      --server-arg=--max-model-len=1024 --out "$res/serve_e2b.json" --log-dir "$res/logs"
  run timeout 200 python3 benchmarks/bench_serve.py --random-weights e2b --assistant-modes plain --dataset random \
      --input-len 128 --output-len 256 --ignore-eos --concurrency 8 --requests-per-level 32 \
      --long-prompt-len 4096 --long-prompt-interval 1 --server-arg=--max-model-len=4352 \
      --out "$res/long_prompts_e2b.json" --log-dir "$res/logs"
  echo "== $(date +%T) done"
} > "$out/run23.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12" "$out/run23.log" | tail -n 80
