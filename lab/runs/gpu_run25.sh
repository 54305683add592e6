#!/usr/bin/env bash
# Run 25 (issue 12): the engine's host overhead with async scheduling on and off at E2B's real shapes (random bf16
# weights, B = 1, plain and speculative), and the prefix cache's TTFT (the demo pair, a shared 2048-token prefix,
# cache on vs off). Carry `.whl`. Results in one tarball beside the log.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run25
{
  for spec in "" --spec; do
    run env OUT=$res timeout 170 python3 benchmarks/bench_host_overhead.py --model e2b --batch 1 2 --context 1024 \
        --steps 40 $spec
    mv "$res/bench_host_overhead.json" "$res/host_overhead${spec:+_spec}.json"
  done
  for cache in on off; do
    flag=--enable-prefix-caching; [ "$cache" = off ] && flag=--no-enable-prefix-caching
    run timeout 75 python3 benchmarks/bench_serve.py --assistant-modes plain --dataset random \
        --random-prefix-len 2048 --input-len 64 --output-len 16 --ignore-eos --concurrency 1 \
        --requests-per-level 16 --server-arg=--max-model-len=2304 --server-arg=$flag \
        --out "$res/prefix_$cache.json" --log-dir "$res/logs"
  done
  echo "== $(date +%T) done"
} > "$out/run25.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12" "$out/run25.log" | grep -v "^{'model'" | tail -n 60
