#!/usr/bin/env bash
# Run 131 (issue 10), one call under END s (default 300), prepared in the thirty-sixth session. Carry `.whl` and
# `.branch` (q-split: a Q-only layer's q_proj in float32 parts, added by the paged kernel as it loads the query rows;
# in main's history as the merge 72ddbaf, reverted in a7cd3e5: `git archive 72ddbaf` into .branch). Set GIT_COMMIT.
# bench_spec.py at E2B (B = 2 and 16, k = 4, context 4096): main, q-split, main again, q-split again (the run's own
# noise, both ways), then q-split's kernel tests (test_paged_attention, test_q_split) compiled on the GPU while time
# is left.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run131
end=${END:-300}
use_trees .branch
{
  header
  spec_tree main "$PWD"
  spec_tree q_split "$PWD/.branch"
  spec_tree main_again "$PWD"
  spec_tree q_split_again "$PWD/.branch"
  spec_table main q_split main_again q_split_again
  tree_tests .branch 90 tests/test_paged_attention.py tests/test_q_split.py
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run131.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run131.log" | tail -n 60
