#!/usr/bin/env bash
# Run 136 (issue 10), one call under END s (default 480), prepared in the thirty-eighth session. Carry `.whl` and
# `.baseline` (main before this branch: `git archive` of it, the demo pair's weights left out). Set GIT_COMMIT.
# This tree: (a) kernel_config gives a sliding window's key blocks a split each (E2B decode: 9 splits, not 4; run
# 135's sweep had 8 splits of 64 keys at 26 us against 37 us at B = 16, one sample each); (b) UNTUNED leaves GEMMs
# to cuBLAS (run 135: without autotuning, XLA's Triton GEMMs made E2B's decode 2x and its B = 16 verify 6x slower).
# 1. E2B's step, main and this tree alternately, twice each (the split rule).
# 2. E2B's and the demo pair's step with XLA_FLAGS as UNTUNED now sets them: how the first programs serve until
#    their tuned twins replace them, and how long bench_spec's 6 programs take to compile.
# 3. The demo pair's cold start, main then this tree (the untuned first programs on cuBLAS).
# 4. This tree's paged-kernel tests on the GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run136
end=${END:-480}
use_baseline
CUBLAS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false"
{
  header
  spec_tree main "$PWD/.baseline"; spec_tree branch "$PWD"; spec_tree main_again "$PWD/.baseline"
  spec_tree branch_again "$PWD"
  spec_table main branch main_again branch_again
  mkdir -p "$res/spec_cublas"
  run env OUT=$res/spec_cublas XLA_FLAGS="$CUBLAS" timeout $(lim 80) python3 benchmarks/bench_spec.py --models e2b \
      --batch 2 16 --k 4 --context 4096 --repeats 20 | grep -a "compiled\|^e2b\|^model"
  spec_table cublas
  for v in default cublas; do
    flags=; [ $v = cublas ] && flags=$CUBLAS
    mkdir -p "$res/demo_$v"
    run env OUT=$res/demo_$v XLA_FLAGS="$flags" timeout $(lim 60) python3 benchmarks/bench_spec.py --models demo \
        --batch 2 8 --k 4 --context 1000 --repeats 20 | grep -a "compiled\|^demo\|^model"
  done
  for tree in main branch; do
    root=$(root_of $tree); mkdir -p "$res/cold_$tree"
    (cd "$root" && run env OUT=$res/cold_$tree PYTHONPATH=$root:/tmp/site timeout $(lim 60) python3 \
        benchmarks/serve_check.py --runs cold | tail -3)
    grep -ah "compiled \|ready in" "$res/cold_$tree/serve_cold.log" | head -4
  done
  gpu_tests 100 tests/test_paged_attention.py
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run136.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run136.log" | tail -n 90
