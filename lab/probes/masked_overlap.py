"""Why the masked round's masks do not overlap its verify forward on the GPU: bench_spec.py --processed with its
masked round instrumented. Per round it records the host time of the draft program's dispatch call, of the verify
forward's dispatch call and the moment the drafts are on the host (all from the round's start). With EARLY_COPY=1
the drafts' copy to the host is issued right after the draft's dispatch, before the verify is dispatched (so the
copy cannot queue behind the verify). Run under XLA_FLAGS=--xla_gpu_enable_command_buffer= to see whether
command-buffer updates make the verify's dispatch block.

    python lab/probes/masked_overlap.py --models e2b --batch 2 16 --k 4 --context 4096 --repeats 20 --processed
"""
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import benchmarks.bench_spec as bench_spec  # noqa: E402

EARLY = os.environ.get("EARLY_COPY") == "1"


def timed_masked_round(steps, programs, state, draft_in, accept_in, repeats, warmup=3):
    draft, verify, accept = programs
    marks = {"draft_dispatch": [], "verify_dispatch": [], "drafts_read": [], "round": []}
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        state, drafted, q, q_ids = draft(steps.program_params, steps.draft_params, state, draft_in)
        t1 = time.perf_counter()
        if EARLY:
            drafted.copy_to_host_async()
        state, h_all, logits = verify(steps.program_params, state, draft_in, drafted)
        t2 = time.perf_counter()
        np.asarray(drafted)[:, :steps.k]
        t3 = time.perf_counter()
        state, out = accept(state, accept_in(), drafted, q, q_ids, h_all, logits)
        jax.block_until_ready(out)
        t4 = time.perf_counter()
        if i >= warmup:
            for key, t in zip(marks, (t1, t2, t3, t4)):
                marks[key].append((t - t0) * 1e3)
    med = {key: statistics.median(v) for key, v in marks.items()}
    print(f"masked round B={drafted.shape[0]} early_copy={EARLY} "
          f"xla_flags={os.environ.get('XLA_FLAGS', '')!r}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items()),
          flush=True)
    return {"masked_round_ms": med["round"], "masked_drafts_read_ms": med["drafts_read"],
            "masked_draft_dispatch_ms": med["draft_dispatch"], "masked_verify_dispatch_ms": med["verify_dispatch"],
            "masked_accept_ms": float("nan"), "masked_accept_pipelined_ms": float("nan")}, state


bench_spec.timed_masked_round = timed_masked_round
if __name__ == "__main__":
    sys.argv[0] = "bench_spec.py"
    bench_spec.main()
