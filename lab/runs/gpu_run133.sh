#!/usr/bin/env bash
# Run 133 (issue 10), one call under END s (default 330), prepared in the thirty-seventh session. Carry `.whl` and
# `.baseline` (main before the untuned first programs: `git archive` of it, the demo pair's weights left out). Set
# GIT_COMMIT. This tree: the server's first three programs compile without XLA's GEMM autotuning and are replaced
# by tuned ones in the background (run 132: autotuning off in every program made the demo pair ready 3.7 s sooner,
# 22.1 -> 18.5 s on an H100, with its step up to ~8 % slower).
# 1. The demo pair's cold start (the README's command), main and this tree alternately, twice each.
# 2. This tree's server kept up until its log says the first programs were replaced (the tuned ones compiled on
#    the GPU), then asked once more and stopped.
# 3. 31B's speculative step on main at B = 2 (B = 16 too where the GPU has over 120 GB), memory fraction 0.95.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run133
end=${END:-330}
use_baseline
cold() {  # cold NAME TREE
  mkdir -p "$res/cold_$1"
  (cd "$2" && run env OUT=$res/cold_$1 PYTHONPATH=$2:/tmp/site timeout $(lim 60) python3 benchmarks/serve_check.py \
      --runs cold | tail -3)
  grep -ah "compiled \|ready in" "$res/cold_$1/serve_cold.log" | head -4
}
{
  header
  cold main "$PWD/.baseline"; cold branch "$PWD"; cold main_again "$PWD/.baseline"; cold branch_again "$PWD"
  # 2. the replacement, watched in the server's log
  log=$res/serve_retune.log port=8765
  python3 -m gemma4_mtp_jax.serve --port $port --executable-cache-dir /tmp/run133_exec \
      --compilation-cache-dir /tmp/run133_jax > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 $(lim 100)); do grep -q "replaced by their autotuned" "$log" && break; sleep 1; done
  curl -s -m 30 http://127.0.0.1:$port/v1/completions -H 'content-type: application/json' \
      -d '{"prompt": "The", "max_tokens": 16, "temperature": 0}' | head -c 400; echo
  kill -TERM $pid; wait $pid; echo "== server exit $?"
  grep -ah "compiled \|ready in\|replaced\|background" "$log"
  # 3. 31B
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  batches="2"; [ "$mem" -gt 120000 ] && batches="2 16"
  mkdir -p "$res/spec_31b"
  run env OUT=$res/spec_31b XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout $(lim 200) python3 benchmarks/bench_spec.py \
      --models 31b --batch $batches --k 4 --context 4096 --repeats 10
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run133.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"\|GET /health" "$out/run133.log" | tail -n 80
