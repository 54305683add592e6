#!/usr/bin/env bash
# Run 92 (issue 10), one call under 590 s. Carry `.whl` and `.baseline` = main before the change (b0ecaf5:
# rm -rf .baseline && mkdir .baseline && git archive b0ecaf5 | tar -x -C .baseline
# && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors). Set GIT_COMMIT to this tree's commit.
# The branch: a verify step's rows (up to 128) split o_proj, down_proj and the per-layer gate along K like a decode
# batch, so their sandwich norms run in the split-K kernels, where main left them to XLA's fusions past 16 rows.
# 1. E2B's step times (bench_spec, B = 2 and 16, k = 4), both trees.
# 2. The first of BUILD.md's two suite calls on the branch.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run92
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  both 75 spec bench_spec.py --models e2b --batch 2 16
  run env OUT=$res/suite1 GEMMA4_TEST_WORKERS=16 timeout $(lim 440) bash scripts/gpu_suite.sh --part 1
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run92.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run92.log" | grep -v "PASSED" | tail -n 120
