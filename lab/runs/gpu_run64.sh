#!/usr/bin/env bash
# Run 64 (issue 10), one call under 590 s; carry `.whl` (it holds transformers 5.24 for bench_hf_eager.py). Set
# GIT_COMMIT to the commit the tree is at: the device's copy does not say.
# 1. Where E2B's decode kernels are now (the attention-inputs kernel landed: 668 kernels, 19.1 per layer, where 15
#    were expected): the optimized HLO of the decode program at B = 2, dumped for reading here (autotuning off).
# 2. Where the demo pair's compile time goes: its slowest program compiled alone under XLA's scoped timers.
# 3. The matrix's first model: E2B at B = 1, 2, 16, 64 and k = 2, 4, 8 in one process (every program compiled
#    concurrently first), and transformers' generate at batch 1 beside it (bench_all.py). The rest of the matrix
#    follows in later calls: `bench_all.py --merge` with the JSON this one leaves.
# 4. E2B's sampling programs (temperature 1, top-p 0.95; filter_logits sorts the vocabulary twice on main, once on
#    the branch filter-logits-one-sort: run this line there too).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run64
end=${END:-585}
{
  mkdir -p "$res/kernels" "$res/hlo"
  run env OUT=$res/kernels XLA_FLAGS=--xla_gpu_autotune_level=0 timeout $(lim 60) \
      python3 benchmarks/kernel_count.py --models e2b --batch 2 --programs decode --dump-hlo "$res/hlo"
  run env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_MAX_VLOG_LEVEL=1 timeout $(lim 90) python3 lab/probes/probe_compile.py \
      > "$res/probe_compile.log" 2>&1
  grep -aE " time: [0-9.]+ (s|min)" "$res/probe_compile.log" | sort -t: -k2 -rn | head -40
  grep -av "^[WIE]1" "$res/probe_compile.log" | tail -5
  mkdir -p "$res/sampled"  # what sampled serving costs (never measured): the sampling variants, T = 1, top-p 0.95
  run env OUT=$res/sampled timeout $(lim 120) python3 benchmarks/bench_spec.py --models e2b --batch 2 16 --sampled
  mkdir -p "$res/matrix"
  run timeout $(lim 400) python3 benchmarks/bench_all.py --models e2b --hf-models e2b --batch 1 2 16 64 \
      --k 2 4 8 --timeout $(lim 380) --out "$res/matrix"
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run64.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run64.log" | tail -n 100
