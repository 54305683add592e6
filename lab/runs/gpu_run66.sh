#!/usr/bin/env bash
# Run 66 (issue 10), one call under 590 s; carry `.whl`. Set GIT_COMMIT.
# Why E2B's speculative step costs 1.78 decode steps at B = 16 (1.22 at B = 2): the verify is 4.67 ms against
# decode's 2.99 (run 63, pipelined). Kernel-by-kernel device time of the speculative step and of the decode step at
# B = 16 (jax.profiler: command buffers off, so the gaps are overstated; the kernels' own times are what counts),
# and what XLA's split-K GEMMs buy: E2B's step with split-K autotuning off (three split-K GEMMs and their
# reductions per layer, 105 kernels per decode step).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run66
end=${END:-585}
{
  mkdir -p "$res/profile_spec" "$res/profile_decode" "$res/nosplitk"
  run env OUT=$res/profile_spec timeout $(lim 150) python3 benchmarks/bench_spec.py --models e2b --batch 16 --profile
  run env OUT=$res/profile_decode timeout $(lim 120) python3 benchmarks/bench_decode.py --models e2b --batch 16 \
      --profile
  run env OUT=$res/nosplitk XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_split_k_autotuning=false" \
      timeout $(lim 130) python3 benchmarks/bench_spec.py --models e2b --batch 2 16
  run env OUT=$res/nosplitk XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_split_k_autotuning=false --xla_gpu_autotune_level=0" \
      timeout $(lim 60) python3 benchmarks/kernel_count.py --models e2b --batch 2 --programs decode
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run66.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run66.log" | tail -n 120
