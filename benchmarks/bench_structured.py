"""Structured output through the engine: the acceptance length with and without a grammar, whether every output
parses and validates, and the host's time filling grammar masks per round.

The same chat prompts (asking for a JSON object) run as B sequences at once through a speculative engine with
masked rounds (`EngineConfig.structured_outputs`): unconstrained, then under a JSON schema (bounded strings, so
that a small model's document ends within max_tokens), greedy and sampled. Reported per setting: mean acceptance
length and the rate at each draft position, the fraction of outputs the model ended (not cut by max_tokens) and of
those the fraction that parse and validate, output tokens per second, and milliseconds of mask filling per round
(engine.runner.Runner.mask_seconds). The acceptance and validity figures mean something only for a trained pair
(the demo pair by default); timings need the GPU.

    python benchmarks/bench_structured.py [--ckpt demo --assistant demo] [--batch 1 16] [--out structured.json]
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema
import numpy as np

from gemma4_mtp_jax.api import load_assistant, load_target
from gemma4_mtp_jax.engine import Engine, EngineConfig
from gemma4_mtp_jax.engine.grammar import GrammarSpec, Vocabulary, compile_grammar
from gemma4_mtp_jax.model.sampling import SamplingParams
from gemma4_mtp_jax.server.chat import TextTokenizer
from gemma4_mtp_jax.weights import demo

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
QUESTIONS = ["Describe a person as JSON with name, age and city.", "Give me a JSON record of a traveller.",
             "Write a JSON object about a friend: name, age, city.", "Reply in JSON: who lives in Paris?"]


def run(engine: Engine, tokenizer, prompts: list[list[int]], grammar, temperature: float, max_new: int) -> dict:
    reqs = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=temperature, seed=i)
        reqs.append(engine.add_request(p, max_new, sp, grammar=None if grammar is None else grammar.matcher()))
    mask0, t0 = engine.runner.mask_seconds, time.perf_counter()
    engine.run()
    seconds = time.perf_counter() - t0
    rounds = [n for r in reqs for n in r.accepted_per_round]
    k = engine.k
    valid, stopped = 0, sum(r.finish_reason == "stop" for r in reqs)
    for r in reqs:
        if r.finish_reason != "stop":  # cut by max_tokens: no grammar makes a truncated document parse
            continue
        try:
            jsonschema.validate(json.loads(tokenizer.decode([t for t in r.output if t not in engine.eos_ids])),
                                SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"mean_acceptance_length": float(np.mean(rounds) + 1) if rounds else None,
            "rate_per_position": [float(np.mean([n > j for n in rounds])) for j in range(k)] if rounds else [],
            "stopped": stopped / len(reqs), "valid_of_stopped": valid / max(1, stopped),
            "output_tokens_per_s": sum(len(r.output) for r in reqs) / seconds,
            "mask_ms_per_round": 1e3 * (engine.runner.mask_seconds - mask0) / max(1, len(rounds) // len(reqs))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default="demo")
    ap.add_argument("--assistant", default="demo")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ckpt, helper = demo.resolve(args.ckpt, args.assistant)
    target, assistant = load_target(ckpt, args.dtype), load_assistant(helper, args.dtype)
    tokenizer = TextTokenizer(ckpt)
    engine = Engine(target, EngineConfig(max_num_seqs=max(args.batch), max_model_len=512, structured_outputs=True),
                    assistant=assistant)
    grammar = compile_grammar(GrammarSpec.json_schema(SCHEMA),
                              Vocabulary(tokenizer.tokenizer.to_str(), target.config.vocab_size, engine.eos_ids))
    results = []
    for B in args.batch:
        prompts = [tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
                   for i in range(B)]
        for temperature in args.temperatures:
            for name, g in (("none", None), ("json_schema", grammar)):
                row = {"batch": B, "temperature": temperature, "grammar": name,
                       **run(engine, tokenizer, prompts, g, temperature, args.max_new_tokens)}
                print(json.dumps(row))
                results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
