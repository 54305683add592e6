#!/usr/bin/env bash
# Run 132 (issue 10), one call under END s (default 420), prepared in the thirty-seventh session. Carry `.whl`.
# Set GIT_COMMIT. Three questions on main as it stands:
# 1. Does the demo pair lose step time without XLA's GEMM autotuning (XLA_FLAGS --xla_gpu_autotune_level=0)? Its
#    weights are 33 MB, so its step is bound by launches, not by how a GEMM is tiled (E2B's decode doubled at level 0
#    in run 61). bench_spec.py on the demo pair (B = 2 and 8, k = 4, context 1000), default, level 0, twice each.
# 2. The demo pair's cold start (the README's command; goal 15 s, run 121: 18.4 s) with and without autotuning,
#    twice each. Autotuning was 2.1 s of a 4.6 s compile of one demo program alone (run 109).
# 3. 31B's speculative step on main (run 78, seventeen sessions ago: spec / decode 1.15 at B = 2, 1.30 at B = 16;
#    goals 1.12 / 1.25). B = 16 needs ~76 GiB (weights 58 GiB, pages 18 GiB), so only an H200 runs it.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run132
end=${END:-420}
L0="--xla_gpu_autotune_level=0"
demo_spec() {  # demo_spec NAME [XLA_FLAGS]
  mkdir -p "$res/demo_$1"
  run env OUT=$res/demo_$1 XLA_FLAGS="${2:-}" timeout $(lim 60) python3 benchmarks/bench_spec.py --models demo \
      --batch 2 8 --k 4 --context 1000 --repeats 20 | grep -a "compiled\|^demo\|^model"
}
demo_cold() {  # demo_cold NAME [XLA_FLAGS]
  mkdir -p "$res/cold_$1"
  run env OUT=$res/cold_$1 XLA_FLAGS="${2:-}" timeout $(lim 60) python3 benchmarks/serve_check.py --runs cold \
      | tail -3
  grep -ah "compiled \|ready in" "$res/cold_$1/serve_cold.log" | head -4
}
{
  header
  demo_spec default; demo_spec level0 "$L0"; demo_spec default_again; demo_spec level0_again "$L0"
  demo_cold default; demo_cold level0 "$L0"; demo_cold default_again; demo_cold level0_again "$L0"
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  batches="2"; [ "$mem" -gt 120000 ] && batches="2 16"
  mkdir -p "$res/spec_31b"
  run env OUT=$res/spec_31b timeout $(lim 240) python3 benchmarks/bench_spec.py --models 31b --batch $batches \
      --k 4 --context 4096 --repeats 10
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run132.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run132.log" | tail -n 80
