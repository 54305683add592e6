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
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run48
end=585
vmodule="TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1"
{
  for prog in spec decode; do
    flag=; [ $prog = spec ] && flag=--spec
    run env OUT=$res $vmodule TF_CPP_MIN_LOG_LEVEL=0 timeout $(lim 70) python3 benchmarks/probe_dispatch.py $flag \
        --context 1024 --repeats 40 --tag $prog > "$res/probe_dispatch_$prog.log" 2>&1
    echo "== rc=$? $prog"
    grep "^{'jax'\|^host_inputs\|^device_inputs\|moved over" "$res/probe_dispatch_$prog.log"
    echo "updates: $(grep -c 'Updated [0-9]* commands' "$res/probe_dispatch_$prog.log")," \
         "full: $(grep -c 'skipped 0 command' "$res/probe_dispatch_$prog.log")"
  done
  for spec in "" --spec; do
    run env OUT=$res timeout $(lim 90) python3 benchmarks/bench_host_overhead.py --model e2b --batch 1 \
        --context 1024 --steps 40 $spec
    mv "$res/bench_host_overhead.json" "$res/host_overhead${spec:+_spec}.json"
  done
  echo "== $(date +%T) tests, $((end - SECONDS)) s left"
} > "$out/run48.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run48.log" | tail -n 40
OUT=$res GEMMA4_TEST_WORKERS=16 timeout $((end - SECONDS)) bash scripts/gpu_suite.sh \
  tests/test_xla_env.py tests/test_engine.py tests/test_speculative.py tests/test_server_process.py \
  tests/test_paged_attention.py tests/test_centroid_head.py tests/test_prefix_cache.py tests/test_param_pack.py
echo "== suite rc=$? at $(date +%T)"
grep -c PASSED "$res/pytest.log"; grep -E "FAILED|ERROR" "$res/pytest.log" | head -20
