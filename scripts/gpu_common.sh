# Sourced by a scripts/gpu_run*.sh at the start of its device call: `. scripts/gpu_common.sh NAME`. Installs the
# carried wheels (.whl/) into /tmp/site without touching the image, sets the environment, makes $out (the device
# tool's $OUT) and $res=/tmp/NAME (results, tarred into $out when the script exits), and defines `run`, which logs
# each command with its start time and exit code, and `lim`, a step's timeout within the script's deadline $end.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/out}; mkdir -p "$out"; res=/tmp/$1; mkdir -p "$res/logs"
run() { echo "== $(date +%T) $*"; "$@"; echo "== rc=$?"; }
# lim N: N seconds, or fewer when the script's own deadline $end (seconds since it started) comes sooner.
lim() { local left=$((${end:-600} - SECONDS)); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
trap 'tar czf "$out/results.tar.gz" -C "$res" .' EXIT
