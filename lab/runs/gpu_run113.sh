#!/usr/bin/env bash
# Run 113 (issue 10, cold start), one call under 400 s (END); carry `.whl` and `.baseline` (as run 112). Set
# GIT_COMMIT. Run 112's compile_all figures moved 27-60 s between processes of one tree on a fresh machine, so the
# twin ordering is timed again on a machine already warm: main and branch alternating, E2B then the demo, twice.
# Its branch (bda9a2f: compile_all's twin ordering, 9954f4e) was measured and withdrawn in 617e7f3; NOTEBOOK.md,
# twenty-fifth session, says what it changed. To rerun it, check out that commit.
set -uo pipefail
cd "$(dirname "$0")/../.."
. lab/runs/common.sh run113
end=${END:-400}
{
  echo "== commit ${GIT_COMMIT:-unknown}; $(nproc) cores"
  use_baseline
  for i in 1 2; do
    both 90 e2b$i compile_all.py --families e2b --engines speculative
    both 50 demo$i compile_all.py --families demo --engines speculative
  done
  echo "== $(date +%T) done, $((end - SECONDS)) s left"
} > "$out/run113.log" 2>&1
grep -a "wall\|rc=" "$out/run113.log"
