#!/usr/bin/env bash
# Run 87 (issue 10), one call under 590 s. Carry `.whl` and `.baseline` = 7b32680 (the in-kernel selection in 4-bit digits:
# rm -rf .baseline && mkdir .baseline && git archive 7b32680 | tar -x -C .baseline
# && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors). Set GIT_COMMIT to this tree's commit.
# The branch: the centroid head's selection in 2-bit digits (4 thresholds per round, against 16 in 7b32680, whose
# kernel was 17 us slower than main's at T = 16, run 86).
# 1. The centroid head's tests compiled by Triton.
# 2. The centroid head at T = 1 and 16, both trees, with the scores matmul alone.
# 3. E2B's step times (bench_spec, B = 2 and 16, k = 4), both trees.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run87
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  gpu_tests 120 tests/test_centroid_head.py
  both 105 centroid bench_centroid_head.py --tokens 1 16 --no-sweep --reps 30 --paths pallas_full pallas_kernel scores select
  both 80 spec bench_spec.py --models e2b --batch 2 16
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run87.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run87.log" | tail -n 80
