#!/usr/bin/env bash
# One short device call: the server test made deterministic, then 31B's spec / decode at k = 4, B = 2 for bf16 and
# for fp8 weights + fp8 KV, each in its own process, in the same call.
cd "$(dirname "$0")/../.."
end=${END:-200}
. scripts/gpu_ab_harness.sh fp8c
header
run timeout $(lim 60) bash scripts/gpu_suite.sh tests/test_server.py -k "engine_step_error" -q
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
for q in none fp8; do
  kv=auto; [ $q = fp8 ] && kv=fp8
  run env OUT=$res/spec_$q timeout $(lim 70) python3 benchmarks/bench_spec.py --models 31b --batch 2 --k 4 \
    --quantization $q --kv-cache-dtype $kv --repeats 10
done
