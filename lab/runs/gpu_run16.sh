#!/usr/bin/env bash
# Run 16 (issues 9 and 10): run 15 again without its two mistakes (six compile-only processes at once each grabbed
# most of the GPU's memory; more files under $OUT than come back). One process at a time, memory on demand, and
# everything in one tarball next to the log:
# (1) issue 9: the demo pair's steps at batch 1 (bench_spec.py), then `generate` at batch 1, spec vs plain, bf16
#     (realized vs projected) and float32 (greedy outputs must be identical);
# (2) issue 10: kernels of the demo pair's programs (this tree) and of E2B's verify and speculative programs at
#     B = 2 in the tree of commit 70c3af6 (.baseline/, untracked: `git archive 70c3af6 gemma4_mtp_jax benchmarks`).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"; res=/tmp/run16; mkdir -p "$res"
ln -sfn "$PWD/gemma4_mtp_jax/demo_pair" .baseline/gemma4_mtp_jax/demo_pair
run() { echo "== $(date +%T) $*"; "$@"; echo "== rc=$?"; }
{
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
  OUT=$res run timeout 60 python3 benchmarks/bench_spec.py --models demo --batch 1 --context 256 --repeats 100
  run timeout 100 python3 benchmarks/realized_speedup.py --prompts acceptance_prompts.json --max-new-tokens 128 \
      --bench-spec "$res/bench_spec.json" --out "$res/realized_bf16.json"
  run timeout 70 python3 benchmarks/realized_speedup.py --prompts acceptance_prompts.json --max-new-tokens 128 \
      --per-source 4 --dtype float32 --out "$res/realized_f32.json"
  OUT=$res run timeout 60 python3 benchmarks/kernel_count.py --models demo --batch 2 --json-name kc_new_demo.json
  (cd .baseline && PYTHONPATH=$PWD OUT=$res run timeout 60 python3 benchmarks/kernel_count.py --models e2b --batch 2 \
      --programs verify speculative --json-name kc_old_e2b.json)
  echo "== $(date +%T) done"
} > "$out/run16.log" 2>&1
tar czf "$out/results.tar.gz" -C "$res" .
grep -v "cuda_timer\|^W1201\|^I1201" "$out/run16.log" | tail -n 70
