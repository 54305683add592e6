#!/usr/bin/env bash
# Run 81 (issue 10), one call under 590 s. Carry `.whl` and `.baseline` (main before the split-K kernels:
# rm -rf .baseline && mkdir .baseline && git archive 198bdfe | tar -x -C .baseline
# && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors). Set GIT_COMMIT to the commit this tree is at.
# The branch: o_proj, down_proj and per_layer_input_gate split along K as one batched matmul, their partials
# summed by the norm / gate kernel after them (kernels/split_k.py), for matmuls of at most 16 rows.
# 1. The split-K kernels' tests, compiled by Triton.
# 2. probe_split_k: each site at E2B's shapes, XLA's own split against the written-out one (kernels, us per layer).
# 3. Kernels per E2B decode / verify / speculative program at B = 2, both trees (autotuning off).
# 4. E2B's step times (bench_spec, B = 2 and 16, k = 4), main then branch.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run81
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  run timeout $(lim 90) python3 -m pytest -q -p no:cacheprovider tests/test_split_k.py
  mkdir -p "$res/probe"
  run env OUT=$res/probe timeout $(lim 120) python3 lab/probes/probe_split_k.py --rows 2 16 --splits 8 16
  kernels_both --models e2b --batch 2
  both 110 spec bench_spec.py --models e2b --batch 2 16
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run81.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run81.log" | tail -n 100
