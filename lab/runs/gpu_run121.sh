#!/usr/bin/env bash
# Run 121 (issue 10, cold start), one call under 560 s (END); carry `.whl` and `.baseline` = main before the
# compile-ahead change (359f3b2). Set GIT_COMMIT. Prepared in the twenty-seventh session, not yet run.
# Since this session the server compiles its first programs from the checkpoints' shapes while the weights load
# (engine.compile_ahead, into the executable cache), so a cold start takes about max(load, compile) rather than
# their sum. Run 117 (main before it): ready at 15.1 s (demo), 33.1 s (E2B, 10.1 s of it loading), 36.2 s (31B,
# 9.5 s loading). Here both trees, one after the other on the same machine, cold (serve_check makes fresh caches):
# the demo pair, and E2B and 31B at random weights (--load-format dummy: loading draws them on the device). First,
# lab/probes/probe_cache_reserialize.py on the GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run121
end=${END:-560}
use_baseline
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  # Whether XLA:GPU, like XLA:CPU, loses an executable's kernels when one JAX's persistent cache gave back is
  # serialized again (executable_cache.compile_for_cache keeps those out of the cache on the CPU only).
  run timeout $(lim 90) python3 lab/probes/probe_cache_reserialize.py
  for family in e2b 31b; do
    python3 -c "from benchmarks.common import write_random_checkpoint as w; w('$family', '/tmp/${family}_ckpt')"
  done
  for tree in main branch; do
    root=$(root_of $tree)
    check() {  # check NAME LIMIT [SERVER FLAGS]: serve_check.py of this tree, cold, until every program compiled
      local name=$1 limit=$2; shift 2
      mkdir -p "$res/${name}_$tree"
      run env OUT="$res/${name}_$tree" PYTHONPATH=$root:/tmp/site timeout $(lim "$limit") python3 \
          "$root/benchmarks/serve_check.py" --runs cold --until-compiled ${1:+--} "$@"
      grep -ah "compiled ahead\|ready in\|loading .*done\|waiting for" "$res/${name}_$tree/serve_cold.log" | head -12
    }
    check demo 100
    check e2b 130 --ckpt /tmp/e2b_ckpt/e2b_target --assistant /tmp/e2b_ckpt/e2b_assistant --load-format dummy
    check 31b 130 --ckpt /tmp/31b_ckpt/31b_target --assistant /tmp/31b_ckpt/31b_assistant --load-format dummy
  done
  for d in "$res"/*_main "$res"/*_branch; do
    python3 -c "import json, sys; [print(sys.argv[1], {k: r.get(k) for k in ('ready_s', 'all_compiled_s', 'ok', 'stream_equals_repeat')}) for r in json.load(open(sys.argv[2]))]" \
        "$(basename "$d")" "$d/serve_check.json"
  done
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run121.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run121.log" | tail -n 80
