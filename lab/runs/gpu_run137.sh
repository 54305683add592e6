#!/usr/bin/env bash
# Run 137 (issue 10), one call under END s (default 330), prepared in the thirty-eighth session, not yet run. Carry
# `.whl` and `.baseline` = main. Set GIT_COMMIT. This tree (verify-window-splits-2, merged into main and reverted:
# NOTEBOOK.md's thirty-eighth session names the commits)
# gives a verify's sliding layers a split per key block too (E2B: 10 splits of 64 keys, not 5), where main lets the
# merge's cap on partials bind. Run 135's sweep read 33.6 us at 8 splits against 50-65 at 4-5 (one sample each),
# and E2B's B = 16 ratio is bound by its verify (1.35 goal; 1.54-1.59 on an H100 in run 136).
# 1. E2B's step, main and this tree alternately, twice each.
# 2. This tree's paged-kernel tests on the GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run137
end=${END:-330}
use_baseline
{
  header
  spec_tree main "$PWD/.baseline"; spec_tree branch "$PWD"; spec_tree main_again "$PWD/.baseline"
  spec_tree branch_again "$PWD"
  spec_table main branch main_again branch_again
  gpu_tests 80 tests/test_paged_attention.py
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run137.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run137.log" | tail -n 60
