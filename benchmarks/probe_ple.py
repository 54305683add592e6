"""How a decode step hands each layer its per-layer input (E2B / E4B), measured on the GPU.

`model.target.layer_major` turns the per-layer inputs [B, T, L, P] into one slice per layer. In run 44's optimized
HLO of E2B's decode step each of the 35 slices is copied out by a `wrapped_slice` kernel of its own, one kernel per
layer beside the layer's ~20. This probe compiles the decode program with each variant below (the function is
swapped for the probe only), and reports kernels per step (kernel_count.py's count of the optimized HLO) and the
pipelined step time at random weights:

- stacked: the model's choice, one layer-major array behind an optimization barrier;
- sliced: the barrier around a tuple of the L slices (XLA may then compute them in one multi-output fusion);
- free: no barrier (XLA may fuse each slice into its consumer, or re-compute the normed projection per layer).

    python benchmarks/probe_ple.py --model e2b --batch 2 16      # on the GPU
    python benchmarks/probe_ple.py --smoke                         # tiny shapes, CPU
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import SMOKE, random_pages  # noqa: E402
from benchmarks.common import (TARGETS, bench_state, environment, fresh_rows, layout_for, pipelined_time,  # noqa: E402
                               random_params, write_json)
from benchmarks.kernel_count import summarize  # noqa: E402
from gemma4_mtp_jax.api import Target, abstract_target_params  # noqa: E402
from gemma4_mtp_jax.config import parse_target_config  # noqa: E402
from gemma4_mtp_jax.model import target as target_module  # noqa: E402
from gemma4_mtp_jax.sampling import SamplingBatch  # noqa: E402
from gemma4_mtp_jax.step import CompiledSteps  # noqa: E402

VARIANTS = {
    "stacked": target_module.layer_major,
    "sliced": lambda ple: jax.lax.optimization_barrier(tuple(ple[..., i, :] for i in range(ple.shape[-2]))),
    "free": lambda ple: jnp.moveaxis(ple, -2, 0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="e2b", choices=["e2b", "e4b"])
    ap.add_argument("--batch", nargs="+", type=int, default=[2, 16])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, float32 (runs on CPU)")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    cfg = parse_target_config(SMOKE if args.smoke else TARGETS[args.model])
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    context = 48 if args.smoke else args.context
    target = Target(cfg, random_params(abstract_target_params(cfg, dtype)), dtype, None, {})
    layout = layout_for(cfg, max(args.batch), page_size=16, max_model_len=context + 16)
    rng = np.random.default_rng(0)
    rows = []
    for variant in args.variants:
        target_module.layer_major = VARIANTS[variant]
        try:
            steps = CompiledSteps(target, layout, dtype)
            state = bench_state(steps, random_pages(cfg, layout, dtype))
            for B in args.batch:
                fn = steps.compile_decode(B)
                tables = {g: rng.permutation(np.arange(1, layout.pages(g)))[: B * w].reshape(B, w).astype(np.int32)
                          for g, w in layout.pages_per_seq}
                step_rows = fresh_rows(rng.integers(0, cfg.vocab_size, B), np.full(B, context - 1), steps.num_slots)
                sampling = SamplingBatch.from_params([], B)
                holder = [state]

                def one_step():
                    holder[0], out = fn(steps.program_params, holder[0], step_rows, tables, sampling)
                    return out

                for _ in range(3):
                    one_step()
                t = pipelined_time(one_step, args.repeats)
                state = holder[0]
                kernels = summarize(steps._lower_decode(B, False).compile().as_text())
                row = {"variant": variant, "batch": B, "kernels": kernels["kernels"], "by_kind": kernels["by_kind"],
                       "pipelined_ms": t * 1e3}
                rows.append(row)
                print(row, flush=True)
            del steps, state
        finally:
            target_module.layer_major = VARIANTS["stacked"]
    write_json("probe_ple.json", {"env": env, "model": "smoke" if args.smoke else args.model, "rows": rows})
    print(f"\n{'variant':8} {'B':>3} {'kernels':>8} {'pipelined ms':>13}")
    for r in rows:
        print(f"{r['variant']:8} {r['batch']:3d} {r['kernels']:8d} {r['pipelined_ms']:13.3f}")


if __name__ == "__main__":
    main()
