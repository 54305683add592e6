#!/usr/bin/env bash
# Run 115 (issue 10), one call under 420 s (END). Carry `.whl` and `.baseline` = main before the change (42b7153).
# Set GIT_COMMIT. The branch merges the paged kernel's key splits in one variadic reduction (the online-softmax merge
# as the reducer) instead of a max then a weighted sum. Kernels per step (E2B decode, verify, speculative at B = 2,
# 16) and E2B bench_spec at B = 2, 16, k = 4, in both trees.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run115
end=${END:-420}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  kernels_both --models e2b --batch 2 16
  both 120 spec bench_spec.py --models e2b --batch 2 16
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run115.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run115.log" | tail -n 60
