#!/usr/bin/env bash
# Run 120 (issue 10), one call under 560 s (END); carry `.whl` and `.baseline` = main before the Pallas split merge
# (6d8e6d0). Set GIT_COMMIT. Prepared in the twenty-seventh session as the branch's last A/B; the split merge landed
# in the twenty-eighth (a5da3ba) on E2B's A/B (run 118) and the suite, so this is its check at 31B (goals: spec/decode
# 1.12 at B = 2, 1.25 at B = 16; run 78: 1.15 / 1.30). Then the demo pair's cold start three times on this tree, to
# tell the machine's spread from the code's (run 117: 15.1 s; run 121, another machine: 18.4 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run120
end=${END:-560}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  both 200 spec bench_spec.py --models 31b --batch 2 16 --repeats 10
  for i in 1 2 3; do
    mkdir -p "$res/demo_$i"
    run env OUT="$res/demo_$i" timeout $(lim 60) python3 benchmarks/serve_check.py --runs cold
    grep -ah "ready in" "$res/demo_$i/serve_cold.log"
  done
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run120.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run120.log" | tail -n 60
