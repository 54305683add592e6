#!/usr/bin/env bash
# Run 47 (issues 10 and 12), one call under 300 s. Carry `.whl`.
# Run 46: the speculative program (E2B, B = 1, k = 4) re-records all 1005 nodes of its command buffer on most calls,
# synchronised or pipelined, with its inputs fresh or placed on the device once ("updated_allocs=2", nothing skipped),
# although no state buffer moves; decode skips its updates since SKIP_TEMP. Here, under TF_CPP_VMODULE:
# (1) the speculative and the decode program as they are, each with its optimized HLO and buffer assignment dumped,
#     to find the allocations that move;
# (2) the speculative program under xla_gpu_command_buffer_update_mode=SKIP_PROFILED (XLA gives the allocations it
#     sees move, outputs included, a stable address too).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run47
end=290
vmodule="TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1,gpu_executable=3,gpu_executable_buffer_allocator=3"
{
  for prog in spec decode; do
    VMODULE=${vmodule#TF_CPP_VMODULE=} probe $prog --options xla_dump_to=$res/dump_$prog
    grep "updated_alloc_indices\|VA remapping\|moved over" "$res/probe_dispatch_$prog.log" | sort | uniq -c | sort -rn | head -8
  done
  run env OUT=$res $vmodule TF_CPP_MIN_LOG_LEVEL=0 timeout $(lim 80) python3 lab/probes/probe_dispatch.py --spec \
      --context 1024 --repeats 40 --tag spec_profiled --options xla_gpu_command_buffer_update_mode=SKIP_PROFILED \
      > "$res/probe_dispatch_spec_profiled.log" 2>&1
  echo "== rc=$? spec SKIP_PROFILED"; update_summary "$res/probe_dispatch_spec_profiled.log"
  grep -i "error\|moved over" "$res/probe_dispatch_spec_profiled.log" | head -5
  for prog in spec decode; do  # the allocations of each program: index, size, kind
    f=$(ls "$res"/dump_$prog/*after_optimizations-buffer-assignment.txt 2>/dev/null | grep -v values | head -1)
    echo "== $prog: $(grep -c '^allocation' "$f") allocations in $(basename "$f")"
    grep '^allocation' "$f" | head -30
  done
  echo "== $(date +%T) done"
} > "$out/run47.log" 2>&1
cat "$out/run47.log" | grep -v "^W12\|^I12" | tail -n 120
