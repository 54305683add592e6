"""Probe: the feed-forward block kernel (kernels/feed_forward.py) at the E2B assistant's shapes, per tiling, against
XLA's kernels for the same math. NOT a test.

    python lab/probes/probe_feed_forward.py [--rows 2 16] [--layers 16] [--tilings 32,8,1 32,8,4 ...]

A program of `--layers` layers (their own weights and attention outputs, chained through the residual) runs what
follows a sliding layer's attention: o_proj (1024 -> 256), the block, and the layer's last residual add
(`add_normed` summing the partials, with the next norm). `xla` is the model's plain path (the reference: XLA fuses
and runs its own kernels); `sS_wW_oO` the kernel with S programs and W warps after o_proj split in O parts (1: one
matmul) whose partials the kernel adds. Printed per variant: kernels per layer (optimized HLO), pipelined device
time per layer (median), the kernels' own microseconds per layer from a trace, and the largest difference from `xla`.
Writes $OUT/probe_feed_forward.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import pipelined_time, write_json  # noqa: E402
from benchmarks.kernel_count import summarize  # noqa: E402
from benchmarks.kernel_profile import profile_calls  # noqa: E402
from gemma4_mtp_jax.kernels import feed_forward as ff  # noqa: E402
from gemma4_mtp_jax.kernels import split_k  # noqa: E402

EPS = 1e-6
H, I, Q = 256, 2048, 1024  # the E2B / E4B assistants' hidden and MLP widths, sliding heads x head dim


def program(splits: int, warps: int, o_splits: int, L: int):
    """jit(fn)(layers, x): L layers; layers[i] = (attention output, o_proj, norms [4, H], gate, up, down); splits
    0 = the plain path."""

    def fn(layers, x):
        n = None
        for attn, wo, norms, gate, up, down in layers:
            o = split_k.split_matmul(attn, wo, o_splits if splits else 1)
            if splits:
                h, f = ff.feed_forward_block(o, x, norms[0], norms[1], gate, up, down, eps=EPS, splits=splits,
                                             num_warps=warps)
            else:
                h, f = ff.feed_forward_block_reference(o, x, norms[0], norms[1], gate, up, down, eps=EPS, splits=1)
            x, n = split_k.add_normed(f, h, norms[2], eps=EPS, next_weight=norms[3])
        return x, n

    return jax.jit(fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 16])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tilings", nargs="+", default=["16,8,1", "32,8,1", "64,4,1", "32,8,4", "32,8,16", "64,4,4"],
                    help="S,W,O: the kernel's programs, its warps, o_proj's parts")
    args = ap.parse_args()
    L = args.layers
    key = jax.random.PRNGKey(0)
    rnd = lambda i, shape, scale=1.0: (jax.random.normal(jax.random.fold_in(key, i), shape) * scale  # noqa: E731
                                       ).astype(jnp.bfloat16)
    results = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "layers": L, "rows": {}}
    for M in args.rows:
        layers = [(rnd(10 * i + M * 1000, (M, Q)), rnd(10 * i + 5, (H, Q), Q**-0.5), 1.0 + 0.1 * rnd(10 * i + 1, (4, H)),
                   rnd(10 * i + 2, (I, H), H**-0.5), rnd(10 * i + 3, (I, H), H**-0.5), rnd(10 * i + 4, (H, I), I**-0.5))
                  for i in range(L)]
        x = rnd(7 + M, (M, H))
        ref = None
        for splits, warps, o_splits in [(0, 0, 1)] + [tuple(map(int, t.split(","))) for t in args.tilings]:
            name = "xla" if splits == 0 else f"s{splits}_w{warps}_o{o_splits}"
            f = program(splits, warps, o_splits, L)
            try:
                compiled = f.lower(layers, x).compile()
            except Exception as e:  # a tiling Triton cannot build: say so, go on
                print(f"M={M:3d} {name:11s} failed to compile: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            info = summarize(compiled.as_text())
            out = jax.block_until_ready(f(layers, x))
            if ref is None:
                ref, diff = out, 0.0
            else:
                diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                           for a, b in zip(out, ref))
            piped = pipelined_time(lambda: f(layers, x), n=50)
            prof = profile_calls(lambda: f(layers, x), calls=5)
            row = dict(kernels_per_layer=info["kernels"] / L, pipelined_us_per_layer=piped / L * 1e6,
                       busy_us_per_layer=prof["busy_us"] / L, max_abs_diff=diff,
                       top=[(n, c, us) for n, c, us in prof["top"][:6]])
            results["rows"].setdefault(str(M), {})[name] = row
            print(f"M={M:3d} {name:11s} kernels/layer {row['kernels_per_layer']:5.2f}  pipelined "
                  f"{row['pipelined_us_per_layer']:6.2f} us/layer  busy {row['busy_us_per_layer']:6.2f}  "
                  f"|diff| {diff:.3g}  " + "  ".join(f"{n[:28]} {us / L:.2f}" for n, _, us in row["top"][:3]),
                  flush=True)
    if os.environ.get("OUT"):
        write_json("probe_feed_forward.json", results)


if __name__ == "__main__":
    main()
