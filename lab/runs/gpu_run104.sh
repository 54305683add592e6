#!/usr/bin/env bash
# Run 104 (issue 10), one call under 480 s (END: the device time left); main alone, carry `.whl`. Set GIT_COMMIT.
# Where the drafter's time goes, for the next design (a draft step's kernels fused by hand): E2B's decode, verify
# and speculative programs traced at B = 2 and 16 (bench_spec --profile, now with every kernel of a step in launch
# order in the JSON), and the optimized HLO of the verify and speculative programs at B = 2 (kernel_count
# --dump-hlo), which names what each fusion holds.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run104
end=${END:-480}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  mkdir -p $res/profile $res/kernels
  run env OUT=$res/profile timeout $(lim 200) python3 benchmarks/bench_spec.py --models e2b --batch 2 16 --repeats 10 \
      --profile
  run env OUT=$res/kernels XLA_FLAGS=--xla_gpu_autotune_level=0 timeout $(lim 120) python3 benchmarks/kernel_count.py \
      --models e2b --batch 2 --programs verify speculative --dump-hlo $res/hlo
  ls -la $res/hlo 2>/dev/null | head
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run104.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run104.log" | tail -n 40
