#!/usr/bin/env bash
# Run 73 (issue 10), one call under 590 s; carry `.whl`. Set GIT_COMMIT.
# What the sampled speculative step spends its extra 4.6 ms on at B = 16 (runs 64, 68): its kernels, profiled.
# (The paged kernel's tiling sweeps this script first held ran as run 74, at the server's 16-token pages.)
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run73
end=${END:-585}
{
  mkdir -p "$res/sampled_profile"
  run env OUT=$res/sampled_profile timeout $(lim 120) python3 benchmarks/bench_spec.py --models e2b --batch 16 \
      --sampled --profile
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run73.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run73.log" | tail -n 90
