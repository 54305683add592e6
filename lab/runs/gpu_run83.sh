#!/usr/bin/env bash
# Run 83 (issue 10), one call under 590 s. Carry `.whl` and `.baseline` (main before the split-K kernels, 198bdfe,
# as for run 81). Set GIT_COMMIT to the commit this tree is at.
# The branch since run 81: the layer's last residual add takes layer_scalar, and per_layer_projection goes through
# the split-K kernels too.
# 1. Kernels per E2B decode / verify / speculative program at B = 2, the branch (main's: run 81).
# 2. E2B's step times (bench_spec, B = 2 and 16, k = 4), main then branch.
# 3. BUILD.md's first GPU suite call (kernels, parity, speculative, trainer, ...), with test_split_k, in what is left.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run83
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  mkdir -p "$res/kernels_branch"
  run env OUT=$res/kernels_branch XLA_FLAGS=--xla_gpu_autotune_level=0 timeout $(lim 60) python3 \
      benchmarks/kernel_count.py --models e2b --batch 2
  both 80 spec bench_spec.py --models e2b --batch 2 16
  mkdir -p "$res/suite1"
  run env OUT=$res/suite1 GEMMA4_TEST_WORKERS=16 timeout $(lim 600) bash scripts/gpu_suite.sh \
    tests/test_train_demo.py tests/test_train_assistant.py \
    tests/test_paged_attention.py tests/test_attention_inputs.py tests/test_split_k.py tests/test_grouped_matmul.py \
    tests/test_centroid_head.py tests/test_param_pack.py tests/test_parity_target.py tests/test_parity_assistant.py \
    tests/test_speculative.py tests/test_layering.py tests/test_loading.py tests/test_convert.py \
    tests/test_orbax_io.py tests/test_safetensors_io.py tests/test_corpus.py tests/test_xla_env.py \
    tests/test_input_pack.py tests/test_executable_cache.py
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run83.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'" "$out/run83.log" | tail -n 60
