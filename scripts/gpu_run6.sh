#!/usr/bin/env bash
# GPU run 6: E2B speculative step after switching greedy drafting to the fused centroid argmax kernel and the
# 2-row minimum bucket (B=1 rows are benchmarked as given: bench_spec compiles the exact batch asked).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 python3 benchmarks/bench_spec.py --models e2b --batch 1 2 16 --k 4 --context 4096 --repeats 15 2>&1 | grep -v Warning > $OUT/spec_e2b.log; echo "rc=$?"
tail -6 $OUT/spec_e2b.log
