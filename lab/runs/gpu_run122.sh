#!/usr/bin/env bash
# Run 122 (issue 10), one call under 560 s (END); carry `.whl` and `.baseline` = main. Set GIT_COMMIT. Prepared in
# the twenty-eighth session for branch sampling-one-sort, not yet run.
# 0. The paged kernel with 16 warps at E2B's verify (B = 16, 5 tokens) and prefill-chunk shapes at D = 512.
# 1. Nsight Compute on the paged kernel (never used in this project; KINDS.md: it reads the H200's counters on
#    Firecracker). Run 118 found E2B's verify attention at B = 16 and 5 tokens 1.6-2.4x a 1-token call, and run 119
#    that neither larger row blocks nor head-dim splits help. What bounds a program (the page-table gather's
#    latency, the tensor-core dots, occupancy) decides the next kernel change. Each shape: the kernel and its split
#    merge, first launches, with the occupancy, throughput and warp-stall sections.
# 2. Sampled serving, both trees: `sampling.filter_logits` with one sort (the branch) against two (main). Run 68
#    measured the same change 0.7 ms faster per sampled speculative step at B = 16. Then where the sampled step's
#    time goes at B = 16 (4.6 ms over greedy in run 68), op by op.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run122
end=${END:-560}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  # 16 warps (four warpgroups), never swept: all 40 verify rows of a KV head in one 64-row block at D = 512 with
  # 68 float32 registers a thread for the accumulator and scores (8 warps: 136, over the planner's 128).
  sweep verify_full16_w16 e2b_full 16 5 4096 4 block_rows=64 num_warps=16 k_splits=9,17,33 block_k=16,32 num_stages=1,2
  sweep prefill_full_w16 e2b_full 1 256 2048 256 block_rows=64 num_warps=16 k_splits=1,2,4 block_k=16,32
  ncu_paged full16_q5 e2b_full 16 5
  ncu_paged full16_q1 e2b_full 16 1
  both 150 sampled bench_spec.py --models e2b --batch 2 16 --sampled --repeats 10
  ncu_paged sliding16_q5 e2b_sliding 16 5
  ncu_paged sliding16_q1 e2b_sliding 16 1
  spec_profile sampled_profile --models e2b --batch 16 --sampled --repeats 5
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run122.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run122.log" | tail -n 150
