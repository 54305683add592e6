#!/usr/bin/env bash
# Run 79 (issue 10), one call under 590 s; carry `.whl`. Set GIT_COMMIT to the commit the tree is at.
# 1. Whole-prompt prefill (2048 tokens, 256-token chunks) through the paged kernel and through XLA, since
#    kernel_config gives a prefill chunk key splits up to one wave of programs: E2B and 31B at a table width of
#    the prompt (XLA's best case: it attends over the whole width), E2B again at a server's 8192.
# 2. Cold compilation of the server's programs (compile_all.py, 16 threads, no cache): the demo pair and E2B,
#    speculative (issue 10's goals: the demo pair ready <= 15 s, E2B <= 60 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run79
end=${END:-585}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  mkdir -p "$res/prefill" "$res/prefill_8k" "$res/compile"
  run env OUT=$res/prefill timeout $(lim 200) python3 benchmarks/bench_prefill.py --models e2b 31b --prompt 2048 \
      --chunk 256 --repeats 3
  run env OUT=$res/prefill_8k timeout $(lim 90) python3 benchmarks/bench_prefill.py --models e2b --prompt 2048 \
      --chunk 256 --repeats 3 --max-model-len 8192
  run env OUT=$res/compile timeout $(lim 240) python3 benchmarks/compile_all.py --families demo e2b \
      --engines speculative
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run79.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run79.log" | tail -n 80
