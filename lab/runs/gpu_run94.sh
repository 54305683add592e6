#!/usr/bin/env bash
# Run 94 (issue 10), one call under 590 s (END: the device time left). Carry `.whl`. Set GIT_COMMIT. Measurements
# only (no package code changes): the two costs of E2B's verify at B = 16 that run 91 found and run 92 did not fix.
# 1. Each E2B weight matmul at 16, 64, 80, 96 and 128 rows, by trace: XLA's autotuned plan, then XLA's cuBLAS path
#    (triton GEMM off; should this XLA no longer know the flag, it aborts that step alone). Which row counts and
#    which path stream the weights at the decode's rate?
# 2. The split-K matmuls written out at 80 rows against XLA's (probe_split_k), per layer.
# 3. The full-attention layer's verify tiling (B = 16, 5 queries, 4096 keys, 16-token pages): 16-, 32- and 64-row
#    blocks over key splits, beside kernel_config's choice (40 rows per KV head: the 16-row blocks re-read the keys).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run94
end=${END:-585}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  mkdir -p $res/gemm_xla $res/gemm_cublas $res/split_k $res/attention
  run env OUT=$res/gemm_xla timeout $(lim 150) python3 lab/probes/probe_verify_gemm.py
  run env OUT=$res/gemm_cublas XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout $(lim 120) \
      python3 lab/probes/probe_verify_gemm.py
  run env OUT=$res/split_k timeout $(lim 100) python3 lab/probes/probe_split_k.py --rows 16 80
  run env OUT=$res/attention timeout $(lim 180) python3 benchmarks/bench_paged_attention.py --shapes e2b_full \
      --batch 16 --q-len 5 --ctx 4096 --page-size 16 --sweep --sweep-grid block_rows=16,32,64 \
      k_splits=4,9,17,32 block_k=16,32 num_warps=4,8
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run94.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run94.log" | tail -n 200
