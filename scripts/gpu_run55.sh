#!/usr/bin/env bash
# Run 55 (planned; issues 10, 12), one call under 590 s. Carry `.whl`.
# (1) The README's serve command as users run it (JAX's default preallocation, the server's 90 % memory fraction),
#     cold then warm (`benchmarks/serve_check.py`): every GPU run so far set XLA_PYTHON_CLIENT_PREALLOCATE=false;
# (2) the same with `--executable-cache-dir`: cold (fills it), warm (loads every program without tracing): issue
#     10's restart goal is <= 10 s (CPU, E2B's speculative engine: 67.5 -> 9.9 s). The 31B restart is the one that
#     matters most (~1 min of lowering): a later run.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run55
end=585
mkdir -p "$res/readme" "$res/exec"
{
  run env -u XLA_PYTHON_CLIENT_PREALLOCATE OUT=$res/readme timeout $(lim 200) python3 benchmarks/serve_check.py
  run env OUT=$res/exec timeout $(lim 200) python3 benchmarks/serve_check.py -- --executable-cache-dir /tmp/exec_cache
  ls /tmp/exec_cache | wc -l; du -sh /tmp/exec_cache
  echo "== $(date +%T) $((end - SECONDS)) s left"
} > "$out/run55.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12" "$out/run55.log" | tail -n 60
