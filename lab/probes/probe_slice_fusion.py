"""Does XLA read a matmul's weights straight out of a larger array, or copy the slice first?

Param packing (param_pack.py, mode "all") cut E2B's decode call from 540 arrays to 6 and the engine's host overhead
to nothing, but the decode program grew from 730 to 1007 kernels (run 39): each weight sliced out of the packed
1-D array was copied before its matmul. This probe compiles one bf16 matmul chain at E2B's width five ways and
reports kernels (optimized HLO, kernel_count.py's walk) and pipelined time per call:

  separate    every layer's weight its own argument (what the programs take today)
  flat        one 1-D array, each weight a static slice + reshape (pack mode "all")
  rows        one 2-D array [layers * out, in], each weight a static row slice
  stacked     one 3-D array [layers, out, in], each weight a static index
  scan        the same 3-D array under lax.scan (a dynamic index per iteration)

    python lab/probes/probe_slice_fusion.py            # on the GPU
    python lab/probes/probe_slice_fusion.py --smoke    # tiny, any backend
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks.common import environment, pipelined_time, write_json  # noqa: E402
from benchmarks.kernel_count import summarize  # noqa: E402


def layer(h, w):
    return jnp.tanh(jnp.dot(h, w.T, preferred_element_type=jnp.float32)).astype(h.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    L, D, B = (4, 64, 2) if args.smoke else (args.layers, args.width, args.rows)
    key = jax.random.PRNGKey(0)
    stacked = (jax.random.normal(key, (L, D, D), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
    separate = [stacked[i] for i in range(L)]
    flat = stacked.reshape(-1)
    rows = stacked.reshape(L * D, D)
    h0 = jax.random.normal(jax.random.fold_in(key, 1), (B, D), jnp.float32).astype(jnp.bfloat16)

    def run_separate(ws, h):
        for w in ws:
            h = layer(h, w)
        return h

    def run_flat(p, h):
        for i in range(L):
            h = layer(h, lax.slice(p, (i * D * D,), ((i + 1) * D * D,)).reshape(D, D))
        return h

    def run_rows(p, h):
        for i in range(L):
            h = layer(h, lax.slice(p, (i * D, 0), ((i + 1) * D, D)))
        return h

    def run_stacked(p, h):
        for i in range(L):
            h = layer(h, p[i])
        return h

    def run_scan(p, h):
        return lax.scan(lambda h, w: (layer(h, w), None), h, p)[0]

    cases = {"separate": (run_separate, separate), "flat": (run_flat, flat), "rows": (run_rows, rows),
             "stacked": (run_stacked, stacked), "scan": (run_scan, stacked)}
    ref = None
    out = {}
    for name, (fn, p) in cases.items():
        f = jax.jit(fn)
        compiled = f.lower(p, h0).compile()
        s = summarize(compiled.as_text())
        y = f(p, h0)
        ref = y if ref is None else ref
        same = bool(jnp.array_equal(y, ref))
        t = pipelined_time(lambda: f(p, h0), 50)
        out[name] = {"kernels": s["kernels"], "by_kind": s["by_kind"], "pipelined_us": t * 1e6, "same": same}
        print(f"{name:9} kernels {s['kernels']:4d} ({s['kernels'] / L:.1f}/layer)  pipelined {t * 1e6:8.1f} us  "
              f"same as separate: {same}  {s['by_kind']}", flush=True)
    write_json("probe_slice_fusion.json", {"env": env, "layers": L, "width": D, "rows": B, "cases": out})


if __name__ == "__main__":
    main()
