"""Chunked prefill at real Gemma 4 shapes (random bf16 weights): the paged-attention Pallas kernel vs its XLA
reference for the chunks' attention. Checks both write the same K/V (the last full layer's), then times a whole prompt.

    python benchmarks/bench_prefill.py --models e2b 31b --prompt 2048 --chunk 256
    python benchmarks/bench_prefill.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import SMOKE, random_pages  # noqa: E402
from benchmarks.common import TARGETS, environment, layout_for, random_params, write_json  # noqa: E402
from gemma4_mtp_jax.api import Target, abstract_target_params  # noqa: E402
from gemma4_mtp_jax.model.config import FULL, owning_layers, parse_target_config  # noqa: E402
from gemma4_mtp_jax.steps.device_state import PrefillRows, StepInputs  # noqa: E402
from gemma4_mtp_jax.model.sampling import SamplingBatch  # noqa: E402
from gemma4_mtp_jax.programs.compiled import CompiledSteps  # noqa: E402


def run_prompt(fn, params, state, prompt, chunk, tables, sampling):
    """Prefill `prompt` chunk by chunk; returns (state, the last chunk's packed result)."""
    out = None
    for start in range(0, len(prompt), chunk):
        piece = prompt[start:start + chunk]
        n = len(piece)
        rows = PrefillRows.stack([dict(slot=0, tokens=np.pad(piece, (0, chunk - n)),
                                       positions=np.pad(np.arange(start, start + n), (0, chunk - n),
                                                        constant_values=-1),
                                       last_index=n - 1, stop_ids=-1, remaining=1)], 1, chunk)
        state, out = fn(params, state, CompiledSteps.inputs(StepInputs(rows, tables, sampling)))
    return state, out


def written_kv(cfg, state, tables, prompt_len: int, page_size: int) -> np.ndarray:
    """The K the prompt wrote into the last full-attention layer that owns K/V (the end of the whole stack)."""
    layer = max(i for i in owning_layers(cfg) if cfg.layers[i].layer_type == FULL)
    pages = tables[FULL][0, : -(-prompt_len // page_size)]
    return np.asarray(state.pages[layer][0][:, pages], np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["e2b", "31b"], choices=sorted(TARGETS))
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the page tables' width in tokens (default: the prompt + 16). The XLA path attends over "
                         "the whole width, the kernel over the keys written so far")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    rows = []
    for name in (["smoke"] if args.smoke else args.models):
        cfg = parse_target_config(SMOKE if name == "smoke" else TARGETS[name])
        dtype = jnp.float32 if name == "smoke" else jnp.dtype(args.dtype).type
        prompt_len, chunk = (100, 32) if name == "smoke" else (args.prompt, args.chunk)
        target = Target(cfg, random_params(abstract_target_params(cfg, dtype)), dtype, None, {})
        max_len = args.max_model_len or prompt_len + 16
        if max_len < prompt_len + 16:
            ap.error(f"--max-model-len {max_len} must hold the prompt and 16 tokens more ({prompt_len + 16})")
        layout = layout_for(cfg, 1, page_size=args.page_size, max_model_len=max_len, prefill_chunk=chunk)
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, cfg.vocab_size, prompt_len).tolist()
        tables = {g: rng.permutation(np.arange(1, layout.pages(g)))[:w][None].astype(np.int32)
                  for g, w in layout.pages_per_seq}
        sampling = SamplingBatch.from_params([], 1)
        hs, times = {}, {}
        for impl in ("pallas", "xla") if not args.smoke else ("xla",):
            steps = CompiledSteps(target, layout, dtype, impl)
            t0 = time.perf_counter()
            fn = steps.compile_prefill(1, chunk)
            compile_s = time.perf_counter() - t0
            state = steps.arrays.init_state(random_pages(cfg, layout, dtype))
            state, out = run_prompt(fn, steps.program_params, state, prompt, chunk, tables, sampling)  # warm-up
            hs[impl] = written_kv(cfg, state, tables, prompt_len, args.page_size)
            samples = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                state, out = run_prompt(fn, steps.program_params, state, prompt, chunk, tables, sampling)
                out.block_until_ready()
                samples.append(time.perf_counter() - t0)
            times[impl] = (statistics.median(samples), compile_s)
            del state, steps
        row = {"model": name, "dtype": jnp.dtype(dtype).name, "prompt": prompt_len, "chunk": chunk,
               "max_model_len": max_len}
        for impl, (t, c) in times.items():
            row[f"{impl}_ms"] = t * 1e3
            row[f"{impl}_tok_per_s"] = prompt_len / t
            row[f"{impl}_compile_s"] = c
        if "pallas" in hs:
            ref = hs["xla"]
            row["rel_err_last_kv"] = float(np.linalg.norm(hs["pallas"] - ref) / np.linalg.norm(ref))
        rows.append(row)
        print(row, flush=True)
        del target
    write_json("bench_prefill.json", {"env": env, "rows": rows})
    print(f"\n{'model':6} {'prompt':>6} {'chunk':>5} {'max len':>7} {'pallas ms':>10} {'xla ms':>10} {'pallas tok/s':>12} {'rel err':>8}")
    for r in rows:
        print(f"{r['model']:6} {r['prompt']:6d} {r['chunk']:5d} {r['max_model_len']:7d} "
              f"{r.get('pallas_ms', float('nan')):10.1f} "
              f"{r['xla_ms']:10.1f} {r.get('pallas_tok_per_s', float('nan')):12.0f} "
              f"{r.get('rel_err_last_kv', float('nan')):8.1e}")


if __name__ == "__main__":
    main()
