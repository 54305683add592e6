"""Benchmark of the centroid head (gemma4_mtp_jax/kernels/centroid_head.py) at E2B assistant dims. NOT a test.

    python benchmarks/bench_centroid_head.py            # on the GPU (H200): E2B dims, bf16, T = 1, 8, 64
    python benchmarks/bench_centroid_head.py --smoke    # tiny shapes on the CPU (Pallas in interpret mode)

Paths timed per T (hn [T, 256] bf16; table [262144, 256] bf16; 2048 centroids; top-32; 128 rows per centroid):
    xla_full       centroid scores -> top_k -> gather -> dot -> argmax, plain XLA (the reference path)
    pallas_full    centroid scores (XLA) -> Pallas argmax kernel (selection inside) -> chunk combine
    pallas_kernel  the Pallas argmax kernel + combine alone (scores precomputed)
    pallas_sparse  the Pallas sparse-logits kernel alone ([T, 4096] logits + ids; scores precomputed)
    scores         the centroid scores alone (the [T, 256] x [256, 2048] matmul)
    select         XLA's selection: the scores + lax.top_k (+ the index-order sort)
    dense_full     full-vocab logits [T,256]x[256,262144] + argmax, for comparison
    floor          one elementwise kernel on hn: what a link of the chain costs with almost no work in it
Correctness first (Pallas vs XLA: token ids equal, logits close), then timing.

Timing, two ways:
- kernels (the figure to trust): one call traced by jax.profiler (benchmarks/kernel_profile.py), the sum of its
  kernels' own durations (`kernel_us`) and their number. In a step's CUDA graph each kernel adds a launch gap of
  about 1 us on top. The launch sweep is timed this way.
- chain: a jitted program runs CHAIN calls back to back, each on a different input set, chained by
  `lax.optimization_barrier` (call i+1's inputs wait for call i's outputs). Device time per call = (median
  t(CHAIN calls) - median t(1 call)) / (CHAIN - 1). The input sets are two stacked arrays, sliced inside the
  program (the `floor` path shows what a link costs with almost no work): as 2*CHAIN separate arguments, the
  host's per-argument dispatch cost, not the device, set the time of a link (~7-28 us for the floor). `single` is the median wall time of one dispatched call.
Input sets rotate (>= 128 random hn per T, so the rows read do not sit in the 50 MB L2 from a previous call). GB/s = bytes that must
be read (T*K*V/C*Ha*2 [+ C*Ha*2 centroids for the full paths]; the whole table for dense) / device time, next to a
device copy bandwidth (x*2 over 1 GiB, read+write) and a read bandwidth (max over 1 GiB) measured in the same run.

Writes $OUT/bench_centroid_head.json when $OUT is set. The compact table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.kernel_profile import profile_calls  # noqa: E402
from gemma4_mtp_jax.kernels import centroid_head as ch  # noqa: E402

T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def timed(f, arg_sets, reps):
    """Median wall seconds of f(*args) (blocked), rotating over arg_sets; one untimed warm-up per set first."""
    for a in arg_sets[: min(len(arg_sets), 3)]:
        jax.block_until_ready(f(*a))
    ts = []
    for i in range(reps):
        a = arg_sets[i % len(arg_sets)]
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def chained(step, n):
    """jit(prog)(hns [n, T, Ha], tops [n, ...] second inputs) running step n times, serialized by barriers."""

    def prog(hns, tops):
        outs, prev = [], None
        for i in range(n):
            h, tp = hns[i], tops[i]
            if prev is not None:
                h, tp, _ = jax.lax.optimization_barrier((h, tp, prev))
            prev = step(h, tp)
            outs.append(prev)
        return outs

    return jax.jit(prog)


def bandwidth(n_bytes, reps):
    """(copy GB/s counting read+write, read GB/s) over an n_bytes bf16 buffer."""
    x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
    cp = jax.jit(lambda a: a * 2)
    rd = jax.jit(lambda a: jnp.max(a))
    t_cp = timed(cp, [(x,)], reps)
    t_rd = timed(rd, [(x,)], reps)
    return 2 * n_bytes / t_cp / 1e9, n_bytes / t_rd / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpret mode)")
    ap.add_argument("--tokens", type=int, nargs="*", default=None)
    ap.add_argument("--chain", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep of the argmax kernel")
    ap.add_argument("--no-chain", action="store_true", help="time the traced kernels only (no chain programs)")
    ap.add_argument("--budget-s", type=float, default=100.0, help="stop sweeping after this many seconds")
    ap.add_argument("--paths", nargs="+", default=None, help="time only these paths (default: all; see above)")
    args = ap.parse_args()

    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    interpret = not on_gpu
    if args.smoke:
        Ha, V, C, K = 64, 8192, 64, 8
        Ts = args.tokens or [1, 8]
        chain, reps, n_sets, bw_bytes = args.chain or 4, args.reps or 5, 8, 16 << 20
        sweep_cfgs = {t: [(32, 1, 4), (8, 4, 4)] for t in Ts}
    else:
        Ha, V, C, K = 256, 262144, 2048, 32
        Ts = args.tokens or [1, 8, 64]
        chain, reps, n_sets, bw_bytes = args.chain or 16, args.reps or 60, 128, 1 << 30
        # (block_rows, chunks_per_program, num_warps)
        sweep_cfgs = {1: [(16, 1, 4), (16, 2, 4), (32, 1, 4), (64, 1, 4), (32, 2, 4), (128, 1, 8)],
                      2: [(32, 1, 4), (64, 1, 4), (64, 2, 4), (128, 1, 8)],
                      8: [(64, 1, 4), (128, 1, 8), (128, 2, 8), (64, 4, 4), (128, 4, 8)],
                      16: [(128, 1, 8), (128, 2, 8), (128, 4, 8), (128, 8, 8), (64, 4, 4), (64, 8, 4), (32, 16, 4)],
                      64: [(128, 4, 8), (128, 16, 8), (128, 32, 8)]}
    R = V // C
    dt = jnp.bfloat16
    dev = jax.devices()[0]
    log(f"backend={backend} device={getattr(dev, 'device_kind', dev)} jax={jax.__version__} interpret={interpret}")
    log(f"dims: Ha={Ha} V={V} C={C} K={K} R={R} dtype=bf16 chain={chain} reps={reps} sets={n_sets}")

    copy_gbs, read_gbs = bandwidth(bw_bytes, max(10, reps // 3))
    log(f"device bandwidth: copy (r+w) {copy_gbs:.0f} GB/s, read {read_gbs:.0f} GB/s over {bw_bytes >> 20} MiB")

    key = jax.random.PRNGKey(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    table = jax.random.normal(k1, (V, Ha), dt)
    centroids = jax.random.normal(k2, (C, Ha), dt)
    ordering = jax.random.permutation(k3, V).astype(jnp.int32)
    jax.block_until_ready((table, centroids, ordering))

    def xla_full(h, tp):
        return ch.centroid_head(h, centroids, table, ordering, K, mode="argmax", impl="xla")

    def pallas_full(h, tp, **launch):
        return ch.centroid_head(h, centroids, table, ordering, K, mode="argmax", impl="pallas",
                                interpret=interpret, **launch)

    # tp: the precomputed centroid scores of h
    def pallas_kernel(h, tp, **launch):
        return ch.centroid_argmax(h, tp, table, ordering, top_k=K, interpret=interpret, **launch)

    def pallas_sparse(h, tp):
        return ch.centroid_sparse_logits(h, tp, table, ordering, top_k=K, interpret=interpret)

    def scores(h, tp):
        return ch.centroid_scores(h, centroids)

    def select(h, tp):
        return ch.select_centroids(h, centroids, K)

    def dense_full(h, tp):
        lg = jnp.einsum("th,vh->tv", h, table, preferred_element_type=jnp.float32)
        j = jnp.argmax(lg, axis=-1)
        return ordering[j], jnp.take_along_axis(lg, j[:, None], axis=-1)[:, 0]

    def floor(h, tp):
        return h * jnp.asarray(2, h.dtype)

    def sparse_ref(h, tp):
        return ch.centroid_sparse_logits_reference(h, tp, table, ordering, top_k=K)

    paths = dict(xla_full=xla_full, pallas_full=pallas_full, pallas_kernel=pallas_kernel,
                 pallas_sparse=pallas_sparse, scores=scores, select=select, dense_full=dense_full, floor=floor)
    if args.paths:
        unknown = sorted(set(args.paths) - set(paths))
        if unknown:
            ap.error(f"--paths: unknown {', '.join(unknown)}; known: {', '.join(paths)}")
        paths = {n: f for n, f in paths.items() if n in args.paths}
    row_bytes = K * R * Ha * 2  # per token
    results = {"backend": backend, "device": str(getattr(dev, "device_kind", dev)), "jax": jax.__version__,
               "dims": dict(Ha=Ha, V=V, C=C, K=K, R=R), "copy_gbs": copy_gbs, "read_gbs": read_gbs,
               "chain": chain, "reps": reps, "per_T": {}}

    for T in Ts:
        log(f"=== T={T} ===")
        kh = jax.random.fold_in(k4, T)
        hn_all = jax.random.normal(kh, (n_sets, T, Ha), dt)
        hns = [hn_all[i] for i in range(n_sets)]
        tops = [jax.jit(scores)(h, None) for h in hns]  # the kernels' precomputed input
        tops_all = jnp.stack(tops)
        jax.block_until_ready(tops_all)
        cfg = ch.default_config(T, K, R, Ha, 2)
        res = {"default_config": cfg, "paths": {}, "sweep": [], "check": {}}

        # ---- correctness: Pallas vs XLA on a few sets
        n_chk = min(8, n_sets)
        mism, maxdiff, near = 0, 0.0, 0
        j_xla, j_pf, j_pk, j_ps, j_sr = map(jax.jit, (xla_full, pallas_full, pallas_kernel, pallas_sparse, sparse_ref))
        for i in range(n_chk):
            rt, rl = j_xla(hns[i], tops[i])
            pt, pl_ = j_pf(hns[i], tops[i])
            kt, kl = j_pk(hns[i], tops[i])
            rt, rl, pt, pl_, kt, kl = map(np.asarray, (rt, rl, pt, pl_, kt, kl))
            for t_, l_ in ((pt, pl_), (kt, kl)):
                bad = t_ != rt
                mism += int(bad.sum())
                near += int((bad & (np.abs(l_ - rl) <= 1e-3 * np.maximum(1.0, np.abs(rl)))).sum())
                maxdiff = max(maxdiff, float(np.max(np.abs(l_ - rl))))
            sl, si = j_ps(hns[i], tops[i])
            rsl, rsi = j_sr(hns[i], tops[i])
            mism += int((np.asarray(si) != np.asarray(rsi)).sum())
            maxdiff = max(maxdiff, float(np.max(np.abs(np.asarray(sl) - np.asarray(rsl)))))
        ok = mism == 0
        res["check"] = dict(sets=n_chk, id_mismatches=mism, near_tie_mismatches=near, max_abs_logit_diff=maxdiff,
                            ok=ok)
        log(f"check: id mismatches {mism} (near-ties {near}), max |logit diff| {maxdiff:.3g} -> "
            f"{'OK' if ok else 'MISMATCH'}")

        # ---- timing
        def run(name, step, n):
            t_c = time.perf_counter()
            f = chained(step, n)
            groups = [(hn_all[g * n:(g + 1) * n], tops_all[g * n:(g + 1) * n]) for g in range(n_sets // n)]
            jax.block_until_ready(f(*groups[0]))
            compile_s = time.perf_counter() - t_c
            return timed(f, groups, reps), compile_s

        def kernels(step):
            """(kernel µs, kernels) of one call, from a trace; the call's input set rotates like the chain's."""
            f, i = jax.jit(step), [0]

            def call():
                i[0] += 1
                return f(hns[i[0] % n_sets], tops[i[0] % n_sets])

            prof = profile_calls(call, calls=5)
            return prof["busy_us"], prof["kernels"]

        for name, step in paths.items():
            if args.no_chain:
                (t1, c1), (tn, cn) = (0.0, 0.0), (0.0, 0.0)
            else:
                t1, c1 = run(name, step, 1)
                tn, cn = run(name, step, chain)
            k_us, k_n = kernels(step)
            dev_us = (tn - t1) / (chain - 1) * 1e6
            if name == "dense_full":
                nbytes = V * Ha * 2
            elif name in ("pallas_kernel", "pallas_sparse"):
                nbytes = T * row_bytes
            elif name in ("scores", "select"):
                nbytes = C * Ha * 2
            elif name == "floor":
                nbytes = 2 * T * Ha * 2
            else:
                nbytes = T * row_bytes + C * Ha * 2
            gbs = nbytes / (k_us * 1e-6) / 1e9 if k_us > 0.05 else None  # no trace (CPU) or below timer noise
            res["paths"][name] = dict(kernel_us=k_us, kernels=k_n, chain_us=dev_us, single_call_us=t1 * 1e6,
                                      bytes=nbytes, gbs=gbs, compile_s=c1 + cn)
            log(f"{name:14s} kernels {k_us:8.2f} us ({k_n:.0f})  chain {dev_us:8.2f} us/call  single-dispatch "
                f"{t1 * 1e6:8.1f} us  {gbs or 0:7.0f} GB/s ({nbytes / 2**20:.2f} MiB)  compile {c1 + cn:.1f}s")

        # ---- launch-config sweep of the argmax kernel alone, by its traced kernel time
        for bp, g, nw in [] if args.no_sweep else sweep_cfgs.get(T, []):
            if bp > R:
                continue
            if time.perf_counter() - T0 > args.budget_s:
                log("sweep: time budget spent, skipping the rest")
                break
            step = lambda h, tp, bp=bp, g=g, nw=nw: pallas_kernel(h, tp, block_rows=bp, chunks_per_program=g,
                                                                  num_warps=nw)
            cfg_s = dict(block_rows=bp, chunks_per_program=g, num_warps=nw)
            tag = f"block_rows={bp:4d} chunks_per_program={g:2d} num_warps={nw}"
            try:
                k_us, k_n = kernels(step)
            except Exception as e:  # a config the lowering rejects: report and go on
                log(f"sweep {tag}: FAILED {type(e).__name__}: {str(e)[:200]}")
                res["sweep"].append(dict(cfg_s, error=str(e)[:500]))
                continue
            res["sweep"].append(dict(cfg_s, kernel_us=k_us, kernels=k_n))
            log(f"sweep {tag}: kernels {k_us:8.2f} us ({k_n:.0f})")
        good = [s for s in res["sweep"] if s.get("kernel_us", 0) > 0]  # no trace off the GPU
        if good:
            best = res["best_config"] = min(good, key=lambda s: s["kernel_us"])
            log(f"best: block_rows={best['block_rows']} chunks_per_program={best['chunks_per_program']} "
                f"num_warps={best['num_warps']} {best['kernel_us']:.2f} us (default {cfg})")
        results["per_T"][str(T)] = res

    # ---- compact table
    print()
    print(f"centroid head, bf16, Ha={Ha} V={V} C={C} top-{K}; device: {results['device']}; "
          f"copy {copy_gbs:.0f} GB/s (r+w), read {read_gbs:.0f} GB/s")
    names = list(paths)
    print(f"{'T':>3} {'check':>5} | " + " | ".join(f"{n:>22s}" for n in names))
    print(f"{'':>3} {'':>5} | " + " | ".join(f"{'kernel us (n)':>14s} {'chain':>7s}" for _ in names))
    for T in Ts:
        r = results["per_T"][str(T)]
        cells = [f"{r['paths'][n]['kernel_us']:9.2f} ({r['paths'][n]['kernels']:2.0f}) {r['paths'][n]['chain_us']:7.2f}"
                 for n in names]
        print(f"{T:>3} {'ok' if r['check']['ok'] else 'BAD':>5} | " + " | ".join(cells))
    for T in Ts:
        b = results["per_T"][str(T)].get("best_config")
        if b:
            print(f"T={T}: best argmax-kernel config block_rows={b['block_rows']} "
                  f"chunks_per_program={b['chunks_per_program']} num_warps={b['num_warps']} "
                  f"-> {b['kernel_us']:.2f} us")
    print(f"(single-dispatch wall us, incl. host overhead: " + "; ".join(
        f"T={T}: " + ", ".join(f"{n} {results['per_T'][str(T)]['paths'][n]['single_call_us']:.0f}" for n in names)
        for T in Ts) + ")")
    log("done")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        p = Path(out) / "bench_centroid_head.json"
        p.write_text(json.dumps(results, indent=1))
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
