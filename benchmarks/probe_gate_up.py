"""Probe: the gate|up kernel (kernels/gate_up.py) at E2B's MLP shape, per tiling, against XLA's kernels for the same
math. NOT a test.

    python benchmarks/probe_gate_up.py [--intermediate 6144] [--rows 2 16 80] [--layers 8] [--tilings N,K,W,S ...]

A program of `--layers` MLPs (H 1536, I 6144 or 12288, each with its own weights: 8 layers at 6144 are 453 MB, far
past the 50 MB L2, so every layer's weights come from HBM) chained through down_proj, x <- mlp(x), as
`feed_forward.mlp` runs them:
`xla` is the model's plain path (XLA's gate|up GEMM, the GELU x up fusion, down_proj's GEMM); `nN_kK_wW_sS` the
kernel with block_n N, block_k K, W warps and S pipeline stages writing h, then the same down_proj GEMM.
Printed per variant: kernels per layer (optimized HLO), pipelined device time per layer (median), the weights'
achieved TB/s over it (gate + up + down), and max |h - h_xla| of one layer's h (bf16; one bf16 ulp of |h| ~ 4 is
0.03). Then, from a trace of `xla` and of the fastest tiling: the gate|up part's own microseconds per layer (the
kernel's; XLA's GEMM + fusion, taken as XLA's busy time less down_proj's GEMM as timed in the kernel's program) and
its TB/s, and one verdict line per rows value. Writes $OUT/probe_gate_up.json when $OUT is set.

The verdict lines decide kernels/gate_up.py's defaults: rows 2 and 16 BLOCK_N, BLOCK_K, NUM_WARPS and NUM_STAGES,
rows 80 whether a verify's rows should take the kernel at all.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import compile_concurrently, pipelined_time, write_json  # noqa: E402
from benchmarks.kernel_count import summarize  # noqa: E402
from benchmarks.kernel_profile import profile_calls  # noqa: E402
from gemma4_mtp_jax.kernels import gate_up as gu  # noqa: E402
from gemma4_mtp_jax.kernels.device_budget import default_budget  # noqa: E402
from gemma4_mtp_jax.kernels.split_k import split_matmul  # noqa: E402

H = 1536  # E2B's hidden width; its MLP is 6144 wide, 12288 in its double-wide layers (--intermediate)
# block_n, block_k, warps, stages: the default, each knob moved from it, and wider column blocks for more rows.
TILINGS = ["16,256,4,3", "16,256,4,1", "16,256,4,2", "16,512,4,2", "16,256,8,3", "16,512,8,3",
           "32,256,4,3", "32,512,4,2", "32,256,8,3", "64,256,4,3", "64,256,8,2", "64,512,8,2"]


def program(tiling: gu.Tiling | None):
    """jit(fn)(layers, x) -> (x, the first layer's h): x <- mlp(x) through each layer's (gate, up, down), as
    `feed_forward.mlp` computes it with this tiling (None: the plain path). The first h comes out for the diff, so
    that no second program per tiling compiles its kernel again."""

    def fn(layers, x):
        hs = []
        for gate, up, down in layers:
            h = gu.gate_up_reference(x, gate, up) if tiling is None else gu.gate_up(x, gate, up, tiling=tiling)
            x = split_matmul(h, down, 1)
            hs.append(h)
        return x, hs[0]

    return jax.jit(fn)


def name_of(t: gu.Tiling | None) -> str:
    return "xla" if t is None else f"n{t.block_n}_k{t.block_k}_w{t.num_warps}_s{t.num_stages}"


def gate_up_us(prof: dict, L: int) -> float:
    """The kernel's own microseconds per layer in a trace (its Pallas name starts with gate_up)."""
    return sum(us for n, _, us in prof["top"] if "gate_up" in n) / L


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intermediate", type=int, default=6144, help="I: 6144, or 12288 (the double-wide layers)")
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 16, 80])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tilings", nargs="+", default=TILINGS, help="block_n,block_k,warps,stages")
    args = ap.parse_args()
    I = args.intermediate
    L = args.layers
    key = jax.random.PRNGKey(0)
    rnd = lambda i, shape, scale=1.0: (jax.random.normal(jax.random.fold_in(key, i), shape) * scale  # noqa: E731
                                       ).astype(jnp.bfloat16)
    layers = [(rnd(3 * i, (I, H), H**-0.5), rnd(3 * i + 1, (I, H), H**-0.5), rnd(3 * i + 2, (H, I), I**-0.5))
              for i in range(L)]
    gate_up_bytes, all_bytes = 2 * I * H * 2, 3 * I * H * 2
    smem = default_budget().smem_per_block
    tilings = [gu.Tiling(*map(int, t.split(","))) for t in args.tilings]
    results = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "layers": L, "H": H, "I": I,
               "rows": {}}
    for M in args.rows:
        x = rnd(10_000 + M, (M, H))
        fit = [t for t in tilings if gu._shared_bytes(M, t, 2) <= smem]
        for t in tilings:
            if t not in fit:
                print(f"M={M:3d} {name_of(t):15s} skipped: {gu._shared_bytes(M, t, 2) >> 10} KiB of stages past "
                      f"{smem >> 10} KiB of shared memory", flush=True)
        variants = [None] + fit
        fns = {name_of(t): program(t) for t in variants}
        lowerings = {n: (lambda f=f: f.lower(layers, x)) for n, f in fns.items()}
        try:
            compiled = compile_concurrently(lowerings)
        except Exception:  # noqa: BLE001  one tiling Triton cannot build: compile one at a time to name it
            compiled = {}
            for n, lower in lowerings.items():
                try:
                    compiled.update(compile_concurrently({n: lower}, threads=1))
                except Exception as e:  # noqa: BLE001
                    compiled[n] = e
        h_ref = None
        rows = results["rows"].setdefault(str(M), {})
        for t in variants:
            name = name_of(t)
            if isinstance(compiled[name], Exception):  # a tiling Triton cannot build: say so, go on
                e = compiled[name]
                print(f"M={M:3d} {name:15s} failed to compile: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            exe, secs = compiled[name]
            h = jax.block_until_ready(exe(layers, x))[1].astype(jnp.float32)
            if t is None:
                h_ref = h
            diff = float(jnp.max(jnp.abs(h - h_ref)))
            us = pipelined_time(lambda exe=exe: exe(layers, x), n=30) / L * 1e6
            rows[name] = dict(tiling=None if t is None else t._asdict(), compile_s=secs, diff_h=diff,
                              kernels_per_layer=summarize(exe.as_text())["kernels"] / L, pipelined_us_per_layer=us,
                              tb_s_weights=all_bytes / us * 1e-6)
            print(f"M={M:3d} {name:15s} kernels/layer {rows[name]['kernels_per_layer']:4.2f}  pipelined {us:6.2f} "
                  f"us/layer  {rows[name]['tb_s_weights']:4.2f} TB/s  |diff h| {diff:.3g}", flush=True)
        kernels = {n: r for n, r in rows.items() if n != "xla"}
        if "xla" not in rows or not kernels:
            continue
        best = min(kernels, key=lambda n: kernels[n]["pipelined_us_per_layer"])
        prof = {n: profile_calls(lambda n=n: compiled[n][0](layers, x), calls=5) for n in ("xla", best)}
        k_us = gate_up_us(prof[best], L)
        down_us = prof[best]["busy_us"] / L - k_us
        x_us = prof["xla"]["busy_us"] / L - down_us
        for n in ("xla", best):
            rows[n]["busy_us_per_layer"] = prof[n]["busy_us"] / L
            rows[n]["top"] = [(kn, c / L, us / L) for kn, c, us in prof[n]["top"][:4]]
            print(f"M={M:3d} {n:15s} trace: busy {prof[n]['busy_us'] / L:6.2f} us/layer  " +
                  "  ".join(f"{kn[:36]} {us / L:.2f}" for kn, _, us in prof[n]["top"][:3]), flush=True)
        xla_us, best_us = rows["xla"]["pipelined_us_per_layer"], kernels[best]["pipelined_us_per_layer"]
        verdict = dict(best=best, best_us=best_us, xla_us=xla_us, gate_up_kernel_us=k_us, gate_up_xla_us=x_us,
                       kernel_tb_s=gate_up_bytes / k_us * 1e-6, xla_tb_s=gate_up_bytes / x_us * 1e-6)
        results.setdefault("verdict", {})[str(M)] = verdict
        print(f"VERDICT rows={M:3d}: best {best} {best_us:.2f} us/layer vs xla {xla_us:.2f} "
              f"({best_us - xla_us:+.2f} us, {'kernel wins' if best_us < xla_us else 'XLA wins'}); gate|up alone "
              f"{k_us:.2f} us ({verdict['kernel_tb_s']:.2f} TB/s) vs XLA's GEMM + fusion {x_us:.2f} us "
              f"({verdict['xla_tb_s']:.2f} TB/s); default plan {name_of(gu.plan(M, H, I, jnp.bfloat16))}",
              flush=True)
    if os.environ.get("OUT"):
        write_json("probe_gate_up.json", results)


if __name__ == "__main__":
    main()
