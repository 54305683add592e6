#!/usr/bin/env bash
# Run 130 (issue 10), one call under END s (default 200), prepared in the thirty-sixth session with the session's last
# ~300 s of device time. Carry `.whl`, `.branch` (merge-proj: the key splits' merge inside o_proj's kernel, every
# layer whose keys are split) and `.mid` (merge-proj-cap: the same where each program's re-read of its head's splits
# stays within its block of o_proj's columns, i.e. not E2B's full-attention layers). Set GIT_COMMIT.
# bench_spec.py at E2B (B = 2 and 16, k = 4, context 4096) in main, merge-proj and merge-proj-cap; then
# merge-proj-cap's tests of the new kernel compiled on the GPU, and main once more (the run's own noise) while time
# is left.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run130
end=${END:-200}
use_trees .branch .mid
{
  header
  spec_tree main "$PWD"
  spec_tree merge_proj "$PWD/.branch"
  spec_tree merge_proj_cap "$PWD/.mid"
  spec_table main merge_proj merge_proj_cap
  tree_tests .mid 45 tests/test_merge_project.py
  [ $((end - SECONDS)) -gt 55 ] && spec_tree main_again "$PWD" && spec_table main_again
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run130.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run130.log" | tail -n 60
