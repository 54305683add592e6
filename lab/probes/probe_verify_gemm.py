"""Probe: how fast each E2B weight matmul streams its weights at a decode batch's rows and at a verify step's. NOT a test.

    python lab/probes/probe_verify_gemm.py [--rows 16 80 128] [--layers 20]
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python lab/probes/probe_verify_gemm.py   # XLA's cuBLAS path

At E2B, B = 16, a verify step's 80 rows made every weight matmul 30-45 % slower than the decode's 16 rows
(lab/NOTEBOOK.md, run 91: the wide layers' gate|up 22.4 -> 32.9 us), though both are far below the
arithmetic bound. For each projection of a decoder layer (its name, contraction K, columns N) and each row count M,
one program runs `--layers` matmuls, each with its own weights and input (so XLA's dot merger cannot fuse them and
the L2 cache cannot serve one from another), compiled with the process's XLA_FLAGS (XLA's GEMM autotuner on, as in
serving). A trace (kernel_profile.py) gives each matmul kernel's own duration; printed per (projection, M): the
kernels' names, microseconds per matmul and the weight bytes / time. Writes $OUT/probe_verify_gemm.json when $OUT
is set. `--smoke`: tiny shapes, wall time only (any backend).
"""

from __future__ import annotations

import argparse
import statistics
import zlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import TARGETS, environment, median_time, write_json  # noqa: E402
from benchmarks.kernel_profile import kind_of, profile_calls  # noqa: E402
from gemma4_mtp_jax.config import SLIDING, parse_target_config  # noqa: E402

SMOKE = {"tiny_up": (64, 256), "tiny_down": (256, 64)}


def e2b_projections() -> dict[str, tuple[int, int]]:
    """name -> (K, N) of E2B's projections, from its config: q_proj and o_proj of a sliding layer, and gate|up (one
    matmul, as XLA merges the two) and down_proj of the narrow MLPs and of the wide ones (the layers that reuse
    another layer's K/V)."""
    cfg = parse_target_config(TARGETS["e2b"])
    H, nH = cfg.hidden_size, cfg.num_heads
    D = next(lc.head_dim for lc in cfg.layers if lc.layer_type == SLIDING)
    narrow, wide = min(lc.intermediate_size for lc in cfg.layers), max(lc.intermediate_size for lc in cfg.layers)
    return {"q_proj_sliding": (H, nH * D), "o_proj_sliding": (nH * D, H),
            "gate_up_narrow": (H, 2 * narrow), "gate_up_wide": (H, 2 * wide),
            "down_narrow": (narrow, H), "down_wide": (wide, H)}


def program(layers: int):
    """(xs [L, M, K], ws [L, N, K]) -> [L, M, N]: L separate matmuls x_l @ w_l.T, as a layer's projection."""
    def run(xs, ws):
        return jnp.stack([jnp.einsum("mk,nk->mn", xs[i], ws[i]) for i in range(layers)])

    return jax.jit(run)


def probe(name: str, K: int, N: int, M: int, layers: int, traced: bool) -> dict:
    kx, kw = jax.random.split(jax.random.key(zlib.crc32(f"{name}:{M}".encode())))
    xs = jax.random.normal(kx, (layers, M, K), jnp.bfloat16)
    ws = (jax.random.normal(kw, (layers, N, K), jnp.float32) * 0.02).astype(jnp.bfloat16)
    fn = program(layers)
    row = {"projection": name, "K": K, "N": N, "rows": M, "layers": layers,
           "wall_us_per_matmul": median_time(fn, (xs, ws), repeats=10) * 1e6 / layers}
    if traced:
        prof = profile_calls(lambda: fn(xs, ws), calls=3)
        gemms = [(n, c, us) for n, c, us in prof["top"] if kind_of(n) == "gemm"]
        us = sum(us for _, _, us in gemms) / layers
        row.update(kernel_us_per_matmul=us, weight_TBps=K * N * 2 / (us * 1e-6) / 1e12,
                   kernels=[f"{n} x{c:.0f}" for n, c, _ in gemms])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 80, 96, 128])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--projections", nargs="+", default=None,
                    help="a subset of q_proj_sliding o_proj_sliding gate_up_narrow gate_up_wide down_narrow down_wide")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    shapes = SMOKE if args.smoke else e2b_projections()
    names = args.projections or list(shapes)
    unknown = sorted(set(names) - set(shapes))
    if unknown:
        ap.error(f"--projections: unknown {unknown}; choose from {list(shapes)}")
    layers = 2 if args.smoke else args.layers
    traced = jax.default_backend() == "gpu"
    env = environment()
    print(env, flush=True)
    rows = []
    for name in names:
        K, N = shapes[name]
        for M in args.rows:
            row = probe(name, K, N, M, layers, traced)
            rows.append(row)
            write_json("probe_verify_gemm.json", {"env": env, "rows": rows})
            line = f"{name:16} K={K:6d} N={N:6d} M={M:4d}  wall {row['wall_us_per_matmul']:8.1f} us/matmul"
            if traced:
                line += (f"  kernel {row['kernel_us_per_matmul']:7.1f} us  {row['weight_TBps']:5.2f} TB/s  "
                         f"{', '.join(row['kernels'])[:90]}")
            print(line, flush=True)
    if traced:
        print("\nkernel us per matmul (weight TB/s)")
        print(f"{'projection':16} " + " ".join(f"{'M=' + str(m):>14}" for m in args.rows))
        for name in names:
            cells = [r for r in rows if r["projection"] == name]
            print(f"{name:16} " + " ".join(f"{r['kernel_us_per_matmul']:6.1f} ({r['weight_TBps']:4.2f})"
                                            for r in cells))
    else:
        print("median wall us per matmul:", statistics.median(r["wall_us_per_matmul"] for r in rows))


if __name__ == "__main__":
    main()
