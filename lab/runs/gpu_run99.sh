#!/usr/bin/env bash
# Run 99 (issue 10), one call. Carry `.whl` and `.baseline` = ee107db with this tree's benchmarks/bench_spec.py
# (its --pack-params flag; the package code stays main's). Set GIT_COMMIT to this tree's commit.
# Runs 97-98: with the target's weights as separate arrays (bench_spec's default, and the server's), stacking
# gate|up copies them under cuBLAS whatever the model does. Packed (`--pack-params`), the stack is a row slice: does
# the verify's cuBLAS plan then win? E2B bench_spec at B = 2 and 16, k = 4, both trees packed.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run99
end=${END:-400}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  both 110 spec bench_spec.py --models e2b --batch 2 16 --pack-params
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run99.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run99.log" | tail -n 40
