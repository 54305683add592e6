"""Control flow (stablehlo.if / case / while) in the lowered programs of the masked round at E2B shapes, beside the
decode and speculative programs: XLA's GPU runtime copies a conditional's predicate to the host, which holds the
dispatching thread until the device gets there. Does the verify forward carry one the decode does not? Lowering
only (no compile, no device): runs on the CPU.

    JAX_PLATFORMS=cpu python lab/probes/masked_syncs.py [e2b|demo|...]
"""
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.common import layout_for, lower_program  # noqa: E402
from benchmarks.kernel_count import load_model  # noqa: E402
from gemma4_mtp_jax.programs.compiled import CompiledSteps  # noqa: E402
from gemma4_mtp_jax.steps.speculative import AssistantDrafter  # noqa: E402

target, assistant = load_model(sys.argv[1] if len(sys.argv) > 1 else "e2b")
B, k = 2, 4
layout = layout_for(target.config, B, page_size=16, max_model_len=4096, num_speculative_tokens=k,
                    assistant_window=assistant.config.text.sliding_window)
spec = CompiledSteps(target, layout, target.dtype, "auto", drafter=AssistantDrafter(assistant), k=k, num_slots=B,
                     structured=True)
plain = CompiledSteps(target, layout, target.dtype, "auto", max_batch=B)
progs = {"decode": lambda: plain.decode_program(B, False),
         "decode_processed": lambda: plain.decode_program(B, True, True),
         "speculative": lambda: spec.speculative_program(B, False), "draft": lambda: spec.draft_program(B),
         "verify": lambda: spec.verify_program(B), "accept": lambda: spec.accept_program(B)}
for name, prog in progs.items():
    text = lower_program(prog()).as_text()
    ops = collections.Counter(re.findall(r"stablehlo\.(if|case|while)\b", text))
    calls = collections.Counter(re.findall(r"custom_call @(\w+)", text))
    print(f"{name:17} control flow {dict(ops)}  custom calls {dict(calls)}", flush=True)
