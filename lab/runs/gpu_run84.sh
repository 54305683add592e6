#!/usr/bin/env bash
# Run 84 (issue 10), one call under 590 s. Carry `.whl` and `.baseline` = 636a992 (the split-K kernels in the
# target and the assistant, differentiable): rm -rf .baseline && mkdir .baseline && git archive 636a992 | tar -x
# -C .baseline && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors. Set GIT_COMMIT to this tree's commit.
# The branch: the assistant's layers keep their projections whole (split_k=False).
# 1. Kernels per E2B program at B = 2, both trees.
# 2. E2B's step times (bench_spec, B = 2 and 16, k = 4), 636a992 then the branch.
# 3. On 636a992 (the kernels inside the assistant's trainer): the split-K tests, the trainers' tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run84
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  kernels_both --models e2b --batch 2
  both 80 spec bench_spec.py --models e2b --batch 2 16
  (cd .baseline && run env PYTHONPATH=$PWD:/tmp/site GEMMA4_TEST_JAX_PLATFORMS=cuda \
      XLA_FLAGS=--xla_gpu_autotune_level=0 timeout $(lim 300) python3 -m pytest -q -n 16 -p no:cacheprovider \
      --durations=8 tests/test_split_k.py tests/test_train_assistant.py tests/test_train_demo.py > "$res/train.log" 2>&1;
   tail -15 "$res/train.log")
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run84.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run84.log" | tail -n 60
