#!/usr/bin/env bash
# Run 50 (issue 12), one call under 590 s. Carry `.whl`.
# Run 49 and the first suite call showed: (a) on the GPU, XLA read the packed inputs straight from the transferred
# array again (a static slice of a region written at offset 0 folds back into a slice of the array), so a call still
# updated 157-170 command-buffer nodes; the write's offset is now a value only the device knows. (b) Orbax saving
# device arrays under the VMM allocator crashed the process (SIGSEGV, 16 tests); save_params now hands Orbax host
# arrays and the converter loads on the host.
# (1) probe_dispatch, speculative and decode, E2B B = 1, context 1024, with XLA's update log: nodes per update;
# (2) bench_host_overhead E2B B = 1, decode and speculative;
# (3) the second half of the GPU suite (BUILD.md), with the files that failed in the first half.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run50
end=585
{
  for prog in spec decode; do probe $prog; done
  host_overhead 1
  echo "== $(date +%T) tests, $((end - SECONDS)) s left"
} > "$out/run50.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^{'model'\|^{'jax'" "$out/run50.log" | tail -n 40
OUT=$res GEMMA4_TEST_WORKERS=16 timeout $((end - SECONDS)) bash scripts/gpu_suite.sh \
  tests/test_orbax_io.py tests/test_convert.py tests/test_speculative.py::test_speculative_step_updates_state_in_place \
  tests/test_engine.py tests/test_prefix_cache.py tests/test_tensor_parallel.py tests/test_server_units.py \
  tests/test_server_support.py tests/test_server.py tests/test_server_process.py tests/test_train_demo.py \
  tests/test_train_assistant.py
echo "== suite rc=$? at $(date +%T)"
grep -c PASSED "$res/pytest.log"; grep -E "^(FAILED|ERROR)" "$res/pytest.log" | head -20
