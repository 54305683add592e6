#!/usr/bin/env bash
# One device call: BUILD.md's GPU suite, part 2 (engine, prefix cache, tensor parallel, server), the two loading tests
# fixed since the last call, then what time is left for fp8 decode at 31B's B = 1 and 16 (each format in its own
# process: one process's freed weights did not make room for the next format's under the VMM allocator).
cd "$(dirname "$0")/../.."
end=${END:-585}
. scripts/gpu_ab_harness.sh fp8b
header
run timeout $(lim 500) bash scripts/gpu_suite.sh --part 2
run timeout $(lim 60) bash scripts/gpu_suite.sh tests/test_loading.py -k "compressed" -q
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
run env OUT=$res/dec_fp8 timeout $(lim 100) python3 benchmarks/bench_decode.py --models 31b --batch 1 16 \
  --quantization fp8 --kv-cache-dtype fp8
run env OUT=$res/dec_bf16w timeout $(lim 80) python3 benchmarks/bench_decode.py --models 31b --batch 16 \
  --quantization none --kv-cache-dtype fp8
