# Shell functions for one device call that measures this tree, or this tree against main's (an A/B), on a GPU
# machine without network. Source it first: `. scripts/gpu_ab_harness.sh NAME`. It installs the carried wheels
# (.whl/, from scripts/fetch_gpu_wheels.sh) into /tmp/site without touching the image, sets the environment, makes
# $out (the device tool's $OUT) and $res=/tmp/NAME (results, tarred into $out when the script exits), and defines
# `run`, which logs each command with its start time and exit code, `lim`, a step's timeout within the script's
# deadline $end, and the measurements below (each names the benchmark it runs).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"; res=/tmp/$1; mkdir -p "$res/logs"
run() { echo "== $(date +%T) $*"; "$@"; echo "== rc=$?"; }
# lim N: N seconds, or fewer when the script's own deadline $end (seconds since it started) comes sooner.
lim() { local left=$((${end:-600} - SECONDS)); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
# The device returns no file over 16 MiB: an archive too big loses everything in it (a step matrix's JSON beside an
# HLO dump and a verbose log, say), so the largest files leave it, one by one, named, until it fits.
pack_results() {
  tar czf "$out/results.tar.gz" -C "$res" .
  while [ "$(stat -c %s "$out/results.tar.gz")" -gt 15000000 ]; do
    local big; big=$(find "$res" -type f -printf '%s %P\n' | sort -rn | head -1 | cut -d' ' -f2-)
    [ -n "$big" ] || break
    echo "== results.tar.gz over 15 MB: left out $big ($(stat -c %s "$res/$big") bytes)"
    rm -f "$res/$big"
    tar czf "$out/results.tar.gz" -C "$res" .
  done
}
trap pack_results EXIT
# host_overhead B: benchmarks/bench_host_overhead.py at E2B, batch B, context 1024, plain then speculative; the JSON
# to $res/host_overhead[_spec].json.
host_overhead() {
  for spec in "" --spec; do
    run env OUT=$res timeout $(lim 90) python3 benchmarks/bench_host_overhead.py --model e2b --batch $1 \
        --context 1024 --steps 40 $spec
    mv "$res/bench_host_overhead.json" "$res/host_overhead${spec:+_spec}.json"
  done
}
# header: the first lines of a run's log, the commit under test ($GIT_COMMIT) and the GPU.
header() {
  echo "== commit ${GIT_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
}
# tree_tests DIR LIMIT FILES...: those test files of the tree at DIR compiled on the GPU (8 workers, autotuning off),
# run in DIR itself (`python -m` puts the working directory first on sys.path), within LIMIT seconds and the
# deadline; the log to $res/tests.log, its tail printed. gpu_tests LIMIT FILES...: the same in this tree.
tree_tests() {
  local dir=$1 limit=$2; shift 2
  (cd "$dir" && run env PYTHONPATH=$PWD:/tmp/site GEMMA4_TEST_JAX_PLATFORMS=cuda XLA_FLAGS=--xla_gpu_autotune_level=0 \
      timeout $(lim "$limit") python3 -m pytest -q -n 8 -p no:cacheprovider "$@" > "$res/tests.log" 2>&1)
  tail -5 "$res/tests.log"
}
gpu_tests() { tree_tests "$PWD" "$@"; }
# Two trees in one call: main's carried as .baseline (without the demo pair's weights, over the carry limit; the
# same files in both trees, copied in here), this tree the branch. root_of main|branch: a tree's root.
use_trees() {  # use_trees DIR...: the demo pair's weights (left out of each carried tree) copied into each
  local d f
  for d in "$@"; do
    for f in gemma4_mtp_jax/demo_pair/*/model.safetensors; do [ -e "$d/$f" ] || cp "$f" "$d/$f"; done
  done
}
use_baseline() { use_trees .baseline; }
# spec_tree NAME ROOT: bench_spec.py at E2B (B = 2 and 16, k = 4, context 4096) in the tree at ROOT, within 80 s and
# the deadline, its JSON to $res/spec_NAME.
spec_tree() {
  mkdir -p "$res/spec_$1"
  run env OUT=$res/spec_$1 PYTHONPATH=$2:/tmp/site timeout $(lim 80) python3 "$2/benchmarks/bench_spec.py" \
      --models e2b --batch 2 16 --k 4 --context 4096 --repeats 20
}
# spec_table NAME...: the pipelined decode / verify / speculative ms of each spec_tree NAME's run, spec / decode and
# the decode against the copy roofline of that run's own probe.
spec_table() {
  python3 - "$res" "$@" <<'PY'
import json, os, sys
res = sys.argv[1]
print(f"{'tree':14s} {'B':>2s} {'decode':>8s} {'verify':>8s} {'spec':>8s} {'spec/dec':>8s} {'roof':>5s}  (ms, pipelined; roof: the decode's roofline share)")
for name in sys.argv[2:]:
    path = os.path.join(res, f"spec_{name}", "bench_spec.json")
    if not os.path.exists(path):
        print(f"{name:14s} (no result)"); continue
    for r in json.load(open(path))["rows"]:
        d, v, s = r["decode_pipelined_ms"], r["verify_pipelined_ms"], r["spec_pipelined_ms"]
        roof = r.get("decode_roofline_ms", float("nan")) / d
        print(f"{name:14s} {r['batch']:2d} {d:8.3f} {v:8.3f} {s:8.3f} {s / d:8.3f} {roof:5.0%}")
PY
}
root_of() { [ "$1" = main ] && echo "$PWD/.baseline" || echo "$PWD"; }
# kernels_both ARGS...: benchmarks/kernel_count.py ARGS in each tree (autotuning off), to $res/kernels_{main,branch};
# "{tree}" in an argument becomes the tree's name (--dump-hlo "$res/hlo_{tree}").
kernels_both() {
  local tree root
  for tree in main branch; do
    root=$(root_of $tree); mkdir -p "$res/kernels_$tree"
    run env OUT=$res/kernels_$tree PYTHONPATH=$root:/tmp/site XLA_FLAGS=--xla_gpu_autotune_level=0 \
        timeout $(lim 60) python3 "$root/benchmarks/kernel_count.py" "${@//\{tree\}/$tree}"
  done
}
# both LIMIT NAME SCRIPT ARGS...: benchmarks/SCRIPT ARGS in each tree (main, then branch), each within LIMIT seconds
# (and the deadline), its $OUT $res/NAME_{main,branch}.
both() {
  local limit=$1 name=$2 script=$3 tree root; shift 3
  for tree in main branch; do
    root=$(root_of $tree); mkdir -p "$res/${name}_$tree"
    run env OUT=$res/${name}_$tree PYTHONPATH=$root:/tmp/site timeout $(lim "$limit") python3 \
        "$root/benchmarks/$script" "$@"
  done
}
# faster_at B: 1 when the branch's speculative step at batch B ran >= 3 % faster pipelined than main's in `both ...
# spec bench_spec.py` ($res/spec_{main,branch}/bench_spec.json), else 0 (a missing or cut run counts as not faster).
faster_at() {
  python3 - "$res" "$1" <<'PY' 2>/dev/null || echo 0
import json, sys
res, batch = sys.argv[1], int(sys.argv[2])
t = {tree: {r["batch"]: r["spec_pipelined_ms"] for r in json.load(open(f"{res}/spec_{tree}/bench_spec.json"))["rows"]}
     for tree in ("main", "branch")}
print(int(t["branch"][batch] < 0.97 * t["main"][batch]))
PY
}
# serve_random FAMILY LIMIT [SERVE FLAGS...]: serve_check.py --runs cold $CHECK_ARGS on FAMILY's random-weight
# checkpoint (benchmarks/common.py writes its config files; --load-format dummy), within LIMIT seconds, to
# $res/serve_FAMILY; the server log's start-up lines printed.
serve_random() {
  local family=$1 limit=$2 tdir adir; shift 2
  mkdir -p "$res/serve_$family"
  read -r tdir adir < <(python3 -c "from benchmarks.common import write_random_checkpoint as w
print(*w('$family', '/tmp/${family}_ckpt'))")
  run env OUT="$res/serve_$family" timeout $(lim "$limit") python3 benchmarks/serve_check.py --runs cold ${CHECK_ARGS:-} -- \
      --ckpt "$tdir" --assistant "$adir" --load-format dummy "$@"
  grep -ah "compiled \|ready in\|compiling \|load\|stopped" "$res/serve_$family/serve_cold.log" | tail -20
}
# sweep NAME SHAPE B TQ CTX K_SPEC GRID...: bench_paged_attention.py's sweep of one shape (16-token pages, 20 reps,
# 4 input sets), --sweep-grid GRID, within 70 s and the deadline, its JSON to $res/NAME; the per-tiling lines left out.
sweep() {
  local name=$1 shape=$2 b=$3 tq=$4 ctx=$5 kspec=$6; shift 6
  mkdir -p "$res/$name"
  run env OUT=$res/$name timeout $(lim 70) python3 benchmarks/bench_paged_attention.py --sweep --shapes $shape \
      --batch $b --q-len $tq --ctx $ctx --page-size 16 --k-spec $kspec --reps 20 --max-sets 4 --sweep-grid "$@" \
      | grep -v "B=.*: kernel \|^  "
}
# ncu_paged NAME SHAPE B TQ: Nsight Compute (ncu, on the image) on the first launches of the paged kernel and its
# merge at one shape of bench_paged_attention.py (ctx 4096, k = 4): speed of light, occupancy, launch, warp states,
# memory and compute sections and the warp-stall ratios, to $res/ncu_NAME.txt; the key lines printed, or the log's
# tail when nothing was profiled. When the benchmark crashes at exit under ncu (it did for two shapes of four on the
# H200), ncu prints no report: such a shape runs once more with the report exported to a file
# ($res/ncu_NAME.ncu-rep), which is then printed from the file.
ncu_paged() {
  local name=$1 shape=$2 b=$3 tq=$4 ncu
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "== no ncu on this image"; return; }
  _ncu_profile() {
    run timeout $(lim 100) "$ncu" --clock-control none --kernel-name regex:paged_attention --launch-count 2 "$@" \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 benchmarks/bench_paged_attention.py --shapes "$shape" --batch "$b" --q-len "$tq" --ctx 4096 \
        --page-size 16 --k-spec 4 --reps 1 --max-sets 1 --copy-mib 64
  }
  _ncu_profile > "$res/ncu_$name.txt" 2>&1
  if ! grep -aq "Duration" "$res/ncu_$name.txt"; then
    _ncu_profile --export "$res/ncu_$name" --force-overwrite >> "$res/ncu_$name.txt" 2>&1
    [ -f "$res/ncu_$name.ncu-rep" ] &&
      "$ncu" --import "$res/ncu_$name.ncu-rep" --page details >> "$res/ncu_$name.txt" 2>&1
  fi
  grep -aE "  paged_attention|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Dynamic Shared|Block Limit (Registers|Shared Mem)|Waves Per SM|Grid Size|Memory Throughput|DRAM Throughput|L2 Hit Rate|Compute \(SM\) Throughput|Warp Cycles Per Issued|stalled_(long_scoreboard|barrier|short_scoreboard|math_pipe_throttle|wait|mio_throttle|lg_throttle|not_selected|dispatch_stall|no_instruction)" \
      "$res/ncu_$name.txt" | head -70
  grep -aq "Duration" "$res/ncu_$name.txt" || tail -n 15 "$res/ncu_$name.txt"  # nothing profiled: say why
}
# spec_profile NAME ARGS...: bench_spec.py ARGS --profile (where a step's device time goes, op by op) within 120 s
# and the deadline, its JSON to $res/NAME.
spec_profile() {
  local name=$1; shift
  mkdir -p "$res/$name"
  run env OUT="$res/$name" timeout $(lim 120) python3 benchmarks/bench_spec.py "$@" --profile
}
