#!/usr/bin/env bash
# GPU run 5: is the 1-row decode slower than the 2-row one at 31B (matrix-vector path)? Decode only, B = 1, 2.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 280 python3 benchmarks/bench_decode.py --models 31b --batch 1 2 --context 4096 2>&1 | grep -v Warning > $OUT/decode12.log; echo "rc=$?"
tail -4 $OUT/decode12.log
