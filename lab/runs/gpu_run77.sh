#!/usr/bin/env bash
# Run 77 (issue 10), one call under 590 s. The tree: main with the fused q|k|v matmul back
# (git checkout -b fused-qkv && git revert --no-edit 9fde87c); carry `.whl` and `.baseline`, main's tree:
# rm -rf .baseline && mkdir .baseline && git archive main | tar -x -C .baseline
# && rm .baseline/gemma4_mtp_jax/demo_pair/*/model.safetensors. Set GIT_COMMIT.
# Run 76 counted one new loop fusion per K/V-owning layer at E4B (+24) and 31B (+60) where the fused matmul removed
# the re-concatenation (E2B got none). Is it the three weights' concatenation, copied every step, or something
# cheap? 1. Both trees' E4B decode HLO at B = 2, and the loop fusions only the fused tree has, with their shapes.
# 2. E4B and 31B decode at B = 2 and 16, both trees (bench_decode), which prices whatever they are.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run77
end=${END:-585}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  kernels_both --models e4b --batch 2 --dump-hlo "$res/hlo_{tree}"
  python3 - "$res" <<'PY'
import collections, gzip, re, sys
res = sys.argv[1]
def loops(tree):  # fusion kind and root opcode + result shape of each kLoop fusion computation's caller line
    text = gzip.open(f"{res}/hlo_{tree}/e4b_decode_b2.hlo.txt.gz", "rt").read()
    out = collections.Counter()
    for line in text.splitlines():
        if "kind=kLoop" in line and " fusion(" in line:
            shape = line.split("=", 1)[1].split("fusion(")[0].strip()
            calls = re.search(r"calls=%?([\w.\-]+)", line)
            out[(shape, calls.group(1).rsplit(".", 1)[0] if calls else "?")] += 1
    return out
main, branch = loops("main"), loops("branch")
for key, n in sorted((branch - main).items(), key=lambda kv: -kv[1])[:20]:
    print(f"only in the fused tree: {n:3d} x {key[0]} ({key[1]})")
PY
  both 200 decode bench_decode.py --models e4b 31b --batch 2 16
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run77.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{" "$out/run77.log" | tail -n 60
