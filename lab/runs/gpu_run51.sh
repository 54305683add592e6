#!/usr/bin/env bash
# Run 51 (planned; issue 12), one call under 590 s. Carry `.whl`.
# Run 50: with the inputs packed and staged, a call still re-records ~160 of the speculative program's 1009 nodes
# (decode: ~215 of 851), although only the packed result's buffer moves. Suspected: XLA assigns small temporaries
# to the result's allocation before the result is written (the CPU compiler does: 36 of them in the smoke decode
# program's 32-byte result allocation, lab/NOTEBOOK.md, the tenth session).
# (1) probe_dispatch, speculative and decode, E2B B = 1, context 1024, with the buffer assignment dumped and the
#     updated allocation indices logged: which allocation moves, and which values share it;
# (2) the README's serve command on the GPU with JAX's default preallocation (every GPU run so far set
#     XLA_PYTHON_CLIENT_PREALLOCATE=false; serving never has): benchmarks/serve_check.py;
# (3) with the time left, the tests run 50 cut: the trainer's, one tensor-parallel and one prefix-cache equality.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run51
end=585
{
  for prog in spec decode; do
    VMODULE=command_buffer_thunk=3,command_executor=1,gpu_executable=3 probe $prog --options xla_dump_to=$res/dump_$prog
    grep -o "updated_alloc[a-z_]*[^;]*" "$res/probe_dispatch_$prog.log" | sort | uniq -c | sort -rn | head -5
    f=$(ls "$res"/dump_$prog/*after_optimizations-buffer-assignment.txt 2>/dev/null | grep -v values | head -1)
    # the live-out allocations (the result among them) and every value they hold
    awk '/^allocation/ {show = /maybe-live-out|output/} show' "$f" | head -60
  done
  run env -u XLA_PYTHON_CLIENT_PREALLOCATE OUT=$res timeout $(lim 150) python3 benchmarks/serve_check.py \
      > "$res/serve_check.log" 2>&1
  tail -20 "$res/serve_check.log"
  echo "== $(date +%T) tests, $((end - SECONDS)) s left"
} > "$out/run51.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^{'jax'" "$out/run51.log" | tail -n 150
OUT=$res GEMMA4_TEST_WORKERS=12 timeout $((end - SECONDS)) bash scripts/gpu_suite.sh tests/test_train_assistant.py \
  tests/test_train_demo.py tests/test_tensor_parallel.py::test_tensor_parallel_equals_one_device \
  "tests/test_prefix_cache.py::test_outputs_equal_with_and_without_the_cache"
echo "== suite rc=$? at $(date +%T)"
grep -c PASSED "$res/pytest.log"; grep -E "^(FAILED|ERROR)" "$res/pytest.log" | head -20
