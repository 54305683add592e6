"""Realized speculative speedup of `generate` at batch 1, against the projection from the same run.

    python benchmarks/realized_speedup.py --corpus CORPUS_DIR [--ckpt demo --assistant demo]
    python benchmarks/realized_speedup.py --prompts acceptance_prompts.json

Two engines (max_num_seqs 1) serve every prompt, greedy, after a warm-up of both: plain (no assistant: the decode
program) and speculative (the assistant's speculative program). Plain is not the speculative engine with a request's
`speculative` flag off: that still runs the draft steps, and costs a whole round per token. Per request the decode
phase is
latency - TTFT (prefill excluded), which emits the reply's tokens after the first, so per request
    plain rate   = (plain tokens - 1) / plain decode time        (tokens/s)
    spec rate    = (spec tokens - 1) / speculative decode time
    realized     = spec rate / plain rate
    L            = tokens emitted per round (accepted drafts + bonus), measured on this request
Each mode's rate counts its own tokens: where bf16 outputs part ways (below) the two replies can differ in length,
and a ratio of decode totals would then compare different amounts of work. With `--bench-spec` (bench_spec.py's
JSON for the same pair at batch 1, run in the same session: the decode step and the speculative step timed alone,
as compiled programs; `--bench-spec-model` picks its rows),
    projected = L x t_decode / t_spec,
with this run's own L (the pair's measured acceptance, labelled so in the output, never another model's).
Medians over prompts; realized / projected says how much of the step-time arithmetic survives in the generation
loop (host work between steps, rounds cut short at the end of a reply).

Greedy speculative output equals plain output exactly when both run in float32 (`--dtype float32`; the script
then fails on any difference). In bf16 the verify forward (k+1 tokens) and the decode step (1 token) round
differently, so at a near-tie of the target's top two logits the two can part ways: the report gives the share of
identical outputs and where they first differ, and the timings compare decode time per token either way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402

from benchmarks.acceptance import chat_prompts, heldout_prompts  # noqa: E402
from gemma4_mtp_jax import demo  # noqa: E402
from gemma4_mtp_jax.api import load_assistant, load_target  # noqa: E402
from gemma4_mtp_jax.engine import Engine, EngineConfig  # noqa: E402
from gemma4_mtp_jax.generate import generate, load_tokenizer  # noqa: E402


def decode_time(stats: dict) -> float:
    return stats["latency_s"] - stats["ttft_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default="demo")
    ap.add_argument("--assistant", default="demo")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="JSON list of {source, ids} (benchmarks/acceptance.py writes it)")
    src.add_argument("--corpus", help="the demo corpus: held-out and chat prompts as benchmarks/acceptance.py makes them")
    ap.add_argument("--per-source", type=int, default=8, help="prompts per source")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=None, help="drafts per round (default: the assistant's)")
    ap.add_argument("--bench-spec", default=None, help="bench_spec.py's JSON (decode_ms, spec_ms at batch 1)")
    ap.add_argument("--bench-spec-model", default="demo",
                    help="the model of --bench-spec's rows to take (bench_spec.py --models NAME; default: demo)")
    ap.add_argument("--dtype", default=None, help="default: the checkpoint's (bf16 for the demo pair)")
    ap.add_argument("--out", default="realized_speedup.json")
    args = ap.parse_args()

    ckpt, assistant_ckpt = demo.resolve(args.ckpt, args.assistant)
    target, assistant = load_target(ckpt, args.dtype), load_assistant(assistant_ckpt, args.dtype)
    exact = target.dtype == jnp.float32
    if args.prompts:
        records = json.loads(Path(args.prompts).read_text())
    else:
        tok = load_tokenizer(target.path)
        records = [{"source": "heldout", "ids": ids} for ids in
                   heldout_prompts(tok, Path(args.corpus), args.per_source, 64, target.config.bos_token_id)]
        records += [{"source": "chat", "ids": ids} for ids in chat_prompts(Path(target.path), tok, args.per_source)]
    prompts = []
    for source in sorted({r["source"] for r in records}):
        prompts += [(source, r["ids"]) for r in records if r["source"] == source][: args.per_source]
    longest = max(len(ids) for _, ids in prompts) + args.max_new_tokens
    t0 = time.perf_counter()
    engine = Engine(target, EngineConfig(max_num_seqs=1, max_model_len=longest, num_speculative_tokens=args.k),
                    assistant=assistant)
    plain_engine = Engine(target, EngineConfig(max_num_seqs=1, max_model_len=longest))
    for eng in (plain_engine, engine):  # warm-up: every program these requests use is compiled before timing
        generate(target, [prompts[0][1]], args.max_new_tokens, engine=eng)
    print(f"engine + warm-up: {time.perf_counter() - t0:.1f} s", flush=True)

    rows, compared = [], []
    for source, ids in prompts:
        plain = generate(target, [ids], args.max_new_tokens, engine=plain_engine)[0]
        spec = generate(target, [ids], args.max_new_tokens, engine=engine)[0]
        same = spec.tokens == plain.tokens
        if exact and not same:
            raise SystemExit(f"greedy speculative output differs from plain in float32 ({source} prompt {ids[:8]}...)")
        diverge = next((i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens)) if a != b), None)
        n_plain, n_spec = len(plain.tokens), len(spec.tokens)
        compared.append({"source": source, "same": same, "first_divergence": diverge, "plain_tokens": n_plain,
                         "spec_tokens": n_spec})
        if min(n_plain, n_spec) < 8:
            continue  # a reply of a few tokens measures prefill, not decoding
        ps, ss = plain.stats, spec.stats
        plain_rate, spec_rate = (n_plain - 1) / decode_time(ps), (n_spec - 1) / decode_time(ss)
        rows.append({"source": source, "plain_tokens": n_plain, "spec_tokens": n_spec, "rounds": ss["rounds"],
                     "L": ss["mean_acceptance_length"],
                     "loop_plain_ms_per_token": 1e3 / plain_rate, "loop_spec_ms_per_token": 1e3 / spec_rate,
                     "loop_spec_ms_per_round": 1e3 * decode_time(ss) / ss["rounds"],
                     "plain_tokens_per_s": plain_rate, "spec_tokens_per_s": spec_rate,
                     "realized": spec_rate / plain_rate})
    if not rows:
        raise SystemExit(f"every reply was shorter than 8 tokens: nothing to time (--max-new-tokens "
                         f"{args.max_new_tokens})")
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "source"}
    med["L_source"] = "measured: this run's speculative requests (tokens per round, median over prompts)"
    if args.bench_spec:
        rows_in = json.loads(Path(args.bench_spec).read_text())["rows"]
        b1 = [r for r in rows_in if r["model"] == args.bench_spec_model and r["batch"] == 1 and r["k"] == engine.k]
        if not b1:
            raise SystemExit(f"--bench-spec {args.bench_spec}: no row of model {args.bench_spec_model!r} at batch 1 "
                             f"with k = {engine.k} (models there: {sorted({r['model'] for r in rows_in})})")
        med["step_times_model"] = args.bench_spec_model
        med["step_decode_ms"], med["step_spec_ms"] = b1[0]["decode_ms"], b1[0]["spec_ms"]
        for r in rows:
            r["projected"] = r["L"] * b1[0]["decode_ms"] / b1[0]["spec_ms"]
        med["projected"] = statistics.median(r["projected"] for r in rows)
        med["realized_over_projected"] = statistics.median(r["realized"] / r["projected"] for r in rows)
    med["same_output"] = sum(c["same"] for c in compared) / len(compared)
    report = {"ckpt": str(ckpt), "assistant": str(assistant_ckpt), "dtype": jnp.dtype(target.dtype).name,
              "k": engine.k, "batch": 1, "max_new_tokens": args.max_new_tokens, "prompts": len(rows), "median": med,
              "rows": rows, "spec_vs_plain_output": compared}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({"dtype": report["dtype"], "k": engine.k, "prompts": len(rows), "median": med,
                      "first_divergence": [c["first_divergence"] for c in compared]}, indent=2))


if __name__ == "__main__":
    main()
