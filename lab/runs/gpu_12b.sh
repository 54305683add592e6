#!/usr/bin/env bash
# 12B at real shapes, random weights (one device call): decode roofline share at B = 1, 2, 16 and spec / decode at
# k = 4 (bench_spec), then every program of the 12B server compiled (compile_all), each in its own process.
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_12b}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
git log -1 --format=%h | tee -a "$out/gpu.txt"
OUT=$out timeout ${SPEC_S:-330} python3 benchmarks/bench_spec.py --models 12b --batch 1 2 16 --k 4 2>&1 \
  | tee "$out/spec12b.log" | grep -v "^WARNING" | tail -40
OUT=$out timeout ${COMPILE_S:-200} python3 benchmarks/compile_all.py --families 12b 2>&1 | tee "$out/compile12b.log" | tail -25
