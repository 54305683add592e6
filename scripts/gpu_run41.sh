#!/usr/bin/env bash
# Run 41 (planned; issue 12's host overhead): `EngineConfig.pack_params` with the row layout (param_pack.py: E2B's
# 540 parameter arrays per call -> ~20), off and on in one run, E2B: (1) probe_dispatch; (2) decode and speculative
# kernel counts with compile seconds (run 40's probe: row slices are read in place, so packing should add none);
# (3) bench_host_overhead at B = 1 and 2, plain and speculative (goal: async step within 5 % of the pipelined
# program). If packing wins, turn it on by default once the loaded tree is no longer held beside the packed copy.
# Carry `.whl`.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run41
trap 'tar czf "$out/results.tar.gz" -C "$res" .' EXIT
{
  for pack in "" --pack-params; do
    tag=${pack:+packed}; tag=${tag:-tree}
    run env OUT=$res timeout 100 python3 benchmarks/probe_dispatch.py --tag $tag $pack
    run env OUT=$res timeout 150 python3 benchmarks/kernel_count.py --models e2b --batch 2 \
        --programs decode speculative --json-name kernel_count_$tag.json $pack
    for spec in "" --spec; do
      run env OUT=$res timeout 150 python3 benchmarks/bench_host_overhead.py --model e2b --batch 1 2 \
          --context 1024 --steps 40 $spec $pack
      mv "$res/bench_host_overhead.json" "$res/host_overhead_${tag}${spec:+_spec}.json"
    done
  done
  echo "== $(date +%T) done"
} > "$out/run41.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run41.log" | tail -n 100
