#!/usr/bin/env bash
# Run 102 (issue 10), one call under 590 s (END: the device time left). Carry `.whl` and `.baseline` = main
# (0b79998: rm -rf .baseline && mkdir .baseline && git archive 0b79998 | tar -x -C .baseline
# && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors). Set GIT_COMMIT to this tree's commit.
# Ran at eb0410e, a local branch not kept (withdrawn, lab/NOTEBOOK.md run 102 says what it changed):
# on main the branch's code is absent, so this script is the record of the run, not a way to repeat it.
# The branch: the paged kernel's value splits (programs sharing a block's V columns), and kernel_config's plan for
# a full-attention layer's verify rows (D 512, 17-64 rows): one block of all the rows, two value splits, instead
# of 16-row blocks that each re-read the keys (run 91: 81 us a layer at B = 16 against decode's 40).
# 1. The kernel alone (bench_paged_attention --sweep, 5 query tokens, context 4096, 16-token pages): E2B's full
#    layer at B = 2 and 16, 31B's at B = 16; the plan first in each shape, then the grid.
# 2. E2B's step times (bench_spec, B = 2 and 16, k = 4), both trees.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run102
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  for shape in "e2b_full 2,16" "31b_full 16"; do
    set -- $shape
    mkdir -p $res/attention_$1
    run env OUT=$res/attention_$1 timeout $(lim 130) python3 benchmarks/bench_paged_attention.py --shapes $1 \
        --batch $2 --q-len 5 --ctx 4096 --page-size 16 --reps 40 --sweep --sweep-grid block_rows=16,32,64 \
        v_splits=1,2,4 num_warps=4,8,16 k_splits=17,33 block_k=32
  done
  both 110 spec bench_spec.py --models e2b --batch 2 16
  echo "== branch faster at B = 2: $(faster_at 2), at B = 16: $(faster_at 16)"
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run102.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"\|ERROR ValueError: no kernel tiling" "$out/run102.log" | grep -v "PASSED" | \
    cut -c1-260 | tail -n 150
