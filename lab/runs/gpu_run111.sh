#!/usr/bin/env bash
# Run 111 (issue 10, cold start), one call under 300 s (END); carry `.whl`. Set GIT_COMMIT.
# Runs 109-110: compiling the demo pair's 11 programs at once takes 3-5x each program's time alone, in threads or
# in processes alike. If the machine's cores are what the programs share, less work is the only lever, and the
# work that repeats is the GEMM autotuning of the greedy and sampled twin of each batch bucket (the same GEMMs).
# Does XLA reuse one program's autotuning in the next, in one process (with and without the persistent cache)?
# And how busy are the 16 cores while compile_all compiles the 11?
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run111
end=${END:-300}
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8, $2+$3+$4+$5+$6+$7+$8}' /proc/stat; }
{
  echo "== commit ${GIT_COMMIT:-unknown}; $(nproc) cores"
  for fam in demo e2b; do
    run timeout $(lim 60) python3 lab/probes/probe_compile.py --family $fam --program 'speculative[2x4,sampled]'
    run timeout $(lim 90) python3 lab/probes/probe_compile.py --family $fam --program 'speculative[2x4]' \
        'speculative[2x4,sampled]'
  done
  run timeout $(lim 60) python3 lab/probes/probe_compile.py --compilation-cache-dir /tmp/cc_demo \
      --program 'speculative[2x4]' 'speculative[2x4,sampled]'
  ls /tmp/cc_demo | sed 's/-.*//' | sort | uniq -c
  mkdir -p "$res/demo"
  b0=$(busy)
  run env OUT="$res/demo" timeout $(lim 80) python3 benchmarks/compile_all.py --families demo --engines speculative
  b1=$(busy)
  echo "== cores busy during compile_all: $(echo "$b0 $b1" | awk '{printf "%.0f %%", 100 * ($3 - $1) / ($4 - $2)}')"
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run111.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run111.log" | tail -n 60
