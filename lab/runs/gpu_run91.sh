#!/usr/bin/env bash
# Run 91 (issue 10), one call under 590 s (END: the device time left). Carry `.whl`. Set GIT_COMMIT.
# 1. Where E2B's decode, verify and speculative steps spend their kernel time at B = 2 and 16 (bench_spec
#    --profile: op by op, so only the kernels' own durations mean anything).
# 2. The centroid head's kernels by trace at T = 1, 2 and 8 (run 89 reached only T = 16).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run91
end=${END:-585}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
  run env timeout $(lim 300) python3 benchmarks/bench_spec.py --models e2b --batch 2 16 --repeats 10 --profile
  run env timeout $(lim 200) python3 benchmarks/bench_centroid_head.py --no-chain --no-sweep --tokens 1 2 8 \
      --paths pallas_full pallas_kernel scores select floor
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run91.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run91.log" | tail -n 400
