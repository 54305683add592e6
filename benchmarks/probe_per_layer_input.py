"""Probe: the per-layer-input kernel (kernels/per_layer_input.py) at E2B's (or E4B's) shapes, per tiling, against
XLA's kernels for the same math. NOT a test.

    python benchmarks/probe_per_layer_input.py [--model e2b|e4b] [--rows 2 16 80] [--layers 16]
        [--tilings 32,512,4 64,512,8 ...] [--profile] [--time-limit 45]

A program of `--layers` layers (each its own gate, projection, norm and layer scalar, one stack of per-layer inputs
[L, rows, P] that every layer indexes) chained through the residual runs a layer's per-layer-input path and its last
residual add: `xla` is the model's path without the kernel (the gate split-K as `splits_for` plans it, split_k's
`gelu_gate`, the projection split-K, `add_normed` summing its partials, with the next norm); `cC_bB_wW` the kernel
with chunks of C columns of P (S = P / C partials), column blocks of B and W warps, then `add_normed`. Printed per
variant: kernels per layer (optimized HLO), pipelined device time per layer (median), with --profile the kernels'
own microseconds per layer from a trace, and the largest difference from `xla` (bf16 outputs). Variants start until
--time-limit seconds have passed (the whole probe stays under a minute on an H200). Writes
$OUT/probe_per_layer_input.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import pipelined_time, write_json  # noqa: E402
from benchmarks.kernel_count import summarize  # noqa: E402
from benchmarks.kernel_profile import profile_calls  # noqa: E402
from gemma4_mtp_jax.kernels import per_layer_input as pli  # noqa: E402
from gemma4_mtp_jax.kernels import split_k  # noqa: E402

EPS = 1e-6
P = 256
MODELS = {"e2b": (1536, 35), "e4b": (2560, 42)}  # hidden width, layers in the per-layer-input stack


def program(tiling: tuple[int, int, int] | None, M: int, H: int):
    """jit(fn)(layers, stack, x): layers[i] = (gate [P, H], projection [H, P], norms [2, H], layer scalar [1]);
    tiling None is the model's path without the kernel."""
    gate_splits, proj_splits = split_k.plan_splits(M, H, P), split_k.plan_splits(M, P, H)

    def fn(layers, stack, x):
        n = None
        for i, (gate_w, proj_w, norms, scale) in enumerate(layers):
            index = jnp.int32(i)
            if tiling is None:
                g = split_k.gelu_gate(split_k.split_matmul(x, gate_w, gate_splits), stack, index)
                y = split_k.split_matmul(g, proj_w, proj_splits)
            else:
                chunk, block_h, warps = tiling
                y = pli.per_layer_input(x, gate_w, stack, index, proj_w, chunk=chunk, block_h=block_h,
                                        num_warps=warps)
            x, n = split_k.add_normed(y, x, norms[0], eps=EPS, scale=scale, next_weight=norms[1])
        return x, n

    return jax.jit(fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="e2b")
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 16, 80])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tilings", nargs="+",
                    default=["32,512,4", "16,512,4", "64,512,4", "32,256,4", "64,256,4", "16,256,4", "32,512,8",
                             "64,512,8"],
                    help="C,B,W: columns of P per program, columns of H per program, warps")
    ap.add_argument("--profile", action="store_true", help="also trace each variant's kernels (a few s each)")
    ap.add_argument("--time-limit", type=float, default=45.0, help="start no variant after this many seconds")
    args = ap.parse_args()
    H, L_stack = MODELS[args.model]
    L = args.layers
    t_start = time.perf_counter()
    key = jax.random.PRNGKey(0)
    rnd = lambda i, shape, scale=1.0: (jax.random.normal(jax.random.fold_in(key, i), shape) * scale  # noqa: E731
                                       ).astype(jnp.bfloat16)
    layers = [(rnd(10 * i, (P, H), H**-0.5), rnd(10 * i + 1, (H, P), P**-0.5), 1.0 + 0.1 * rnd(10 * i + 2, (2, H)),
               jnp.asarray([0.9], jnp.float32)) for i in range(L)]
    variants = [None] + [tuple(map(int, t.split(","))) for t in args.tilings]
    results = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "model": args.model, "H": H,
               "P": P, "layers": L, "rows": {}}
    for M in args.rows:
        stack, x = rnd(1000 + M, (L_stack, M, P)), rnd(2000 + M, (M, H))
        ref = None
        for tiling in variants:
            name = "xla" if tiling is None else "c{}_b{}_w{}".format(*tiling)
            if time.perf_counter() - t_start > args.time_limit:
                print(f"M={M:3d} {name:13s} skipped: past --time-limit {args.time_limit:.0f} s", flush=True)
                continue
            f = program(tiling, M, H)
            try:
                compiled = f.lower(layers, stack, x).compile()
            except Exception as e:  # a tiling Triton cannot build: say so, go on
                print(f"M={M:3d} {name:13s} failed to compile: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            info = summarize(compiled.as_text())
            out = jax.block_until_ready(f(layers, stack, x))
            if ref is None:
                ref, diff = out, 0.0
            else:
                diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                           for a, b in zip(out, ref))
            piped = pipelined_time(lambda: f(layers, stack, x), n=50)
            row = dict(kernels_per_layer=info["kernels"] / L, pipelined_us_per_layer=piped / L * 1e6,
                       max_abs_diff=diff)
            line = (f"M={M:3d} {name:13s} kernels/layer {row['kernels_per_layer']:5.2f}  pipelined "
                    f"{row['pipelined_us_per_layer']:6.2f} us/layer  |diff| {diff:.3g}")
            if args.profile:
                prof = profile_calls(lambda: f(layers, stack, x), calls=5)
                row.update(busy_us_per_layer=prof["busy_us"] / L, top=[(n, c, us) for n, c, us in prof["top"][:6]])
                line += f"  busy {row['busy_us_per_layer']:6.2f}  " + "  ".join(
                    f"{n[:28]} {us / L:.2f}" for n, _, us in row["top"][:3])
            results["rows"].setdefault(str(M), {})[name] = row
            print(line, flush=True)
    results["seconds"] = time.perf_counter() - t_start
    print(f"probe_per_layer_input: {results['seconds']:.1f} s", flush=True)
    if os.environ.get("OUT"):
        write_json("probe_per_layer_input.json", results)


if __name__ == "__main__":
    main()
