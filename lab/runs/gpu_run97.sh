#!/usr/bin/env bash
# Run 97 (issue 10), one call under 590 s (END: the device time left). Carry `.whl` and `.baseline` = main before
# the change (ee107db; see gpu_run95.sh). Set GIT_COMMIT to this tree's commit.
# The branch: the speculative programs whose verify has more than 16 rows compile with cuBLAS's GEMMs (as in run
# 95), and projections that read one input (gate|up, k|q|v) run as one matmul over a row slice of the packed
# weights (model/layers.projections), so that cuBLAS no longer copies XLA's stack of them on every call (run 96).
# 1. E2B's step times (bench_spec, B = 2 and 16, k = 4), both trees.
# 2. Only where the branch's B = 16 speculative step is >= 3 % faster pipelined: BUILD.md's second suite call on it
#    (the engine's tests, which run the speculative programs at B x (k + 1) > 16 rows).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run97
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  both 100 spec bench_spec.py --models e2b --batch 2 16
  faster=$(faster_at 16)
  echo "== branch faster at B = 16: ${faster:-?}"
  [ "${faster:-0}" = 1 ] && run env OUT=$res/suite2 GEMMA4_TEST_WORKERS=16 timeout $(lim 400) bash scripts/gpu_suite.sh --part 2
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run97.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run97.log" | grep -v "PASSED" | tail -n 80
