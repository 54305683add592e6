#!/usr/bin/env bash
# Run 45 (planned; issues 10 and 12), one call under 580 s. Carry `.whl`.
# (1) E2B decode at B = 2 and 16 under three GEMM set-ups, in one run: XLA's Triton GEMMs (the default), Triton
#     without split-K autotuning, and cuBLAS (--xla_gpu_enable_triton_gemm=false). Run 44's HLO: 3 of a layer's 21
#     kernels are split-K reductions (o_proj, down_proj, per_layer_input_gate at 2 rows). Kernels and pipelined step
#     time decide; an XLA that refuses a flag says so in the log.
# (2) Why the packed engines of run 43 did not start within 85 s: the decode program's compile seconds with and
#     without --pack-params (kernel_count.py), then the same packed under --xla_gpu_autotune_level=0. The suspicion:
#     every layer's GEMM fusion reads its own row slice, so the autotuner tunes each layer's fusion anew.
# (3) benchmarks/probe_ple.py: the 35 `wrapped_slice` kernels that copy out each layer's per-layer input (run 44's
#     HLO), against two other ways of handing the slices over.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run45
trap 'tar czf "$out/results.tar.gz" -C "$res" .' EXIT
end=575
{
  for gemm in triton nosplitk cublas; do
    case $gemm in
      triton) flags="" ;;
      nosplitk) flags="--xla_gpu_enable_split_k_autotuning=false" ;;
      cublas) flags="--xla_gpu_enable_triton_gemm=false" ;;
    esac
    run env OUT=$res XLA_FLAGS="$flags" timeout $(lim 80) python3 benchmarks/kernel_count.py --models e2b \
        --batch 2 --programs decode --json-name kernel_count_$gemm.json
    run env OUT=$res XLA_FLAGS="$flags" timeout $(lim 90) python3 benchmarks/bench_decode.py --models e2b \
        --batch 2 16 --context 4096
    mv "$res/bench_decode.json" "$res/bench_decode_e2b_$gemm.json"
  done
  run env OUT=$res timeout $(lim 120) python3 benchmarks/kernel_count.py --models e2b --batch 2 --programs decode \
      --json-name kernel_count_packed.json --pack-params
  run env OUT=$res XLA_FLAGS=--xla_gpu_autotune_level=0 timeout $(lim 80) python3 benchmarks/kernel_count.py \
      --models e2b --batch 2 --programs decode --json-name kernel_count_packed_noautotune.json --pack-params
  run env OUT=$res timeout $(lim 120) python3 benchmarks/probe_ple.py --model e2b --batch 2 16
  echo "== $(date +%T) done"
} > "$out/run45.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run45.log" | grep -v "^      " | tail -n 100
