#!/usr/bin/env bash
# GPU run 2: decode / verify / speculative step at E2B and 31B shapes (issues 3 and 4). Logs under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $OUT/env.txt
timeout 420 python3 benchmarks/bench_spec.py --models e2b 31b --batch 1 16 --k 4 --context 4096 2>&1 | grep -v Warning > $OUT/spec.log; echo "spec rc=$?"
tail -8 $OUT/spec.log
timeout 120 python3 benchmarks/bench_centroid_head.py --no-sweep 2>&1 | tail -40 > $OUT/centroid.log; echo "centroid rc=$?"
grep -E "T=|pallas_kernel|xla_full|dense_full|select|pallas_full" $OUT/centroid.log | tail -24
