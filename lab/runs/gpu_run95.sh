#!/usr/bin/env bash
# Run 95 (issue 10), one call under 590 s (END: the device time left). Carry `.whl` and `.baseline` = main before
# the change (ee107db: rm -rf .baseline && mkdir .baseline && git archive ee107db | tar -x -C .baseline
# && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors). Set GIT_COMMIT to this tree's commit.
# The branch compiles a speculative program whose verify has more than 16 rows (B x (k + 1)) with cuBLAS's GEMMs
# instead of XLA's Triton ones (step.verify_options; run 94: gate|up at 80 rows 22.3 / 13.1 us against 26.4 / 19.2).
# 1. E2B's step times (bench_spec, B = 2, 4 and 16, k = 4), both trees; B = 2 (10 rows) is the same program in both.
# 2. The branch with Triton's GEMMs off for every program (XLA_FLAGS) at B = 2: would the 10-row verify gain too?
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run95
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  both 130 spec bench_spec.py --models e2b --batch 2 4 16
  mkdir -p $res/spec_all_cublas
  run env OUT=$res/spec_all_cublas XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout $(lim 100) \
      python3 benchmarks/bench_spec.py --models e2b --batch 2
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run95.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run95.log" | grep -v "PASSED" | tail -n 120
