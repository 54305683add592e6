#!/usr/bin/env bash
# Run 29 (issues 10 and 12). Carry `.whl` and `.baseline` (`git archive 7caa80e`, without the demo pair: the tree
# before the paged-attention layout change and the PLE barrier).
# (1) the paged-attention tests on the GPU (the kernel changed); (2) kernels per step, E2B B = 2 / 16, this tree and
# the baseline; (3) bench_spec E2B B = 2 / 16 (synchronised and pipelined), this tree then the baseline, same
# process order; (4) E2B prefix TTFT, cache on vs off, after the spare-ring fix; (5) the trained demo pair served, spec vs plain,
# C = 1, 8, 32, 64 (issue 12's 1.3x goal needs real acceptance).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run29
cp benchmarks/bench_spec.py .baseline/benchmarks/bench_spec.py  # the same (pipelined) timing on both trees
{
  run env GEMMA4_TEST_JAX_PLATFORMS=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider -x tests/test_paged_attention.py
  for tree in . .baseline; do
    tag=$([ "$tree" = . ] && echo after || echo before)
    (cd $tree && run env PYTHONPATH=$PWD:/tmp/site OUT=$res timeout 100 python3 benchmarks/kernel_count.py --models e2b --batch 2 16)
    mv "$res/kernel_count.json" "$res/kernel_count_$tag.json"
    (cd $tree && run env PYTHONPATH=$PWD:/tmp/site OUT=$res timeout 100 python3 benchmarks/bench_spec.py --models e2b --batch 2 16)
    mv "$res/bench_spec.json" "$res/bench_spec_$tag.json"
  done
  for cache in on off; do
    flag=--enable-prefix-caching; [ "$cache" = off ] && flag=--no-enable-prefix-caching
    run timeout 60 python3 benchmarks/bench_serve.py --random-weights e2b --assistant-modes plain --dataset random \
        --random-prefix-len 2048 --input-len 64 --output-len 16 --ignore-eos --concurrency 1 \
        --requests-per-level 16 --server-arg=--max-model-len=2304 --server-arg=$flag \
        --out "$res/prefix_e2b_$cache.json" --log-dir "$res/logs_$cache"
  done
  run timeout 140 python3 benchmarks/bench_serve.py --dataset chat --concurrency 1,8,32,64 --max-tokens 128 \
      --out "$res/serve_demo.json" --log-dir "$res/logs"
  echo "== $(date +%T) done"
} > "$out/run29.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run29.log" | tail -n 100
