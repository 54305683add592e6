#!/usr/bin/env bash
# Run 74 (issues 10, 11), one call under 590 s; carry `.whl`. Set GIT_COMMIT to the commit the tree is at.
# 1. The verify step's full-attention layers (head dim 512) ran at a quarter of decode's speed on the same K/V
#    (run 66: 145 vs 39 us per layer at E2B, B = 16): a grid of tilings at E2B's verify shape (5 query tokens,
#    B = 16, context 4096, the server's 16-token pages) beside kernel_config's own choice, pipeline stages included
#    (one stage halves the K/V buffers, so two programs fit an SM); the decode shape beside it.
# 2. The sliding layers at decode: one key split (no merge kernel after it) against the split kernel and its merge.
# 3. Where 26B-A4B's decode step goes at B = 2 (4.84 ms pipelined against issue 11's 3.0 ms): its kernels, profiled.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run74
end=${END:-585}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  mkdir -p "$res/sweep_full" "$res/sweep_sliding" "$res/moe_profile"
  run env OUT=$res/sweep_full timeout $(lim 230) python3 benchmarks/bench_paged_attention.py --sweep \
      --shapes e2b_full --batch 16 --q-len 5 --ctx 4096 --page-size 16 --reps 15 \
      --sweep-grid block_rows=16,32 k_splits=9,17,32,64 block_k=16,32 num_warps=4,8 num_stages=1,2
  mv "$res/sweep_full/bench_paged_attention.json" "$res/sweep_full/verify_sweep.json"
  run env OUT=$res/sweep_full timeout $(lim 40) python3 benchmarks/bench_paged_attention.py \
      --shapes e2b_full --batch 16 --q-len 1 --ctx 4096 --page-size 16 --reps 15
  run env OUT=$res/sweep_sliding timeout $(lim 100) python3 benchmarks/bench_paged_attention.py --sweep \
      --shapes e2b_sliding --batch 2,16 --q-len 1,5 --ctx 4096 --page-size 16 --reps 15 \
      --sweep-grid block_rows=16 num_warps=4 block_k=32,64 k_splits=1,2,4,8
  run env OUT=$res/moe_profile timeout $(lim 150) python3 benchmarks/bench_decode.py --models 26b --batch 2 \
      --profile
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run74.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run74.log" | grep -v "^e2b_.* B=.*: kernel " | tail -n 110
