#!/usr/bin/env bash
# Run 44 (issues 10 and 11), one call of at most ~440 s (the session's last device time). Carry `.whl`.
# (0) E2B's decode program at B = 2: kernels by kind and its optimized HLO (gzip), to read what the ~21 kernels of a
#     layer are now (run 15's dump predates the in-place query rows);
# (1) E2B's speculative step at B = 2 with its kernels, after the verify attention tiling of ca092b2 (run 38: the
#     verify's attention 24 us per sliding layer against 7.4 in decode; spec / decode pipelined 1.46);
# (2) 26B-A4B decode at B = 1, 2, 4 against the roofline of the experts touched (issue 11: >= 70 % at every B;
#     run 40, pipelined: 49 % at B = 2, 102 % at B = 16) and its speculative step at B = 2 (never measured since
#     the grouped kernel's fix);
# (3) with the time left, the two prefix-cache tests that neither of this session's suite calls finished.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run44
trap 'tar czf "$out/results.tar.gz" -C "$res" .' EXIT
end=440
{
  run env OUT=$res timeout $(lim 70) python3 benchmarks/kernel_count.py --models e2b --batch 2 --programs decode \
      --json-name kernel_count_e2b.json --dump-hlo "$res/hlo"
  run env OUT=$res timeout $(lim 80) python3 benchmarks/bench_spec.py --models e2b --batch 2 --context 4096 --profile
  mv "$res/bench_spec.json" "$res/bench_spec_e2b.json"
  run env OUT=$res timeout $(lim 110) python3 benchmarks/bench_decode.py --models 26b --batch 1 2 4 --context 4096
  mv "$res/bench_decode.json" "$res/bench_decode_26b.json"
  run env OUT=$res timeout $(lim 100) python3 benchmarks/bench_spec.py --models 26b --batch 2 --context 4096
  mv "$res/bench_spec.json" "$res/bench_spec_26b.json"
  echo "== $(date +%T) done with the benchmarks"
} > "$out/run44.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^{'model'" "$out/run44.log" | grep -v "^      " | tail -n 90
left=$((end - SECONDS))
echo "== $(date +%T) tests, ${left} s left"
[ "$left" -gt 30 ] && OUT=$res GEMMA4_TEST_WORKERS=2 timeout $left bash scripts/gpu_suite.sh \
  tests/test_prefix_cache.py::test_cached_pages_survive_preemption_and_eviction \
  tests/test_prefix_cache.py::test_speculative_outputs_and_acceptance_equal_with_and_without_the_cache
echo "== tests rc=$? at $(date +%T)"
grep -E " (PASSED|FAILED) " "$res/pytest.log" 2>/dev/null
