#!/usr/bin/env bash
# Run 63 (issue 10; branch qkv-epilogue, which holds traced-once-layers), one call under 590 s. Carry `.whl` and
# `.baseline`, main's tree: rm -rf .baseline && mkdir .baseline && git archive main | tar -x -C .baseline
# && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors
# Does the attention-inputs kernel (one kernel from q/k/v projections to queries and paged K/V, where XLA ran six
# per layer) pay on the GPU? Per tree (main = .baseline, the branch = this tree): kernels per decode / verify /
# speculative program from the optimized HLO (E2B, B = 2; autotuning off on both for a quick compile), E2B's step
# times (bench_spec, B = 2 and 16, k = 4; main then branch, $ROUNDS rounds, default 1), the demo pair's cold compile.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run63
end=${END:-585}
use_baseline
{
  kernels_both --models e2b --batch 2
  for round in $(seq 1 ${ROUNDS:-1}); do
    for tree in main branch; do
      root=$(root_of $tree); mkdir -p "$res/spec_${tree}_$round"
      run env OUT=$res/spec_${tree}_$round PYTHONPATH=$root:/tmp/site timeout $(lim 110) python3 \
          "$root/benchmarks/bench_spec.py" --models e2b --batch 2 16
    done
  done
  for tree in main branch; do
    root=$(root_of $tree); mkdir -p "$res/compile_$tree"
    run env OUT=$res/compile_$tree PYTHONPATH=$root:/tmp/site timeout $(lim 60) python3 \
        "$root/benchmarks/compile_all.py" --families demo --engines speculative
  done
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run63.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run63.log" | grep -v "compiled .* in .*s$" | tail -n 80
