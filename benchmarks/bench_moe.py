"""The MoE expert block of 26B-A4B (128 experts, top-8, H 2816, Im 704; random bf16 weights) on its own, in one run.

For N tokens (decode: N = B; verify: N = B (k+1); prefill: N = prompt length), router-like random routing (top-k of
normal logits), one layer's expert block through each implementation:
  dense      every expert on every token with a zero-padded routing matrix (the block before the grouped matmul)
  grouped    routed_experts with our Pallas grouped matmul (what the model runs on GPU)
  ragged     routed_experts with lax.ragged_dot (XLA; the CPU path)
  tokamax-*  the same sort/combine around tokamax.ragged_dot ('triton', 'mosaic'), weights pre-transposed to the
             [E, in, out] layout it needs (when tokamax imports)
and the gate|up grouped matmul alone per implementation. Roofline: the bytes of the distinct experts the routing
touched (plus activations) over the copy bandwidth measured in the same run.

    python benchmarks/bench_moe.py --tokens 1 2 4 10 16 2048
    python benchmarks/bench_moe.py --smoke      # tiny shapes, CPU
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import copy_bandwidth, environment, median_time, write_json  # noqa: E402
from benchmarks.kernel_profile import print_profile, profile_calls  # noqa: E402
from gemma4_mtp_jax.kernels import grouped_matmul as gm  # noqa: E402

REAL = dict(E=128, k=8, H=2816, Im=704)
SMOKE = dict(E=8, k=2, H=64, Im=48)


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts touched by `tokens` tokens routed uniformly to `top_k` distinct experts each."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def dense_experts(x, weights, idx, gate_up, down):
    E, two_im, _ = gate_up.shape
    im = two_im // 2
    combine = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32) * weights[..., None], axis=-2)
    gu = jnp.einsum("nh,eoh->neo", x, gate_up)
    act = jax.nn.gelu(gu[..., :im], approximate=True) * gu[..., im:]
    out = jnp.einsum("nei,ehi->neh", act, down)
    return jnp.einsum("neh,ne->nh", out, combine.astype(x.dtype))


def tokamax_experts(x, weights, idx, gate_up_t, down_t, implementation):
    """routed_experts' sort and combine around tokamax.ragged_dot (weights [E, in, out])."""
    import tokamax

    N, k = idx.shape
    im = down_t.shape[1]
    order, sizes = gm.sort_by_group(idx.reshape(-1), gate_up_t.shape[0])
    xs = jnp.take(x, order // k, axis=0)
    gu = tokamax.ragged_dot(xs, gate_up_t, sizes, implementation=implementation)
    act = jax.nn.gelu(gu[:, :im], approximate=True) * gu[:, im:]
    ys = tokamax.ragged_dot(act, down_t, sizes, implementation=implementation)
    y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True).reshape(N, k, -1)
    return jnp.einsum("nkh,nk->nh", y, weights.astype(x.dtype))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 10, 16, 2048])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--no-tokamax", action="store_true")
    ap.add_argument("--sweep-at", nargs="*", type=int, default=[2, 2048], help="token counts to try kernel tilings at")
    ap.add_argument("--profile", action="store_true", help="trace the grouped variant and list its kernels")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU)")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    s = SMOKE if args.smoke else REAL
    E, k, H, Im = s["E"], s["k"], s["H"], s["Im"]
    dt = jnp.float32 if args.smoke else jnp.bfloat16
    on_gpu = jax.default_backend() == "gpu"
    bw = copy_bandwidth(0.05 if args.smoke else 2.0)
    print(f"copy bandwidth (read+write): {bw / 1e12:.3f} TB/s", flush=True)
    key = jax.random.PRNGKey(0)
    gate_up = (jax.random.normal(key, (E, 2 * Im, H), jnp.float32) * 0.02).astype(dt)
    down = (jax.random.normal(jax.random.fold_in(key, 1), (E, H, Im), jnp.float32) * 0.02).astype(dt)
    expert_bytes = (gate_up[0].size + down[0].size) * jnp.dtype(dt).itemsize

    variants = {
        "dense": dense_experts,
        "grouped": functools.partial(gm.routed_experts, impl="pallas", interpret=not on_gpu),
        "ragged": functools.partial(gm.routed_experts, impl="xla"),
    }
    gu_alone = {
        "grouped": lambda xs, w, sz, *_: gm.grouped_matmul(xs, w, sz, glu=True, interpret=not on_gpu),
        "ragged": lambda xs, w, sz, *_: gm.grouped_matmul_reference(xs, w, sz, glu=True),
    }
    sweep = {}  # gate|up kernel tilings tried at the --sweep-at sizes: (block_rows, block_out, block_in, warps, stages)
    for br, bo, bi, nw, ns in ((16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 32, 128, 4, 3), (16, 32, 256, 4, 3),
                               (64, 64, 128, 4, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3)):
        cfg = gm.KernelConfig(br, bo, bi, nw, ns)
        sweep[f"grouped[{br}x{bo}x{bi},w{nw},s{ns}]"] = functools.partial(
            lambda xs, w, sz, cfg: gm.grouped_matmul(xs, w, sz, glu=True, interpret=not on_gpu, config=cfg), cfg=cfg)
    tokamax_error = None
    if not args.no_tokamax:
        try:
            import tokamax
            from absl import flags

            flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags; ours are argparse's, not absl's

            gate_up_t = jnp.asarray(jnp.swapaxes(gate_up, 1, 2))  # [E, H, 2Im], materialised once
            down_t = jnp.asarray(jnp.swapaxes(down, 1, 2))  # [E, Im, H]
            for impl in ("triton", "mosaic"):
                variants[f"tokamax-{impl}"] = functools.partial(
                    lambda x, w, i, gu, dn, impl: tokamax_experts(x, w, i, gate_up_t, down_t, impl), impl=impl)
                gu_alone[f"tokamax-{impl}"] = functools.partial(
                    lambda xs, w, sz, impl: tokamax.ragged_dot(xs, gate_up_t, sz, implementation=impl), impl=impl)
        except Exception as e:  # noqa: BLE001 -- reported, the other variants still run
            tokamax_error = f"{type(e).__name__}: {e}"
            print(f"tokamax unavailable: {tokamax_error}", flush=True)

    rows = []
    rng = np.random.default_rng(0)
    for N in args.tokens:
        x = jnp.asarray(rng.normal(size=(N, H)), dt)
        logits = rng.normal(size=(N, E))
        idx_np = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
        w_np = np.take_along_axis(logits, idx_np, 1)
        w_np = np.exp(w_np - w_np.max(1, keepdims=True))
        idx, weights = jnp.asarray(idx_np), jnp.asarray(w_np / w_np.sum(1, keepdims=True), jnp.float32)
        touched = len(np.unique(idx_np))
        need = touched * expert_bytes + 2 * N * H * jnp.dtype(dt).itemsize
        floor = need / bw
        ref = None
        row = {"tokens": N, "experts_touched": touched, "experts_expected_uniform": expected_experts(E, k, N),
               "roofline_us": floor * 1e6}
        for name, fn in variants.items():
            f = jax.jit(fn)
            try:
                out = f(x, weights, idx, gate_up, down)
                if ref is None:
                    ref = out.astype(jnp.float32)
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / (jnp.max(jnp.abs(ref)) + 1e-9))
                t = median_time(f, (x, weights, idx, gate_up, down), repeats=args.repeats)
                row[name] = {"us": t * 1e6, "of_roofline": floor / t, "rel_err_vs_dense": err}
                if args.profile and name in ("grouped", "dense"):
                    prof = profile_calls(lambda: f(x, weights, idx, gate_up, down))
                    row[name]["profile"] = prof
                    print_profile(f"N={N} {name}", prof, t * 1e6, top=8)
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(N, name, row[name], flush=True)
        order, sizes = gm.sort_by_group(idx.reshape(-1), E)
        xs = jnp.take(x, order // k, axis=0)
        gu_bytes = touched * gate_up[0].size * jnp.dtype(dt).itemsize
        extra = sweep if N in args.sweep_at else {}
        for name, fn in {**gu_alone, **extra}.items():
            f = jax.jit(fn)
            try:
                t = median_time(f, (xs, gate_up, sizes), repeats=args.repeats)
                row[f"gate_up_alone/{name}"] = {"us": t * 1e6, "TBps_on_touched": gu_bytes / t / 1e12}
            except Exception as e:  # noqa: BLE001
                row[f"gate_up_alone/{name}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(N, f"gate_up_alone/{name}", row[f"gate_up_alone/{name}"], flush=True)
        rows.append(row)
    write_json("bench_moe.json", {"env": env, "copy_TBps": bw / 1e12, "shape": s, "tokamax_error": tokamax_error,
                                  "rows": rows})
    names = list(variants)
    print(f"\ncopy bandwidth {bw / 1e12:.3f} TB/s; one layer's experts, E={E} k={k} H={H} Im={Im}; us (of roofline)")
    print(f"{'N':>5} {'touched':>7} {'roof us':>8} " + " ".join(f"{n:>20}" for n in names))
    for r in rows:
        cells = []
        for n in names:
            c = r[n]
            cells.append(f"{c['us']:10.1f} ({c['of_roofline']:5.0%})" if "us" in c else f"{'error':>20}")
        print(f"{r['tokens']:5d} {r['experts_touched']:7d} {r['roofline_us']:8.1f} " + " ".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
