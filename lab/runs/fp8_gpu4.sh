#!/usr/bin/env bash
# Issue 58's GPU points still open, one device call per PART (each under 10 minutes; one GPU, H100 or H200):
#   PART=decode  E2B, E4B and 26B-A4B decode at B = 2 and 16: bf16 weights + cache against fp8 weights + fp8 cache,
#                each format in its own process (the copy probe moves between processes: compare the ratios)
#   PART=serve   the server on 31B random weights, plain, 512-token prompts, 128 out, c = 1 and 16: fp8 weights +
#                fp8 cache at the README's defaults (16 x 8192), then bf16 with --max-num-seqs 7 (what fits)
cd "$(dirname "$0")/../.."
end=${END:-580}
. scripts/gpu_ab_harness.sh fp8d
header
export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEMF:-0.95}
case ${PART:-decode} in
  decode)
    for m in e2b e4b 26b; do
      for q in none fp8; do
        kv=auto; [ $q = fp8 ] && kv=fp8
        run env OUT=$res/decode_${m}_$q timeout $(lim 90) python3 benchmarks/bench_decode.py --models $m \
          --batch 2 16 --quantization $q --kv-cache-dtype $kv
      done
    done ;;
  serve)
    common=(--random-weights 31b --assistant-modes plain --dataset random --input-len 512 --output-len 128
            --ignore-eos --concurrency 1,16 --num-prompts 64 --log-dir $res/logs)
    run timeout $(lim 280) python3 benchmarks/bench_serve.py "${common[@]}" --out $res/serve_fp8.json \
      --server-arg=--quantization=fp8 --server-arg=--kv-cache-dtype=fp8
    run timeout $(lim 280) python3 benchmarks/bench_serve.py "${common[@]}" --out $res/serve_bf16.json \
      --server-arg=--max-num-seqs=7 ;;
esac
