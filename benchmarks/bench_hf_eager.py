"""transformers' own generate at batch 1, for scale: the same real Gemma 4 shapes, random bf16 weights, on the GPU.

What a user of the reference implementation gets without a serving stack: `Gemma4ForCausalLM.generate`, greedy,
eager PyTorch (no torch.compile, no CUDA graphs; its default attention). Per model: a prompt of --context random
token ids, then generate --new-tokens tokens; the time per generated token is the difference between generating
N + 1 tokens and 1 token (the prefill and the first token cancel), over N, the median of --repeats after one
warm-up. Random weights cost what trained ones do (shapes never depend on the values); eos is never met because
it is switched off.

    python benchmarks/bench_hf_eager.py --models e2b 31b --context 4096 --new-tokens 64
    python benchmarks/bench_hf_eager.py --smoke          # a tiny config, CPU

Writes bench_hf_eager.json under $OUT (when set). Needs torch and transformers >= 5.24 (Gemma 4).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode import SMOKE  # noqa: E402
from benchmarks.common import TARGETS, environment, write_json  # noqa: E402


def build(config: dict, device: str, dtype):
    """A Gemma4ForCausalLM of this HF text config, its weights drawn at random directly in `dtype` on `device`."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # never a float32 copy: 31B would not fit twice
    try:
        with torch.device(device):
            model = Gemma4ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def ms_per_token(model, context: int, new_tokens: int, repeats: int, device: str) -> dict:
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

    generate(new_tokens + 1)  # warm-up
    first = [generate(1) for _ in range(repeats)]
    whole = [generate(new_tokens + 1) for _ in range(repeats)]
    per_token = (statistics.median(whole) - statistics.median(first)) / new_tokens
    return {"first_token_s": statistics.median(first), "ms_per_token": per_token * 1e3,
            "tokens_per_s": 1 / per_token, "attn_implementation": model.config._attn_implementation}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["e2b", "31b"], choices=sorted(TARGETS))
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny config on the CPU")
    args = ap.parse_args()
    import torch
    import transformers

    device = "cpu" if args.smoke else "cuda"
    env = {**environment(), "torch": torch.__version__, "transformers": transformers.__version__}
    print(env, flush=True)
    rows = []
    for name in (["smoke"] if args.smoke else args.models):
        t0 = time.perf_counter()
        model = build(SMOKE if name == "smoke" else TARGETS[name], device,
                      torch.float32 if args.smoke else torch.bfloat16)
        print(f"[{name}] weights in {time.perf_counter() - t0:.1f}s", flush=True)
        context, new = (16, 8) if args.smoke else (args.context, args.new_tokens)
        row = {"model": name, "batch": 1, "context": context, "new_tokens": new,
               **ms_per_token(model, context, new, args.repeats, device)}
        rows.append(row)
        print(row, flush=True)
        write_json("bench_hf_eager.json", {"env": env, "rows": rows})
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'model':6} {'ctx':>6} {'ms/token':>9} {'tok/s':>7} {'first s':>8}  attention")
    for r in rows:
        print(f"{r['model']:6} {r['context']:6d} {r['ms_per_token']:9.2f} {r['tokens_per_s']:7.1f} "
              f"{r['first_token_s']:8.3f}  {r['attn_implementation']}")


if __name__ == "__main__":
    main()
