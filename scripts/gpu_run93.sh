#!/usr/bin/env bash
# Run 93 (issue 10), right after run 92 on the same tree, one call under 590 s (END: the device time left). Carry
# `.whl`. Set GIT_COMMIT. The second of BUILD.md's two suite calls.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run93
end=${END:-585}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  run env OUT=$res/suite2 GEMMA4_TEST_WORKERS=16 timeout $(lim 580) bash scripts/gpu_suite.sh --part 2
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run93.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run93.log" | grep -v "PASSED" | tail -n 80
