"""`generate` for research scripts, and its CLI: `python -m gemma4_mtp_jax.generate --ckpt DIR --prompt TEXT`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax

from gemma4_mtp_jax.weights import demo

from gemma4_mtp_jax.engine import distributed
from gemma4_mtp_jax.api import Assistant, Target, load_assistant, load_target
from gemma4_mtp_jax.engine import Engine, EngineConfig, RequestError
from gemma4_mtp_jax.engine.config import CACHE_DTYPES
from gemma4_mtp_jax.model.sampling import SamplingParams
from gemma4_mtp_jax.programs.compiled import enable_compilation_cache
from gemma4_mtp_jax.server.flags import SPECULATIVE_K_CHOICES, SPECULATIVE_K_HELP, adaptive, add_multihost_arguments


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]  # generated token ids (an EOS that stopped generation included)
    stats: dict[str, Any]
    text: str | None = None


def load_tokenizer(directory: str | Path):
    """The checkpoint's `tokenizer.json` through the `tokenizers` library, or None if it has none."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def generate(
    target: Target,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    assistant: Assistant | None = None,
    engine: Engine | None = None,
    engine_config: EngineConfig | None = None,
    stop_ids: frozenset[int] | None = None,
    speculative: bool = True,
) -> list[GenerationResult]:
    """Generate for a list of tokenised prompts, all batched together by the engine.

    sampling: one SamplingParams for all prompts or one per prompt (default greedy). With an `assistant`,
    decoding is speculative (`speculative=False` turns it off for these prompts). Pass an `engine` to reuse its
    compiled programs across calls; otherwise one is built (and compiled) for this call. A prompt whose own part
    of a step fails ends alone with `stats["finish_reason"] == "error"` and the reason in `stats["error"]`.
    """
    if engine is None:
        longest = max((len(p) for p in prompts), default=1) + max_new_tokens
        cfg = engine_config or EngineConfig(max_num_seqs=max(1, len(prompts)), max_model_len=max(longest, 2))
        engine = Engine(target, cfg, assistant=assistant)
    if sampling is None or isinstance(sampling, SamplingParams):
        sampling = [sampling or SamplingParams()] * len(prompts)
    if len(sampling) != len(prompts):
        raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
    t0 = time.perf_counter()
    reqs = [engine.add_request(list(p), max_new_tokens, s, stop_ids, speculative=speculative)
            for p, s in zip(prompts, sampling)]
    engine.run()
    wall = time.perf_counter() - t0
    out = []
    for r in reqs:
        stats = r.stats()
        stats["batch_wall_s"] = wall
        if r.finish_reason == "error":  # this prompt alone failed (the engine isolates it); say why
            stats["error"] = r.error
        out.append(GenerationResult(list(r.output), stats))
    return out


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids expects comma-separated integers, got '{text}'") from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gemma4_mtp_jax.generate",
        description="Generate with a Gemma 4 checkpoint; prints JSON with the tokens and stats of each prompt.",
    )
    ap.add_argument("--ckpt", default="demo",
                    help="target checkpoint: HF directory, converted Orbax directory, hub id, or 'demo' (default): "
                         "the small trained demo pair shipped in the package")
    ap.add_argument("--assistant", default=None,
                    help="MTP assistant checkpoint for speculative decoding (HF dir, Orbax dir, hub id, or 'demo')")
    ap.add_argument("--num-speculative-tokens", type=int, default=None,
                    help="drafts per round with --assistant: every round's with --speculative-k fixed, the most a "
                         "round drafts with auto (default: the assistant's num_assistant_tokens, else 4)")
    ap.add_argument("--speculative-k", choices=SPECULATIVE_K_CHOICES, default=None, help=SPECULATIVE_K_HELP)
    ap.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat for a batch)")
    ap.add_argument("--prompt-ids", action="append", type=_parse_ids, default=[],
                    help="a prompt as comma-separated token ids, e.g. 2,651,1234 (repeat for a batch)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (1.0 = off)")
    ap.add_argument("--seed", type=int, default=None, help="sampling seed (per prompt: seed + index)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="parameter dtype (default: checkpoint's)")
    ap.add_argument("--quantization", choices=["none", "fp8"], default=None,
                    help="target weights: fp8 (weight-only, quantized at load from a float checkpoint) or none (an fp8 "
                         "checkpoint dequantized); default: the checkpoint's own")
    ap.add_argument("--quantization-assistant", choices=["none", "fp8"], default=None,
                    help="the assistant's weights, as --quantization (default: the checkpoint's own)")
    ap.add_argument("--max-model-len", type=int, default=None, help="max prompt + generated tokens per sequence")
    ap.add_argument("--page-size", type=int, default=16, help="KV page size in tokens (default 16)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", *CACHE_DTYPES], default="auto",
                    help="KV cache dtype (default auto: the parameters'); fp8: float8 e4m3fn with static per-layer "
                         "scales, on a GPU of compute capability >= 8.9")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                    help="devices to split the model over (default 1)")
    ap.add_argument("--compilation-cache-dir", default=None,
                    help="JAX persistent compilation cache (default ~/.cache/gemma4_mtp_jax/jax_cache; 'none': off)")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    add_multihost_arguments(ap)
    args = ap.parse_args(argv)

    def info(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    try:
        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
        if not args.prompt and not args.prompt_ids:
            raise RequestError("give at least one --prompt or --prompt-ids")
        t0 = time.perf_counter()
        ckpt, assistant_ckpt = demo.resolve(args.ckpt, args.assistant)
        if "demo" in (args.ckpt, args.assistant):
            info(f"demo pair: {demo.PACKAGED}")
        spread = args.tensor_parallel_size > 1  # each tensor goes from host memory straight onto its shards
        target = load_target(ckpt, args.dtype, on_host=spread, quantization=args.quantization)
        assistant = load_assistant(assistant_ckpt, args.dtype, on_host=spread,
                                   quantization=args.quantization_assistant) if assistant_ckpt else None
        info(f"loaded {args.ckpt} in {time.perf_counter() - t0:.1f}s")
        tok = load_tokenizer(target.path)
        prompts = [list(p) for p in args.prompt_ids]
        if args.prompt:
            if tok is None:
                raise RequestError(f"{target.path} has no tokenizer.json: use --prompt-ids")
            prompts += [tok.encode(p).ids for p in args.prompt]
        sampling = [
            SamplingParams(args.temperature, args.top_k, args.top_p, None if args.seed is None else args.seed + i)
            for i in range(len(prompts))
        ]
        longest = max(len(p) for p in prompts) + args.max_new_tokens
        cfg = EngineConfig(max_num_seqs=len(prompts), max_model_len=args.max_model_len or longest,
                           page_size=args.page_size, num_speculative_tokens=args.num_speculative_tokens,
                           # Across processes each engine would choose its round sizes from its own timings, and
                           # two that chose differently would wait for each other in a collective: a fixed k there.
                           adaptive_speculation=assistant is not None and jax.process_count() == 1
                           and adaptive(args.speculative_k, args.num_speculative_tokens),
                           cache_dtype=args.kv_cache_dtype,
                           tensor_parallel_size=args.tensor_parallel_size)
        enable_compilation_cache(args.compilation_cache_dir)
        t0 = time.perf_counter()
        engine = Engine(target, cfg, progress=lambda name, s: info(f"compiled {name} in {s:.1f}s"),
                        assistant=assistant)
        info(f"compiled {len(engine.compile_times)} programs in {time.perf_counter() - t0:.1f}s")
        results = generate(target, prompts, args.max_new_tokens, sampling, engine=engine)
    except (RequestError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = []
    for p, r in zip(prompts, results):
        item = {"prompt_ids": p, "tokens": r.tokens, "stats": r.stats}
        if tok is not None:
            item["text"] = tok.decode(r.tokens)
        out.append(item)
    if jax.process_index() == 0:  # every process of a multi-host run holds the same result
        print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
