#!/usr/bin/env bash
# Run 118 (issue 10), one call under 560 s (END); carry `.whl` and `.baseline` = main (the branch's base). Set
# GIT_COMMIT. Prepared in the twenty-sixth session on branch split-merge-kernel, not yet run.
# The branch merges the paged kernel's key splits in one Pallas kernel that writes q's layout (grid: sequence, KV
# head, query row, 128-wide slice of D; every split's partial of a row in one load), where XLA's merge plus the
# transpose back took two to four kernels per attention layer (run 105: ~13.5 us per E2B draft step at B = 2;
# run 115: XLA does not make a variadic reduce of the merge one kernel).
# 1. the paged kernel's tests on the GPU (the merge kernel's Triton lowering is new);
# 2. kernels per step, E2B B = 2, 16, both trees;
# 3. E2B bench_spec B = 2, 16, both trees (spec/decode goals 1.20 / 1.35);
# 4. the kernel alone, both trees (bench_paged_attention, E2B shapes at decode and verify).
# If the branch wins, BUILD.md's two suite calls come next, then merge.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run118
end=${END:-560}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  gpu_tests 120 tests/test_paged_attention.py
  kernels_both --models e2b --batch 2 16
  both 120 spec bench_spec.py --models e2b --batch 2 16
  both 60 pa bench_paged_attention.py --shapes e2b_sliding,e2b_full --batch 2,16 --q-len 1,5 --ctx 4096 \
      --page-size 16 --reps 30
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run118.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run118.log" | tail -n 80
