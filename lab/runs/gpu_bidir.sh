#!/usr/bin/env bash
# One device call: the paged kernel's image bounds on the GPU (the kernel, engine and media test files, plus the
# server-process file whose SIGTERM test failed on an H100 before), then 31B spec / decode at k = 4, B = 2 in bf16
# and with fp8 weights + fp8 KV (issue 58's speculative-step point), each in its own process.
cd "$(dirname "$0")/../.."
end=${END:-570}
. scripts/gpu_ab_harness.sh bidir
header
run env GEMMA4_TEST_WORKERS=16 OUT=$res/suite timeout $(lim 330) bash scripts/gpu_suite.sh tests/test_paged_attention.py \
  tests/test_kernels_in_engine.py tests/test_multimodal_serving.py tests/test_multimodal.py tests/test_server_process.py
cp $res/suite/failures.txt $out/ 2>/dev/null
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
for q in none fp8; do
  kv=auto; [ $q = fp8 ] && kv=fp8
  run env OUT=$res/spec_$q timeout $(lim 100) python3 benchmarks/bench_spec.py --models 31b --batch 2 --k 4 \
    --quantization $q --kv-cache-dtype $kv --repeats 10
done
