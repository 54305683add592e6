#!/usr/bin/env bash
# Run 36 (issue 12's host overhead): after run 34, a call of the E2B decode program still holds the thread longer
# than the device takes. Which buffers move between calls (each move re-records the command-buffer nodes using
# it), how many allocations XLA sees change per call, and what passing the ~540 weight arrays alone costs.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run36
{
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 \
      run env OUT=$res timeout 150 python3 lab/probes/probe_dispatch.py --tag moved 2> "$res/logs/vlog.txt"
  grep -oE "updated_allocs=[0-9]+" "$res/logs/vlog.txt" | sort | uniq -c
  grep -oE "Updated [0-9]+ commands in [0-9]+ .s \(skipped [0-9]+" "$res/logs/vlog.txt" \
      | sed -E 's/ in [0-9]+ .s//' | sort | uniq -c
  echo "== $(date +%T) done"
} > "$out/run36.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12" "$out/run36.log" | tail -n 60
