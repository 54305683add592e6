#!/usr/bin/env bash
# The third call of 2026-12-07 evening (H200, warm after gpu_masked_fp8.sh and fp8_gpu4.sh PART=serve with MEMF=0.54):
# E4B and 26B-A4B decode, bf16 against fp8 weights + fp8 cache, each in its own process.
cd "$(dirname "$0")/../.."
. scripts/gpu_ab_harness.sh fp8e >/dev/null 2>&1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
end=350
for mq in "e4b none auto 75" "e4b fp8 fp8 75" "26b none auto 100" "26b fp8 fp8 100"; do
  set -- $mq
  run env OUT=$res/decode_$1_$2 timeout $(lim $4) python3 benchmarks/bench_decode.py --models $1 --batch 2 16 \
    --quantization $2 --kv-cache-dtype $3 2>&1 | grep -E "^(model|e4b|26b) "
done
