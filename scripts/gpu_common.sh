# Sourced by a scripts/gpu_run*.sh at the start of its device call: `. scripts/gpu_common.sh NAME`. Installs the
# carried wheels (.whl/) into /tmp/site without touching the image, sets the environment, makes $out (the device
# tool's $OUT) and $res=/tmp/NAME (results, tarred into $out when the script exits), and defines `run`, which logs
# each command with its start time and exit code, `lim`, a step's timeout within the script's deadline $end, and
# `update_summary`, the command-buffer updates of each phase of a probe_dispatch log under TF_CPP_VMODULE.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"; res=/tmp/$1; mkdir -p "$res/logs"
run() { echo "== $(date +%T) $*"; "$@"; echo "== rc=$?"; }
# lim N: N seconds, or fewer when the script's own deadline $end (seconds since it started) comes sooner.
lim() { local left=$((${end:-600} - SECONDS)); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
trap 'tar czf "$out/results.tar.gz" -C "$res" .' EXIT
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
