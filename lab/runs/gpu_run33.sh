#!/usr/bin/env bash
# Run 33 (issue 12's host overhead, after run 32 ruled out lax.cond): how long a call of the E2B decode program
# holds the thread, with per-step inputs from the host or on the device, under XLA_FLAGS variants: the defaults
# (with XLA's command-buffer update log), command buffers off, and each `xla_gpu_command_buffer_update_mode`
# value this XLA accepts (stable addresses for the temporaries, so a run does not re-record every kernel node).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run33
{
  modes=""
  for m in SKIP_TEMP VMM_PERSISTENT_TEMP SKIP_PROFILED NEVER_UPDATE CAPTURE_CMD_NEVER_UPDATE; do
    if XLA_FLAGS="--xla_gpu_command_buffer_update_mode=$m" timeout 60 python3 -c "import jax; jax.devices()" \
        > /dev/null 2>&1; then modes="$modes $m"; echo "update mode $m: accepted"; else echo "update mode $m: rejected"; fi
  done
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1,command_buffer_cmd=1,command_buffer_cmd_executor=1 \
      run env OUT=$res timeout 120 python3 lab/probes/probe_dispatch.py --tag default 2> "$res/logs/default_vlog.txt"
  grep -E "Updated|Update command buffer|Skip updating|updated_allocs" "$res/logs/default_vlog.txt" | sort | uniq -c \
      | sort -rn | head -20
  grep -E "Updated [0-9]+ commands" "$res/logs/default_vlog.txt" | tail -5
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" run env OUT=$res timeout 120 python3 lab/probes/probe_dispatch.py \
      --tag cmdbuf_off
  for m in $modes; do
    XLA_FLAGS="--xla_gpu_command_buffer_update_mode=$m" run env OUT=$res timeout 120 python3 \
        lab/probes/probe_dispatch.py --tag "$m"
  done
  echo "== $(date +%T) done"
} > "$out/run33.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12" "$out/run33.log" | tail -n 100
