#!/usr/bin/env bash
# Run 26 (issues 12 and 13, nvidia-h200-x2): the whole suite after the device-state / async-scheduling change, in 28
# workers (the two-GPU host has 32 cores; the tests use the first GPU), then what the rest of the call allows of
# issue 13: the all-reduce per layer, and 31B's decode and speculative step at TP = 1 and 2 (goal:
# >= 1.6x per step at TP = 2; B = 2 only, for the time left). Carry `.whl`. Results in one tarball beside the logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run26
GEMMA4_TEST_WORKERS=28 OUT=$res bash scripts/gpu_suite.sh
suite=$?
{
  nvidia-smi --query-gpu=name --format=csv
  run env OUT=$res timeout 40 python3 benchmarks/bench_allreduce.py --devices 2 --batch 2 16 --repeats 100
  for tp in 1 2; do
    run env OUT=$res timeout 120 python3 benchmarks/bench_spec.py --models 31b --batch 2 --repeats 10 \
        --tensor-parallel-size $tp
    mv "$res/bench_spec.json" "$res/spec_31b_tp$tp.json" 2>/dev/null
  done
  echo "== $(date +%T) done"
} > "$out/run26.log" 2>&1
cp "$res/pytest.log" "$out/pytest.log"
tar czf "$out/results.tar.gz" -C "$res" --exclude pytest.log .
grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -20; tail -2 "$out/pytest.log"
grep -v "cuda_timer\|^W12\|^I12" "$out/run26.log" | grep -v "^{'model'" | tail -n 40
exit $suite
