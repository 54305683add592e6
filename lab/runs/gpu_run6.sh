#!/usr/bin/env bash
# GPU run 6 (issue 8, "before"): device facts, the paged kernel's shared-memory probe, the suite on the GPU as it
# stood at the start of the session. Logs under $OUT.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv | tee $OUT/env.txt
python3 -c "import jax,transformers,torch; d=jax.devices()[0]; print(jax.__version__, transformers.__version__, torch.__version__, d, d.core_count, getattr(d,'compute_capability',None), d.device_kind)" 2>&1 | tail -1 | tee -a $OUT/env.txt
timeout 100 python3 lab/probes/probe_kernel_smem.py > $OUT/probe.log 2>&1; echo "probe rc=$?"; tail -3 $OUT/probe.log
t0=$(date +%s)
GEMMA4_TEST_JAX_PLATFORMS=cuda timeout 420 python3 -m pytest -q -v -n 8 --timeout 240 -p no:cacheprovider --durations=60 -rf --junitxml=$OUT/junit.xml tests > $OUT/pytest.log 2>&1
echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"
grep -cE "PASSED" $OUT/pytest.log; grep -E "FAILED|ERROR|Timeout" $OUT/pytest.log | sort | uniq | head -40
tail -5 $OUT/pytest.log
