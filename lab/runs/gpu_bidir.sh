#!/usr/bin/env bash
# Two device calls (PART=a, then PART=b on the warm machine):
#   a: the paged kernel's image bounds on the GPU (the kernel, engine-kernel and media test files), then the 12B's
#      decode roofline share and spec / decode at k = 4, B = 1, 2, 16 (bench_spec, random weights);
#   b: the 12B server's programs compiled (compile_all: cold start), E4B's media encoders (bench_media), the
#      server-process tests (their SIGTERM test
#      failed on an H100 before), then 31B spec / decode at k = 4, B = 2 in bf16 and with fp8 weights + fp8 KV.
cd "$(dirname "$0")/../.."
end=${END:-570}
. scripts/gpu_ab_harness.sh bidir
header
git log -1 --format=%h
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
case ${PART:-a} in
  a)
    run env GEMMA4_TEST_WORKERS=16 OUT=$res/suite XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout $(lim 220) \
      bash scripts/gpu_suite.sh tests/test_paged_attention.py tests/test_kernels_in_engine.py \
      tests/test_multimodal_serving.py tests/test_multimodal.py
    cp $res/suite/failures.txt $out/ 2>/dev/null
    run env OUT=$res timeout $(lim 330) python3 benchmarks/bench_spec.py --models 12b --batch 1 2 16 --k 4 ;;
  b)
    run env OUT=$res timeout $(lim 200) python3 benchmarks/compile_all.py --families 12b
    run env OUT=$res timeout $(lim 120) python3 benchmarks/bench_media.py --models e4b
    run env GEMMA4_TEST_WORKERS=8 OUT=$res/suite2 XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout $(lim 150) \
      bash scripts/gpu_suite.sh tests/test_server_process.py
    cp $res/suite2/failures.txt $out/failures_b.txt 2>/dev/null
    for q in none fp8; do
      kv=auto; [ $q = fp8 ] && kv=fp8
      run env OUT=$res/spec_$q timeout $(lim 100) python3 benchmarks/bench_spec.py --models 31b --batch 2 --k 4 \
        --quantization $q --kv-cache-dtype $kv --repeats 10
    done ;;
esac
