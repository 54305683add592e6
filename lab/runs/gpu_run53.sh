#!/usr/bin/env bash
# Run 53 (issues 10, 12): the second half of the GPU suite (BUILD.md's second call). Carry `.whl`. END (seconds,
# default 585) is the script's own deadline: less when the session has less device time left.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run53
end=${END:-585}
OUT=$res GEMMA4_TEST_WORKERS=16 timeout $((end - SECONDS)) bash scripts/gpu_suite.sh tests/test_engine.py \
  tests/test_prefix_cache.py tests/test_tensor_parallel.py tests/test_server_units.py tests/test_server_support.py \
  tests/test_server.py tests/test_server_process.py
echo "== suite rc=$? at $(date +%T)"
grep -c PASSED "$res/pytest.log"; grep -E "^(FAILED|ERROR)" "$res/pytest.log" | head -20
