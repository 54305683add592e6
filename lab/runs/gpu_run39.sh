#!/usr/bin/env bash
# (Ran at a26c06e, when --pack-params took a mode: none / vectors / all. It is now a switch; run41 measures it.)
# Run 39: (1) 26B-A4B decode after row_tiles' binary search became one compare fusion (run 38: 32 of its ~72
# kernels per layer were that search's loop); (2) param packing, modes "all" and "none" (run37's measurements:
# probe, E2B decode kernel count and compile seconds, host overhead at B = 1 plain and speculative); (3) the paged
# attention kernel at E2B's verify shapes (B = 2, 5 query tokens; run 38: 24 us per sliding layer against 7.4 in
# decode) under other key splits and row blocks; (4) the 26B speculative step at B = 2. Carry `.whl`.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run39
{
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
  run env OUT=$res timeout 150 python3 benchmarks/bench_decode.py --models 26b --batch 1 2 16 --context 4096 --profile
  for mode in all none; do
    run env OUT=$res timeout 100 python3 lab/probes/probe_dispatch.py --tag $mode --pack-params $mode
    run env OUT=$res timeout 100 python3 benchmarks/kernel_count.py --models e2b --batch 2 --programs decode \
        --json-name kernel_count_$mode.json --pack-params $mode
    for spec in "" --spec; do
      run env OUT=$res timeout 120 python3 benchmarks/bench_host_overhead.py --model e2b --batch 1 \
          --context 1024 --steps 40 $spec --pack-params $mode
      mv "$res/bench_host_overhead.json" "$res/host_overhead_${mode}${spec:+_spec}.json"
    done
  done
  att="--batch 2 --q-len 5 --ctx 4096 --page-size 16 --reps 10 --copy-mib 256"
  for cfg in "" "--k-splits 5" "--k-splits 8" "--block-rows 16 --k-splits 4" "--block-rows 16 --k-splits 8" \
             "--block-rows 32 --k-splits 8"; do
    run timeout 45 python3 benchmarks/bench_paged_attention.py --shapes e2b_sliding $att $cfg | grep "ctx="
  done
  for cfg in "" "--k-splits 32" "--k-splits 64" "--block-rows 16 --k-splits 32"; do
    run timeout 45 python3 benchmarks/bench_paged_attention.py --shapes e2b_full $att $cfg | grep "ctx="
  done
  run env OUT=$res timeout 100 python3 benchmarks/bench_spec.py --models 26b --batch 2 --context 4096 --profile
  echo "== $(date +%T) done"
} > "$out/run39.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12\|^{'model'\|^ \{8\}" "$out/run39.log" | tail -n 150
