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
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run122
end=${END:-560}
use_baseline
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
{
  echo "== commit ${GIT_COMMIT:-unknown}; ncu: ${NCU:-none}"
  [ -n "$NCU" ] && "$NCU" --version | tail -1
  prof() {  # prof NAME SHAPE B TQ: ncu on the first launches of the paged kernel and its merge at one E2B shape
    local name=$1 shape=$2 b=$3 tq=$4
    [ -n "$NCU" ] || return
    run timeout $(lim 100) "$NCU" --clock-control none --kernel-name regex:paged_attention --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 benchmarks/bench_paged_attention.py --shapes "$shape" --batch "$b" --q-len "$tq" --ctx 4096 \
        --page-size 16 --k-spec 4 --reps 1 --max-sets 1 --copy-mib 64 > "$res/ncu_$name.txt" 2>&1
    grep -aE "  paged_attention|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Dynamic Shared|Block Limit (Registers|Shared Mem)|Waves Per SM|Grid Size|Memory Throughput|DRAM Throughput|L2 Hit Rate|Compute \(SM\) Throughput|Warp Cycles Per Issued|stalled_(long_scoreboard|barrier|short_scoreboard|math_pipe_throttle|wait|mio_throttle|lg_throttle|not_selected|dispatch_stall|no_instruction)" \
        "$res/ncu_$name.txt" | head -70
    grep -aq "Duration" "$res/ncu_$name.txt" || tail -n 15 "$res/ncu_$name.txt"  # nothing profiled: say why
  }
  sweep() {  # sweep NAME SHAPE B TQ CTX K_SPEC GRID...: bench_paged_attention's sweep of one shape to $res/NAME
    local name=$1 shape=$2 b=$3 tq=$4 ctx=$5 kspec=$6; shift 6
    mkdir -p "$res/$name"
    run env OUT=$res/$name timeout $(lim 70) python3 benchmarks/bench_paged_attention.py --sweep --shapes $shape \
        --batch $b --q-len $tq --ctx $ctx --page-size 16 --k-spec $kspec --reps 20 --max-sets 4 --sweep-grid "$@" \
        | grep -v "B=.*: kernel \|^  "
  }
  # 16 warps (four warpgroups), never swept: all 40 verify rows of a KV head in one 64-row block at D = 512 with
  # 68 float32 registers a thread for the accumulator and scores (8 warps: 136, over the planner's 128).
  sweep verify_full16_w16 e2b_full 16 5 4096 4 block_rows=64 num_warps=16 k_splits=9,17,33 block_k=16,32 num_stages=1,2
  sweep prefill_full_w16 e2b_full 1 256 2048 256 block_rows=64 num_warps=16 k_splits=1,2,4 block_k=16,32
  prof full16_q5 e2b_full 16 5
  prof full16_q1 e2b_full 16 1
  both 150 sampled bench_spec.py --models e2b --batch 2 16 --sampled --repeats 10
  prof sliding16_q5 e2b_sliding 16 5
  prof sliding16_q1 e2b_sliding 16 1
  mkdir -p "$res/sampled_profile"
  run env OUT="$res/sampled_profile" timeout $(lim 120) python3 benchmarks/bench_spec.py --models e2b --batch 16 \
      --sampled --profile --repeats 5
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run122.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run122.log" | tail -n 150
