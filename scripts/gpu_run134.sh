#!/usr/bin/env bash
# Run 134 (issue 10), one call under END s (default 420), prepared in the thirty-seventh session, not yet run. Carry
# `.whl` and `.baseline` = 4258ef2 (main before the untuned first programs: `git archive 4258ef2`, the demo pair's
# weights and benchmarks/results left out). Set GIT_COMMIT. What the untuned first programs (914b1ed) do at E2B,
# where run 61 found its decode up to twice as slow without autotuning:
# 1. bench_spec.py at E2B (B = 2 and 16, k = 4, context 4096) with autotuning off in every program, and with it on:
#    the step the first batch bucket serves with until the replacement, against the one after it.
# 2. E2B's server at random weights, cold, in both trees (main before the change first), until every program is
#    compiled: how much sooner it is ready. (The replacement comes after that, so the server, stopped then, may not
#    get to it; run 133 watched it happen for the demo pair.)
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run134
end=${END:-420}
use_baseline
{
  header
  mkdir -p "$res/spec_untuned" "$res/spec_tuned"
  run env OUT=$res/spec_untuned XLA_FLAGS=--xla_gpu_autotune_level=0 timeout $(lim 80) python3 \
      benchmarks/bench_spec.py --models e2b --batch 2 16 --k 4 --context 4096 --repeats 20
  spec_tree tuned "$PWD"
  spec_table untuned tuned
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
