#!/usr/bin/env bash
# GPU run 8 (issue 8, "after"): the README's main command (serve_check: cold and warm start, chat plain and
# streaming, SIGTERM), 31B's plain-engine programs (run 7 ran out of time there), and the whole suite on the GPU.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
mkdir -p $OUT/serve $OUT/compile
OUT=$OUT/serve timeout 240 python3 benchmarks/serve_check.py 2>&1 | grep -v cuda_timer | tail -6
(OUT=$OUT/compile timeout 200 python3 benchmarks/compile_all.py --families 31b --engines plain > $OUT/compile/log 2>&1; echo "31b plain rc=$?" >> $OUT/compile/log) &
t0=$(date +%s)
timeout 420 bash scripts/gpu_suite.sh > /dev/null 2>&1
echo "suite rc=$? in $(( $(date +%s) - t0 )) s"
wait
grep -v "compiled \|cuda_timer" $OUT/compile/log | tail -5
grep -E "FAILED|ERROR" $OUT/pytest.log | head -20
tail -3 $OUT/pytest.log
