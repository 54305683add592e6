#!/usr/bin/env bash
# Run 37 (planned; issue 12's host overhead): `EngineConfig.pack_params` ("none" by default) passes the target's
# norm scales and layer scalars ("vectors": E2B 540 -> 279 arrays, 31B 832 -> 412), or every leaf up to 1 GiB
# ("all"), packed into a few arrays per dtype (param_pack.py), since each array costs ~2.9 us of host time per call
# (run 36). The three modes in one run. Carry `.whl`.
# (1) probe_dispatch: the trivial program on the tree vs the packed parameters; the decode call held / pipelined;
# (2) kernel counts and compile seconds of the E2B B = 2 decode program (on the CPU backend packing added one kernel per layer and
#     doubled the E2B decode compile, 3.9-5.4 s -> 8.4-11.8 s: cold start pays that);
# (3) bench_host_overhead E2B B = 1, plain and speculative (issue 12's goal: <= 5 % at B = 1).
# If packing wins: turn it on by default, run the GPU suite, record the figures in RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run37
{
  for mode in all none vectors; do
    pack="--pack-params $mode"; tag=$mode
    run env OUT=$res timeout 150 python3 benchmarks/probe_dispatch.py --tag $tag $pack
    run env OUT=$res timeout 120 python3 benchmarks/kernel_count.py --models e2b --batch 2 --programs decode \
        --json-name kernel_count_$tag.json $pack
    for spec in "" --spec; do
      run env OUT=$res timeout 150 python3 benchmarks/bench_host_overhead.py --model e2b --batch 1 \
          --context 1024 --steps 40 $spec $pack
      mv "$res/bench_host_overhead.json" "$res/host_overhead_${tag}${spec:+_spec}.json"
    done
  done
  echo "== $(date +%T) done"
} > "$out/run37.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run37.log" | tail -n 100
