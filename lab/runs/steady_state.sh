#!/usr/bin/env bash
# One device call: how long after a cold start the demo pair's and E2B's servers (random weights) reach their steady
# speed (/health programs_final: the first programs' tuned replacements in), through bench_serve.py, empty caches.
cd "$(dirname "$0")/../.."
. scripts/gpu_ab_harness.sh steady
header
run timeout $(lim 200) python3 benchmarks/bench_serve.py --assistant-modes spec --concurrency 1 --requests-per-level 8 \
  --max-tokens 64 --max-num-seqs 8 --port 8011 --ready-timeout 90 --final-timeout 150 \
  --server-arg=--compilation-cache-dir=none --server-arg=--executable-cache-dir=none \
  --out $res/steady_demo.json --log-dir $res/steady_demo
run timeout $(lim 260) python3 benchmarks/bench_serve.py --random-weights e2b --assistant-modes spec --dataset random \
  --input-len 128 --output-len 64 --ignore-eos --num-prompts 16 --concurrency 1 --requests-per-level 4 \
  --max-num-seqs 8 --port 8012 --ready-timeout 120 --final-timeout 200 \
  --server-arg=--compilation-cache-dir=none --server-arg=--executable-cache-dir=none \
  --out $res/steady_e2b.json --log-dir $res/steady_e2b
grep -rh "ready in\|replaced by their autotuned\|programs_final\|final_s\|tuned_replacement" $res/steady_* | head -20
python3 - "$res" <<'PY'
import json, sys, pathlib
for p in sorted(pathlib.Path(sys.argv[1]).glob("steady_*.json")):
    d = json.loads(p.read_text())
    servers = d.get("servers") or d.get("startup") or d
    print(p.name, json.dumps(servers)[:1500])
PY
