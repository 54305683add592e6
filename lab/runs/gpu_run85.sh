#!/usr/bin/env bash
# Run 85 (issue 10), one call under 590 s. Carry `.whl` and `.baseline` = 198bdfe (main before the split-K kernels:
# rm -rf .baseline && mkdir .baseline && git archive 198bdfe | tar -x -C .baseline
# && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors). Set GIT_COMMIT to this tree's commit.
# What the eighteenth session could not time: the split-K kernels at E4B (o_proj and the per-layer-input matmuls
# split; down_proj, 50 MiB, keeps XLA's plan) and 31B (every matmul over 40 MiB: nothing should change), and E2B
# again in alternating rounds, since one process per tree left a spread as large as the effect (runs 81-84).
# 1. Decode at B = 2 and 16, E4B and 31B, both trees (bench_decode).
# 2. E2B's steps (bench_spec, B = 2 and 16), main and branch alternating, $ROUNDS rounds (default 2).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run85
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  both 180 decode bench_decode.py --models e4b 31b --batch 2 16
  for round in $(seq 1 ${ROUNDS:-2}); do
    both 60 "spec$round" bench_spec.py --models e2b --batch 2 16
  done
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run85.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run85.log" | tail -n 60
