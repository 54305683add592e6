#!/usr/bin/env bash
# Run 27 (issues 12 and 13, nvidia-h200-x2): the tests run 26's suite failed, as fixed (the server's fault test now
# strikes inside `Engine._take`; the refused-size test counts the visible devices), then 31B's decode and
# speculative step at TP = 2 and TP = 1, B = 2 (run 26's TP = 2 ran out of memory in the benchmark's own set-up: the
# whole random weights and two sets of shards on the first GPU). Carry `.whl`. Logs go straight to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run27
GEMMA4_TEST_WORKERS=4 bash scripts/gpu_suite.sh tests/test_server.py tests/test_tensor_parallel.py \
    -k "fault_in_one_request or sizes_the_model"
suite=$?
{
  for tp in 2 1; do
    run env OUT=$res timeout 150 python3 benchmarks/bench_spec.py --models 31b --batch 2 --repeats 10 \
        --tensor-parallel-size $tp
    mv "$res/bench_spec.json" "$out/spec_31b_tp$tp.json" 2>/dev/null
  done
  echo "== $(date +%T) done"
} > "$out/run27.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12" "$out/run27.log" | grep -v "^{'model'" | tail -n 40
exit $suite
