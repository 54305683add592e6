#!/usr/bin/env bash
# Run 108 (issue 10), one call under 420 s (END); carry `.whl` and `.baseline` (main at 0c57278). Set GIT_COMMIT.
# The feed-forward block kernel (32 programs of 8 warps, o_proj in 4 parts it adds) in E2B's speculative step in
# both trees, the speculative program's kernels in both, and the paged kernel's key splits for a draft step's
# sliding layers (a split's merge is two kernels of its own).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run108
end=${END:-420}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  use_baseline
  both 150 spec bench_spec.py --models e2b --batch 2 16
  kernels_both --models e2b --batch 2 16 --programs decode speculative
  mkdir -p $res/paged
  run env OUT=$res/paged timeout $(lim 90) python3 benchmarks/bench_paged_attention.py --shapes e2b_sliding \
      --batch 2,16 --q-len 1 --ctx 4096 --page-size 16 --reps 40 --sweep --sweep-grid block_rows=16 \
      k_splits=1,2,3,5,9 block_k=32,64 num_warps=4
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run108.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run108.log" | tail -n 50
