#!/usr/bin/env bash
# Run 130 (issue 10), one call under END s (default 210), prepared in the thirty-sixth session. Carry `.whl`,
# `.branch` (merge-proj: the key splits' merge inside o_proj's kernel) and `.baseline` (1257e9e, main before the
# thirty-fifth session's cuts). Set GIT_COMMIT.
# bench_spec.py at E2B (B = 2 and 16, k = 4, context 4096): main, merge-proj, the new kernel's tests on the GPU, main
# again, merge-proj again (the run's own noise, both ways), then 1257e9e (main as landed against its state before the thirty-fifth session,
# which run 128 never timed as a whole) while time is left.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_common.sh run130
end=${END:-210}
use_trees .branch .baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
  spec_tree main "$PWD"
  spec_tree merge_proj "$PWD/.branch"
  # The new kernel's tests compiled on the GPU (the whole suite does not fit this session's budget).
  # (In the branch's own directory: `python -m` puts the working directory, main's package, first on sys.path.)
  (cd .branch && run env PYTHONPATH=$PWD:/tmp/site GEMMA4_TEST_JAX_PLATFORMS=cuda XLA_FLAGS=--xla_gpu_autotune_level=0 \
      timeout $(lim 60) python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_merge_project.py > "$res/tests.log" 2>&1)
  tail -3 "$res/tests.log"
  # Each tree took 45-56 s in run 128; the rest only while one more fits.
  [ $((end - SECONDS)) -gt 60 ] && spec_tree main_again "$PWD"
  [ $((end - SECONDS)) -gt 60 ] && spec_tree merge_proj_again "$PWD/.branch"
  [ $((end - SECONDS)) -gt 60 ] && spec_tree before "$PWD/.baseline"
  spec_table main merge_proj main_again merge_proj_again before
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run130.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run130.log" | tail -n 60
