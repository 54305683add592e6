#!/usr/bin/env bash
# Run 105 (issue 10), one call under 540 s (END: the device time left); carry `.whl` and `.baseline` (main before
# the change). Set GIT_COMMIT. The assistant's feed-forward block in one kernel (kernels/feed_forward.py) and each
# layer's next norm folded into its last residual kernel: the kernel's tests compiled by Triton, E2B's speculative
# step in both trees, the speculative program's kernels in both, and the branch's draft step kernel by kernel.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run105
end=${END:-540}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  use_baseline
  gpu_tests 150 tests/test_feed_forward.py tests/test_split_k.py
  both 150 spec bench_spec.py --models e2b --batch 2 16
  kernels_both --models e2b --batch 2 --programs speculative
  mkdir -p $res/profile
  run env OUT=$res/profile timeout $(lim 120) python3 benchmarks/bench_spec.py --models e2b --batch 2 --repeats 10 \
      --profile
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run105.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run105.log" | tail -n 40
