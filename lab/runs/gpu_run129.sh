#!/usr/bin/env bash
# Run 129 (issue 10), one call under END s (default 300), prepared in the thirty-fifth session. Carry `.whl`,
# `.baseline` (main at 1257e9e, before that session's cuts) and `.mid` (5849553: the per-layer-input and gate|up
# kernels, reverted in 85024af). Set GIT_COMMIT.
# 1. main as landed against 1257e9e, E2B greedy (bench_spec.py, B = 2 and 16, k = 4, context 4096), main's tree
#    first and last (the run's own noise): run 128 never timed the landed combination as a whole.
# 2. Where the per-layer-input kernel loses on the H200 (run 128: the step 3.6 % slower with it and gate|up): its
#    probe from .mid at 2 and 16 rows with each variant's kernels traced.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run129
end=${END:-300}
use_trees .baseline .mid
{
  header
  spec_tree before "$PWD/.baseline"
  spec_tree landed "$PWD"
  spec_tree before_again "$PWD/.baseline"
  run env OUT=$res PYTHONPATH=$PWD/.mid:/tmp/site timeout $(lim 60) python3 .mid/benchmarks/probe_per_layer_input.py \
      --rows 2 16 --tilings 16,256,4 32,512,4 --profile
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run129.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run129.log" | tail -n 80
