#!/usr/bin/env bash
# Run 35 (issue 12): the server at 31B's real shapes (random bf16 weights, --load-format dummy), spec vs plain at
# C = 1, 8, 32, 64: random 512-token prompts, 128 tokens each (ignore-EOS). Random weights accept no draft, so this
# measures what a round costs under load at 31B. Each mode's JSON is written when it ends, so a run cut short keeps
# the spec half. Carry `.whl`. Server logs (per-program compile times) beside the results. END (seconds, default
# 585): the script's deadline. First run (6af18c0, the eleventh session): both servers died compiling, XLA's GEMM
# autotuner out of the allocator's budget (JAX's default 75 % of the GPU) after 62 GB of weights and a 52 GB pool;
# the server now asks for 90 % (--gpu-memory-utilization) and fits its default pool to what is left.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run35
{
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  run timeout $((${END:-585} - 25)) python3 benchmarks/bench_serve.py --random-weights 31b --dataset random --input-len 512 \
      --output-len 128 --ignore-eos --concurrency 1,8,32,64 \
      --server-arg=--max-model-len=1024 --out "$res/serve_31b.json" --log-dir "$res/logs"
  grep -hE "compiled|ready|programs|KV pools|PA budget" "$res"/logs/*.log 2>/dev/null | tail -n 40
  echo "== $(date +%T) done"
} > "$out/run35.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12" "$out/run35.log" | tail -n 100
