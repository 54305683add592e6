"""Ways to cut the kernels of a decode step, each measured against the model as it is, in one process (GPU).

Run 44's optimized HLO of E2B's decode step has ~21 kernels per layer (lab/NOTEBOOK.md). Each variant below
changes one thing; the probe compiles the decode program with it and reports kernels per step (kernel_count.py's
count of the optimized HLO of the very executable it times) and the pipelined step time at random weights:

- `model`: the code as it is.
- GEMM set-up, as per-program XLA options: `no_split_k` (split K forced to 1, so o_proj, down_proj
  and per_layer_input_gate lose their separate reduction kernel) and `cublas` (no Triton GEMMs at all).
- (The attention prologue's XLA variants, q, k and v normed as one array and rotate-half as a reversal, saved no
  kernel in runs 45-46; `kernels/attention_inputs.py` now does the whole prologue in one kernel.)
- The per-layer inputs (E2B / E4B): `ple_sliced` (the optimization barrier around a tuple of the L slices) and
  `ple_free` (no barrier); the model materializes one layer-major array (`model.target.layer_major`), whose L
  slices run 35 `wrapped_slice` kernels at E2B.

    python lab/probes/probe_decode_variants.py --model e2b --batch 2 16      # on the GPU
    python lab/probes/probe_decode_variants.py --smoke                         # tiny shapes, CPU

Every program is compiled first (none after --deadline seconds), then timed round-robin, --rounds times (the median
is reported), so that drifts of the GPU's clock and temperature fall on every variant alike: in run 45, which timed
each variant once in turn, two variants that compile to the same kernels differed by 8-11 %. All programs pass one
device state along. JSON to $OUT/probe_decode_variants.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench_decode import SMOKE, random_pages  # noqa: E402
from benchmarks.common import (TARGETS, environment, fresh_inputs, layout_for, pipelined_time,  # noqa: E402
                               random_params, write_json)
from benchmarks.kernel_count import summarize  # noqa: E402
from gemma4_mtp_jax.api import Target, abstract_target_params  # noqa: E402
from gemma4_mtp_jax.config import parse_target_config  # noqa: E402
from gemma4_mtp_jax.model import target as target_module  # noqa: E402
from gemma4_mtp_jax.step import CompiledSteps, compiler_options  # noqa: E402


@contextlib.contextmanager
def swapped(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


# variant -> (XLA options added to the programs' own, model swap as (module, attribute, value) or None)
VARIANTS = {
    "model": ({}, None),
    "no_split_k": ({"xla_gpu_experimental_force_split_k": 1}, None),
    "cublas": ({"xla_gpu_enable_triton_gemm": False}, None),
    "ple_sliced": ({}, (target_module, "layer_major", lambda ple: jax.lax.optimization_barrier(
        tuple(ple[..., i, :] for i in range(ple.shape[-2]))))),
    "ple_free": ({}, (target_module, "layer_major", lambda ple: jnp.moveaxis(ple, -2, 0))),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="e2b", choices=["e2b", "e4b", "31b"])
    ap.add_argument("--batch", nargs="+", type=int, default=[2, 16])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20, help="calls per pipelined chain")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds over all programs (median reported)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which no variant is compiled")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, float32 (runs on CPU)")
    args = ap.parse_args()
    start = time.perf_counter()
    env = environment()
    print(env, flush=True)
    cfg = parse_target_config(SMOKE if args.smoke else TARGETS[args.model])
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    context = 48 if args.smoke else args.context
    target = Target(cfg, random_params(abstract_target_params(cfg, dtype)), dtype, None, {})
    # Each batch size decodes its own sequences in its own pages, so that no program's writes reach into the
    # context another program reads: the tokens of one batch size are then comparable across variants.
    layout = layout_for(cfg, sum(args.batch), page_size=16, max_model_len=context + 16)
    first_sequence = {B: sum(args.batch[:i]) for i, B in enumerate(args.batch)}
    rows, programs = [], []
    state = [None]  # one device state, passed through every variant's program in turn
    for variant in args.variants:
        if time.perf_counter() - start > args.deadline:
            print(f"deadline: {variant} and later variants not compiled", flush=True)
            break
        options, swap = VARIANTS[variant]
        with swapped(*swap) if swap else contextlib.nullcontext():
            steps = CompiledSteps(target, layout, dtype, max_batch=max(args.batch))
            if state[0] is None:
                state[0] = steps.init_state(random_pages(cfg, layout, dtype))
            for B in args.batch:
                t0 = time.perf_counter()
                try:
                    fn = steps._lower_decode(B, False).compile(compiler_options={**compiler_options(), **options})
                except Exception as e:  # an XLA that does not know an option: say so, go on
                    rows.append({"variant": variant, "batch": B, "error": str(e).splitlines()[0][:300]})
                    print(rows[-1], flush=True)
                    break
                kernels = summarize(fn.as_text())
                rows.append({"variant": variant, "batch": B, "kernels": kernels["kernels"],
                             "by_kind": kernels["by_kind"], "compile_s": time.perf_counter() - t0, "times_ms": []})
                programs.append((rows[-1], functools.partial(fn, steps.program_params)))
                print({k: v for k, v in rows[-1].items() if k not in ("by_kind", "times_ms")}, flush=True)

    def step_of(row, call, B):
        rng = np.random.default_rng(B)  # every variant decodes the same inputs
        tables = {g: 1 + first_sequence[B] * w + rng.permutation(B * w).reshape(B, w).astype(np.int32)
                  for g, w in layout.pages_per_seq}
        inputs = fresh_inputs(rng.integers(0, cfg.vocab_size, B), np.full(B, context - 1), tables, 1)

        def one_step():
            state[0], out = call(state[0], inputs)
            return out
        return one_step

    # Timed round-robin: each round times every program once, so drifts of clock and temperature fall on all alike.
    calls = [(row, step_of(row, call, row["batch"])) for row, call in programs]
    for row, one_step in calls:
        for _ in range(3):
            one_step()
        row["tokens"] = np.asarray(one_step())[:, 0].tolist()  # equal across variants, or a variant is wrong
    for _ in range(args.rounds):
        for row, one_step in calls:
            row["times_ms"].append(pipelined_time(one_step, args.repeats) * 1e3)
    for row, _ in calls:
        row["pipelined_ms"] = statistics.median(row["times_ms"])
    write_json("probe_decode_variants.json", {"env": env, "model": "smoke" if args.smoke else args.model,
                                              "context": context, "rounds": args.rounds, "rows": rows})
    print(f"\n{'variant':15} {'B':>3} {'kernels':>8} {'pipelined ms':>13} {'min':>7} {'max':>7} {'compile s':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:15} {r['batch']:3d} error: {r['error'][:80]}")
        else:
            print(f"{r['variant']:15} {r['batch']:3d} {r['kernels']:8d} {r['pipelined_ms']:13.3f} "
                  f"{min(r['times_ms']):7.3f} {max(r['times_ms']):7.3f} {r['compile_s']:10.1f}")


if __name__ == "__main__":
    main()
