"""Benchmark the Pallas paged attention kernel against the XLA reference on real Gemma 4 shapes.

    python benchmarks/bench_paged_attention.py            # on the GPU (H200): the full matrix, < 3 minutes
    python benchmarks/bench_paged_attention.py --smoke    # tiny shapes, any backend (kernel in interpret mode on CPU)

For every shape: check the kernel against the reference (max abs error, relative Frobenius error), then time both.
A timed program runs the op over `n_sets` input sets that read disjoint pages (so the L2 cache cannot serve a
set from the previous one), and the time per op is (median over >= 20 repeats - dispatch overhead) / n_sets.
Achieved bandwidth = K/V bytes the visible key ranges need / time, next to the HBM copy bandwidth of a large
jitted elementwise op measured in the same run (bytes read + written). The compact table prints last; with $OUT
set, all numbers go to $OUT/bench_paged_attention.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gemma4_mtp_jax.kernels import paged_attention as pa  # noqa: E402

# name -> (query heads, KV heads, head dim, sliding window or None)
SHAPES = {
    "e2b_sliding": (8, 1, 256, 512),
    "e2b_full": (8, 1, 512, None),
    "31b_sliding": (32, 16, 256, 1024),
    "31b_full": (32, 4, 512, None),
}
SMOKE_SHAPES = {
    "tiny_sliding": (4, 1, 32, 24),
    "tiny_full": (4, 2, 32, None),
}
L2_BYTES = 50 << 20  # H100/H200 L2


def timed(fn, args, reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def copy_bandwidth(nbytes: int, reps: int) -> dict:
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x + 1)
    t = statistics.median(timed(f, (x,), reps))
    del x
    return {"bytes_read_plus_written": 2 * nbytes, "seconds": t, "GBps": 2 * nbytes / t / 1e9}


def dispatch_overhead(args, reps: int) -> float:
    """Round trip of a jitted program that takes the same arguments and does (almost) nothing."""
    f = jax.jit(lambda *a: a[-1][0, 0, 0])
    return statistics.median(timed(f, args, reps))


def build_inputs(key, *, B, Tq, nH, nKV, D, window, ctx, page_size, k_spec, n_sets, dtype, seed):
    """Pools, and per set: q, page table, q positions. Sets (and sequences) use disjoint, shuffled pages."""
    rng = np.random.default_rng(seed)
    ring = None
    if window is not None:  # a window-sized ring, sized as kv_state does: W + k + 2 slots
        ring = math.ceil((window + k_spec + 2) / page_size)
        width = ring
    else:
        width = math.ceil((ctx + Tq) / page_size)
    num_pages = 1 + n_sets * B * width  # page 0 = the null page
    perm = 1 + rng.permutation(num_pages - 1)
    tables = perm.reshape(n_sets, B, width).astype(np.int32)
    # Sequence b's first query sits at ctx - jitter (jitter < page_size: sequences end on different page offsets).
    starts = ctx - rng.integers(0, page_size, size=(n_sets, B))
    qpos = (starts[..., None] + np.arange(Tq)).astype(np.int32)  # [n_sets, B, Tq]
    hi = qpos.max(-1)
    lo = np.zeros_like(hi) if window is None else np.maximum(0, qpos.min(-1) - window + 1)
    keys = int((hi - lo + 1).sum()) // n_sets  # visible key positions per set
    kk, kv, kq = jax.random.split(key, 3)
    shape = (nKV, num_pages, page_size, D)
    k_pages = jax.random.normal(kk, shape, dtype)
    v_pages = jax.random.normal(kv, shape, dtype)
    q = (jax.random.normal(kq, (n_sets, B, Tq, nH, D), jnp.float32) * 0.25).astype(dtype)
    kv_bytes = keys * nKV * D * jnp.dtype(dtype).itemsize * 2
    return dict(k_pages=k_pages, v_pages=v_pages, q=q, tables=jnp.asarray(tables), qpos=jnp.asarray(qpos),
                ring=ring, width=width, num_pages=num_pages, kv_bytes_per_set=kv_bytes)


def make_program(op, n_sets, window, ring):
    def run(k_pages, v_pages, q, tables, qpos):
        return [op(q[i], k_pages, v_pages, tables[i], qpos[i], window=window, ring_pages=ring) for i in range(n_sets)]

    return jax.jit(run)


def bench_one(name, shape, *, B, Tq, ctx, args, key, reps, interpret, seed, kernel_kw, ref_cache=None):
    nH, nKV, D, window = shape
    dtype = jnp.bfloat16
    # Enough sets that one program touches > 2x L2 where that is cheap, and at least 2.
    set_bytes = B * nKV * D * 2 * 2 * (min(ctx, window or ctx) + Tq)
    n_sets = int(min(args.max_sets, max(2, math.ceil(2 * L2_BYTES / set_bytes))))
    if args.smoke:
        n_sets = 2
    inp = build_inputs(key, B=B, Tq=Tq, nH=nH, nKV=nKV, D=D, window=window, ctx=ctx, page_size=args.page_size,
                       k_spec=args.k_spec, n_sets=n_sets, dtype=dtype, seed=seed)
    ring = inp["ring"]
    cfg = pa.kernel_config((B, Tq, nH, D), (nKV, inp["num_pages"], args.page_size, D), (B, inp["width"]),
                           itemsize=jnp.dtype(dtype).itemsize, window=window, ring_pages=ring, **kernel_kw)

    def kernel_op(q, kp, vp, pt, qp, *, window, ring_pages):
        return pa.paged_attention(q, kp, vp, pt, qp, window=window, ring_pages=ring_pages, interpret=interpret,
                                  **kernel_kw)

    prog_args = (inp["k_pages"], inp["v_pages"], inp["q"], inp["tables"], inp["qpos"])
    kern = make_program(kernel_op, n_sets, window, ring)
    ref = make_program(pa.paged_attention_reference, n_sets, window, ring)

    t0 = time.perf_counter()
    out_k = jax.block_until_ready(kern(*prog_args))
    compile_k = time.perf_counter() - t0
    # The reference depends only on the shape and the inputs (the same seed draws the same inputs), so a sweep
    # computes and times it once per shape instead of once per tiling.
    cached = None if ref_cache is None else ref_cache.get((name, B, Tq, ctx))
    if cached is None:
        t0 = time.perf_counter()
        rr = np.asarray(jax.block_until_ready(ref(*prog_args))[0], np.float32)
        compile_r = time.perf_counter() - t0
        tr = None
    else:
        rr, compile_r, tr = cached
    ok = np.asarray(out_k[0], np.float32)
    max_abs = float(np.max(np.abs(ok - rr)))
    rel_fro = float(np.linalg.norm(ok - rr) / max(np.linalg.norm(rr), 1e-30))
    finite = bool(np.all(np.isfinite(ok)))
    del out_k

    overhead = dispatch_overhead(prog_args, reps)
    tk = statistics.median(timed(kern, prog_args, reps))
    if tr is None:
        tr = statistics.median(timed(ref, prog_args, reps))
        if ref_cache is not None:
            ref_cache[(name, B, Tq, ctx)] = (rr, compile_r, tr)
    us_k = max(tk - overhead, 1e-9) / n_sets * 1e6
    us_r = max(tr - overhead, 1e-9) / n_sets * 1e6
    kvb = inp["kv_bytes_per_set"]
    row = dict(
        name=name, B=B, Tq=Tq, ctx=ctx, nH=nH, nKV=nKV, D=D, window=window, ring_pages=ring,
        page_size=args.page_size, n_sets=n_sets, l2_warm_possible=bool(n_sets * kvb < 2 * L2_BYTES),
        kernel_config=dict(block_rows=cfg.block_rows, block_k=cfg.block_k, k_splits=cfg.k_splits,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        kv_bytes=kvb, kernel_us=us_k, ref_us=us_r, kernel_GBps=kvb / (us_k * 1e-6) / 1e9,
        ref_GBps=kvb / (us_r * 1e-6) / 1e9, speedup=us_r / us_k, max_abs_err=max_abs, rel_fro_err=rel_fro,
        finite=finite, program_s_kernel=tk, program_s_ref=tr, dispatch_overhead_s=overhead,
        first_call_s_kernel=compile_k, first_call_s_ref=compile_r)
    del inp, prog_args
    return row


SWEEP = dict(block_rows=(16, 32), k_splits=(1, 2, 4, 9, 17, 32, 64), block_k=(16, 32), num_warps=(4, 8),
             num_stages=(2,))


def _bench_logged(name, shape, B, Tq, ctx, args, key, interpret, seed, kernel_kw, ref_cache) -> dict:
    """bench_one, its failure recorded rather than raised (one failing shape or tiling must not hide the others),
    and its line printed."""
    t0 = time.perf_counter()
    try:
        row = bench_one(name, shape, B=B, Tq=Tq, ctx=ctx, args=args, key=key, reps=args.reps, interpret=interpret,
                        seed=seed, kernel_kw=kernel_kw, ref_cache=ref_cache)
    except Exception as e:
        row = dict(name=name, B=B, Tq=Tq, ctx=ctx, error=f"{type(e).__name__}: {e}"[:2000])
    row["wall_s"] = time.perf_counter() - t0
    row["asked"] = kernel_kw
    if "error" in row:
        print(f"{name} B={B} Tq={Tq} ctx={ctx} {kernel_kw}: ERROR {row['error'][:300]}", flush=True)
    else:
        print(f"{name} B={B} Tq={Tq} ctx={ctx}: kernel {row['kernel_us']:.1f} us "
              f"({row['kernel_GBps']:.0f} GB/s), ref {row['ref_us']:.1f} us, "
              f"max|err| {row['max_abs_err']:.2e}, rel {row['rel_fro_err']:.2e}, "
              f"cfg {row['kernel_config']}, first calls {row['first_call_s_kernel']:.1f}/"
              f"{row['first_call_s_ref']:.1f} s, wall {row['wall_s']:.1f} s", flush=True)
    return row


def _print_sweep(rows: list[dict]) -> None:
    """Per shape: kernel_config's own tiling (the first and the last row of each shape: how far the same tiling
    drifts over the sweep) against the fastest of the sweep."""
    print(f"\n{'shape':<12} {'B':>3} {'Tq':>3} {'ctx':>6} {'auto us':>8} {'again':>8} {'best us':>8}  "
          f"best tiling (of n that ran)")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["name"], r["B"], r["Tq"], r["ctx"]), []).append(r)
    for (name, B, Tq, ctx), rs in groups.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            print(f"{name:<12} {B:>3} {Tq:>3} {ctx:>6}  every tiling failed")
            continue
        auto, again = (r.get("kernel_us", float("nan")) for r in (rs[0], rs[-1]))
        best = min([r for r in rs[1:-1] if "error" not in r] or ok, key=lambda r: r["kernel_us"])
        print(f"{name:<12} {B:>3} {Tq:>3} {ctx:>6} {auto:>8.1f} {again:>8.1f} {best['kernel_us']:>8.1f}  "
              f"{best['kernel_config']} (of {len(ok)})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU (kernel in interpret mode)")
    ap.add_argument("--shapes", default=None, help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--q-len", default="1,5")
    ap.add_argument("--ctx", default="4096,32768")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--k-spec", type=int, default=4, help="speculative tokens (sizes the sliding ring)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-sets", type=int, default=8, help="cap on input sets per timed program")
    ap.add_argument("--copy-mib", type=int, default=2048, help="size of the HBM copy-bandwidth probe")
    # Kernel tiling overrides (default: kernel_config's choice per shape).
    ap.add_argument("--block-rows", type=int, default=None)
    ap.add_argument("--block-k", type=int, default=None)
    ap.add_argument("--k-splits", type=int, default=None)
    ap.add_argument("--num-warps", type=int, default=None)
    ap.add_argument("--num-stages", type=int, default=None)
    ap.add_argument("--sweep", action="store_true",
                    help="time every tiling of a grid (block rows x key splits x keys per block x warps; the "
                         "arguments above stay fixed) for each shape beside kernel_config's own choice, and print "
                         "the fastest")
    ap.add_argument("--sweep-grid", nargs="+", default=[], metavar="NAME=V1,V2",
                    help=f"replace a dimension of the sweep's grid (default {SWEEP}), e.g. block_k=32,64")
    args = ap.parse_args(argv)
    args.grid = dict(SWEEP)
    for item in args.sweep_grid:
        name, _, values = item.partition("=")
        if name not in SWEEP or not values:
            ap.error(f"--sweep-grid {item!r}: expected NAME=V1,V2,... with NAME one of {', '.join(SWEEP)}")
        try:
            args.grid[name] = tuple(int(v) for v in values.split(","))
        except ValueError:
            ap.error(f"--sweep-grid {item!r}: the values must be integers")
    return args


def sweep_configs(fixed: dict, dims: dict[str, tuple[int, ...]]) -> list[dict]:
    """kernel_config's own choice first and last (single samples drift: on an H100 the first tiling of a shape read
    1.19x the same tiling asked for by name later), every point of the grid `dims` between, with the arguments given
    on the command line held fixed."""
    grid = [{}]
    for name, values in dims.items():
        grid = [{**g, name: v} for g in grid for v in ((fixed[name],) if name in fixed else values)]
    return [dict(fixed)] + [{**fixed, **g} for g in grid if g != fixed] + [dict(fixed)]


def main(argv=None):
    args = parse_args(argv)
    backend = jax.default_backend()
    if args.smoke:
        shapes = SMOKE_SHAPES
        batches, q_lens, ctxs = [1, 3], [1, 5], [40, 100]
        args.page_size = min(args.page_size, 8)
        args.reps = min(args.reps, 3)
        args.copy_mib = min(args.copy_mib, 16)
    else:
        if backend != "gpu":
            sys.exit(f"backend is {backend!r}: run on a GPU, or pass --smoke")
        shapes = SHAPES if args.shapes is None else {s: SHAPES[s] for s in args.shapes.split(",")}
        batches = [int(x) for x in args.batch.split(",")]
        q_lens = [int(x) for x in args.q_len.split(",")]
        ctxs = [int(x) for x in args.ctx.split(",")]
    interpret = backend != "gpu"
    kernel_kw = {k: getattr(args, k) for k in ("block_rows", "block_k", "k_splits", "num_warps", "num_stages")
                 if getattr(args, k) is not None}
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, backend {backend}, device {dev.device_kind}, interpret={interpret}", flush=True)

    copy = copy_bandwidth(args.copy_mib << 20, max(args.reps, 5))
    print(f"HBM copy (x + 1, {args.copy_mib} MiB bf16): {copy['GBps']:.0f} GB/s read+write", flush=True)

    rows = []
    ref_cache: dict = {}
    key = jax.random.key(0)
    seed = 0
    for name, shape in shapes.items():
        for B in batches:
            for Tq in q_lens:
                for ctx in ctxs:
                    seed += 1
                    key, sub = jax.random.split(key)
                    for kw in sweep_configs(kernel_kw, args.grid) if args.sweep else [kernel_kw]:
                        rows.append(_bench_logged(name, shape, B, Tq, ctx, args, sub, interpret, seed, kw, ref_cache))
    if args.sweep:
        _print_sweep(rows)

    total = time.perf_counter() - t_start
    print(f"\ncopy bandwidth {copy['GBps']:.0f} GB/s; total {total:.0f} s")
    hdr = (f"{'shape':<12} {'B':>3} {'Tq':>3} {'ctx':>6} {'kern_us':>9} {'ref_us':>9} {'x':>6} {'kern_GB/s':>9} "
           f"{'%copy':>6} {'max_abs':>9} {'rel_fro':>9} {'splits':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<12} {r['B']:>3} {r['Tq']:>3} {r['ctx']:>6}  ERROR {r['error'][:80]}")
            continue
        warm = "*" if r["l2_warm_possible"] else " "
        print(f"{r['name']:<12} {r['B']:>3} {r['Tq']:>3} {r['ctx']:>6} {r['kernel_us']:>9.1f} {r['ref_us']:>9.1f} "
              f"{r['speedup']:>6.1f} {r['kernel_GBps']:>8.0f}{warm} {100 * r['kernel_GBps'] / copy['GBps']:>6.1f} "
              f"{r['max_abs_err']:>9.2e} {r['rel_fro_err']:>9.2e} {r['kernel_config']['k_splits']:>6}")
    print("(* = the timed sets fit in 2x L2: bandwidth may be flattered)")

    out_dir = os.environ.get("OUT")
    if out_dir:
        path = Path(out_dir) / "bench_paged_attention.json"
        path.write_text(json.dumps(dict(jax=jax.__version__, backend=backend, device=dev.device_kind,
                                        interpret=interpret, copy=copy, rows=rows, total_s=total,
                                        args=vars(args)), indent=1))
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
