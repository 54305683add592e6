#!/usr/bin/env bash
# GPU run 1: kernel checks + timings, decode-step roofline (issue 3). Logs under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee $OUT/env.txt
python3 -c "import jax, jaxlib; print(jax.__version__, jax.devices())" | tee -a $OUT/env.txt
timeout 200 python3 benchmarks/bench_paged_attention.py 2>&1 | tail -60 > $OUT/paged.log; echo "paged rc=$?"
tail -25 $OUT/paged.log
timeout 130 python3 benchmarks/bench_centroid_head.py --budget-s 40 2>&1 | tail -50 > $OUT/centroid.log; echo "centroid rc=$?"
tail -22 $OUT/centroid.log
timeout 240 python3 benchmarks/bench_decode.py --models e2b 31b --batch 1 16 --context 4096 2>&1 | tail -30 > $OUT/decode.log; echo "decode rc=$?"
tail -12 $OUT/decode.log
