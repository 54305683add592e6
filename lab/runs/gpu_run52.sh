#!/usr/bin/env bash
# Run 52 (issues 10, 12), one call under 590 s. Carry `.whl`.
# Since run 50, each step program returns its packed result over the first columns of its packed inputs, which it
# takes donated (input_pack.return_in): every output aliases a donated input, so no output allocation can hold
# temporaries. Run 50 saw ~160 command-buffer nodes re-recorded per call, suspected to be those temporaries.
# (1) probe_dispatch, speculative, E2B B = 1, context 1024, with XLA's update log: nodes per update;
# (2) the first half of the GPU suite (BUILD.md's first call), in the time left.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run52
end=585
{
  probe spec
  echo "== $(date +%T) tests, $((end - SECONDS)) s left"
} > "$out/run52.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^{'model'\|^{'jax'" "$out/run52.log" | tail -n 40
OUT=$res GEMMA4_TEST_WORKERS=16 timeout $((end - SECONDS)) bash scripts/gpu_suite.sh tests/test_train_demo.py \
  tests/test_train_assistant.py tests/test_paged_attention.py tests/test_grouped_matmul.py \
  tests/test_centroid_head.py tests/test_param_pack.py tests/test_parity_target.py tests/test_parity_assistant.py \
  tests/test_speculative.py tests/test_layering.py tests/test_loading.py tests/test_convert.py \
  tests/test_orbax_io.py tests/test_safetensors_io.py tests/test_corpus.py tests/test_xla_env.py tests/test_input_pack.py
echo "== suite rc=$? at $(date +%T)"
grep -c PASSED "$res/pytest.log"; grep -E "^(FAILED|ERROR)" "$res/pytest.log" | head -20
