#!/usr/bin/env bash
# Run 134 (issue 10), one call under END s (default 300), prepared in the thirty-seventh session, not yet run. Carry
# `.whl` and `.baseline` = 4258ef2 (main before the untuned first programs: `git archive 4258ef2`, the demo pair's
# weights and lab/results left out). Set GIT_COMMIT. Its first step (E2B's step with autotuning off against
# on) ran as run 135's second; since then the untuned programs' GEMMs go to cuBLAS (run 136).
# E2B's server at random weights, cold, in both trees (main before the change first), until every program is
# compiled: how much sooner it is ready. (The replacement comes after that, so the server, stopped then, may not
# get to it; run 133 watched it happen for the demo pair.)
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run134
end=${END:-300}
use_baseline
{
  header
  python3 -c "from benchmarks.common import write_random_checkpoint as w; w('e2b', '/tmp/e2b_ckpt')"
  for tree in main branch; do
    root=$(root_of $tree)
    mkdir -p "$res/e2b_$tree"
    (cd "$root" && run env OUT="$res/e2b_$tree" PYTHONPATH=$root:/tmp/site timeout $(lim 140) python3 \
        benchmarks/serve_check.py --runs cold --until-compiled -- --ckpt /tmp/e2b_ckpt/e2b_target \
        --assistant /tmp/e2b_ckpt/e2b_assistant --load-format dummy | tail -3)
    grep -ah "compiled ahead\|ready in\|loading .*done\|replaced\|background in" "$res/e2b_$tree/serve_cold.log" | head -14
  done
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run134.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run134.log" | tail -n 80
