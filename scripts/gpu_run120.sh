#!/usr/bin/env bash
# Run 120 (issue 10), one call under 560 s (END); carry `.whl` and `.baseline` = main. Set GIT_COMMIT. Prepared in
# the twenty-seventh session, not yet run: the A/B a kernel branch still needs before BUILD.md's suite and the
# merge, at 31B (its goals: spec/decode 1.12 at B = 2, 1.25 at B = 16; run 78: 1.15 / 1.30). Run 118 measured E2B.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run120
end=${END:-560}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  both 200 spec bench_spec.py --models 31b --batch 2 16 --repeats 10
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run120.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run120.log" | tail -n 60
