#!/usr/bin/env bash
# Run 89 (issue 10), one call under 590 s. Carry `.whl` and `.baseline` = main before the change (7238ca9, as for
# run 88). Set GIT_COMMIT to this tree's commit.
# 1. The centroid head's kernels by their traced durations (run 88 showed the chain timing of small kernels was the
#    host's per-argument dispatch cost): main's kernel at T = 1 and 16 (this tree's benchmark script, copied into
#    main's tree), this tree at T = 1, 2, 8 and 16 with every head path and the launch sweep.
# 2. The first of BUILD.md's two suite calls, in the time left (the log has a line per test).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run89
end=${END:-585}
use_baseline
cp benchmarks/bench_centroid_head.py .baseline/benchmarks/
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  both_args="--no-chain --reps 30"
  mkdir -p "$res/centroid_main" "$res/centroid_branch"
  run env OUT=$res/centroid_main PYTHONPATH=$(root_of main):/tmp/site timeout $(lim 60) python3 \
      "$(root_of main)/benchmarks/bench_centroid_head.py" $both_args --tokens 16 1 --no-sweep \
      --paths pallas_full pallas_kernel
  run env OUT=$res/centroid_branch timeout $(lim 130) python3 benchmarks/bench_centroid_head.py $both_args \
      --tokens 16 1 2 8 --budget-s 110 --paths pallas_full pallas_kernel scores select floor
  run env OUT=$res/suite1 GEMMA4_TEST_WORKERS=16 timeout $(lim 600) bash scripts/gpu_suite.sh \
      tests/test_train_demo.py tests/test_train_assistant.py \
      tests/test_paged_attention.py tests/test_attention_inputs.py tests/test_split_k.py tests/test_grouped_matmul.py \
      tests/test_centroid_head.py tests/test_param_pack.py tests/test_parity_target.py tests/test_parity_assistant.py \
      tests/test_speculative.py tests/test_layering.py tests/test_loading.py tests/test_convert.py \
      tests/test_orbax_io.py tests/test_safetensors_io.py tests/test_corpus.py tests/test_xla_env.py \
      tests/test_input_pack.py tests/test_executable_cache.py
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run89.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run89.log" | grep -v "PASSED" | tail -n 90
