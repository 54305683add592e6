"""Ways to cut the kernels of a decode step, each measured against the model as it is, in one process (GPU).

Run 44's optimized HLO of E2B's decode step has ~21 kernels per layer (benchmarks/RESULTS.md). Each variant below
changes one thing; the probe compiles the decode program with it and reports kernels per step (kernel_count.py's
count of the optimized HLO of the very executable it times) and the pipelined step time at random weights:

- `model`: the code as it is.
- GEMM set-up, as per-program XLA options: `no_split_k` (split K forced to 1, so o_proj, down_proj
  and per_layer_input_gate lose their separate reduction kernel) and `cublas` (no Triton GEMMs at all).
- The attention prologue (what happens between the QKV matmul and the attention kernel: 4 norm / RoPE fusions and
  2 scatters per layer that owns K/V): `joint_norm` norms q, k and v heads as one [nH + 2 nKV, D] array (one
  reduction instead of three, the scale vectors stacked; v's is ones) and ropes q and k as one array;
  `joint_norm_rev` also writes rotate_half as a reversal of the two halves instead of a concatenation of slices,
  which XLA may fuse into the norm. Both compute what the model computes, element for element.
- The per-layer inputs (E2B / E4B): `ple_sliced` (the optimization barrier around a tuple of the L slices) and
  `ple_free` (no barrier); the model materializes one layer-major array (`model.target.layer_major`), whose L
  slices run 35 `wrapped_slice` kernels at E2B.

    python benchmarks/probe_decode_variants.py --model e2b --batch 2 16      # on the GPU
    python benchmarks/probe_decode_variants.py --smoke                         # tiny shapes, CPU

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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import SMOKE, random_pages  # noqa: E402
from benchmarks.common import (TARGETS, environment, fresh_inputs, layout_for, pipelined_time,  # noqa: E402
                               random_params, write_json)
from benchmarks.kernel_count import summarize  # noqa: E402
from gemma4_mtp_jax.api import Target, abstract_target_params  # noqa: E402
from gemma4_mtp_jax.config import SLIDING, parse_target_config  # noqa: E402
from gemma4_mtp_jax.model import decoder as decoder_module  # noqa: E402
from gemma4_mtp_jax.model import target as target_module  # noqa: E402
from gemma4_mtp_jax.model.layers import Linear, Weight, apply_rope, rms_normalize, rope_inv_freq  # noqa: E402
from gemma4_mtp_jax.step import CompiledSteps, compiler_options  # noqa: E402


def rope_by_reversal(x, positions, inv_freq):
    """apply_rope with rotate_half(x) = [-x2, x1] written as the reversal of x's two halves, times [-1, 1]."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq
    ang = jnp.concatenate([ang, ang], axis=-1)[..., None, :]
    cos, sin = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
    halves = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    rotated = (halves[..., ::-1, :] * jnp.asarray([[-1], [1]], x.dtype)).reshape(x.shape)
    return x * cos + rotated * sin


class JointNormAttention(decoder_module.Attention):
    """decoder.Attention with q, k and v normed as one array of heads (same parameters, same values)."""

    rope: str = "concat"

    @nn.compact
    def __call__(self, x, positions, kv):
        cfg, lc = self.cfg, self.cfg.layers[self.layer]
        B, T, _ = x.shape
        D, nH, nKV, pd = lc.head_dim, cfg.num_heads, lc.num_kv_heads, self.param_dtype
        inv_freq = rope_inv_freq(cfg.rope[lc.layer_type], D)
        rope = apply_rope if self.rope == "concat" else rope_by_reversal
        q = Linear(nH * D, pd, name="q_proj")(x)
        scales = [jnp.broadcast_to(Weight((D,), pd, name="q_norm")().astype(jnp.float32), (nH, D))]
        parts = [q]
        if lc.kv_mode != "reuse":
            k_raw = Linear(nKV * D, pd, name="k_proj")(x)
            parts += [k_raw, k_raw if lc.k_eq_v else Linear(nKV * D, pd, name="v_proj")(x)]
            scales += [jnp.broadcast_to(Weight((D,), pd, name="k_norm")().astype(jnp.float32), (nKV, D)),
                       jnp.ones((nKV, D), jnp.float32)]
        heads = jnp.concatenate(parts, axis=-1).reshape(B, T, -1, D)
        heads = (rms_normalize(heads, cfg.rms_norm_eps) * jnp.concatenate(scales)).astype(x.dtype)
        roped = rope(heads[:, :, : nH + (nKV if len(parts) > 1 else 0)], positions, inv_freq)
        q = roped[:, :, :nH]
        if len(parts) > 1:
            kv = kv.store(self.layer, roped[:, :, nH:], heads[:, :, nH + nKV:])
        window = cfg.sliding_window if lc.layer_type == SLIDING else None
        out = kv.attend(lc.kv_source, q, positions, window)
        return Linear(cfg.hidden_size, pd, name="o_proj")(out.reshape(B, T, nH * D)), kv


@contextlib.contextmanager
def swapped(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _attention(rope: str):
    return lambda *a, **kw: JointNormAttention(*a, rope=rope, **kw)


# variant -> (XLA options added to the programs' own, model swap as (module, attribute, value) or None)
VARIANTS = {
    "model": ({}, None),
    "joint_norm_rev": ({}, (decoder_module, "Attention", _attention("reversal"))),
    "joint_norm": ({}, (decoder_module, "Attention", _attention("concat"))),
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
