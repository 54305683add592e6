#!/usr/bin/env bash
# Speculation that pays, through the server (one device call per PART, each under 10 minutes):
#   PART=demo   the demo pair, greedy, c = 1,8,32,64,128: plain, auto, fixed k = 4, fixed k = 2
#   PART=temp   the demo pair at T = 0.8: plain, auto
#   PART=random E2B shapes, random weights (drafts never accepted), --ignore-eos: plain, auto
# Goals: auto >= 0.98x plain everywhere; auto within 5 % of the best fixed k on the demo pair.
# Levels of 2 x C requests last 0.2-2 s on the demo pair (a ~10 % spread): ROUNDS (default 16) x C requests per level.
# A cold machine compiles the auto server's ~250 programs in ~190 s (demo) and more at E2B shapes, and bench_serve
# times only once every program is final: each bench gets LIMIT s (default 300; random: 480).
cd "$(dirname "$0")/../.."
end=${END:-590}
. scripts/gpu_ab_harness.sh spec_auto
header
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
part=${PART:-demo}
bench() {  # bench NAME ARGS...: one bench_serve run, its JSON under $res/NAME.json
  local name=$1; shift
  run timeout $(lim ${LIMIT:-300}) python3 benchmarks/bench_serve.py --port 8011 --out "$res/$name.json" \
      --log-dir "$res/logs_$name" --rounds-per-level ${ROUNDS:-16} "$@"
}
case $part in
  demo)
    levels=1,8,32,64,128
    bench auto --concurrency $levels --assistant-modes spec,plain --server-arg=--speculative-k --server-arg=auto
    bench k4 --concurrency $levels --assistant-modes spec --server-arg=--num-speculative-tokens=4
    bench k2 --concurrency $levels --assistant-modes spec --server-arg=--num-speculative-tokens=2 ;;
  temp)
    bench auto_t08 --concurrency 1,8,32,64,128 --temperature 0.8 --assistant-modes spec,plain ;;
  random)
    LIMIT=${LIMIT:-480} bench auto_random --concurrency 1,8,32,64,128 --dataset random --random-weights e2b --ignore-eos \
      --input-len 256 --output-len 128 --assistant-modes spec,plain --server-arg=--speculative-k --server-arg=auto ;;
esac
