"""transformers' own generate against this stack's `generate` at batch 1: the same real Gemma 4 shapes, random
bf16 weights, on the GPU, each timed end to end the same way.

- `--impl transformers`: what a user of the reference implementation gets without a serving stack,
  `Gemma4ForCausalLM.generate`, greedy, eager PyTorch (no torch.compile, no CUDA graphs; its default attention).
- `--impl ours`: `gemma4_mtp_jax.generate.generate` on an engine of one sequence (no assistant: plain decoding),
  every program compiled and autotuned before timing, the prefix cache off (every call prefills the whole
  prompt, as transformers does). Its time is the whole loop: the host's scheduling, dispatch and read-back of
  every step, not the decode program alone.
Per model: a prompt of --context random token ids, then generate --new-tokens tokens; the time per generated
token is the difference between generating N + 1 tokens and 1 token (the prefill and the first token cancel),
over N, the median of --repeats after one warm-up. Random weights cost what trained ones do (shapes never depend
on the values); no stop token ends a reply (transformers' eos is switched off, ours has no stop ids).

    python benchmarks/bench_hf_eager.py --models e2b 31b --context 4096 --new-tokens 64
    python benchmarks/bench_hf_eager.py --impl ours --models e2b 31b --context 4096 --new-tokens 64
    python benchmarks/bench_hf_eager.py --smoke [--impl ours]     # a tiny config, CPU

Run the two in separate processes (bench_all.py does): one framework on the GPU at a time. Writes
bench_hf_eager.json (transformers) or bench_ours_generate.json (ours) under $OUT (when set). transformers needs
torch and transformers >= 5.24 (Gemma 4).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import SMOKE  # noqa: E402
from benchmarks.common import TARGETS, environment, random_params, write_json  # noqa: E402

JSON_NAMES = {"transformers": "bench_hf_eager.json", "ours": "bench_ours_generate.json"}


def build(config: dict, device: str, dtype):
    """A Gemma4ForCausalLM of this HF text config (Gemma4UnifiedForCausalLM for the 12B's `gemma4_unified_text`), its
    weights drawn at random directly in `dtype` on `device`."""
    import torch
    import transformers

    unified = config.get("model_type") == "gemma4_unified_text"
    config_cls, model_cls = (("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM") if unified
                             else ("Gemma4TextConfig", "Gemma4ForCausalLM"))
    cfg = getattr(transformers, config_cls)(**{k: v for k, v in config.items() if k != "model_type"})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # never a float32 copy: 31B would not fit twice
    try:
        with torch.device(device):
            model = getattr(transformers, model_cls)(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def marginal_ms_per_token(generate: Callable[[int], float], new_tokens: int, repeats: int) -> dict:
    """generate(n) -> seconds to generate n tokens after the prompt. One warm-up, then the medians over `repeats`
    of n = 1 and n = new_tokens + 1: their difference over new_tokens is the time per token, prefill excluded."""
    generate(new_tokens + 1)  # warm-up
    first = [generate(1) for _ in range(repeats)]
    whole = [generate(new_tokens + 1) for _ in range(repeats)]
    per_token = (statistics.median(whole) - statistics.median(first)) / new_tokens
    return {"first_token_s": statistics.median(first), "ms_per_token": per_token * 1e3, "tokens_per_s": 1 / per_token}


def transformers_ms_per_token(model, context: int, new_tokens: int, repeats: int, device: str) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, model.config.vocab_size, (1, context), generator=g).to(device)

    def generate(n: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == context + n, out.shape
        return time.perf_counter() - t0

    return {**marginal_ms_per_token(generate, new_tokens, repeats),
            "attn_implementation": model.config._attn_implementation}


def ours_ms_per_token(config: dict, dtype, context: int, new_tokens: int, repeats: int) -> dict:
    """This stack's `generate` (plain decoding, batch 1), timed as transformers' is."""
    import numpy as np

    from gemma4_mtp_jax.api import Target, abstract_target_params
    from gemma4_mtp_jax.model.config import parse_target_config
    from gemma4_mtp_jax.engine import Engine, EngineConfig
    from gemma4_mtp_jax.generate import generate as our_generate

    tcfg = parse_target_config(config)
    target = Target(tcfg, random_params(abstract_target_params(tcfg, dtype), 0), dtype, None, {})
    # Every program compiled, tuned, before the engine is returned (no background compile, no untuned programs).
    engine = Engine(target, EngineConfig(max_num_seqs=1, max_model_len=context + new_tokens + 2,
                                         enable_prefix_caching=False, compile_in_background=False))
    prompt = np.random.default_rng(0).integers(1, tcfg.vocab_size, context).tolist()

    def generate(n: int) -> float:
        t0 = time.perf_counter()
        out = our_generate(target, [prompt], n, engine=engine, stop_ids=frozenset())
        seconds = time.perf_counter() - t0  # generate returns once the last token is on the host
        assert len(out[0].tokens) == n, (len(out[0].tokens), n)
        return seconds

    return marginal_ms_per_token(generate, new_tokens, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=sorted(JSON_NAMES), default="transformers",
                    help="whose generate to time (default: transformers)")
    ap.add_argument("--models", nargs="+", default=["e2b", "31b"], choices=sorted(TARGETS))
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny config on the CPU")
    args = ap.parse_args()
    if args.impl == "transformers":  # JAX (environment() asks it for the devices) must leave the GPU to torch
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env = environment()
    if args.impl == "transformers":
        import torch
        import transformers

        env.update(torch=torch.__version__, transformers=transformers.__version__)
        device = "cpu" if args.smoke else "cuda"
    print(env, flush=True)
    rows = []
    for name in (["smoke"] if args.smoke else args.models):
        config = SMOKE if name == "smoke" else TARGETS[name]
        context, new = (16, 8) if args.smoke else (args.context, args.new_tokens)
        t0 = time.perf_counter()
        if args.impl == "transformers":
            model = build(config, device, torch.float32 if args.smoke else torch.bfloat16)
            print(f"[{name}] weights in {time.perf_counter() - t0:.1f}s", flush=True)
            timing = transformers_ms_per_token(model, context, new, args.repeats, device)
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
        else:
            import jax.numpy as jnp

            timing = ours_ms_per_token(config, jnp.float32 if args.smoke else jnp.bfloat16, context, new,
                                       args.repeats)
            timing["attn_implementation"] = "this stack"
        row = {"model": name, "impl": args.impl, "batch": 1, "context": context, "new_tokens": new, **timing,
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(row, flush=True)
        write_json(JSON_NAMES[args.impl], {"env": env, "rows": rows})
    whose = {"transformers": "transformers'", "ours": "this stack's"}[args.impl]
    print(f"\n{whose} generate, batch 1, greedy, per token after the first")
    print(f"{'model':6} {'ctx':>6} {'ms/token':>9} {'tok/s':>7} {'first s':>8}  attention")
    for r in rows:
        print(f"{r['model']:6} {r['context']:6d} {r['ms_per_token']:9.2f} {r['tokens_per_s']:7.1f} "
              f"{r['first_token_s']:8.3f}  {r['attn_implementation']}")


if __name__ == "__main__":
    main()
