"""How XLA runs fp8-weight matmuls at 31B's MLP shapes on this GPU: the evidence for split_k.W8A8_MIN_ROWS and for
keeping the scale on the output (docs/decisions/0017-fp8-weights.md).

Variants over a chain of 8 matmuls (gate/up [21504, 5376] and down [5376, 21504] alternating, 31B's MLP), each at
M rows: bf16 weights; fp8 weight-only with the per-channel scale on the output (ours) or on the weight before the
dot (qwix's choice for bf16 activations); qwix.dot_general itself; W8A8 (activations quantized per tensor or per
token, XLA's cuBLASLt fp8 rewrite). Prints us per chain, weight GB/s, and what the optimized HLO holds (a cuBLASLt
fp8 call, a bf16 copy of a weight); with $OUT set, the results and the optimized HLO at 2 and 256 rows go there.
qwix (not a dependency) is timed where it is importable.

    python benchmarks/bench_fp8_matmul.py [--rows 2 16 24 32 48 64 80 256 2048]
"""

import argparse
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

F8 = jnp.float8_e4m3fn
N, K, LAYERS = 21504, 5376, 8


def quantize(w):
    s = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=1) / 448.0
    s = jnp.where(s == 0, 1.0, s)
    return jnp.clip(w.astype(jnp.float32) / s[:, None], -448, 448).astype(F8), s


def chain(mm):
    def f(x, ws):
        for w in ws:
            x = mm(x, w)
        return x
    return jax.jit(f)


def bf16_mm(x, w):
    return jnp.einsum("mk,nk->mn", x, w)


def wo_out(x, w):
    q, s = w
    y = jnp.einsum("mk,nk->mn", x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * s).astype(x.dtype)


def wo_in(x, w):
    q, s = w
    return jnp.einsum("mk,nk->mn", x, (q.astype(jnp.float32) * s[:, None]).astype(x.dtype))


def w8a8_tensor(x, w):
    q, s = w
    sx = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32))), 1e-12) / 448.0
    xq = jnp.clip(x.astype(jnp.float32) / sx, -448, 448).astype(F8)
    y = jax.lax.dot_general(xq.astype(jnp.bfloat16) * sx.astype(jnp.bfloat16), q.astype(jnp.bfloat16),
                            (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * s).astype(x.dtype)


def w8a8_token(x, w):
    q, s = w
    sx = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True), 1e-12) / 448.0
    xq = jnp.clip(x.astype(jnp.float32) / sx, -448, 448).astype(F8)
    y = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * sx * s).astype(x.dtype)


def timed(fn, args, n=20):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(n)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 16, 24, 32, 48, 64, 80, 256, 2048])
    args = ap.parse_args()
    key = jax.random.PRNGKey(0)
    ws = []
    for i in range(LAYERS):
        shape = (N, K) if i % 2 == 0 else (K, N)
        ws.append((0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)).astype(jnp.bfloat16))
    qs = [quantize(w) for w in ws]
    variants = {"bf16": (bf16_mm, ws), "fp8_wo_scale_out": (wo_out, qs), "fp8_wo_scale_in": (wo_in, qs),
                "w8a8_tensor": (w8a8_tensor, qs), "w8a8_token": (w8a8_token, qs)}
    try:
        import qwix
        qw = [qwix.QArray(q, s[:, None].astype(jnp.bfloat16), qtype=F8) for q, s in qs]
        variants["qwix_dot_general"] = (lambda x, w: qwix.dot_general(x, w, (((1,), (1,)), ((), ()))), qw)
    except Exception as e:  # qwix absent: the rest still answers
        print("qwix unavailable:", repr(e)[:200])
    wbytes = {name: sum(int(np.prod(w[0].shape if isinstance(w, tuple) else w.shape)) *
                        (1 if name != "bf16" else 2) for w in (v[1])) for name, v in variants.items()}
    if "qwix_dot_general" in variants:
        wbytes["qwix_dot_general"] = wbytes["fp8_wo_scale_out"]
    out = {"device": jax.devices()[0].device_kind, "rows": {}}
    for m in args.rows:
        x = (jax.random.normal(key, (m, K), jnp.float32)).astype(jnp.bfloat16)
        ref = None
        for name, (mm, w) in variants.items():
            f = chain(mm)
            hlo = f.lower(x, w).compile().as_text()
            if os.environ.get("OUT") and m in (2, 256):
                with open(os.path.join(os.environ["OUT"], f"hlo_{name}_{m}.txt"), "w") as fh:
                    fh.write(hlo)
            t = timed(f, (x, w))
            y = np.asarray(f(x, w), np.float32)
            ref = y if ref is None else ref
            err = float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))
            rec = dict(us=round(t * 1e6, 1), weight_GBps=round(wbytes[name] / t / 1e9, 1), rel_err_vs_bf16=err,
                       cublaslt_f8=bool(re.search(r"f8e4m3fn.*cublas|cublas.*f8e4m3fn|__cublas\$lt\$matmul\$f8", hlo)),
                       bf16_weight_copy=bool(re.search(r"bf16\[(21504,5376|5376,21504)\][^\n]*fusion", hlo)) and name != "bf16",
                       triton_gemm=hlo.count("__triton_gemm"), cublas=hlo.count("custom_call_target=\"__cublas"))
            out["rows"].setdefault(m, {})[name] = rec
            print(m, name, rec, flush=True)
    return out


if __name__ == "__main__":
    res = main()
    dest = os.environ.get("OUT")
    if dest:
        with open(os.path.join(dest, "fp8_matmul.json"), "w") as fh:
            json.dump(res, fh, indent=1)
