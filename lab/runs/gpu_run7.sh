#!/usr/bin/env bash
# GPU run 7 (issue 8): the planner's tilings of every real geometry compile; every engine program of every family
# compiles at the server's default flags. Runs the committed tree (.snap/head.tar, `git archive HEAD`).
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/w && tar -xf .snap/head.tar -C /tmp/w && cd /tmp/w && export PYTHONPATH=/tmp/w
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv | tee $OUT/env.txt
timeout 90 python3 lab/probes/probe_kernel_smem.py --planned > $OUT/planned.log 2>&1; echo "planned rc=$?"; tail -3 $OUT/planned.log
timeout 420 python3 benchmarks/compile_all.py > $OUT/compile_all.log 2>&1; echo "compile_all rc=$?"
grep -v "compiled " $OUT/compile_all.log | tail -20
