#!/usr/bin/env bash
# Run 15 (issues 9 and 10), one call, no wheels needed:
# (1) issue 9: the demo pair's decode and speculative steps at batch 1 (bench_spec.py), then `generate` at batch 1,
#     spec vs plain, in bf16 as served (realized vs projected) and in float32 (greedy outputs must be identical);
# (2) issue 10: kernels per program from the optimized HLO (kernel_count.py), this tree vs the tree of commit
#     70c3af6 copied into .baseline/ (untracked; `git archive 70c3af6 gemma4_mtp_jax benchmarks`), compile only,
#     six processes at once; the optimized HLO of each program comes back gzipped;
# (3) issue 10: E2B's decode / verify / speculative step times, this tree then the baseline, B = 2 and 16.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
ln -sfn "$PWD/gemma4_mtp_jax/demo_pair" .baseline/gemma4_mtp_jax/demo_pair
run() { echo "== $(date +%T) $*"; "$@"; echo "== rc=$?"; }
count() {  # count NAME DIR ARGS...: one kernel_count.py process, its own log
  local name=$1 dir=$2; shift 2
  (cd "$dir" && PYTHONPATH=$PWD OUT=$out timeout 230 python3 benchmarks/kernel_count.py --json-name "kc_$name.json" \
      --dump-hlo "$out/hlo_$name" "$@" > "$out/kc_$name.log" 2>&1; echo "kc_$name rc=$?" >> "$out/kc_$name.log")
}
{
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
  run timeout 60 python3 benchmarks/bench_spec.py --models demo --batch 1 --context 256 --repeats 100
  run timeout 90 python3 benchmarks/realized_speedup.py --prompts acceptance_prompts.json --max-new-tokens 128 \
      --bench-spec "$out/bench_spec.json" --out "$out/realized_bf16.json"
  run timeout 75 python3 benchmarks/realized_speedup.py --prompts acceptance_prompts.json --max-new-tokens 128 \
      --per-source 4 --dtype float32 --out "$out/realized_f32.json"
  echo "== $(date +%T) kernel counts"
  count new_e2b . --models e2b --batch 2 16 &
  count new_31b . --models 31b --batch 2 16 &
  count new_demo . --models demo --batch 2 16 &
  count old_e2b .baseline --models e2b --batch 2 16 --programs verify speculative &
  count old_31b .baseline --models 31b --batch 2 16 --programs verify speculative &
  count old_demo .baseline --models demo --batch 2 16 --programs verify speculative &
  wait
  tail -n 8 "$out"/kc_*.log
  mkdir -p "$out/e2b_new" "$out/e2b_old"
  echo "== $(date +%T) e2b step times, this tree"
  OUT=$out/e2b_new timeout 140 python3 benchmarks/bench_spec.py --models e2b --batch 2 16 --repeats 20 | tail -4
  echo "== $(date +%T) e2b step times, 70c3af6"
  (cd .baseline && PYTHONPATH=$PWD OUT=$out/e2b_old timeout 140 python3 benchmarks/bench_spec.py --models e2b \
      --batch 2 16 --repeats 20 | tail -4)
  echo "== $(date +%T) done"
} > "$out/run15.log" 2>&1
(cd "$out" && tar czf hlo.tar.gz hlo_* && rm -rf hlo_*)
tail -n 60 "$out/run15.log"
