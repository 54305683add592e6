#!/usr/bin/env bash
# GPU run 4: is the prefill difference kernel error or bf16 noise? E2B prefill in float32 (kernel vs XLA),
# and single attention calls at prefill shape (q_len 256) in bf16.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 150 python3 benchmarks/bench_prefill.py --models e2b --dtype float32 --prompt 1024 --chunk 256 --repeats 2 2>&1 | grep -v Warning > $OUT/prefill_f32.log; echo "prefill rc=$?"
tail -3 $OUT/prefill_f32.log
timeout 150 python3 benchmarks/bench_paged_attention.py --batch 1 --q-len 256 --ctx 4096 --page-size 16 --k-spec 256 --reps 5 --max-sets 2 2>&1 | tail -12 > $OUT/paged256.log; echo "paged rc=$?"
cat $OUT/paged256.log
