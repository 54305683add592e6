#!/usr/bin/env bash
# Run 89 (issue 10), one call under 590 s. Carry `.whl`. Set GIT_COMMIT to this tree's commit.
# 1. The centroid head's kernels by their traced durations (run 88 showed the chain timing of small kernels was the
#    host's per-argument dispatch cost) at T = 16, 1 and 8, with the launch sweep. Main's grid (7238ca9) is in the
#    sweep: one program per 128-row tile at T = 16, per 64-row tile at T = 8 and per 16-row tile at T = 1, each with
#    its own selection.
# 2. The first of BUILD.md's two suite calls, in the time left (the log has a line per test).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run89
end=${END:-585}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  mkdir -p "$res/centroid"
  run env OUT=$res/centroid timeout $(lim 120) python3 benchmarks/bench_centroid_head.py --no-chain --reps 30 \
      --tokens 16 1 8 --budget-s 110 --paths pallas_full pallas_kernel scores select floor
  run env OUT=$res/suite1 GEMMA4_TEST_WORKERS=16 timeout $(lim 600) bash scripts/gpu_suite.sh --part 1
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run89.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run89.log" | grep -v "PASSED" | tail -n 70
