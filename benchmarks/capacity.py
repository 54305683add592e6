"""How many sequences of --max-model-len tokens a target's KV pools hold on this device, for each weight format and
K/V cache dtype, as the engine plans them (`engine.memory.pool_memory_left` after the random weights are on the
device, the page geometry of `model.kv_state.make_layout`, the prefix cache's spare ring): the sequences that run
at once without preemption, for `--max-num-seqs` at the server's defaults.

    python benchmarks/capacity.py --models 31b --quantization none fp8 --kv-cache-dtype auto fp8
    python benchmarks/capacity.py --smoke      # tiny shapes (CPU: no memory limit, so only the bytes per sequence)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import SMOKE  # noqa: E402
from benchmarks.common import TARGETS, add_format_args, environment, random_params, write_json  # noqa: E402
from gemma4_mtp_jax.api import abstract_target_params  # noqa: E402
from gemma4_mtp_jax.engine.config import EngineConfig  # noqa: E402
from gemma4_mtp_jax.engine.memory import pool_memory_left  # noqa: E402
from gemma4_mtp_jax.model.config import parse_target_config  # noqa: E402
from gemma4_mtp_jax.model.kv_state import make_layout, page_bytes  # noqa: E402


def capacity(cfg, params, cache_dtype, max_model_len: int, page_size: int, k: int) -> dict:
    """Bytes per sequence and the sequences of `max_model_len` the device memory left after `params` holds."""
    probe = make_layout(cfg, page_size=page_size, max_model_len=max_model_len, num_speculative_tokens=k,
                        num_pages={g: 1 << 30 for g in ("sliding_attention", "full_attention")})
    per_page = page_bytes(cfg, page_size, cache_dtype)
    per_seq = sum(probe.table_width(g) * per_page[g] for g, _ in probe.pages_per_seq)
    # Page 0 of each pool and the prefix cache's spare sliding ring are the engine's fixed cost.
    fixed = sum(per_page[g] * (1 + (probe.table_width(g) if probe.ring_pages(g) else 0)) for g, _ in probe.pages_per_seq)
    left = pool_memory_left(jax.devices()[:1], params)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    return {"weights_GB": weights / 1e9, "kv_GB_per_sequence": per_seq / 1e9,
            "memory_left_GB": None if left is None else left / 1e9,
            "sequences": None if left is None else max(0, (left - fixed) // per_seq)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["31b"], choices=sorted(TARGETS))
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--k", type=int, default=0, help="drafts per round the pools make room for (default: 0)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU)")
    add_format_args(ap)
    args = ap.parse_args()
    env = environment()
    rows = []
    for name in (["smoke"] if args.smoke else args.models):
        tcfg = parse_target_config(SMOKE if name == "smoke" else TARGETS[name])
        dtype = jnp.float32 if name == "smoke" else jnp.bfloat16
        for quantization in args.quantization:
            t0 = time.perf_counter()
            params = random_params(abstract_target_params(tcfg, dtype), quantization=quantization)
            for kv_name in args.kv_cache_dtype:
                cache_dtype = EngineConfig(cache_dtype=kv_name).kv_cache_dtype(dtype)
                row = {"model": name, "quantization": quantization, "kv_cache_dtype": str(cache_dtype),
                       "max_model_len": args.max_model_len,
                       **capacity(tcfg, params, cache_dtype, args.max_model_len, args.page_size, args.k)}
                rows.append(row)
                print(row, f"({time.perf_counter() - t0:.0f}s)", flush=True)
            del params
            gc.collect()
    write_json("capacity.json", {"env": env, "rows": rows})
    print(f"\n{'model':6} {'weights':7} {'kv':13} {'weights GB':>10} {'GB/seq':>7} {'left GB':>8} {'sequences':>9}")
    for r in rows:
        left = "-" if r["memory_left_GB"] is None else f"{r['memory_left_GB']:.1f}"
        print(f"{r['model']:6} {r['quantization']:7} {r['kv_cache_dtype']:13} {r['weights_GB']:10.1f} "
              f"{r['kv_GB_per_sequence']:7.3f} {left:>8} {'-' if r['sequences'] is None else r['sequences']:>9}")


if __name__ == "__main__":
    main()
