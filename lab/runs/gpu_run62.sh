#!/usr/bin/env bash
# Run 62 (issues 10, 12), one call under 220 s. Carry `.whl` and `.branch` (the qkv-epilogue branch's package, tests,
# benchmarks and pyproject.toml copied in, the demo weights left out).
# 1. This tree: the pool-memory test fixed after run 53 of this session (it asked for a CPU backend the GPU suite
#    does not start), and the executable-cache and xla_env tests (two written after run 57).
# 2. The branch: the attention-inputs kernel's tests compiled on the GPU, then kernels per decode program, this tree
#    vs the branch (E2B, B = 2; autotuning off for a quick compile, the same on both).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run62
end=${END:-200}
OUT=$res GEMMA4_TEST_WORKERS=8 timeout $(lim 70) bash scripts/gpu_suite.sh \
  "tests/test_engine.py::test_pool_memory_left_counts_weights_and_reserve" tests/test_executable_cache.py \
  tests/test_xla_env.py
echo "== suite rc=$? at $(date +%T)"
mv "$res/pytest.log" "$res/pytest_main.log"
(cd .branch && PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false GEMMA4_TEST_JAX_PLATFORMS=cuda \
  timeout $(lim 50) python3 -m pytest -v -p no:cacheprovider tests/test_attention_inputs.py > "$res/pytest_branch.log" 2>&1)
rc=$?; grep -E "^(FAILED|ERROR)" "$res/pytest_branch.log" | head; tail -2 "$res/pytest_branch.log"
echo "== branch kernel tests rc=$rc at $(date +%T)"
for tree in main branch; do
  root=$PWD; [ "$tree" = branch ] && root=$PWD/.branch
  mkdir -p "$res/kernels_$tree"
  run env OUT=$res/kernels_$tree PYTHONPATH=$root:/tmp/site XLA_FLAGS=--xla_gpu_autotune_level=0 timeout $(lim 45) \
      python3 "$root/benchmarks/kernel_count.py" --models e2b --batch 2 --programs decode
done
echo "== $(date +%T) done, $((end - SECONDS)) s left"
