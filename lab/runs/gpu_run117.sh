#!/usr/bin/env bash
# Run 117 (issue 10, cold start), one call under 560 s (END); carry `.whl`. Set GIT_COMMIT. Prepared in the
# twenty-sixth session, not yet run. Run 116 timed the servers' first answer with the background compile
# (--compile-in-background): demo 18.1 s, E2B 35.6 s; it stopped them before the background was done. Here each
# server is asked, then waited for until /health counts every program compiled (serve_check --until-compiled:
# all_compiled_s), cold: the demo pair, E2B and 31B at random weights (31B's speculative server has never been timed
# since compile-as-lowered; its goal is 150 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run117
end=${END:-560}
{
  echo "== commit ${GIT_COMMIT:-unknown}; $(nproc) cores"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  mkdir -p "$res/serve_demo"
  run env OUT="$res/serve_demo" timeout $(lim 100) python3 benchmarks/serve_check.py --runs cold --until-compiled
  CHECK_ARGS=--until-compiled serve_random e2b 150
  CHECK_ARGS=--until-compiled serve_random 31b 300
  for d in "$res"/serve_*; do
    python3 -c "import json, sys; [print(sys.argv[1], {k: r.get(k) for k in ('ready_s', 'all_compiled_s', 'ok', 'exit_code', 'shutdown_s')}) for r in json.load(open(sys.argv[2]))]" \
        "$(basename "$d")" "$d/serve_check.json"
  done
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run117.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run117.log" | tail -n 80
