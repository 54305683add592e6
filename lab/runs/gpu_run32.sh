#!/usr/bin/env bash
# Run 32 (issue 12's host overhead; issue 10's kernel table). Carry `.whl`. Does the engine's host overhead come
# from `lax.cond` (XLA's GPU runtime copies a conditional's predicate to the host, holding the dispatching thread
# until the device reaches it)? For E2B at B = 1, plain and speculative: the engine step against the program's
# pipelined time, and how long a program call holds the thread (dispatch_ms), with (a) the defaults, (b) conditionals
# recorded into XLA's command buffers (CUDA graph conditional nodes: the predicate stays on the device), (c) every
# cond traced as a select (plain only; a diagnostic). Then the kernel counts of E2B B = 2 under (a) and (b).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run32
COND="--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  ho() {  # tag, then extra arguments
    local tag=$1; shift
    run env OUT=$res timeout 150 python3 benchmarks/bench_host_overhead.py --model e2b --batch 1 --context 1024 \
        --steps 40 "$@"
    mv "$res/bench_host_overhead.json" "$res/host_overhead_$tag.json"
  }
  ho plain_default
  XLA_FLAGS="$COND" ho plain_cond_cmdbuf
  ho plain_select --cond-as-select
  ho spec_default --spec
  XLA_FLAGS="$COND" ho spec_cond_cmdbuf --spec
  run env OUT=$res timeout 120 python3 benchmarks/kernel_count.py --models e2b --batch 2
  mv "$res/kernel_count.json" "$res/kernel_count_default.json"
  XLA_FLAGS="$COND" run env OUT=$res timeout 120 python3 benchmarks/kernel_count.py --models e2b --batch 2 \
      --dump-hlo $res/hlo_cond
  mv "$res/kernel_count.json" "$res/kernel_count_cond_cmdbuf.json"
  echo "== $(date +%T) done"
} > "$out/run32.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run32.log" | tail -n 120
