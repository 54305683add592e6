#!/usr/bin/env bash
# Run 116 (issue 10, cold start), one call under 590 s (END); carry `.whl`. Set GIT_COMMIT. The server now compiles
# the smallest batch and prefill buckets' programs, listens, and compiles the rest in the background
# (--compile-in-background, on by default).
# 1. the README's server, cold then warm (serve_check.py: ready seconds, plain, repeated and streamed replies,
#    SIGTERM during the background compile -> exit 0), and E2B's (random weights, cold);
# 2. BUILD.md's second GPU suite call (the engine's, prefix cache's, server's tests) plus the executable cache's;
# 3. the README's server cold with --no-compile-in-background, the same machine, for the ratio.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run116
end=${END:-590}
{
  echo "== commit ${GIT_COMMIT:-unknown}; $(nproc) cores"
  mkdir -p "$res/serve_demo" "$res/serve_demo_all" "$res/suite"
  run env OUT="$res/serve_demo" timeout $(lim 90) python3 benchmarks/serve_check.py
  grep -ah "compiled \|ready in\|compiling \|stopped\|SIGTERM" "$res/serve_demo/serve_cold.log" | tail -16
  serve_random e2b 120
  run env OUT="$res/suite" GEMMA4_TEST_WORKERS=16 timeout $(lim 380) bash scripts/gpu_suite.sh --part 2 \
      tests/test_executable_cache.py
  run env OUT="$res/serve_demo_all" timeout $(lim 80) python3 benchmarks/serve_check.py --runs cold -- \
      --no-compile-in-background
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run116.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12\|^{'\|^{\"" "$out/run116.log" | tail -n 90
