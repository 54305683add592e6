#!/usr/bin/env bash
# Run 56 (issues 10, 12; replaces the planned runs 54 and 55), one call under 590 s. Carry `.whl`.
# (1) What JAX's allocators report as their limit (`memory_stats()`), under the VMM allocator the package selects
#     and under BFC: engine.pool_memory_left reads `bytes_limit`, and the 31B servers of run 35 logged no pool
#     figure, so VMM seems to report none.
# (2) The plain 31B rows run 35 could not reach (C = 1 to 64), the server filling an executable cache: its ready time
#     measures compile_all compiling each program as soon as it is lowered (run 35: 128 s, ~1 min of lowering
#     before the first compilation started).
# (3) The same 31B server restarted on that cache (issue 10's restart goal: <= 10 s; weights still load).
# (4) The README's serve command (demo pair) with --executable-cache-dir: cold, then warm (`serve_check.py`).
# (5) The README's serve command as users run it, with JAX's default preallocation (every GPU run so far set
#     XLA_PYTHON_CLIENT_PREALLOCATE=false), cold only.
# The suite tests the eleventh session did not reach on the GPU run in BUILD.md's two suite calls, not here.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run56
end=${END:-585}
{
  for first in "import gemma4_mtp_jax" "pass"; do  # VMM (the package adds SKIP_TEMP to XLA_FLAGS), then BFC
    run env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 60 python3 -c "
$first
import os, jax, jax.numpy as jnp
x = jnp.zeros((1 << 28,), jnp.float32).block_until_ready()  # 1 GiB
print(os.environ.get('XLA_FLAGS'), jax.devices()[0].memory_stats())"
  done
  mkdir -p "$res/logs31" "$res/logs31_restart" "$res/exec" "$res/readme"
  run timeout $(lim 330) python3 benchmarks/bench_serve.py --random-weights 31b --assistant-modes plain \
      --dataset random --input-len 512 --output-len 128 --ignore-eos --concurrency 1,8,32,64 --num-prompts 512 \
      --server-arg=--max-model-len=1024 --server-arg=--executable-cache-dir=/tmp/exec31 \
      --out "$res/serve_31b_plain.json" --log-dir "$res/logs31"
  grep -hE "ready|KV pools|do not fit|compil" "$res"/logs31/*.log 2>/dev/null | tail -n 25
  run timeout $(lim 100) python3 benchmarks/bench_serve.py --random-weights 31b --assistant-modes plain \
      --dataset random --input-len 512 --output-len 128 --ignore-eos --concurrency 1 --requests-per-level 2 \
      --server-arg=--max-model-len=1024 --server-arg=--executable-cache-dir=/tmp/exec31 \
      --out "$res/serve_31b_restart.json" --log-dir "$res/logs31_restart"
  grep -hE "ready|loaded|KV pools|compil|weights" "$res"/logs31_restart/*.log 2>/dev/null | tail -n 25
  du -sh /tmp/exec31
  echo "== $(date +%T) demo pair, executable cache, $((end - SECONDS)) s left"
  run env OUT=$res/exec timeout $(lim 170) python3 benchmarks/serve_check.py -- --executable-cache-dir /tmp/exec_demo
  grep -hE "ready|loaded|compil" "$res"/exec/*.log 2>/dev/null | tail -n 40
  echo "== $(date +%T) README default preallocation, $((end - SECONDS)) s left"
  run env -u XLA_PYTHON_CLIENT_PREALLOCATE OUT=$res/readme timeout $(lim 120) python3 benchmarks/serve_check.py --runs cold
  echo "== $(date +%T) done"
} > "$out/run56.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12" "$out/run56.log" | tail -n 120
