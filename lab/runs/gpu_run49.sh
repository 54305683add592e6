#!/usr/bin/env bash
# Run 49 (issues 12 and 10), one call under 590 s. Carry `.whl`.
# The step programs now take their host inputs as one packed int32 array, staged into the device state's buffer by
# one kernel (gemma4_mtp_jax/input_pack.py). Run 48 found the ~15 separate inputs the largest host cost of a call:
# their transfers, and 96-215 command-buffer nodes re-recorded per call because they move.
# (1) probe_dispatch, speculative and decode, E2B B = 1, context 1024, with XLA's update log: how many nodes a call
#     still updates, and how long a call holds the host (run 48: 3.25 ms both, fresh inputs; 1.99 / 2.38 placed once);
# (2) bench_host_overhead at E2B B = 1, decode and speculative (issue 12: async step <= 5 % over the program
#     pipelined; run 48: +22 % and +9.6 %);
# (3) bench_spec E2B B = 2, 16 (issue 10: spec / decode <= 1.20 and <= 1.35; run 44: 1.24 pipelined at B = 2);
# (4) with the time left, the trained demo pair served, spec vs plain, C = 1, 8, 32, 64 (issue 12: >= 1.3x at 64).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run49
end=575
{
  for prog in spec decode; do probe $prog; done
  host_overhead 1
  run env OUT=$res timeout $(lim 160) python3 benchmarks/bench_spec.py --models e2b --batch 2 16 --context 4096
  run timeout $(lim 200) python3 benchmarks/bench_serve.py --dataset chat --concurrency 1,8,32,64 --max-tokens 128 \
      --out "$res/serve_demo.json" --log-dir "$res/logs"
  echo "== $(date +%T) done"
} > "$out/run49.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run49.log" | tail -n 90
