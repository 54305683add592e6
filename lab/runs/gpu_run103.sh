#!/usr/bin/env bash
# Run 103 (issue 10), one call under 590 s (END: the device time left); main alone, carry `.whl`. Set GIT_COMMIT.
# XLA's own fusion and command-buffer options that no run had tried, each for the whole process (XLA_FLAGS; the
# package still adds SKIP_TEMP): E2B bench_spec at B = 2 and 16, k = 4, once per option, main's plain plan first and
# last (the drift between the two is the noise floor).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run103
end=${END:-585}
variants=(
  "plain="
  "concurrent_region=--xla_gpu_graph_enable_concurrent_region=true"
  "triton_softmax=--xla_gpu_experimental_enable_triton_softmax_priority_fusion=true"
  "heroless=--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true"
  "multi_output=--xla_gpu_unsupported_enable_triton_multi_output_fusion=true"
  "block_level=--xla_gpu_experimental_enable_fusion_block_level_rewriter=true"
  "plain_again="
)
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  for v in "${variants[@]}"; do
    name=${v%%=*} flags=${v#*=}
    mkdir -p $res/flags_$name
    echo "== variant $name: XLA_FLAGS='$flags'"
    run env OUT=$res/flags_$name XLA_FLAGS="$flags" timeout $(lim 80) python3 benchmarks/bench_spec.py --models e2b \
        --batch 2 16
  done
  python3 - "$res" "${variants[@]}" <<'PY'
import json, sys
res, names = sys.argv[1], [v.split("=", 1)[0] for v in sys.argv[2:]]
print(f"{'variant':<18} {'B':>3} {'decode pipe':>11} {'spec pipe':>10} {'ratio':>6}")
for n in names:
    try:
        rows = json.load(open(f"{res}/flags_{n}/bench_spec.json"))["rows"]
    except (OSError, ValueError, KeyError):
        print(f"{n:<18} no result"); continue
    for r in rows:
        print(f"{n:<18} {r['batch']:>3} {r['decode_pipelined_ms']:>11.3f} {r['spec_pipelined_ms']:>10.3f} "
              f"{r['spec_pipelined_ms'] / r['decode_pipelined_ms']:>6.2f}")
PY
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run103.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run103.log" | tail -n 60
