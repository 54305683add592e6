#!/usr/bin/env bash
# Run 90 (issue 10), one call under 590 s (END: the device time left), right after run 89 on the same tree. Carry
# `.whl`. Set GIT_COMMIT.
# 1. The second of BUILD.md's two suite calls.
# 2. In the time left: where E2B's decode, verify and speculative steps spend their kernel time at B = 2 and 16
#    (bench_spec --profile: op by op, so only the kernels' own durations mean anything).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run90
end=${END:-585}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  run env OUT=$res/suite2 GEMMA4_TEST_WORKERS=16 timeout $(lim 470) bash scripts/gpu_suite.sh --part 2
  run env OUT=$res/profile timeout $(lim 200) python3 benchmarks/bench_spec.py --models e2b --batch 2 16 \
      --repeats 10 --profile
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run90.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run90.log" | grep -v "PASSED" | tail -n 150
