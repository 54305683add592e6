#!/usr/bin/env bash
# Run 138 (issue 10), one call under END s (default 480), prepared in the thirty-ninth session, not yet run. Carry
# `.whl` and `.baseline` = main. Set GIT_COMMIT. This tree (assistant-split, merged into main and reverted: restore
# it with `git revert --no-commit 198ad9d c81bb7d`; NOTEBOOK.md's thirty-ninth session names the commits) splits the 1024-wide drafters' (26B-A4B, 31B) o_proj and
# down_proj along their contraction as the target's are, their parts summed by the residual kernels
# (kernels/split_k.py) instead of by XLA's own reduction kernels: compiled for the H200 on the CPU, 31B's
# speculative program holds 1096 kernels at B = 2 (main 1124) and 1032 at B = 16 (main 1060), 7 fewer a draft
# step; E2B's and E4B's drafters take the feed-forward block kernel and are unchanged. 31B's ratio goals: 1.12 at
# B = 2, 1.25 at B = 16 (1.15 / 1.30 on the H200 in run 78; 1.11 at B = 2 on an H100 in run 133).
# 1. 31B's step (B = 2; 16 too where the GPU has over 120 GB), main and this tree alternately, twice each.
# 2. This tree's split-K and drafter parity tests on the GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run138
end=${END:-480}
use_baseline
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
batches="2"; [ "$mem" -gt 120000 ] && batches="2 16"
spec31() {  # spec31 NAME ROOT: bench_spec.py at 31B in the tree at ROOT, its JSON to $res/spec_NAME
  mkdir -p "$res/spec_$1"
  run env OUT=$res/spec_$1 PYTHONPATH=$2:/tmp/site XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout $(lim 110) \
      python3 "$2/benchmarks/bench_spec.py" --models 31b --batch $batches --k 4 --context 4096 --repeats 10
}
{
  header
  spec31 main "$PWD/.baseline"; spec31 branch "$PWD"; spec31 main_again "$PWD/.baseline"; spec31 branch_again "$PWD"
  spec_table main branch main_again branch_again
  gpu_tests 100 tests/test_split_k.py tests/test_parity_assistant.py
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run138.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run138.log" | tail -n 60
