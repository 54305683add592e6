#!/usr/bin/env bash
# Run 61 (issue 10), one call under 590 s. Carry `.whl` and `.branch` (the traced-once-layers branch's tree:
#   rm -rf .branch && mkdir .branch && git archive traced-once-layers | tar -x -C .branch).
# 1. Where the demo pair's cold start goes: the server's 11 programs (`compile_all.py --families demo --engines
#    speculative`) compiled cold under XLA's GEMM autotuner at its default level (4: every candidate kernel's
#    output checked against a reference), level 1 (timing only) and level 0 (no autotuning).
# 2. Whether the level changes the step: E2B's bench_spec (B = 2 and 16, k = 4) at levels 4, 1, 0, and the branch
#    at level 4 (does tracing each kind of layer once change the step on the GPU?).
# 3. Kernels per program, main vs the branch (E2B, B = 2).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run61
end=${END:-585}
level() { [ "$1" = 4 ] && echo "" || echo "--xla_gpu_autotune_level=$1"; }
{
  for lv in 4 1 0; do
    mkdir -p "$res/compile_L$lv"
    run env OUT=$res/compile_L$lv XLA_FLAGS="$(level $lv)" timeout $(lim 90) python3 benchmarks/compile_all.py \
        --families demo --engines speculative
  done
  for tree_lv in main:4 branch:4 main:1 main:0; do
    tree=${tree_lv%:*}; lv=${tree_lv#*:}; root=$PWD; [ "$tree" = branch ] && root=$PWD/.branch
    mkdir -p "$res/spec_${tree}_L$lv"
    run env OUT=$res/spec_${tree}_L$lv PYTHONPATH=$root:/tmp/site XLA_FLAGS="$(level $lv)" timeout $(lim 80) \
        python3 "$root/benchmarks/bench_spec.py" --models e2b --batch 2 16
  done
  for tree in main branch; do
    root=$PWD; [ "$tree" = branch ] && root=$PWD/.branch
    mkdir -p "$res/kernels_$tree"
    run env OUT=$res/kernels_$tree PYTHONPATH=$root:/tmp/site XLA_FLAGS="$(level 0)" timeout $(lim 80) \
        python3 "$root/benchmarks/kernel_count.py" --models e2b --batch 2
  done
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run61.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run61.log" | grep -v "compiled .* in .*s$" | tail -n 120
