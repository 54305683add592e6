"""Host syncs and kernels of the programs a grammar batch runs, compiled for the H200 on a machine without it (the
CUDA plugin, compile-only; BUILD.md's /tmp/gpuvenv): the masked round's draft / verify / accept against the decode,
processed decode and fused round, at E2B shapes, B = 2, k = 4. A host sync (a conditional's or a loop's predicate
copied to the host) holds the dispatching thread until the device gets there.

    JAX_PLATFORMS=cpu /tmp/gpuvenv/bin/python lab/probes/masked_syncs_gpu.py [e2b|31b]
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import jax  # noqa: E402

from benchmarks.common import compile_only_device, layout_for, lower_program  # noqa: E402
from benchmarks.kernel_count import load_model, summarize  # noqa: E402
from gemma4_mtp_jax.programs.compiled import CompiledSteps  # noqa: E402
from gemma4_mtp_jax.steps.speculative import AssistantDrafter  # noqa: E402

device = compile_only_device("h200")
target, assistant = load_model(sys.argv[1] if len(sys.argv) > 1 else "e2b")
B, k = 2, 4
layout = layout_for(target.config, B, page_size=16, max_model_len=4096, num_speculative_tokens=k,
                    assistant_window=assistant.config.text.sliding_window)
with jax.default_device(device):
    spec = CompiledSteps(target, layout, target.dtype, "auto", drafter=AssistantDrafter(assistant), k=k,
                         num_slots=B, structured=True)
    plain = CompiledSteps(target, layout, target.dtype, "auto", max_batch=B)
    progs = {"decode": lambda: plain.decode_program(B, False),
             "decode_processed": lambda: plain.decode_program(B, True, True),
             "speculative": lambda: spec.speculative_program(B, False),
             "speculative_processed": lambda: spec.speculative_program(B, True, True),
             "draft": lambda: spec.draft_program(B), "verify": lambda: spec.verify_program(B),
             "accept": lambda: spec.accept_program(B)}
    for name, prog in progs.items():
        text = lower_program(prog()).compile().as_text()
        s = summarize(text)
        top = dict(list(s["by_kind"].items())[:6])
        print(f"{name:22} kernels {s['kernels']:5d}  host syncs {s['host_syncs']}  {json.dumps(top)}", flush=True)
