#!/usr/bin/env bash
# Run 135 (issue 10), one call under END s (default 470), prepared in the thirty-eighth session. Carry `.whl`. Set
# GIT_COMMIT.
# 1. The sliding layers' paged kernel at E2B's decode and verify shapes (B = 2 and 16, 1 and 5 tokens, context
#    4096, window 512): kernel_config's tiling against 4-32 key splits of 16-64 keys. At decode kernel_config gives
#    4 splits (it wants 2 key blocks of 64 a split): 8 programs at B = 2, 64 at B = 16, on 132 SMs (run 122's ncu:
#    6 % achieved occupancy at B = 16). Run 124, which was to sweep this, never ran.
# 2. run134's first step: E2B's step with XLA's GEMM autotuning off in every program against on (how the untuned
#    first programs serve until their tuned twins replace them).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run135
end=${END:-470}
{
  header
  grid="block_rows=16 num_warps=4 num_stages=2 k_splits=4,8,16,32 block_k=16,32,64"
  for b in 2 16; do
    for tq in 1 5; do
      # shellcheck disable=SC2086
      sweep sliding_b${b}_q$tq e2b_sliding $b $tq 4096 4 $grid
    done
  done
  mkdir -p "$res/spec_untuned" "$res/spec_tuned"
  run env OUT=$res/spec_untuned XLA_FLAGS=--xla_gpu_autotune_level=0 timeout $(lim 80) python3 \
      benchmarks/bench_spec.py --models e2b --batch 2 16 --k 4 --context 4096 --repeats 20
  spec_tree tuned "$PWD"
  spec_table untuned tuned
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run135.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run135.log" | tail -n 120
