#!/usr/bin/env bash
# Run 80 (issue 10), one call under 480 s; carry `.whl`. Set GIT_COMMIT to the commit the tree is at. (Its first
# attempt, in the seventeenth session, never came back: the machine was taken back during the call.)
# 1. Cold compilation of the server's programs since compile_all starts the costliest first (7419f1b): the demo
#    pair and E2B, speculative, against run 79 (35.2 s and 60.3 s wall).
# 2. The centroid head at T = 2, 8, 16 (run 78 reached T = 1 only): the whole head through XLA and through the
#    kernel, the kernel alone, the selection alone (issue 10's goal: <= 10 us at T <= 16).
# 3. E2B's verify and speculative programs at B = 2, kernels by where they come from (kernel_count --by-scope):
#    which of a draft step's ~63 kernels to remove (goal <= 25).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run80
end=${END:-470}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  mkdir -p "$res/compile" "$res/centroid"
  run env OUT=$res/compile timeout $(lim 150) python3 benchmarks/compile_all.py --families demo e2b \
      --engines speculative
  run env OUT=$res/centroid timeout $(lim 200) python3 benchmarks/bench_centroid_head.py --tokens 2 8 16 \
      --no-sweep --reps 30 --paths xla_full pallas_full pallas_kernel select
  run env OUT=$res XLA_FLAGS=--xla_gpu_autotune_level=0 timeout $(lim 80) python3 benchmarks/kernel_count.py \
      --models e2b --batch 2 --programs verify speculative --by-scope 3
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run80.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run80.log" | tail -n 150
