#!/usr/bin/env bash
# One device call: the loading tests that failed on the GPU, then fp8 against bf16 at 31B's shapes (random weights):
# decode at B = 1, 2, 16 (weights alone: both with an fp8 cache, which bf16 weights need to fit B = 16 on 80 GB),
# the bf16 engine's decode at B = 1, 2, capacity, and spec / decode at k = 4, B = 2.
cd "$(dirname "$0")/../.."
end=${END:-580}
. scripts/gpu_ab_harness.sh fp8
header
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
run timeout $(lim 90) bash scripts/gpu_suite.sh tests/test_loading.py tests/test_convert.py -k "fp8 or on_host or compressed" -q
run env OUT=$res/dec timeout $(lim 200) python3 benchmarks/bench_decode.py --models 31b --batch 1 2 16 \
  --quantization fp8 none --kv-cache-dtype fp8
run env OUT=$res/cap timeout $(lim 90) python3 benchmarks/capacity.py --models 31b --quantization fp8 none \
  --kv-cache-dtype fp8 auto
run env OUT=$res/spec timeout $(lim 200) python3 benchmarks/bench_spec.py --models 31b --batch 2 --k 4 \
  --quantization fp8 none --kv-cache-dtype fp8
run env OUT=$res/dec16 timeout $(lim 120) python3 benchmarks/bench_decode.py --models 31b --batch 1 2 \
  --quantization none --kv-cache-dtype auto
