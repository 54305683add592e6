#!/usr/bin/env bash
# The whole test suite on a GPU machine whose image already has JAX with CUDA, torch and hypothesis (the project's
# H200 image): installs the wheels of scripts/fetch_gpu_wheels.sh into /tmp/site (nothing of the image is
# replaced), then runs pytest on the GPU in 12 worker processes (GPU memory is allocated on demand so they share
# the card). Extra arguments go to pytest. Log and JUnit XML under $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false GEMMA4_TEST_JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
python3 -m pytest -q -n 12 -p no:cacheprovider --durations=25 -rf --junitxml="$out/junit.xml" tests "$@" 2>&1 | tee "$out/pytest.log"
exit "${PIPESTATUS[0]}"
