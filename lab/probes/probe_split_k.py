"""Probe: the split-K matmuls written out (kernels/split_k.py) against XLA's own, at E2B's decode shapes. NOT a test.

    python lab/probes/probe_split_k.py [--rows 2 10 16 80] [--layers 35]

For each of the three projections a decoder layer follows with a sum-consuming kernel (o_proj -> post-attention
norm + residual + pre-feedforward norm; down_proj -> post-feedforward norm + residual; per_layer_input_gate ->
GELU x the layer's per-layer input), a program of `--layers` such layers (their own weights, chained through the
residual) is compiled three ways: XLA's plan (`xla`: one einsum, XLA splits K itself and adds a reduction kernel),
and the split written out with S parts (`sS`: one batched einsum, then the kernel that sums). Printed per variant:
kernels per layer (from the optimized HLO, by kind), device time per layer (synchronised and pipelined, median),
and the largest difference from the `xla` variant's outputs. Writes $OUT/probe_split_k.json when $OUT is set.

Each layer has its own input: run 81 gave every layer the same one, and XLA's dot merger then merged the 35
matmuls into one, so that run's GEMM timings measured something else (lab/NOTEBOOK.md, eighteenth session).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import median_time, pipelined_time, write_json  # noqa: E402
from benchmarks.kernel_count import summarize  # noqa: E402
from gemma4_mtp_jax.kernels import split_k  # noqa: E402

EPS = 1e-6
H, Q, F, P = 1536, 2048, 6144, 256  # E2B: hidden, q heads x head dim, MLP width, per-layer input width
SITES = {"o_proj": (Q, H), "down_proj": (F, H), "per_layer_input_gate": (H, P)}  # (K, N)


def site_program(site: str, splits: int, L: int):
    """jit(fn)(ws, xs, residual, norms, multiplier) running L layers of `site` (layer i: weights ws[i], input
    xs[i]); splits 0 = XLA's plan."""

    def layer(w, x, residual, norms, multiplier, i):
        y = split_k.split_matmul(x, w, max(splits, 1))
        if site == "o_proj":
            h, n = split_k.add_normed(y, residual, norms[0], eps=EPS, next_weight=norms[1])
            return h, n
        if site == "down_proj":
            h, _ = split_k.add_normed(y, residual, norms[0], eps=EPS)
            return h, h
        g = split_k.gelu_gate(y, multiplier, jnp.int32(i))
        return residual + jnp.pad(g, ((0, 0), (0, H - P))), g

    def fn(ws, xs, residual, norms, multiplier):
        outs = []
        for i, (w, x) in enumerate(zip(ws, xs)):
            residual, o = layer(w, x, residual, norms, multiplier, i)
            outs.append(o)
        return residual, outs[-1]

    return jax.jit(fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 10, 16, 80])
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--splits", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--sites", nargs="+", default=list(SITES))
    args = ap.parse_args()
    L = args.layers
    key = jax.random.PRNGKey(0)
    results = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "layers": L, "rows": {}}
    for site in args.sites:
        K, N = SITES[site]
        ws = [(jax.random.normal(jax.random.fold_in(key, i), (N, K), jnp.float32) * K**-0.5).astype(jnp.bfloat16)
              for i in range(L)]
        norms = jax.random.uniform(jax.random.fold_in(key, 99), (2, H), jnp.float32, 0.5, 1.5).astype(jnp.bfloat16)
        for M in args.rows:
            xs = [jax.random.normal(jax.random.fold_in(key, 1000 * M + i), (M, K), jnp.float32).astype(jnp.bfloat16)
                  for i in range(L)]
            residual = jax.random.normal(jax.random.fold_in(key, 200 + M), (M, H), jnp.float32).astype(jnp.bfloat16)
            multiplier = jax.random.normal(jax.random.fold_in(key, 300 + M), (L, M, P), jnp.float32)
            multiplier = multiplier.astype(jnp.bfloat16)
            inputs = (ws, xs, residual, norms, multiplier)
            ref = None
            plan = split_k.plan_splits(M, K, N)
            for splits in [0] + args.splits:
                name = "xla" if splits == 0 else f"s{splits}"
                t0 = time.perf_counter()
                f = site_program(site, splits, L)
                compiled = f.lower(*inputs).compile()
                compile_s = time.perf_counter() - t0
                info = summarize(compiled.as_text())
                out = jax.block_until_ready(f(*inputs))
                if ref is None:
                    ref, diff = out, 0.0
                else:
                    diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                               for a, b in zip(out, ref))
                sync = median_time(f, inputs, repeats=20)
                piped = pipelined_time(lambda: f(*inputs), n=20)
                row = dict(kernels=info["kernels"], per_layer=info["kernels"] / L, by_kind=info["by_kind"],
                           sync_us_per_layer=sync / L * 1e6, pipelined_us_per_layer=piped / L * 1e6,
                           max_abs_diff=diff, compile_s=compile_s)
                results["rows"].setdefault(site, {}).setdefault(str(M), {})[name] = row
                print(f"{site:22s} M={M:3d} {name:4s}{' (plan)' if splits == plan else '       '} "
                      f"kernels/layer {row['per_layer']:5.2f}  sync {row['sync_us_per_layer']:7.2f} us/layer  "
                      f"pipelined {row['pipelined_us_per_layer']:7.2f}  |diff| {diff:.3g}  "
                      f"kinds {info['by_kind']}", flush=True)
    if os.environ.get("OUT"):
        write_json("probe_split_k", results)


if __name__ == "__main__":
    main()
