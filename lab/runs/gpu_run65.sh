#!/usr/bin/env bash
# Run 65 (issue 10), one call under 590 s, after run 64; carry `.whl` and `matrix.json` (run 64's
# matrix/bench_all.json, copied to the repository root). Set GIT_COMMIT.
# The rest of the step matrix: E4B, 26B-A4B and 31B at B = 1, 2, 16, 64 and k = 2, 4, 8, one process per model,
# with transformers' generate at batch 1 for 31B beside it; what run 64 measured is kept (--merge). It may take two
# calls: run it again with the last bench_all.json as matrix.json. A model whose
# process runs out of time keeps the rows it measured in the JSON but is run again by the next --merge.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run65
end=${END:-585}
{
  mkdir -p "$res/matrix" "$res/matrix31"
  run timeout $(lim 400) python3 benchmarks/bench_all.py --models e2b e4b 26b --hf-models e2b \
      --batch 1 2 16 64 --k 2 4 8 --timeout $(lim 250) --merge matrix.json --out "$res/matrix"
  # 31B without B = 64: its weights (62 GB) and 64 sequences' pages at context 4096 (~64 GB) would not leave room
  run timeout $(lim 400) python3 benchmarks/bench_all.py --models 31b --hf-models 31b \
      --batch 1 2 16 --k 2 4 8 --timeout $(lim 380) --merge "$res/matrix/bench_all.json" --out "$res/matrix31"
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run65.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run65.log" | tail -n 100
