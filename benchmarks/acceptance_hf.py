"""Acceptance of transformers' own assisted generation on a Gemma 4 target + MTP assistant pair (torch, CPU).

Why: our engine's acceptance figures need a reference measured on the same pair and the same prompt token ids by
the implementation the checkpoints were released for. This script runs `target.generate(..., assistant_model=...)`
unchanged and only *observes* it: transformers calls `candidate_generator.update_candidate_strategy(input_ids,
scores, num_matches)` once per round, right after verification, with `scores` holding the target's logits for the
round's `drafts + 1` positions and `num_matches` the number of drafts kept. For a Gemma 4 assistant the generator
is `SinglePositionMultiTokenCandidateGenerator`, whose hook is a no-op, so wrapping it changes nothing.

Usage:
    python benchmarks/acceptance_hf.py --target DIR --assistant DIR --prompts-json FILE \\
        [--ks 1,2,4,8] [--temperatures 0,0.8] [--max-new-tokens 128] [--dtype float32|bfloat16] [--seed 0] \\
        [--out results.json]

FILE: a JSON list of {"source": "heldout" | "chat" | "heldout_chat", "ids": [prompt token ids, <bos> included]};
the ids are fed as they are (no re-tokenising), so this sees exactly what our engine's benchmark sees.

Which rounds count (the `rounds` of the report): a round is one target verify forward that followed a draft. Left
out of the acceptance statistics, but not of `tokens_generated` / `wall_s`:
  * rounds with no draft: the prefill forward (transformers drafts only from the second forward on) and forwards
    where max_new_tokens left no room to draft;
  * rounds that drafted fewer than k tokens: transformers caps a draft at the tokens left before max_new_tokens;
  * the round that ended the generation (eos or max_new_tokens): transformers crops the kept tokens at the first
    eos / at the length limit and reports the cropped count, so its count may understate what verification
    accepted. We drop that one round per prompt rather than guess (with ~128 new tokens it is one round in tens).
`rounds_excluded` reports how many were dropped.

How transformers 5.24 drafts with a Gemma 4 assistant, and where it differs from our engine (docs/DESIGN.md conventions),
so that the figures are compared knowingly:
  * Same: query position P (the bonus token's) for all k steps; step 1 gets the target's post-norm hidden at P-1
    (`hidden_states[-1]`), later steps the assistant's `post_projection` output; full-acceptance rounds see exactly
    the committed K/V.
  * After a partial acceptance (n < k) the assistant also sees stale K/V of rejected drafts: full layers one entry
    (position P, the first rejected draft); sliding layers, once past the window, attend the last W+1 entries of the
    verify forward's K/V, i.e. k-n rejected-draft entries at positions >= P instead of the oldest k-n committed ones.
  * Drafts are always the assistant's argmax; its generation_config (e.g. `suppress_tokens`) and the logits
    processors are not applied to it. At T > 0 the acceptance ratio uses q = softmax of the raw assistant logits
    (temperature 1, no top-k/p; the centroid head fills non-candidates with min-1, not -inf) evaluated at that argmax
    draft, whereas our engine samples the draft from q at the request's temperature. Sampled figures are therefore
    those of a different (and not exactly lossless) algorithm; greedy ones are directly comparable up to the stale
    K/V above.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import torch

SOURCES = ("heldout", "chat", "heldout_chat")  # benchmarks/acceptance.py's prompt sources
GREEDY_CHECK_PROMPTS = 3  # prompts whose greedy assisted output is compared with plain greedy `generate`


# ----------------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Prompt:
    index: int
    source: str
    ids: list[int]


def load_prompts(path: Path, vocab_size: int) -> list[Prompt]:
    """Read and validate the prompt file; errors name the file and the offending entry."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"--prompts-json {path}: no such file")
    except json.JSONDecodeError as e:
        raise SystemExit(f"--prompts-json {path}: not valid JSON ({e})")
    if not isinstance(data, list) or not data:
        raise SystemExit(f"--prompts-json {path}: expected a non-empty JSON list of {{'source', 'ids'}} objects")
    prompts = []
    for i, entry in enumerate(data):
        where = f"--prompts-json {path}, entry {i}"
        if not isinstance(entry, dict) or "source" not in entry or "ids" not in entry:
            raise SystemExit(f"{where}: expected an object with keys 'source' and 'ids'")
        source, ids = entry["source"], entry["ids"]
        if source not in SOURCES:
            raise SystemExit(f"{where}: source {source!r} is not one of {SOURCES}")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise SystemExit(f"{where}: 'ids' must be a non-empty list of integers")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise SystemExit(f"{where}: token ids {bad[:5]} outside the target's vocabulary [0, {vocab_size})")
        prompts.append(Prompt(i, source, ids))
    return prompts


def parse_list(flag: str, text: str, kind: type) -> list:
    """Comma-separated numbers for --ks / --temperatures; errors name the flag."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: expected comma-separated {kind.__name__} values")
    if not values:
        raise SystemExit(f"{flag}: no values given")
    if kind is int and any(v < 1 for v in values):
        raise SystemExit(f"{flag} {text!r}: every k must be >= 1")
    if kind is float and any(v < 0 for v in values):
        raise SystemExit(f"{flag} {text!r}: temperatures must be >= 0")
    return values


def load_pair(target_dir: Path, assistant_dir: Path, dtype: torch.dtype):
    """Target via AutoModelForCausalLM (Gemma4ForCausalLM for a `gemma4_text` config), assistant via
    Gemma4AssistantForCausalLM (Gemma4UnifiedAssistantForCausalLM for the 12B's `gemma4_unified_assistant`):
    transformers picks its Gemma 4 drafting path from the assistant's class name."""
    import json

    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    for flag, d in (("--target", target_dir), ("--assistant", assistant_dir)):
        if not (d / "config.json").is_file():
            raise SystemExit(f"{flag} {d}: no config.json there (expected a Hugging Face checkpoint directory)")
    unified = json.loads((assistant_dir / "config.json").read_text()).get("model_type") == "gemma4_unified_assistant"
    assistant_cls = "Gemma4UnifiedAssistantForCausalLM" if unified else "Gemma4AssistantForCausalLM"
    hf_logging.disable_progress_bar()
    try:
        target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
    except Exception as e:  # the message of from_pretrained alone does not say which flag was at fault
        raise SystemExit(f"--target {target_dir}: transformers could not load it ({type(e).__name__}: {e})")
    try:
        assistant = getattr(transformers, assistant_cls).from_pretrained(str(assistant_dir), dtype=dtype).eval()
    except Exception as e:
        raise SystemExit(f"--assistant {assistant_dir}: transformers could not load it as "
                         f"{assistant_cls} ({type(e).__name__}: {e})")
    if not type(target).__name__.startswith("Gemma4"):
        raise SystemExit(f"--target {target_dir}: loaded as {type(target).__name__}; transformers drafts with a "
                         "Gemma 4 assistant only for a Gemma 4 (or Gemma 3n) target")
    return target, assistant


def eos_ids(target) -> list[int]:
    eos = target.generation_config.eos_token_id
    if eos is None:
        raise SystemExit("--target: generation_config.json has no eos_token_id; generation would never stop on eos")
    return [eos] if isinstance(eos, int) else list(eos)


# ----------------------------------------------------------------------------------------------------------------------
# Observing transformers' rounds
# ----------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Round:
    drafted: int  # drafts verified in this forward (0 for the prefill forward)
    accepted: int  # drafts kept, as transformers reports it (after its eos / length cropping)
    length: int  # sequence length (prompt included) after the round


@contextlib.contextmanager
def observe_rounds() -> Iterator[list[Round]]:
    """Record every round of transformers' assisted decoding while the context is open.

    Wraps `SinglePositionMultiTokenCandidateGenerator.update_candidate_strategy` (the per-round hook) at class
    level, calling the original afterwards, and restores it on exit. `scores` has shape [1, drafted + 1, V].
    """
    from transformers.generation import candidate_generator as cg

    cls = cg.SinglePositionMultiTokenCandidateGenerator
    original = cls.update_candidate_strategy
    rounds: list[Round] = []

    def hook(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        rounds.append(Round(int(scores.shape[1]) - 1, int(num_matches), int(input_ids.shape[1])))
        return original(self, input_ids, scores, num_matches)

    cls.update_candidate_strategy = hook
    try:
        yield rounds
    finally:
        cls.update_candidate_strategy = original


def sampling_kwargs(temperature: float) -> dict[str, Any]:
    """Greedy at T=0; otherwise pure temperature sampling (top_k=0 and top_p=1.0 switch those warpers off)."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


@torch.inference_mode()
def run_one(target, assistant, prompt: Prompt, *, k: int | None, temperature: float, max_new_tokens: int,
            eos: list[int], seed: int) -> tuple[list[int], list[Round], float]:
    """One generation at batch 1: (new token ids, rounds, wall seconds). k=None means plain `generate`."""
    ids = torch.tensor([prompt.ids], dtype=torch.long)
    kwargs: dict[str, Any] = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=target.generation_config.pad_token_id if target.generation_config.pad_token_id is not None
        else eos[0],
        **sampling_kwargs(temperature),
    )
    if k is not None:
        # SinglePositionMultiTokenCandidateGenerator reads the draft length from the *assistant's* generation_config
        # (a `num_assistant_tokens` generate kwarg would land on the target's config and be ignored); it has no
        # schedule of its own, "constant" just states the intent. The draft lengths seen are checked by the caller.
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        kwargs["assistant_model"] = assistant
    torch.manual_seed(seed)
    with observe_rounds() as rounds:
        t0 = time.perf_counter()
        out = target.generate(ids, **kwargs)
        wall = time.perf_counter() - t0
    return out[0, ids.shape[1]:].tolist(), list(rounds), wall


def unexpected_draft_lengths(prompts: list[Prompt], runs: list[tuple[list[int], list[Round], float]], k: int,
                             max_new_tokens: int) -> list[tuple[int, int, int]]:
    """Check that transformers drafted exactly k per round, except where it must cap the draft: it drafts
    min(k, max_length - len - 1) tokens from a sequence of length len. Returns (prompt, round, drafted) offenders."""
    bad = []
    for p, (_, rounds, _) in zip(prompts, runs):
        max_length = len(p.ids) + max_new_tokens
        for i in range(1, len(rounds)):
            expected = max(0, min(k, max_length - rounds[i - 1].length - 1))
            if rounds[i].drafted != expected:
                bad.append((p.index, i, rounds[i].drafted))
        if rounds and rounds[0].drafted != 0:
            bad.append((p.index, 0, rounds[0].drafted))
    return bad


def counted(rounds: list[Round], k: int) -> list[int]:
    """Accepted counts of the rounds that enter the statistics (the module docstring says which and why)."""
    return [r.accepted for r in rounds[:-1] if r.drafted == k]


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------
def summarise(source: str, temperature: float, k: int, runs: list[tuple[list[int], list[Round], float]]) -> dict:
    acc = [a for _, rounds, _ in runs for a in counted(rounds, k)]
    all_rounds = [r for _, rounds, _ in runs for r in rounds]
    drafted = Counter(r.drafted for r in all_rounds)
    n = len(acc)
    tokens = sum(len(t) for t, _, _ in runs)
    wall = sum(w for _, _, w in runs)
    return {
        "source": source,
        "temperature": temperature,
        "k": k,
        "prompts": len(runs),
        "rounds": n,
        "rounds_excluded": len(all_rounds) - n,
        "mean_acceptance_length": (sum(acc) / n + 1.0) if n else None,  # mean(accepted + 1)
        "acceptance_rate_per_position": [sum(a >= j for a in acc) / n if n else None for j in range(1, k + 1)],
        "accepted_histogram": [acc.count(a) for a in range(k + 1)],
        "tokens_generated": tokens,
        "target_forwards": len(all_rounds),  # prefill included
        "tokens_per_target_forward": tokens / len(all_rounds) if all_rounds else None,
        "draft_lengths_seen": {str(d): c for d, c in sorted(drafted.items())},
        "wall_s": wall,
        "s_per_prompt": wall / len(runs) if runs else None,
    }


def print_table(rows: list[dict]) -> None:
    kmax = max(r["k"] for r in rows)
    head = f"{'source':12} {'T':>4} {'k':>2} {'rounds':>6} {'acc_len':>7} {'tok':>6} {'s/prompt':>8}  rate@1..{kmax}"
    print(head)
    print("-" * len(head))
    for r in rows:
        al = f"{r['mean_acceptance_length']:.3f}" if r["mean_acceptance_length"] is not None else "-"
        rates = " ".join("-" if x is None else f"{x:.2f}" for x in r["acceptance_rate_per_position"])
        print(f"{r['source']:12} {r['temperature']:>4g} {r['k']:>2} {r['rounds']:>6} {al:>7} "
              f"{r['tokens_generated']:>6} {r['s_per_prompt']:>8.3f}  {rates}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="HF target dir (Gemma4ForCausalLM)")
    ap.add_argument("--assistant", type=Path, required=True, help="HF assistant dir (Gemma4AssistantForCausalLM)")
    ap.add_argument("--prompts-json", type=Path, required=True, help='JSON list of {"source", "ids"}')
    ap.add_argument("--ks", default="1,2,4,8", help="drafts per round, comma-separated")
    ap.add_argument("--temperatures", default="0,0.8", help="0 = greedy; comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is seed + i")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args(argv)

    ks = parse_list("--ks", args.ks, int)
    temps = parse_list("--temperatures", args.temperatures, float)
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]

    import transformers

    target, assistant = load_pair(args.target, args.assistant, dtype)
    eos = eos_ids(target)
    prompts = load_prompts(args.prompts_json, target.config.get_text_config().vocab_size)
    sources = [s for s in SOURCES if any(p.source == s for p in prompts)]
    print(f"{len(prompts)} prompts ({', '.join(f'{s}: {sum(p.source == s for p in prompts)}' for s in sources)}), "
          f"ks={ks}, T={temps}, max_new_tokens={args.max_new_tokens}, {args.dtype}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}",
          flush=True)

    # runs[(T, k)][prompt index] = (new tokens, rounds, wall)
    runs: dict[tuple[float, int], list[tuple[list[int], list[Round], float]]] = {}
    draft_length_offenders: dict[str, int] = {}  # rounds whose draft length was not k (nor the max_new_tokens cap)
    for T in temps:
        for k in ks:
            t0 = time.perf_counter()
            runs[(T, k)] = [run_one(target, assistant, p, k=k, temperature=T, max_new_tokens=args.max_new_tokens,
                                    eos=eos, seed=args.seed + p.index) for p in prompts]
            bad = unexpected_draft_lengths(prompts, runs[(T, k)], k, args.max_new_tokens)
            draft_length_offenders[f"T={T:g},k={k}"] = len(bad)
            if bad:
                print(f"warning: T={T:g} k={k}: draft lengths other than k (beyond the max_new_tokens cap): "
                      f"{bad[:5]}", file=sys.stderr)
            print(f"  T={T:g} k={k}: {time.perf_counter() - t0:.1f}s", flush=True)

    # Lossless check: greedy assisted output must equal plain greedy generate (exact in float32; bfloat16 may
    # legitimately diverge, the verify forward on k+1 tokens rounds differently from a 1-token decode).
    greedy_equals_plain: dict[str, Any] = {}
    if 0.0 in temps:
        checks = prompts[:GREEDY_CHECK_PROMPTS]
        plain = [run_one(target, assistant, p, k=None, temperature=0.0, max_new_tokens=args.max_new_tokens,
                         eos=eos, seed=args.seed + p.index) for p in checks]
        per_k = {f"k={k}": [runs[(0.0, k)][i][0] == plain[i][0] for i in range(len(checks))] for k in ks}
        greedy_equals_plain = {"prompts": [p.index for p in checks], "per_k": per_k,
                               "all": all(all(v) for v in per_k.values()),
                               "plain_s_per_prompt": sum(w for _, _, w in plain) / len(plain)}

    rows = []
    for T in temps:
        for k in ks:
            for s in sources:
                idx = [p.index for p in prompts if p.source == s]
                rows.append(summarise(s, T, k, [runs[(T, k)][i] for i in idx]))
            if len(sources) > 1:
                rows.append(summarise("all", T, k, runs[(T, k)]))
    print()
    print_table(rows)
    if greedy_equals_plain:
        print(f"\ngreedy assisted == plain greedy on prompts {greedy_equals_plain['prompts']}: "
              f"{greedy_equals_plain['all']}  {greedy_equals_plain['per_k']}")
    per_prompt = [w for r in runs.values() for _, _, w in r]
    print(f"mean wall per assisted generation: {sum(per_prompt) / len(per_prompt):.3f}s "
          f"({len(per_prompt)} generations, {sum(per_prompt):.1f}s in all)")

    report = {
        "config": {
            "target": str(args.target), "assistant": str(args.assistant), "prompts_json": str(args.prompts_json),
            "ks": ks, "temperatures": temps, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
            "seed": args.seed, "eos_token_ids": eos, "transformers": transformers.__version__,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
            "round_policy": "acceptance stats exclude draft-less forwards, drafts shorter than k, and the final "
                            "(eos/length-cropped) round of each generation",
        },
        "greedy_equals_plain": greedy_equals_plain,
        "draft_length_offenders": draft_length_offenders,
        "results": rows,
        "s_per_assisted_generation": sum(per_prompt) / len(per_prompt),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
