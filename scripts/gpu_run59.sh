#!/usr/bin/env bash
# Run 59 (issue 10; branch traced-once-layers), one call under 590 s. Carry `.whl` and `.baseline`, main's tree:
#   rm -rf .baseline && mkdir .baseline && git archive main | tar -x -C .baseline
# Does tracing each kind of decoder layer (and the assistant's draft step) once change what the GPU runs? Per tree
# (main = .baseline, the branch = this tree): kernels per decode / verify / speculative program from the optimized
# HLO (E2B and 31B, B = 2), then E2B's step times (bench_spec, B = 2 and 16, k = 4) in alternating processes.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run59
end=${END:-585}
root_of() { [ "$1" = main ] && echo "$PWD/.baseline" || echo "$PWD"; }
{
  for tree in main branch; do
    root=$(root_of $tree); mkdir -p "$res/$tree"
    run env OUT=$res/$tree PYTHONPATH=$root:/tmp/site timeout $(lim 170) python3 "$root/benchmarks/kernel_count.py" \
        --models e2b 31b --batch 2
  done
  for round in 1 2; do
    for tree in main branch; do
      root=$(root_of $tree); mkdir -p "$res/$tree/spec$round"
      run env OUT=$res/$tree/spec$round PYTHONPATH=$root:/tmp/site timeout $(lim 70) python3 \
          "$root/benchmarks/bench_spec.py" --models e2b --batch 2 16
    done
  done
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run59.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12" "$out/run59.log" | tail -n 80
