#!/usr/bin/env bash
# The whole test suite on a GPU machine whose image already has JAX with CUDA, torch and hypothesis (the project's
# H200 image): installs the wheels of scripts/fetch_gpu_wheels.sh into /tmp/site (nothing of the image is
# replaced), then runs pytest on the GPU in 14 worker processes (GEMMA4_TEST_WORKERS) (GPU memory is allocated on demand so they share
# the card). Extra arguments go to pytest; `--part 1|2|3 [ARGS]` runs one of BUILD.md's three calls, `--check-parts`
# only checks that the three parts hold every test file once. The log (one line per test, so a run cut short still says what passed)
# and JUnit XML go under $OUT when it is set, /tmp otherwise; the failures and the summary are printed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false GEMMA4_TEST_JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
# GEMM autotuning times every candidate kernel of every new matmul shape at compile time; the suite compiles
# hundreds of small programs once each, so tuning costs more than it could save. It changes which kernel runs,
# never what is computed at the requested precision.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
# The whole suite no longer fits one 600 s device call, nor two: `--part 1|2|3` are BUILD.md's three calls (kernels,
# parity and speculative tests; the engine's and server's; the slow remainder: the assistant trainer, conversion,
# 12B, media, prefix cache, tensor parallel). Every tests/test_*.py is in exactly one part.
part1=(tests/test_train_demo.py tests/test_paged_attention.py
       tests/test_attention_inputs.py tests/test_split_k.py tests/test_feed_forward.py tests/test_grouped_matmul.py
       tests/test_centroid_head.py tests/test_triton_lowering.py tests/test_kernels_in_engine.py
       tests/test_param_pack.py tests/test_parity_target.py tests/test_parity_assistant.py tests/test_speculative.py
       tests/test_layering.py tests/test_loading.py tests/test_orbax_io.py
       tests/test_safetensors_io.py tests/test_corpus.py tests/test_xla_env.py tests/test_input_pack.py)
part2=(tests/test_executable_cache.py tests/test_engine.py tests/test_server_units.py
       tests/test_server_support.py tests/test_server.py tests/test_server_process.py
       tests/test_grammar.py tests/test_speculation.py tests/test_tool_calls.py tests/test_acceptance_protocol.py
       tests/test_multihost_server.py)
part3=(tests/test_train_assistant.py tests/test_convert.py tests/test_unified.py tests/test_multimodal.py
       tests/test_prefix_cache.py tests/test_tensor_parallel.py tests/test_multimodal_serving.py)
check_parts() {  # every test file in exactly one part, and no part naming a file that is not there
  local f n
  for f in tests/test_*.py; do
    n=$(printf '%s\n' "${part1[@]}" "${part2[@]}" "${part3[@]}" | grep -cx "$f")
    [ "$n" = 1 ] || { echo "gpu_suite.sh: $f is in $n of the three parts" >&2; return 1; }
  done
  for f in "${part1[@]}" "${part2[@]}" "${part3[@]}"; do [ -f "$f" ] || { echo "gpu_suite.sh: no $f" >&2; return 1; }; done
}
if [ "${1:-}" = "--check-parts" ]; then check_parts; exit; fi
if [ "${1:-}" = "--part" ]; then
  check_parts || exit 2
  case "${2:-}" in
    1) set -- "${part1[@]}" "${@:3}" ;;
    2) set -- "${part2[@]}" "${@:3}" ;;
    3) set -- "${part3[@]}" "${@:3}" ;;
    *) echo "gpu_suite.sh: --part takes 1, 2 or 3, got '${2:-}'" >&2; exit 2 ;;
  esac
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
out=${OUT:-/tmp}; mkdir -p "$out"
# Each failure's report as it happens (tests/conftest.py): pytest prints them only at the end, which a call cut
# short at its time limit never reaches.
export GEMMA4_TEST_FAILURES_FILE=$out/failures.txt
python3 -m pytest -v -n ${GEMMA4_TEST_WORKERS:-14} -p no:cacheprovider --durations=25 -rf --junitxml="$out/junit.xml" "${@:-tests}" \
    > "$out/pytest.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -40
tail -3 "$out/pytest.log"
exit "$rc"
