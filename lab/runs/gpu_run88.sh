#!/usr/bin/env bash
# Run 88 (issue 10), one call under 590 s. Carry `.whl` and `.baseline` = main before the change (7238ca9:
# rm -rf .baseline && mkdir .baseline && git archive 7238ca9 | tar -x -C .baseline
# && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors). Set GIT_COMMIT to this tree's commit.
# The branch: the centroid head's programs each serve G consecutive tiles after one selection, and the default
# grid is one wave (<= one program per SM), where main ran 512 programs at T = 16, each repeating its token's
# selection.
# 1. The centroid head's tests compiled by Triton.
# 2. The centroid head at T = 16, 1 and 8: main without a sweep, the branch with its launch sweep; the floor path
#    (one elementwise kernel per link of the chain) in both.
# 3. E2B's step times (bench_spec, B = 2 and 16, k = 4), both trees.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run88
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  gpu_tests 120 tests/test_centroid_head.py
  paths="--tokens 16 1 8 --reps 30 --paths pallas_full pallas_kernel floor"
  mkdir -p "$res/centroid_main" "$res/centroid_branch"
  run env OUT=$res/centroid_main PYTHONPATH=$(root_of main):/tmp/site timeout $(lim 110) python3 \
      "$(root_of main)/benchmarks/bench_centroid_head.py" $paths --no-sweep
  run env OUT=$res/centroid_branch timeout $(lim 200) python3 benchmarks/bench_centroid_head.py $paths --budget-s 190
  both 75 spec bench_spec.py --models e2b --batch 2 16
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run88.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run88.log" | tail -n 90
