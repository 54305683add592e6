#!/usr/bin/env bash
# Run 30 (issue 12): E2B prefix TTFT after the spare-ring fix (a419915), cache on vs off: run 29's attempt was cut
# by a 60 s limit while the first server still compiled. Carry `.whl`. Results in one tarball beside the log.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run30
{
  for cache in on off; do
    flag=--enable-prefix-caching; [ "$cache" = off ] && flag=--no-enable-prefix-caching
    run timeout 110 python3 benchmarks/bench_serve.py --random-weights e2b --assistant-modes plain --dataset random \
        --random-prefix-len 2048 --input-len 64 --output-len 16 --ignore-eos --concurrency 1 \
        --requests-per-level 16 --server-arg=--max-model-len=2176 --server-arg=$flag \
        --out "$res/prefix_e2b_$cache.json" --log-dir "$res/logs_$cache"
  done
  echo "== $(date +%T) done"
} > "$out/run30.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12" "$out/run30.log" | tail -n 60
