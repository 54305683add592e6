"""Probe the paged-attention kernel's shared-memory needs on the GPU: compile it at explicit tilings and record which
compile and, for those that do not, the bytes Triton asked for (from XLA's "Shared memory size limit exceeded:
requested N" error). The data calibrate `kernels/paged_attention.py`'s shared-memory model (`smem_bytes`), and
the script reports every failing tiling the model would have let through (there must be none).

    python lab/probes/probe_kernel_smem.py [--quick]      # GPU; JSON lines to $OUT/smem_probe.jsonl
    python lab/probes/probe_kernel_smem.py --planned      # GPU; the planner's tilings of every real shape compile
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gemma4_mtp_jax.kernels import paged_attention as pa  # noqa: E402
from gemma4_mtp_jax.kernels.device_budget import default_budget  # noqa: E402


def lower(D, rows, bk, stages, warps, dtype):
    G = 4 if rows >= 4 else 1
    Tq = rows // G
    q = jax.ShapeDtypeStruct((1, Tq, G, D), dtype)
    pages = jax.ShapeDtypeStruct((1, 128, 16, D), dtype)
    table = jax.ShapeDtypeStruct((1, 64), jnp.int32)
    pos = jax.ShapeDtypeStruct((1, Tq), jnp.int32)
    # Past the planner on purpose: the point is to compile tilings it would refuse.
    config = pa.KernelConfig(block_rows=rows, block_k=bk, k_splits=1, num_warps=warps, num_stages=stages)
    fn = lambda q, k, v, t, p: pa._paged_attention_pallas(q, k, v, t, p, window=None, ring_pages=None,  # noqa
                                                          interpret=False, config=config)
    return jax.jit(fn).lower(q, pages, pages, table, pos)


# (query heads, KV heads, head dim) of every attention the engine runs on the real shapes and the demo pair: the
# targets' sliding / full layers and their assistants' (tests/test_paged_attention.py GEOMETRIES has the names).
REAL_GEOMETRIES = [(8, 1, 256), (8, 1, 512), (4, 1, 256), (4, 1, 512), (8, 2, 256), (8, 2, 512), (4, 2, 256),
                   (4, 2, 512), (16, 8, 256), (16, 2, 512), (32, 16, 256), (32, 4, 512), (4, 1, 16), (4, 1, 32),
                   (2, 1, 16), (2, 1, 32)]


def planned(threads: int) -> int:
    """Compile the planner's own tiling for every real geometry x query rows x dtype; returns the failures."""
    jobs = []
    for (nH, nKV, D), Tq, dt in itertools.product(REAL_GEOMETRIES, [1, 5, 9, 64, 256, 512], [jnp.bfloat16, jnp.float32]):
        q = jax.ShapeDtypeStruct((2, Tq, nH, D), dt)
        pages = jax.ShapeDtypeStruct((nKV, 256, 16, D), dt)
        table = jax.ShapeDtypeStruct((2, 128), jnp.int32)
        pos = jax.ShapeDtypeStruct((2, Tq), jnp.int32)
        fn = lambda q, k, v, t, p: pa.paged_attention(q, k, v, t, p, window=512)  # noqa: E731
        jobs.append(((nH, nKV, D, Tq, jnp.dtype(dt).name), jax.jit(fn).lower(q, pages, pages, table, pos)))

    def one(job):
        name, low = job
        try:
            low.compile()
            return name, None
        except Exception as e:  # noqa: BLE001
            return name, str(e)[:300]

    failures = 0
    with cf.ThreadPoolExecutor(threads) as ex:
        for name, err in ex.map(one, jobs):
            if err:
                failures += 1
                print("planned tiling FAILED", name, err)
    print(f"planned tilings: {len(jobs) - failures}/{len(jobs)} compiled")
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--planned", action="store_true", help="only compile the planner's tilings of the real shapes")
    ap.add_argument("--threads", type=int, default=12)
    a = ap.parse_args()
    if a.planned:
        sys.exit(1 if planned(a.threads) else 0)
    dims = [16, 64, 256, 512]
    rows = [16, 64, 256, 1024]
    bks = [16, 32, 64, 128]
    stages = [1, 2, 3]
    dtypes = [jnp.bfloat16, jnp.float32]
    if a.quick:
        dims, rows, bks, stages = [16, 512], [16, 1024], [32, 64], [2]
    configs = []
    for D, r, bk, st, dt in itertools.product(dims, rows, bks, stages, dtypes):
        warps = 4 if r * D <= 8192 else 8
        configs.append((D, r, bk, st, warps, dt))
    lowered = []
    for c in configs:
        try:
            lowered.append((c, lower(*c)))
        except Exception as e:  # noqa: BLE001
            lowered.append((c, e))

    def compile_one(item):
        c, low = item
        D, r, bk, st, warps, dt = c
        rec = dict(D=D, rows=r, block_k=bk, stages=st, warps=warps, dtype=jnp.dtype(dt).name)
        if isinstance(low, Exception):
            rec.update(ok=False, error=f"lower: {str(low)[:200]}")
            return rec
        t0 = time.perf_counter()
        try:
            low.compile()
            rec.update(ok=True)
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            m = re.search(r"requested (\d+)", msg)
            rec.update(ok=False, requested=int(m.group(1)) if m else None, error=msg[:300])
        rec["compile_s"] = round(time.perf_counter() - t0, 2)
        return rec

    out = os.environ.get("OUT", ".")
    budget = default_budget().smem_per_block
    n_ok = under = over = 0
    with cf.ThreadPoolExecutor(a.threads) as ex, open(os.path.join(out, "smem_probe.jsonl"), "w") as f:
        for rec in ex.map(compile_one, lowered):
            model = pa.smem_bytes(rec["rows"], rec["block_k"], rec["D"], rec["stages"], jnp.dtype(rec["dtype"]).itemsize)
            rec["model"] = model
            f.write(json.dumps(rec) + "\n")
            n_ok += rec["ok"]
            under += bool(rec.get("requested") and rec["requested"] > model)
            over += bool(rec["ok"] and model > budget)
            if not rec["ok"]:
                print({k: rec.get(k) for k in ("D", "rows", "block_k", "stages", "warps", "dtype", "requested")})
    print(f"{n_ok}/{len(lowered)} configurations compiled; devices {jax.devices()}")
    print(f"model underestimates: {under} (must be 0); tilings the model refuses that compiled: {over}")


if __name__ == "__main__":
    main()
