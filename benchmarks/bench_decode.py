"""Decode-step time of the target at real Gemma 4 shapes (random weights) next to the HBM roofline.

For each model, weight format (--quantization: bf16 or fp8 weights), K/V cache dtype (--kv-cache-dtype) and batch
size: the compiled decode program (one token per sequence, KV pages donated, paged
attention kernel on GPU) runs over a context of --context tokens per sequence, K/V filled with random data.
Roofline = bytes that must cross HBM per step (every weight once, the LM head included, the PLE rows gathered,
the K/V each attention layer reads, each at its own dtype's bytes) over the copy bandwidth measured in the same
run. Several formats in one run give each row its speed-up over the first format's row of the same model and batch.

    python benchmarks/bench_decode.py --models e2b 31b --batch 1 16 --context 4096
    python benchmarks/bench_decode.py --models 31b --batch 1 2 16 --quantization none fp8 --kv-cache-dtype auto fp8
    python benchmarks/bench_decode.py --smoke            # tiny shapes, CPU
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (TARGETS, add_format_args, copy_bandwidth, environment,  # noqa: E402
                               fresh_inputs, layout_for, pipelined_time, random_params, write_json)
from benchmarks.kernel_profile import print_profile, profile_calls  # noqa: E402
from gemma4_mtp_jax.api import Target, abstract_target_params  # noqa: E402
from gemma4_mtp_jax.model.config import SLIDING, parse_target_config  # noqa: E402
from gemma4_mtp_jax.engine.config import EngineConfig  # noqa: E402
from gemma4_mtp_jax.model.kv_state import abstract_pages, kv_cache_scales  # noqa: E402
from gemma4_mtp_jax.programs.compiled import CompiledSteps  # noqa: E402

SMOKE = dict(model_type="gemma4_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             layer_types=["sliding_attention", "full_attention"] * 2, num_attention_heads=4, num_key_value_heads=1,
             head_dim=16, global_head_dim=32, sliding_window=32, hidden_size_per_layer_input=16,
             vocab_size_per_layer_input=512, num_kv_shared_layers=1, final_logit_softcapping=30.0)


def bytes_per_step(cfg, params, batch: int, context: int, dtype_bytes: int = 2,
                   experts_touched: float | None = None, kv_bytes: int | None = None) -> dict[str, int]:
    """Bytes one decode step must read: every weight at its own dtype's size (fp8 weights and their scales), K/V at
    `kv_bytes` per value (default: `dtype_bytes`, the activations'). MoE models: every expert, or with
    `experts_touched` (mean distinct experts per layer) only those the routing chose."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    weights = 0
    for path, leaf in leaves:
        name = ".".join(str(k.key) for k in path)
        if name.startswith("embed_tokens_per_layer"):
            continue  # PLE: only the rows of the batch's tokens are read
        if experts_touched is not None and ".experts." in f".{name}.":  # their scales too
            weights += int(leaf.nbytes * experts_touched / cfg.num_experts)
            continue
        weights += leaf.size * leaf.dtype.itemsize
    if cfg.hidden_size_per_layer_input:
        weights += batch * cfg.num_layers * cfg.hidden_size_per_layer_input * dtype_bytes
    kv = 0
    for lc in cfg.layers:  # every attention layer (KV-shared ones included) reads its visible K and V
        keys = min(context, cfg.sliding_window) if lc.layer_type == SLIDING else context
        kv += batch * keys * lc.num_kv_heads * lc.head_dim * 2 * (kv_bytes or dtype_bytes)
    return {"weights": weights, "kv": kv, "total": weights + kv}


def experts_touched(target: Target, tokens: np.ndarray, position: int) -> float:
    """Mean over MoE layers of the distinct experts the routing of `tokens` [B] chose (the model's
    `experts_touched` statistic, from a forward of one token per sequence)."""
    B = len(tokens)
    fwd = jax.jit(lambda p, t, pos: target.module.apply({"params": p}, t, pos, logits=False,
                                                        mutable=["intermediates"])[1])
    stats = fwd(target.params, jnp.asarray(tokens, jnp.int32).reshape(B, 1), jnp.full((B, 1), position, jnp.int32))
    counts = [int(v) for v in jax.tree_util.tree_leaves(stats["intermediates"])]
    return float(np.mean(counts))


def expected_experts(cfg, tokens: int) -> float:
    """Distinct experts per layer for `tokens` tokens routed uniformly (top-k distinct experts each)."""
    E, k = cfg.num_experts, cfg.top_k_experts
    return E * (1 - (1 - k / E) ** tokens)


def time_decode(fn, params, state, args, repeats: int, warmup: int = 3) -> tuple[float, Any]:
    """Median seconds per step; the donated device state is threaded from call to call."""
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        state, out = fn(params, state, *args)
        out.block_until_ready()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), state


def random_pages(cfg, layout, dtype, seed=1):
    """K/V pools filled with random data (attention over zeros would flatter the timings)."""
    return random_params(abstract_pages(cfg, layout, dtype), seed)


def time_batches(args, cfg, target: Target, layout, cache_dtype, context: int, fmt: dict, bw: float) -> list[dict]:
    """One row per batch size of args.batch: the decode program of `target` over a cache of `cache_dtype`, against
    the roofline at copy bandwidth `bw` (bytes/s)."""
    params, rows, kv_bytes = target.params, [], jnp.dtype(cache_dtype).itemsize
    max_b, name = max(args.batch), fmt["model"]
    steps = CompiledSteps(target, layout, cache_dtype, args.attention, max_batch=max_b)
    state = steps.arrays.init_state(random_pages(cfg, layout, cache_dtype))
    rng = np.random.default_rng(0)
    for B in args.batch:
        t0 = time.perf_counter()
        fn = steps.compile_decode(B)
        compile_s = time.perf_counter() - t0
        tables = {}
        for g, w in layout.pages_per_seq:  # each sequence its own shuffled pages
            perm = rng.permutation(np.arange(1, layout.pages(g)))[: B * w]
            tables[g] = perm.reshape(B, w).astype(np.int32)
        tokens = rng.integers(0, cfg.vocab_size, B).astype(np.int32)
        positions = np.full(B, context - 1, np.int32)
        inputs = fresh_inputs(tokens, positions, tables, steps.num_slots)
        t, state = time_decode(fn, steps.program_params, state, (inputs,), args.repeats)
        holder = [state]

        def one_step():
            holder[0], out = fn(steps.program_params, holder[0], inputs)
            return out

        # Steps dispatched back to back: the device's own time, with each call's host work hidden behind the
        # previous step (the engine's async scheduling); the synchronised `t` adds it in series.
        t_pipe = pipelined_time(one_step, args.repeats)
        need = bytes_per_step(cfg, params, B, context, kv_bytes=kv_bytes)
        floor = need["total"] / bw
        row = {**fmt, "batch": B, "context": context, "step_ms": t * 1e3,
               "step_pipelined_ms": t_pipe * 1e3, "roofline_ms": floor * 1e3,
               "roofline_fraction": floor / t, "weights_GB": need["weights"] / 1e9, "kv_GB": need["kv"] / 1e9,
               "achieved_TBps": need["total"] / t / 1e12, "compile_s": compile_s}
        if cfg.enable_moe_block:  # the roofline of what the step actually had to read
            touched = experts_touched(target, tokens, context - 1)
            for key, n in (("touched", touched), ("uniform", expected_experts(cfg, B))):
                b = bytes_per_step(cfg, params, B, context, experts_touched=n, kv_bytes=kv_bytes)["total"]
                row[f"experts_{key}"] = n
                row[f"roofline_{key}_ms"] = b / bw * 1e3
                row[f"roofline_{key}_fraction"] = b / bw / t
                row[f"roofline_{key}_fraction_pipelined"] = b / bw / t_pipe
        if args.profile:
            row["profile"] = profile_calls(one_step)
            print_profile(f"{name} B={B} decode", row["profile"], t_pipe * 1e6)
        state = holder[0]
        rows.append(row)
        print(row, flush=True)
    return rows


def add_speedups(rows: list[dict]) -> None:
    """Each row's `speedup_vs_first_format`: the first format's pipelined step time (same model and batch) over its
    own, formats in the order they ran."""
    first: dict[tuple, float] = {}
    for r in rows:
        base = first.setdefault((r["model"], r["batch"]), r["step_pipelined_ms"])
        r["speedup_vs_first_format"] = base / r["step_pipelined_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["e2b", "31b"], choices=sorted(TARGETS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--attention", default="auto", choices=["auto", "pallas", "xla"])
    ap.add_argument("--profile", action="store_true",
                    help="also trace 5 steps and list the kernels the device spent the step in (kernel_profile.py)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU)")
    add_format_args(ap)
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    bw = copy_bandwidth(0.05 if args.smoke else 2.0)
    print(f"copy bandwidth (read+write): {bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    models = ["smoke"] if args.smoke else args.models
    for name in models:
        cfg = parse_target_config(SMOKE if name == "smoke" else TARGETS[name])
        dtype = jnp.float32 if name == "smoke" else jnp.bfloat16
        context = 64 if name == "smoke" else args.context
        max_b = max(args.batch)
        for quantization in args.quantization:
            t0 = time.perf_counter()
            params = random_params(abstract_target_params(cfg, dtype), quantization=quantization)
            print(f"[{name}] random {quantization} weights in {time.perf_counter() - t0:.1f}s", flush=True)
            target = Target(cfg, params, dtype, None, {})
            for kv_name in args.kv_cache_dtype:
                cache_dtype = EngineConfig(cache_dtype=kv_name).kv_cache_dtype(dtype)
                layout = layout_for(cfg, max_b, page_size=args.page_size, max_model_len=context + 16,
                                    scales=kv_cache_scales(cfg, params, cache_dtype))
                fmt = dict(model=name, quantization=quantization, kv_cache_dtype=str(cache_dtype))
                rows += time_batches(args, cfg, target, layout, cache_dtype, context, fmt, bw)
                gc.collect()
        del params, target
        gc.collect()
    add_speedups(rows)
    write_json("bench_decode.json", {"env": env, "copy_TBps": bw / 1e12, "rows": rows})
    print(f"\ncopy bandwidth {bw / 1e12:.3f} TB/s; attention={args.attention}; page_size={args.page_size}")
    print(f"{'model':6} {'weights':7} {'kv':13} {'B':>3} {'ctx':>6} {'step ms':>9} {'pipelined':>9} {'roofline ms':>11} {'ratio':>6} {'TB/s':>6} "
          f"{'compile s':>9} {'speedup':>7}")
    for r in rows:
        print(f"{r['model']:6} {r['quantization']:7} {r['kv_cache_dtype']:13} {r['batch']:3d} {r['context']:6d} {r['step_ms']:9.3f} {r['step_pipelined_ms']:9.3f} "
              f"{r['roofline_ms']:11.3f} "
              f"{r['roofline_fraction']:6.2f} {r['achieved_TBps']:6.2f} {r['compile_s']:9.1f} "
              f"{r['speedup_vs_first_format']:7.2f}")
        if "experts_touched" in r:
            print(f"{'':17} MoE: {r['experts_touched']:.1f} experts/layer touched ({r['experts_uniform']:.1f} "
                  f"uniform): roofline {r['roofline_touched_ms']:.3f} ms, step at "
                  f"{r['roofline_touched_fraction']:.0%} of it ({r['roofline_uniform_fraction']:.0%} of uniform's); "
                  f"pipelined at {r['roofline_touched_fraction_pipelined']:.0%}")


if __name__ == "__main__":
    main()
