#!/usr/bin/env bash
# Run 107 (issue 10), one call under 300 s (END); carry `.whl`. Set GIT_COMMIT. The feed-forward block kernel's
# tests compiled by Triton (32 programs of 8 warps now), and its tilings after o_proj whole or split in parts the
# kernel adds (lab/probes/probe_feed_forward.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run107
end=${END:-300}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  gpu_tests 100 tests/test_feed_forward.py
  run env OUT=$res timeout $(lim 200) python3 lab/probes/probe_feed_forward.py --rows 2 16 --tilings 16,8,1 32,8,1 \
      64,4,1 32,8,2 32,8,4 32,8,8 32,8,16 64,4,4
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run107.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run107.log" | tail -n 40
