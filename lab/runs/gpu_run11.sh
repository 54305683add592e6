#!/usr/bin/env bash
# Run 11 (issue 9): build the trained demo pair on the H200 with the corpus carried in .corpus/ (made by
# scripts/fetch_demo_corpus.sh where there is network). Stages already in runs/demo are kept, so a second call on a
# still-warm machine continues. The pair and the logs come back as a tarball in 15 MB parts (the per-file limit).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15
out=${OUT:-/tmp/out}; mkdir -p "$out"
git log --oneline -1 > "$out/commit.txt" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt"
start=$(date +%s)
timeout "${TRAIN_LIMIT:-540}" python3 -m gemma4_mtp_jax.train_demo --corpus .corpus/text --out runs/demo "$@" \
    2>&1 | tr '\r' '\n' | grep -v -E '^\s*$' > "$out/train.log"
rc=${PIPESTATUS[0]}
echo "train_demo rc=$rc wall=$(( $(date +%s) - start ))s" | tee -a "$out/train.log"
(cd runs/demo && tar cf /tmp/pair.tar --ignore-failed-read pair target_log.jsonl target/pretrain.json data/info.json \
    assistant/eval.json assistant/eval_initial.json assistant/train_log.jsonl assistant/run.json 2>/dev/null)
split -b 15000000 -d /tmp/pair.tar "$out/pair.tar.part"
ls -la "$out"
grep -E "^\[train_demo\]|held-out|error|Error" "$out/train.log" | tail -20
exit "$rc"
