#!/usr/bin/env bash
# Run 60 (issue 10; branch traced-once-layers), one call under 590 s. Carry `.whl` and `.baseline` (main's tree, as
# for run 63). Start-up at 31B's shapes as the server builds it (`compile_all.py`: parameters as shapes,
# --max-num-seqs 64, --max-model-len 1024, the speculative engine's 17 programs), main then the branch: tracing
# and lowering one program at a time was the critical path (run 56: the last 31B program started compiling ~79 s
# in); issue 10's goal is 31B ready <= 150 s (run 35: 185 s for the speculative server).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run60
end=${END:-585}
{
  for tree in main branch; do
    root=$PWD; [ "$tree" = main ] && root=$PWD/.baseline
    mkdir -p "$res/$tree"
    run env OUT=$res/$tree PYTHONPATH=$root:/tmp/site timeout $(lim 280) python3 "$root/benchmarks/compile_all.py" \
        --families 31b --engines speculative --max-num-seqs 64 --max-model-len 1024
  done
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run60.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12" "$out/run60.log" | tail -n 60
