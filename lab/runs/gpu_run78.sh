#!/usr/bin/env bash
# Run 78 (issue 10), one call under 590 s; carry `.whl`. Set GIT_COMMIT to the commit the tree is at.
# 1. The centroid head at E2B's dims, T = 1..16: select by top-k in passes of 16 (this tree) against one
#    lax.top_k(32) (XLA sorts each row), and the whole head with each (issue 10's goal: <= 10 us at T <= 16).
# 2. The paged kernel at prefill shapes (B = 1, a 256-token chunk after 2048 tokens, 16-token pages): a grid of
#    tilings beside kernel_config's own and the XLA path (issue 10's goal: the kernel at least as fast as XLA at
#    every prefill shape; run 3 measured E2B full 492 vs 124 us, E2B sliding 45 vs 22 us, 31B full 995 vs 358).
# 3. 31B's spec / decode at B = 2 and 16 since the verify tiling of 4351ef1 (goals 1.12 / 1.25).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run78
end=${END:-585}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  mkdir -p "$res/centroid" "$res/prefill_e2b_full" "$res/prefill_e2b_sliding" "$res/prefill_31b_full" "$res/spec31b"
  run env OUT=$res/centroid timeout $(lim 90) python3 benchmarks/bench_centroid_head.py --tokens 1 2 4 8 16 \
      --no-sweep --reps 30
  pre() {  # pre SHAPE GRID...: the prefill sweep of one shape
    local shape=$1; shift
    run env OUT=$res/prefill_$shape timeout $(lim 90) python3 benchmarks/bench_paged_attention.py --sweep \
        --shapes $shape --batch 1 --q-len 256 --ctx 2048 --page-size 16 --k-spec 256 --reps 10 --max-sets 4 \
        --sweep-grid "$@"
  }
  pre e2b_full block_rows=32,64 k_splits=1,2,4,8 block_k=32 num_warps=4,8 num_stages=2
  pre e2b_sliding block_rows=32,64 k_splits=1,2,4 block_k=64 num_warps=4,8 num_stages=2
  pre 31b_full block_rows=32 k_splits=1,2,4 block_k=32 num_warps=4,8 num_stages=2
  run env OUT=$res/spec31b timeout $(lim 220) python3 benchmarks/bench_spec.py --models 31b --batch 2 16 \
      --repeats 10
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run78.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run78.log" | grep -v "^e2b_.* B=.*: kernel \|^31b_.* B=.*: kernel " | tail -n 110
