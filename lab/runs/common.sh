# Sourced by every lab/runs/gpu_run*.sh at the start of its device call: `. lab/runs/common.sh NAME`, from the
# repository root. The A/B harness (scripts/gpu_ab_harness.sh: wheels, environment, $out and $res, `run`, `lim`,
# the measurements) plus what only the recorded runs use: `probe`, lab/probes/probe_dispatch.py under XLA's
# command-buffer update log, and `update_summary`, the updates of each phase of such a log.
. scripts/gpu_ab_harness.sh "$1"
update_summary() {  # updates of each phase of a probe_dispatch log: count, nodes skipped, mean host time
  python3 - "$1" <<'PY'
import collections, re, sys
pending, stats = collections.defaultdict(list), []  # a phase's updates are logged before its result line
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"Updated (\d+) commands in (\d+) .s \(skipped (\d+)", line)
    if m:
        pending[(m.group(1), m.group(3))].append(int(m.group(2)))
    m = re.match(r"^(host_inputs|device_inputs|trivial_program_\w+|buffers that moved)", line)
    if m:
        stats.append((m.group(1), line.split(" ", 1)[1].strip()[:150], pending))
        pending = collections.defaultdict(list)
stats.append(("after the last phase", "", pending))
for phase, result, updates in stats:
    print(f"  {phase}: {result}")
    for (n, skipped), us in updates.items():
        print(f"      {len(us):4d} updates of {n} nodes, {skipped:>4} skipped, mean {sum(us) / len(us):7.0f} us")
PY
}
# probe PROG [ARGS...]: lab/probes/probe_dispatch.py on E2B's speculative (PROG spec) or decode program at B = 1,
# context 1024, 40 repeats, under XLA's command-buffer update log ($VMODULE adds modules), ARGS passed on; the log
# goes to $res/probe_dispatch_PROG.log, and its updates per phase are printed.
probe() {
  local prog=$1 flag=; shift; [ "$prog" = spec ] && flag=--spec
  run env OUT=$res TF_CPP_VMODULE=${VMODULE:-command_buffer_thunk=3,command_executor=1} TF_CPP_MIN_LOG_LEVEL=0 \
      timeout $(lim 70) python3 lab/probes/probe_dispatch.py $flag --context 1024 --repeats 40 --tag $prog "$@" \
      > "$res/probe_dispatch_$prog.log" 2>&1
  echo "== rc=$? $prog"; update_summary "$res/probe_dispatch_$prog.log"
}
