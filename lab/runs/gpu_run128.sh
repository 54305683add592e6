#!/usr/bin/env bash
# Run 128 (issue 10), one call under END s (default 380): which of the thirty-fifth session's cuts make E2B's greedy
# step faster. Carry `.whl`, `.baseline` (main at 1257e9e), `.mid` (bdc0270: RoPE's constant inverse frequencies,
# attention_inputs' [N, .] join, triton_ops) and `.branch` (5849553: .mid + the per-layer-input and gate|up kernels
# at run 127's tilings); this tree adds the query prep in the paged kernel. Set GIT_COMMIT.
# bench_spec.py at E2B, B = 2 and 16, k = 4, context 4096 in each tree, then main's again (the run's own noise), then
# the gate|up probe at E2B's double-wide MLP.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run128
end=${END:-380}
use_trees .baseline .mid .branch
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  spec_tree main "$PWD/.baseline"
  spec_tree rope_join "$PWD/.mid"
  spec_tree pli_gate_up "$PWD/.branch"
  spec_tree query_prep "$PWD"
  spec_tree main_again "$PWD/.baseline"
  # E2B's 20 double-wide MLPs (I = 12288), which run 127's probe did not cover.
  run env OUT=$res timeout $(lim 60) python3 benchmarks/probe_gate_up.py --intermediate 12288 --rows 2 16 \
      --tilings 32,256,4,3 16,256,4,3 64,256,4,3 32,512,4,2
  python3 - "$res" <<'PY'
import json, os, sys
res = sys.argv[1]
print("tree          B  decode_pipe  verify_pipe  spec_pipe  (ms, pipelined)")
for name in ("main", "rope_join", "pli_gate_up", "query_prep", "main_again"):
    path = os.path.join(res, f"spec_{name}", "bench_spec.json")
    if not os.path.exists(path):
        print(f"{name:12s} (no result)"); continue
    for r in json.load(open(path))["rows"]:
        print(f"{name:12s} {r['batch']:2d}  {r['decode_pipelined_ms']:10.3f}  {r['verify_pipelined_ms']:10.3f}  "
              f"{r['spec_pipelined_ms']:9.3f}")
PY
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run128.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run128.log" | tail -n 80
