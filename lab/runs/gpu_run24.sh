#!/usr/bin/env bash
# Run 24 (issue 13, planned for nvidia-h200-x2, not yet run): tensor and data parallelism on two H200s. Carry `.whl`.
# (1) the whole suite's TP / DP / multi-process tests and the MoE tests on the GPUs; (2) the all-reduce per layer;
# (3) 31B decode, verify and speculative step at TP = 1 and 2, B = 2 and 16 (goal: >= 1.6x per step at TP = 2);
# (4) 26B-A4B at TP = 1 and 2 (experts split); (5) E2B served at --data-parallel-size 1 and 2 (goal >= 1.9x).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run24
{
  nvidia-smi --query-gpu=name --format=csv
  OUT=$res run timeout 240 bash scripts/gpu_suite.sh tests/test_tensor_parallel.py tests/test_grouped_matmul.py
  OUT=$res run timeout 60 python3 benchmarks/bench_allreduce.py --devices 2 --batch 2 16
  for tp in 1 2; do
    OUT=$res run timeout 200 python3 benchmarks/bench_spec.py --models 31b --batch 2 16 --tensor-parallel-size $tp
    mv "$res/bench_spec.json" "$res/spec_31b_tp$tp.json" 2>/dev/null
    OUT=$res run timeout 150 python3 benchmarks/bench_spec.py --models 26b --batch 2 --tensor-parallel-size $tp
    mv "$res/bench_spec.json" "$res/spec_26b_tp$tp.json" 2>/dev/null
  done
  for dp in 1 2; do
    run timeout 300 python3 benchmarks/bench_serve.py --random-weights e2b --dataset random --input-len 512 \
        --output-len 128 --ignore-eos --concurrency 64 --requests-per-level 256 --assistant-modes plain \
        --server-arg=--max-model-len=1024 --server-arg=--data-parallel-size=$dp --max-num-seqs 64 \
        --out "$res/serve_e2b_dp$dp.json" --log-dir "$res/logs"
  done
  echo "== $(date +%T) done"
} > "$out/run24.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W12\|^I12" "$out/run24.log" | tail -n 80
