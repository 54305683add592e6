#!/usr/bin/env bash
# Run 101 (issue 10), one call under 590 s (END: the device time left). Carry `.whl` and `.baseline` = main
# (0b79998: rm -rf .baseline && mkdir .baseline && git archive 0b79998 | tar -x -C .baseline
# && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors). Set GIT_COMMIT to this tree's commit.
# Ran at a39527d, a local branch not kept (withdrawn, lab/NOTEBOOK.md run 101 says what it changed):
# on main the branch's code is absent, so this script is the record of the run, not a way to repeat it.
# The branch: a speculative program whose verify has more than 16 rows compiles with cuBLAS's GEMMs and without
# XLA's dot-merger (step.verify_options), so that nothing stacks gate|up or q|k|v and cuBLAS copies no weights
# (run 96: ~1 ms of copies a step at B = 16, the cuBLAS GEMMs themselves ~480 us faster than Triton's).
# 1. E2B's step times (bench_spec, B = 2 and 16, k = 4), both trees; B = 2 (10 rows) is the same program in both.
# 2. Where the branch's B = 16 speculative step is >= 3 % faster pipelined: BUILD.md's second suite call on it (the
#    engine's tests, which run speculative programs past 16 rows). Otherwise the branch's B = 16 kernel profile.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run101
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  both 110 spec bench_spec.py --models e2b --batch 2 16
  faster=$(faster_at 16)
  echo "== branch faster at B = 16: ${faster:-?}"
  if [ "${faster:-0}" = 1 ]; then
    run env OUT=$res/suite2 GEMMA4_TEST_WORKERS=16 timeout $(lim 400) bash scripts/gpu_suite.sh --part 2
  else
    mkdir -p $res/profile_branch
    run env OUT=$res/profile_branch timeout $(lim 150) python3 benchmarks/bench_spec.py --models e2b --batch 16 --profile
  fi
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run101.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run101.log" | grep -v "PASSED" | tail -n 120
