"""Acceptance of a target + MTP assistant pair in our engine: per draft position and mean acceptance length, for
k = 1..8 drafts per round, greedy and sampled, on held-out corpus prompts and on chat prompts.

    python benchmarks/acceptance.py --corpus CORPUS_DIR [--ckpt demo --assistant demo] [--out acceptance.json]
        [--sources heldout,chat,heldout_chat] [--quantization fp8 --kv-cache-dtype fp8 --compare bf16.json]

Prompts, `--prompts-per-source` of each source:
- heldout: held-out passages (the first --prompt-len tokens of evenly spaced paragraphs of CORPUS_DIR/heldout,
  <bos> first): text neither model saw. The sources in --heldout-skip-sources are left out (default: Shakespeare,
  which the shipped pair's corpus did not have: its held-out text is out of the pair's domain, not just unseen).
- chat: CHAT_PROMPTS below, through the target's chat template. Not unseen text for the demo pair: they follow
  the training chat templates (gemma4_mtp_jax/train/corpus.py), and several ask to continue or quote passages of
  the training text (the opening of Pride and Prejudice, Genesis 1:1, the first line of Paradise Lost).
- heldout_chat: the first user turn of evenly spaced examples of CORPUS_DIR/heldout/chat.jsonl, through the chat
  template: chat examples that corpus.py built from the held-out text alone, so the passages they quote or
  continue are unseen (the request templates are the training ones). Examples of the template kinds in
  --heldout-chat-skip are left out (default: Shakespeare's, for the same reason).
They are written to --prompts-out, the file benchmarks/acceptance_hf.py reads, so transformers' assisted
generation sees exactly the same token ids.

Counting: a round proposes k drafts and the target accepts the longest agreeing prefix (greedy) or what rejection
sampling keeps (T > 0); "rate at position j" is the fraction of rounds that accepted at least j drafts, and the mean
acceptance length is the tokens a round emits, accepted drafts + the bonus token, averaged over rounds. A round the
engine cut short (stop token or max_tokens) counts with what it accepted before the cut, as the engine reports it.
Numbers, not timings: this runs on any device.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ (the corpus's chat templates)

from gemma4_mtp_jax.weights import demo
from gemma4_mtp_jax.api import load_assistant, load_target
from gemma4_mtp_jax.engine import Engine, EngineConfig
from gemma4_mtp_jax.generate import generate, load_tokenizer
from gemma4_mtp_jax.model.sampling import SamplingParams

# The demo corpus's sources that the shipped pair never trained on (scripts/fetch_demo_corpus.sh added them later),
# and their chat template kinds in gemma4_mtp_jax/train/corpus.py: left out of the held-out prompts by default.
PAIR_UNSEEN_SOURCES = ("shakespeare",)
PAIR_UNSEEN_CHAT_KINDS = ("shakespeare", "shakespeare_scene", "shakespeare_poem")

CHAT_PROMPTS = [
    "Who is Mr. Darcy?",
    "Tell me about Elizabeth Bennet and her sisters.",
    "Write a short letter from Emma to Harriet.",
    "What happens at the ball at Netherfield?",
    "Describe a walk in the country in the style of Jane Austen.",
    "What does Genesis 1:1 say?",
    "Tell me the story of Noah and the flood.",
    "What does the Lord say to Moses on the mountain?",
    "Quote a verse from the Psalms about the shepherd.",
    "What did Jesus teach about love?",
    "Quote a line of Milton about paradise.",
    "Write a few lines of verse about the fall of Satan.",
    "What is Paradise Lost about?",
    "Show me Python code that reads a file line by line.",
    "Write a Python function that returns the maximum of a list.",
    "Show me Python code that parses command line arguments.",
    "How do I open a socket in Python?",
    "Write a Python class for a simple queue.",
    "Continue this passage: It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife.",
    "Continue this passage: In the beginning, God created the heavens and the earth.",
    "Continue this passage: Of Man's first disobedience, and the fruit of that forbidden tree.",
    "Who was Anne Elliot?",
    "What is a good way to spend a rainy afternoon?",
    "Tell me about a marriage proposal in one of the novels.",
    "Write a paragraph about a young woman who receives a letter.",
    "What does the Bible say about wisdom?",
    "Explain what a Python generator is.",
    "Write Python code that sorts a dictionary by value.",
    "Describe the garden of Eden.",
    "Who is Mr. Knightley?",
    "Write a short poem about the morning.",
    "What does Proverbs say about a soft answer?",
]


def heldout_prompts(tokenizer, corpus: Path, count: int, prompt_len: int, bos_id: int,
                    skip_sources: tuple[str, ...] = PAIR_UNSEEN_SOURCES) -> list[list[int]]:
    """`count` prompts: the first prompt_len tokens of paragraphs spread evenly over the held-out .txt files
    (heldout/<source>/...), those of `skip_sources` left out."""
    paragraphs = []
    for f in sorted((corpus / "heldout").rglob("*.txt")):
        if f.relative_to(corpus / "heldout").parts[0] in skip_sources:
            continue
        for para in f.read_text(encoding="utf-8").split("\n\n"):
            ids = tokenizer.encode(para.strip(), add_special_tokens=False).ids
            if len(ids) >= prompt_len:
                paragraphs.append(ids[:prompt_len])
    if len(paragraphs) < count:
        raise SystemExit(f"--corpus {corpus}: {len(paragraphs)} held-out paragraphs of >= {prompt_len} tokens, "
                         f"fewer than {count}")
    pick = np.linspace(0, len(paragraphs) - 1, count).round().astype(int)
    return [[bos_id] + paragraphs[i] for i in pick]


def _render_chat(target_dir: Path, tokenizer, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn through the target's chat template, tokenised."""
    from gemma4_mtp_jax.server.chat import ChatTemplate

    cfg = json.loads((target_dir / "tokenizer_config.json").read_text())
    specials = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token") if k in cfg}
    template = ChatTemplate(cfg["chat_template"], specials, str(target_dir / "tokenizer_config.json"))
    texts = [template.render([{"role": "user", "content": q}]) for q in questions]
    return [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]


def chat_prompts(target_dir: Path, tokenizer, count: int) -> list[list[int]]:
    return _render_chat(target_dir, tokenizer, (CHAT_PROMPTS * 4)[:count])


def _template_kind_patterns(kinds: list[str]) -> list[re.Pattern]:
    """Regexes of corpus.py's chat request templates of these kinds ({x}, {y}: any text)."""
    from tools.corpus import _CHAT_PROMPTS

    unknown = set(kinds) - set(_CHAT_PROMPTS)
    if unknown:
        raise SystemExit(f"--heldout-chat-skip: unknown template kinds {sorted(unknown)}; known: "
                         f"{sorted(_CHAT_PROMPTS)}")
    return [re.compile(re.escape(t).replace(r"\{x\}", "(.+)").replace(r"\{y\}", "(.+)"), re.S)
            for kind in kinds for t in _CHAT_PROMPTS[kind]]


def heldout_chat_prompts(target_dir: Path, tokenizer, corpus: Path, count: int,
                         skip_kinds: list[str]) -> list[list[int]]:
    """`count` prompts: the first user turn of evenly spaced examples of corpus/heldout/chat.jsonl (built from
    the held-out text alone), leaving out requests that match a template of `skip_kinds`."""
    path = corpus / "heldout" / "chat.jsonl"
    if not path.is_file():
        raise SystemExit(f"--corpus {corpus}: no heldout/chat.jsonl (python -m gemma4_mtp_jax.train.corpus writes it)")
    skip = _template_kind_patterns(skip_kinds)
    questions = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = json.loads(line)["text"]
        user = text.split("<start_of_turn>user\n", 1)[1].split("<end_of_turn>", 1)[0]
        if not any(p.fullmatch(user) for p in skip):
            questions.append(user)
    if len(questions) < count:
        raise SystemExit(f"--corpus {corpus}: {len(questions)} held-out chat examples left, fewer than {count}")
    pick = np.linspace(0, len(questions) - 1, count).round().astype(int)
    return _render_chat(target_dir, tokenizer, [questions[i] for i in pick])


def summarize(stats: list[dict], k: int) -> dict:
    rounds = sum(s.get("rounds", 0) for s in stats)
    per_pos = np.zeros(k)
    for s in stats:
        if s.get("accepted_per_position"):
            per_pos += np.asarray(s["accepted_per_position"][:k])
    accepted = int(sum(s.get("accepted", 0) for s in stats))
    return {"rounds": rounds, "accepted": accepted, "generated": int(sum(s["generated_tokens"] for s in stats)),
            "mean_acceptance_length": (accepted + rounds) / max(rounds, 1),
            "rate_per_position": (per_pos / max(rounds, 1)).round(4).tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default="demo")
    ap.add_argument("--assistant", default="demo")
    ap.add_argument("--corpus", required=True, help="the demo corpus directory (its heldout/ part is read)")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--sources", default="heldout,chat,heldout_chat", help="prompt sources (see above)")
    ap.add_argument("--heldout-skip-sources", default=",".join(PAIR_UNSEEN_SOURCES),
                    help="corpus sources left out of heldout ('' keeps every one)")
    ap.add_argument("--heldout-chat-skip", default=",".join(PAIR_UNSEEN_CHAT_KINDS),
                    help="corpus.py chat template kinds left out of heldout_chat ('' keeps every example)")
    ap.add_argument("--prompts-per-source", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="default: the checkpoint's (bf16 for the demo pair)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts-out", default="acceptance_prompts.json")
    ap.add_argument("--out", default="acceptance.json")
    ap.add_argument("--quantization", default=None, choices=["none", "fp8"],
                    help="the target's weights (default: the checkpoint's own)")
    ap.add_argument("--quantization-assistant", default=None, choices=["none", "fp8"],
                    help="the assistant's weights (default: the checkpoint's own)")
    ap.add_argument("--kv-cache-dtype", default=None, choices=["auto", "bfloat16", "float32", "fp8"],
                    help="the K/V cache (default: auto, the target's dtype)")
    ap.add_argument("--compare", default=None, metavar="JSON",
                    help="another run's --out (e.g. bf16 beside this fp8 one): print each row's acceptance length "
                         "against it, and how many greedy outputs are token for token the same")
    args = ap.parse_args()

    ckpt, assistant_ckpt = demo.resolve(args.ckpt, args.assistant)
    target = load_target(ckpt, args.dtype, quantization=args.quantization)
    assistant = load_assistant(assistant_ckpt, args.dtype, quantization=args.quantization_assistant)
    tok = load_tokenizer(target.path)
    n = args.prompts_per_source
    makers = {"heldout": lambda: heldout_prompts(tok, Path(args.corpus), n, args.prompt_len,
                                                 target.config.bos_token_id,
                                                 tuple(x for x in args.heldout_skip_sources.split(",") if x)),
              "chat": lambda: chat_prompts(Path(target.path), tok, n),
              "heldout_chat": lambda: heldout_chat_prompts(Path(target.path), tok, Path(args.corpus), n,
                                                           [k for k in args.heldout_chat_skip.split(",") if k])}
    sources = [s for s in args.sources.split(",") if s]
    if not sources or set(sources) - set(makers):
        ap.error(f"--sources: expected some of {','.join(makers)}, got {args.sources!r}")
    prompts = {s: makers[s]() for s in sources}
    Path(args.prompts_out).write_text(json.dumps(
        [{"source": s, "ids": ids} for s, ps in prompts.items() for ids in ps]))
    flat = [(s, ids) for s, ps in prompts.items() for ids in ps]
    longest = max(len(ids) for _, ids in flat) + args.max_new_tokens
    temps = [float(t) for t in args.temperatures.split(",")]
    results = []
    for k in [int(x) for x in args.ks.split(",")]:
        t0 = time.perf_counter()
        engine = Engine(target, EngineConfig(max_num_seqs=len(flat), max_model_len=longest,
                                             num_speculative_tokens=k, cache_dtype=args.kv_cache_dtype),
                        assistant=assistant)
        for temp in temps:
            sampling = [SamplingParams(temperature=temp, seed=args.seed * 100_003 + i) if temp > 0 else SamplingParams()
                        for i in range(len(flat))]
            out = generate(target, [ids for _, ids in flat], args.max_new_tokens, sampling, engine=engine)
            for source in prompts:
                stats = [o.stats for (s, _), o in zip(flat, out) if s == source]
                rec = {"k": k, "temperature": temp, "source": source, **summarize(stats, k)}
                if temp == 0:  # the greedy text, to compare formats token for token
                    rec["outputs"] = [o.tokens for (s, _), o in zip(flat, out) if s == source]
                results.append(rec)
                print(f"k={k} T={temp} {source:12s} L={rec['mean_acceptance_length']:.2f} "
                      f"per-position {rec['rate_per_position']}", flush=True)
        print(f"  (k={k}: {time.perf_counter() - t0:.0f} s)", flush=True)
    report = {"ckpt": str(ckpt), "assistant": str(assistant_ckpt), "dtype": str(target.dtype),
              "quantization": args.quantization, "quantization_assistant": args.quantization_assistant,
              "kv_cache_dtype": args.kv_cache_dtype,
              "prompts_per_source": n, "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2))
    if args.compare:
        compare(json.loads(Path(args.compare).read_text()), report)


def compare(base: dict, run: dict) -> None:
    """Each row's mean acceptance length and per-position rates beside `base`'s row of the same k, temperature and
    source, and (greedy) the outputs equal token for token and the mean length of their common prefix."""
    rows = {(r["k"], r["temperature"], r["source"]): r for r in base["results"]}
    print(f"\nagainst {base.get('quantization')} weights, {base.get('kv_cache_dtype')} cache:")
    for r in run["results"]:
        b = rows.get((r["k"], r["temperature"], r["source"]))
        if b is None:
            continue
        L, Lb = r["mean_acceptance_length"], b["mean_acceptance_length"]
        line = (f"k={r['k']} T={r['temperature']} {r['source']:12s} L {L:.3f} vs {Lb:.3f} ({100 * (L / Lb - 1):+.1f} %)"
                f" per-position {r['rate_per_position']} vs {b['rate_per_position']}")
        if "outputs" in r and "outputs" in b:
            same = sum(x == y for x, y in zip(r["outputs"], b["outputs"]))
            prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                      for x, y in zip(r["outputs"], b["outputs"])]
            line += f"; greedy outputs equal {same}/{len(prefix)}, common prefix {np.mean(prefix):.1f} tokens"
        print(line)


if __name__ == "__main__":
    main()
