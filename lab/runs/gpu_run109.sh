#!/usr/bin/env bash
# Run 109 (issue 10, cold start), one call under 560 s (END); carry `.whl`. Set GIT_COMMIT.
# Where a cold start's compile time goes, and whether XLA's own compile parallelism takes it back:
# 1. the demo pair's slowest program (probe_compile.py) alone under XLA's scoped timers, then alone with the LLVM
#    module split into parts compiled in parallel (--xla_gpu_enable_llvm_module_compilation_parallelism);
# 2. the demo pair's 11 speculative-server programs (compile_all.py, 11 threads, every cache empty) under four flag
#    sets, and E2B's under two;
# 3. the README's server, cold, with the split on (serve_check.py --runs cold).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run109
end=${END:-560}
LLVM=--xla_gpu_enable_llvm_module_compilation_parallelism=true
{
  echo "== commit ${GIT_COMMIT:-unknown}; $(nproc) cores"
  run env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_MAX_VLOG_LEVEL=1 timeout $(lim 90) python3 lab/probes/probe_compile.py \
      > /tmp/probe_compile.log 2>&1
  grep -a "compiled in" /tmp/probe_compile.log
  grep -aE " time: [0-9.]+ (s|min)" /tmp/probe_compile.log | sort -t: -k2 -rn | head -80 > "$res/probe_compile_timers.txt"
  head -45 "$res/probe_compile_timers.txt"
  run env XLA_FLAGS=$LLVM timeout $(lim 60) python3 lab/probes/probe_compile.py
  run env XLA_FLAGS="$LLVM --xla_gpu_force_compilation_parallelism=16" timeout $(lim 60) python3 lab/probes/probe_compile.py
  for v in default llvm llvm16 level1_llvm; do
    case $v in
      default) f= ;; llvm) f=$LLVM ;; llvm16) f="$LLVM --xla_gpu_force_compilation_parallelism=16" ;;
      level1_llvm) f="$LLVM --xla_gpu_autotune_level=1" ;;
    esac
    mkdir -p "$res/demo_$v"
    run env OUT="$res/demo_$v" XLA_FLAGS="$f" timeout $(lim 80) python3 benchmarks/compile_all.py --families demo \
        --engines speculative
  done
  for v in default llvm; do
    f=; [ $v = llvm ] && f=$LLVM
    mkdir -p "$res/e2b_$v"
    run env OUT="$res/e2b_$v" XLA_FLAGS="$f" timeout $(lim 100) python3 benchmarks/compile_all.py --families e2b \
        --engines speculative
  done
  mkdir -p "$res/serve"
  run env OUT="$res/serve" XLA_FLAGS=$LLVM timeout $(lim 90) python3 benchmarks/serve_check.py --runs cold
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run109.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run109.log" | tail -n 120
