#!/usr/bin/env bash
# Run 40: (1) does XLA read a matmul's weights out of a larger array without copying them
# (lab/probes/probe_slice_fusion.py; run 39's pack mode "all" added a copy per weight)? (2) 26B-A4B decode at
# B = 2 and 16, synchronised and pipelined, after row_tiles' search became one fusion, and (3) before it at B = 16
# (carry `.baseline`: this tree with that one line reverted), since run 39's synchronised step times rose while the
# traced device time fell. Carry `.whl` and `.baseline`.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run40
trap 'tar czf "$out/results.tar.gz" -C "$res" .' EXIT
{
  run env OUT=$res timeout 60 python3 lab/probes/probe_slice_fusion.py
  run env OUT=$res timeout 110 python3 benchmarks/bench_decode.py --models 26b --batch 2 16 --context 4096
  mkdir -p $res/before
  run env OUT=$res/before PYTHONPATH=$PWD/.baseline:/tmp/site timeout 90 python3 .baseline/benchmarks/bench_decode.py \
      --models 26b --batch 16 --context 4096
  echo "== $(date +%T) done"
} > "$out/run40.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run40.log" | tail -n 60
