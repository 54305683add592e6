"""Kernels of 31B's decode (B = 2), verify forward (B = 2, k = 4: 10 rows) and fused round, bf16 against fp8
weights, compiled for the H200 on the CPU (compile-only; BUILD.md's /tmp/gpuvenv): which path do the fp8 matmuls
take at 2 and at 10 rows? (The fp8 verify costs 1.14x its decode on an H100, bf16's 1.05x.)

    JAX_PLATFORMS=cpu /tmp/gpuvenv/bin/python lab/probes/fp8_verify_kernels.py [31b]
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import jax  # noqa: E402

from benchmarks.common import compile_only_device, layout_for, lower_program  # noqa: E402
from benchmarks.kernel_count import load_model, summarize  # noqa: E402
from gemma4_mtp_jax.programs.compiled import CompiledSteps  # noqa: E402
from gemma4_mtp_jax.steps.speculative import AssistantDrafter  # noqa: E402
from gemma4_mtp_jax.weights.quantize import quantize_abstract  # noqa: E402

device = compile_only_device("h200")
target, assistant = load_model(sys.argv[1] if len(sys.argv) > 1 else "31b")
B, k = 2, 4
layout = layout_for(target.config, B, page_size=16, max_model_len=4096, num_speculative_tokens=k,
                    assistant_window=assistant.config.text.sliding_window)
def gemm_configs(text: str) -> dict:
    """How many GEMM fusions take each Triton tiling (output tile sizes, stages, warps), from their
    block_level_fusion_config (the untuned choice: compile-only means no autotuning)."""
    import collections
    import re

    out = collections.Counter()
    for line in text.splitlines():
        m = re.search(r'"block_level_fusion_config":\{"num_warps":"(\d+)","output_tiles":\[\{"sizes":\[([^\]]*)\]\}\]'
                      r'.*?"num_stages":(\d+)', line)
        if m and "gemm_fusion" in line:
            out[f"tile[{m.group(2).replace(chr(34), '')}] warps {m.group(1)} stages {m.group(3)}"] += 1
    return dict(out.most_common(8))


for fmt in ("bf16", "fp8"):
    t = target if fmt == "bf16" else dataclasses.replace(target, params=quantize_abstract(target.params))
    with jax.default_device(device):
        spec = CompiledSteps(t, layout, t.dtype, "auto", drafter=AssistantDrafter(assistant), k=k, num_slots=B,
                             structured=True)
        plain = CompiledSteps(t, layout, t.dtype, "auto", max_batch=B)
        for name, prog in {"decode": lambda: plain.decode_program(B, False),
                           "verify": lambda: spec.verify_program(B)}.items():
            text = lower_program(prog()).compile().as_text()
            s = summarize(text)
            print(f"{fmt} {name:7} kernels {s['kernels']:5d} syncs {s['host_syncs']} {s['by_kind']}", flush=True)
            print(f"{fmt} {name:7} tilings {gemm_configs(text)}", flush=True)
