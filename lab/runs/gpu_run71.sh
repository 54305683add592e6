#!/usr/bin/env bash
# Run 71 (issues 10, 11), one call under 590 s; carry `.whl`. Set GIT_COMMIT to the commit the tree is at.
# 1. Kernels per decode, verify and speculative program for every family at B = 2 (issue 10's table; only
#    E2B has been counted so far), from the parameters' shapes, autotuning off.
# 2. Where the demo pair's slowest cold compile goes (run 64's log of it was lost with an oversized archive):
#    probe_compile.py under XLA's scoped timers, the timer lines kept, the verbose log left on the device.
# 3. 26B-A4B's row of the matrix again, now against the roofline of the experts its routing touched (run 65a's
#    rows used all 128 experts): bench_all.py --merge over the 2026-12-02 matrix, so the JSON and plots come back
#    whole with 26B's share in them.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run71
end=${END:-585}
{
  mkdir -p "$res/kernels"
  run env OUT=$res/kernels XLA_FLAGS=--xla_gpu_autotune_level=0 timeout $(lim 200) \
      python3 benchmarks/kernel_count.py --models e2b e4b 26b 31b --batch 2
  run env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_MAX_VLOG_LEVEL=1 timeout $(lim 90) python3 lab/probes/probe_compile.py \
      > /tmp/probe_compile.log 2>&1
  grep -aE " time: [0-9.]+ (s|min)" /tmp/probe_compile.log | sort -t: -k2 -rn | head -60 > "$res/probe_compile_timers.txt"
  head -40 "$res/probe_compile_timers.txt"; grep -av "^[WIE]1" /tmp/probe_compile.log | tail -5
  python3 - <<'PY' > /tmp/no26b.json
import json
d = json.load(open("lab/results/2026-12-02/bench_all.json"))
d["runs"] = [r for r in d["runs"] if r["model"] != "26b"]  # 26B runs again below, against its touched roofline
print(json.dumps(d))
PY
  mkdir -p "$res/matrix"
  run timeout $(lim 260) python3 benchmarks/bench_all.py --merge /tmp/no26b.json --hf-models e2b 31b \
      --batch 1 2 16 64 --k 2 4 8 --timeout $(lim 240) --out "$res/matrix"
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run71.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run71.log" | tail -n 100
