#!/usr/bin/env bash
# Run 106 (issue 10), one call under 300 s (END); carry `.whl`. Set GIT_COMMIT. The feed-forward block kernel's
# tilings at the E2B assistant's shapes (lab/probes/probe_feed_forward.py) and its tests compiled by Triton.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run106
end=${END:-300}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  gpu_tests 100 tests/test_feed_forward.py
  run env OUT=$res timeout $(lim 200) python3 lab/probes/probe_feed_forward.py --rows 2 16
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run106.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run106.log" | tail -n 40
