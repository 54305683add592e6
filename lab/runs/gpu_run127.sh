#!/usr/bin/env bash
# Run 127 (issue 10), one call under END s (default 470); carry `.whl` and `.baseline` (= main at 1257e9e, the last
# tree before the thirty-fifth session's kernel cuts). Set GIT_COMMIT.
# 1. The greedy speculative step at E2B, B = 2 and 16, k = 4, context 4096 in both trees (bench_spec.py: decode,
#    verify and speculative step, the copy bandwidth in the same run): does the branch's step get faster?
# 2. The two new kernels alone against XLA's kernels for the same math, per tiling (probe_gate_up.py,
#    probe_per_layer_input.py): which to keep, and their tilings.
# Kernels per program come from the compile-only counts (benchmarks/kernel_count.py --compile-for h200), which have
# matched the GPU's so far.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run127
end=${END:-470}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  both 150 spec bench_spec.py --models e2b --batch 2 16 --k 4 --context 4096 --repeats 20
  for b in 2 16; do echo "== branch faster at B = $b: $(faster_at $b)"; done
  run env OUT=$res timeout $(lim 100) python3 benchmarks/probe_gate_up.py
  run env OUT=$res timeout $(lim 60) python3 benchmarks/probe_per_layer_input.py
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run127.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run127.log" | tail -n 150
