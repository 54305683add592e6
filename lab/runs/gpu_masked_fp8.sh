#!/usr/bin/env bash
# Run at 4a2a069 (branch masked-split-experiment: the split of 0-draft grammar steps, since dropped; the
# decode_masked columns of bench_spec need lab/patches/masked-decode-split.patch).
# One device call (one GPU, under 10 minutes):
#   the test files of the masked-steps change on the GPU (grammar, the server's structured output, the engine's
#   kernels), bench_spec --processed at E2B (processed and masked programs against greedy ones), then fp8 against
#   bf16 decode at E2B and 26B-A4B shapes (each format in its own process).
cd "$(dirname "$0")/../.."
end=${END:-585}
. scripts/gpu_ab_harness.sh masked_fp8
header
run env GEMMA4_TEST_WORKERS=16 timeout $(lim 140) bash scripts/gpu_suite.sh tests/test_grammar.py \
  tests/test_kernels_in_engine.py "tests/test_server.py::test_structured_output_holds_with_speculation" \
  > $res/tests.log 2>&1
tail -4 $res/tests.log
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
for m in e2b 26b; do
  for q in none fp8; do
    kv=auto; [ $q = fp8 ] && kv=fp8
    run env OUT=$res/decode_${m}_$q timeout $(lim 70) python3 benchmarks/bench_decode.py --models $m \
      --batch 2 16 --quantization $q --kv-cache-dtype $kv
  done
done
run env OUT=$res/processed timeout $(lim 170) python3 benchmarks/bench_spec.py --models e2b --batch 2 16 --k 4 \
  --processed --repeats 10
