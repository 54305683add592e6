#!/usr/bin/env bash
# GPU run 9 (issue 8): the rest of the device budget on the warm machine of run 8 (one command line, as run):
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false GEMMA4_TEST_JAX_PLATFORMS=cuda
timeout 170 python3 -m pytest -q -n 12 -p no:cacheprovider -v tests/test_train_assistant.py tests/test_speculative.py \
    tests/test_centroid_head.py > $OUT/p2.log 2>&1
