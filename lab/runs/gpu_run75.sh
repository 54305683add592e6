#!/usr/bin/env bash
# Run 75 (issues 10, 11), one call under 590 s. Carry `.whl` and `.baseline`, main's tree before this session's
# package changes: rm -rf .baseline && mkdir .baseline && git archive fa20fbd | tar -x -C .baseline
# && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors. Set GIT_COMMIT to the commit this tree is at.
# The branch: a layer's q|k|v as one matmul handed whole to the attention-inputs kernel (fused qkv), and the
# paged kernel's verify tiling from run 74 (16-row blocks, splits counted per sequence and KV head).
# 1. Kernels per E2B decode / verify / speculative program at B = 2, both trees (autotuning off).
# 2. E2B's step times (bench_spec, B = 2 and 16, k = 4), main then branch.
# 3. The paged kernel alone at the verify shapes run 74 did not time: E2B and 31B full attention at B = 2 and 16,
#    5 tokens, the new plan against the old one (block_rows 32 and its split count) in one process.
# 4. 26B-A4B decode at B = 1, 2, 4, 16 against the roofline of the experts touched (issue 11), branch only.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run75
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  kernels_both --models e2b --batch 2
  both 110 spec bench_spec.py --models e2b --batch 2 16
  pa() {  # pa TAG ARGS: the paged kernel at one shape and tiling, its JSON kept under TAG
    local tag=$1; shift; mkdir -p "$res/paged_$tag"
    run env OUT=$res/paged_$tag timeout $(lim 40) python3 benchmarks/bench_paged_attention.py --q-len 5 \
        --ctx 4096 --page-size 16 --reps 20 "$@"
  }
  pa e2b_b2_new --shapes e2b_full --batch 2
  pa e2b_b2_old --shapes e2b_full --batch 2 --block-rows 32 --k-splits 32
  pa e2b_b16_new --shapes e2b_full --batch 16
  pa e2b_b16_old --shapes e2b_full --batch 16 --block-rows 32 --k-splits 9
  pa 31b_b2_new --shapes 31b_full --batch 2
  pa 31b_b2_old --shapes 31b_full --batch 2 --block-rows 32 --k-splits 17
  pa 31b_b16_new --shapes 31b_full --batch 16
  pa 31b_b16_old --shapes 31b_full --batch 16 --block-rows 32 --k-splits 3
  mkdir -p "$res/moe"
  run env OUT=$res/moe timeout $(lim 120) python3 benchmarks/bench_decode.py --models 26b --batch 1 2 4 16
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run75.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run75.log" | grep -v "^{'\|^e2b_full B=\|^31b_full B=" | tail -n 100
