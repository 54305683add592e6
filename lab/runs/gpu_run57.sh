#!/usr/bin/env bash
# Run 57 (issues 10, 12), one call under 590 s. Carry `.whl`.
# (1) The README's serve command with its defaults, which now keep an executable cache: cold (empty caches), then a
#     restart (`serve_check.py`; issue 10's restart goal: <= 10 s);
# (2) the first half of the GPU suite (BUILD.md's first call, test_executable_cache.py added);
# (3) in the time left, the restart with the compilation cache alone (`-- --executable-cache-dir none`), the
#     comparison for (1).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run57
end=${END:-585}
mkdir -p "$res/default" "$res/jaxcache"
{
  run env OUT=$res/default timeout $(lim 150) python3 benchmarks/serve_check.py
  grep -hE "ready in|executable cache|compiling all" "$res"/default/*.log
  echo "== $(date +%T) tests, $((end - SECONDS)) s left"
} > "$out/run57.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12" "$out/run57.log" | tail -n 30
OUT=$res GEMMA4_TEST_WORKERS=16 timeout $((end - SECONDS - 100)) bash scripts/gpu_suite.sh tests/test_train_demo.py \
  tests/test_train_assistant.py tests/test_paged_attention.py tests/test_grouped_matmul.py \
  tests/test_centroid_head.py tests/test_param_pack.py tests/test_parity_target.py tests/test_parity_assistant.py \
  tests/test_speculative.py tests/test_layering.py tests/test_loading.py tests/test_convert.py \
  tests/test_orbax_io.py tests/test_safetensors_io.py tests/test_corpus.py tests/test_xla_env.py tests/test_input_pack.py \
  tests/test_executable_cache.py
echo "== suite rc=$? at $(date +%T)"
grep -c PASSED "$res/pytest.log"; grep -E "^(FAILED|ERROR)" "$res/pytest.log" | head -20
{
  echo "== $(date +%T) the compilation cache alone, $((end - SECONDS)) s left"
  run env OUT=$res/jaxcache timeout $(lim 150) python3 benchmarks/serve_check.py -- --executable-cache-dir none
  grep -hE "ready in|executable cache|compiling all" "$res"/jaxcache/*.log
} > "$out/run57_jaxcache.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12" "$out/run57_jaxcache.log" | tail -n 20
