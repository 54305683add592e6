#!/usr/bin/env bash
# Run 86 (issue 10), one call under 590 s. Carry `.whl` and `.baseline` = 152e3d1 (main before this session:
# rm -rf .baseline && mkdir .baseline && git archive 152e3d1 | tar -x -C .baseline
# && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors). Set GIT_COMMIT to this tree's commit.
# The branch: each layer's last residual kernel also applies the next layer's input_layernorm (the final norm after
# the last layer); the centroid head selects its clusters inside the gather-dot kernel (no lax.top_k sort).
# 1. The changed kernels' tests compiled by Triton (centroid head, split-K).
# 2. Kernels per E2B program at B = 2, both trees.
# 3. The centroid head at T = 1 and 16, both trees.
# 4. E2B's step times (bench_spec, B = 2 and 16, k = 4), both trees.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run86
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  gpu_tests 120 tests/test_centroid_head.py tests/test_split_k.py
  kernels_both --models e2b --batch 2
  both 80 centroid bench_centroid_head.py --tokens 1 16 --no-sweep --reps 30 --paths pallas_full pallas_kernel select
  both 80 spec bench_spec.py --models e2b --batch 2 16
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run86.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run86.log" | tail -n 80
