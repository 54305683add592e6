#!/usr/bin/env bash
# Run 110 (issue 10, cold start), one call under 400 s (END); carry `.whl`. Set GIT_COMMIT.
# Run 109 found the demo pair's speculative[2x4] compiling in 4.6 s alone (2.1 s of it the GEMM autotuner) but
# 8-25 s a program when compile_all compiles the 11 in threads of one process (33.5 s wall). Is that the machine's
# 16 cores, or the one process? The same programs each in its own process, all started at once (probe_compile.py);
# three of them alone; and compile_all's threads with XLA's per-program compile pools cut to one thread.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run110
end=${END:-400}
now() { date +%s.%N; }
# processes FAMILY [XLA_FLAGS]: every program of FAMILY's speculative engine in its own probe_compile.py process,
# all at once; each one's line, then the wall of the whole batch.
processes() {
  local fam=$1 t0 n i=0; t0=$(now)
  python3 lab/probes/probe_compile.py --family "$fam" --list > /tmp/names_$fam
  while read -r n; do
    i=$((i + 1))
    env XLA_FLAGS="${2:-}" timeout $(lim 150) python3 lab/probes/probe_compile.py --family "$fam" --program "$n" \
        > "$res/logs/proc_${fam}_$i.log" 2>&1 &
  done < /tmp/names_$fam
  wait
  grep -ah "compiled in" "$res"/logs/proc_${fam}_*.log
  echo "== $fam: $i programs in $i processes: $(python3 -c "print(f'{$(now) - $t0:.1f}')") s wall (listing included)"
}
{
  echo "== commit ${GIT_COMMIT:-unknown}; $(nproc) cores"
  processes demo
  for n in 'speculative[8x4,sampled]' 'prefill[1x256]' 'prefill[1x16]'; do
    run timeout $(lim 40) python3 lab/probes/probe_compile.py --program "$n"
  done
  processes e2b
  mkdir -p "$res/demo_par1"
  run env OUT="$res/demo_par1" XLA_FLAGS=--xla_gpu_force_compilation_parallelism=1 timeout $(lim 80) \
      python3 benchmarks/compile_all.py --families demo --engines speculative
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run110.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run110.log" | tail -n 80
