#!/usr/bin/env bash
# Run 48 (issues 10 and 12), one call under 590 s. Carry `.whl`.
# Run 47 found why the step programs still re-record their command buffers: SKIP_TEMP, passed per program, leaves the
# GPU client's allocator alone; XLA only gives temporaries stable addresses (VMM allocator) when the mode is in
# XLA_FLAGS before the client starts. The package now puts it there at import (gemma4_mtp_jax/xla_env.py).
# (1) probe_dispatch, speculative and decode, E2B B = 1, context 1024, with XLA's update log: the updates should stop.
# (2) bench_host_overhead at E2B B = 1, decode and speculative: the engine's async step against the program pipelined
#     (issue 12: <= 5 %).
# (3) With the time left, the GPU tests that run the compiled programs through the engine (async scheduling,
#     preemption, prefix cache, the server) and the kernels, under the new allocator.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run48
end=585
{
  for prog in spec decode; do probe $prog; done
  host_overhead 1
  echo "== $(date +%T) tests, $((end - SECONDS)) s left"
} > "$out/run48.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run48.log" | tail -n 40
OUT=$res GEMMA4_TEST_WORKERS=16 timeout $((end - SECONDS)) bash scripts/gpu_suite.sh \
  tests/test_xla_env.py tests/test_engine.py tests/test_speculative.py tests/test_server_process.py \
  tests/test_paged_attention.py tests/test_centroid_head.py tests/test_prefix_cache.py tests/test_param_pack.py
echo "== suite rc=$? at $(date +%T)"
grep -c PASSED "$res/pytest.log"; grep -E "FAILED|ERROR" "$res/pytest.log" | head -20
