#!/usr/bin/env bash
# Run 114 (issue 10), one call under 200 s (END); carry `.whl`. Set GIT_COMMIT. Prepared in the twenty-fifth session,
# run in the twenty-sixth (NOTEBOOK.md: bf16 ties; serve_check.py's keys renamed since, this script follows them).
# Run 112 found the README server's streamed reply different from its plain reply on the H200 (greedy, both 200).
# Is it the prefix cache (the second request prefills its last prompt token alone, in another program and kernel
# tiling, and bf16 rounding tips a near-tie) or a bug? The same check with the prefix cache on, then off;
# serve_check.json keeps both replies.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run114
end=${END:-200}
{
  echo "== commit ${GIT_COMMIT:-unknown}"
  for mode in on off; do
    flag=--enable-prefix-caching; [ $mode = off ] && flag=--no-enable-prefix-caching
    mkdir -p "$res/serve_$mode"
    run env OUT="$res/serve_$mode" timeout $(lim 90) python3 benchmarks/serve_check.py --runs cold -- $flag
    python3 -c "import json, sys; [print(sys.argv[1], repr(r.get('reply')), repr(r.get('stream_reply'))) for r in json.load(open(sys.argv[2]))]" \
        $mode "$res/serve_$mode/serve_check.json"
  done
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run114.log" 2>&1
grep -v "cuda_timer\|^W12\|^I12\|^E12" "$out/run114.log" | tail -n 30
