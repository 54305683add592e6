#!/usr/bin/env bash
# Run 73 (issue 10), one call under 590 s; carry `.whl`. Set GIT_COMMIT.
# 1. The verify step's full-attention layers (head dim 512) ran at a quarter of decode's speed on the same K/V
#    (run 66: 145 vs 39 us per layer at B = 16): every tiling of a grid at E2B's verify shape (5 query tokens,
#    B = 16) beside kernel_config's own choice (~57 tilings, ~3 s a tiling); then the sliding layers' decode shape.
# 2. What the sampled speculative step spends its extra 4.6 ms on at B = 16 (runs 64, 68): its kernels, profiled.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run73
end=${END:-585}
{
  mkdir -p "$res/sweep" "$res/sampled_profile"
  run env OUT=$res/sweep timeout $(lim 220) python3 benchmarks/bench_paged_attention.py --sweep \
      --shapes e2b_full --batch 16 --q-len 5 --ctx 4096 --sweep-grid k_splits=4,9,17,32,64
  # Sliding layers at decode: is one split (no merge after the kernel: 28 of E2B's 668 decode kernels are merges)
  # as fast as the split kernel plus its merge?
  mkdir -p "$res/sweep_sliding"
  run env OUT=$res/sweep_sliding timeout $(lim 200) python3 benchmarks/bench_paged_attention.py --sweep \
      --shapes e2b_sliding --batch 2,16 --q-len 1 --ctx 4096 --sweep-grid block_k=32,64 k_splits=1,2,4,8
  run env OUT=$res/sampled_profile timeout $(lim 120) python3 benchmarks/bench_spec.py --models e2b --batch 16 \
      --sampled --profile
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run73.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run73.log" | grep -v "^e2b_full .*: kernel " | tail -n 90
