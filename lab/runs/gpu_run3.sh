#!/usr/bin/env bash
# GPU run 3: chunked prefill through the Pallas kernel vs the XLA reference; centroid head at T=64.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 330 python3 benchmarks/bench_prefill.py --models e2b 31b --prompt 2048 --chunk 256 --repeats 3 2>&1 | grep -v Warning > $OUT/prefill.log; echo "prefill rc=$?"
tail -6 $OUT/prefill.log
timeout 100 python3 benchmarks/bench_centroid_head.py --tokens 64 --no-sweep 2>&1 | tail -20 > $OUT/centroid64.log; echo "centroid rc=$?"
grep -E "T=|pallas_kernel|xla_full|dense_full|select|pallas_full|check" $OUT/centroid64.log
