#!/usr/bin/env bash
# Run 31 (issues 10 and 12; planned, not yet run). Carry `.whl` and `.baseline` (`git archive 7caa80e`, without the
# demo pair: the tree before the paged-attention layout change and the PLE barrier). What run 29 meant to measure:
# (1) kernels per step, E2B B = 2 / 16, this tree and the baseline (issue 10's table: <= 8 per layer, <= 25 per
#     draft step);
# (2) E2B spec / decode synchronised and pipelined at B = 2, 8, 16 (run 28's serving showed B = 8 as an outlier);
# (3) the engine's host overhead against the program's pipelined time, plain and speculative (issue 12: <= 5 %).
# Limits are generous: an E2B program compiles in 15-25 s here, and run 29 lost its benches to 100 s limits.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run31
{
  for tree in . .baseline; do
    tag=$([ "$tree" = . ] && echo after || echo before)
    (cd $tree && run env PYTHONPATH=$PWD:/tmp/site OUT=$res timeout 200 python3 benchmarks/kernel_count.py --models e2b --batch 2 16)
    mv "$res/kernel_count.json" "$res/kernel_count_$tag.json"
  done
  run env OUT=$res timeout 200 python3 benchmarks/bench_spec.py --models e2b --batch 2 8 16
  for spec in "" --spec; do
    run env OUT=$res timeout 120 python3 benchmarks/bench_host_overhead.py --model e2b --batch 1 2 --context 1024 \
        --steps 40 $spec
    mv "$res/bench_host_overhead.json" "$res/host_overhead${spec:+_spec}.json"
  done
  echo "== $(date +%T) done"
} > "$out/run31.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run31.log" | tail -n 100
