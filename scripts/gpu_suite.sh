#!/usr/bin/env bash
# The whole test suite on a GPU machine whose image already has JAX with CUDA, torch and hypothesis (the project's
# H200 image): installs the wheels of scripts/fetch_gpu_wheels.sh into /tmp/site (nothing of the image is
# replaced), then runs pytest on the GPU in 14 worker processes (GEMMA4_TEST_WORKERS) (GPU memory is allocated on demand so they share
# the card). Extra arguments go to pytest. The log (one line per test, so a run cut short still says what passed)
# and JUnit XML go under $OUT when it is set, /tmp otherwise; the failures and the summary are printed.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false GEMMA4_TEST_JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
# GEMM autotuning times every candidate kernel of every new matmul shape at compile time; the suite compiles
# hundreds of small programs once each, so tuning costs more than it could save. It changes which kernel runs,
# never what is computed at the requested precision.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
out=${OUT:-/tmp}; mkdir -p "$out"
python3 -m pytest -v -n ${GEMMA4_TEST_WORKERS:-14} -p no:cacheprovider --durations=25 -rf --junitxml="$out/junit.xml" "${@:-tests}" \
    > "$out/pytest.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -40
tail -3 "$out/pytest.log"
exit "$rc"
