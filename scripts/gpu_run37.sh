#!/usr/bin/env bash
# Run 37 (planned; branch param-pack, issue 12's host overhead): the step programs take the target's norm scales and
# layer scalars packed into one array per dtype (param_pack.py: E2B 540 -> 279 arrays, 31B 832 -> 412), since each
# array costs ~2.9 us of host time per call (run 36). Carry `.whl` and `.baseline` (`git archive main` of the tree
# this branch forks from: `mkdir .baseline && git archive main | tar -x -C .baseline`).
# (1) probe_dispatch in both trees: the trivial program on the tree vs the packed parameters, decode held/pipelined;
# (2) bench_host_overhead E2B B = 1 / 2, plain and speculative, this tree (<= 5 % is the goal);
# (3) kernel counts and compile seconds, E2B B = 2, both trees (the unpacking slices must fuse: no new kernels;
#     on the CPU backend they doubled the E2B decode compile, 3.9-5.4 s -> 8.4-11.8 s: cold start pays that);
# (4) bench_spec E2B B = 2: the device time must not grow.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run37
{
  for tree in . .baseline; do
    tag=$([ "$tree" = . ] && echo packed || echo main)
    (cd $tree && run env PYTHONPATH=$PWD:/tmp/site OUT=$res timeout 150 python3 benchmarks/probe_dispatch.py --tag $tag)
    (cd $tree && run env PYTHONPATH=$PWD:/tmp/site OUT=$res timeout 200 python3 benchmarks/kernel_count.py \
        --models e2b --batch 2 --json-name kernel_count_$tag.json)
  done
  for spec in "" --spec; do
    run env OUT=$res timeout 200 python3 benchmarks/bench_host_overhead.py --model e2b --batch 1 2 --context 1024 \
        --steps 40 $spec
    mv "$res/bench_host_overhead.json" "$res/host_overhead${spec:+_spec}.json"
  done
  run env OUT=$res timeout 150 python3 benchmarks/bench_spec.py --models e2b --batch 2
  echo "== $(date +%T) done"
} > "$out/run37.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run37.log" | tail -n 100
