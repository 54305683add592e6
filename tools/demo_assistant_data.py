"""The training data of the shipped demo assistant: the demo corpus's train split as `{"ids": [...]}` lines (the
assistant trainer's pre-tokenized `--data` format), tokenized with the shipped pair's tokenizer, documents shuffled
as the demo recipe's data stage shuffles them, without the sources and chat request kinds that the shipped target
never saw (`tools.corpus.PAIR_UNSEEN_SOURCES`, `PAIR_UNSEEN_CHAT_KINDS`). Gzipped, it is small enough to carry to
a training machine without network.

    python -m tools.demo_assistant_data CORPUS/text OUT.jsonl.gz

The model card (gemma4_mtp_jax/demo_pair/MODEL_CARD.md) gives the command that trained the assistant on it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
from pathlib import Path

from gemma4_mtp_jax.train.demo_recipe import shuffle_documents
from gemma4_mtp_jax.train.tokenizer import encode_documents
from tools.corpus import PAIR_UNSEEN_CHAT_KINDS, PAIR_UNSEEN_SOURCES, chat_kind_patterns, first_user_turn

PAIR_TOKENIZER = Path(__file__).resolve().parents[1] / "gemma4_mtp_jax" / "demo_pair" / "target" / "tokenizer.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.demo_assistant_data", description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", type=Path, help="the corpus's text directory (tools/fetch_demo_corpus.sh OUTDIR/text)")
    ap.add_argument("out", type=Path, help="the .jsonl.gz to write")
    ap.add_argument("--seed", type=int, default=0, help="the demo recipe's seed (its document order)")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    train = args.corpus / "train"
    if not train.is_dir():
        ap.error(f"{args.corpus}: no train/ directory (tools/fetch_demo_corpus.sh OUTDIR writes OUTDIR/text)")
    files = sorted(f for f in train.rglob("*") if f.is_file() and f.suffix in (".txt", ".jsonl")
                   and not set(f.relative_to(train).parts) & set(PAIR_UNSEEN_SOURCES))
    skip = chat_kind_patterns(PAIR_UNSEEN_CHAT_KINDS)
    kept = dropped = 0
    with tempfile.TemporaryDirectory() as tmp:
        chat = Path(tmp) / "chat.jsonl"
        with chat.open("w", encoding="utf-8") as f:
            for line in (train / "chat.jsonl").read_text(encoding="utf-8").splitlines():
                if any(p.fullmatch(first_user_turn(json.loads(line)["text"])) for p in skip):
                    dropped += 1
                else:
                    f.write(line + "\n")
                    kept += 1
        files = [chat if f == train / "chat.jsonl" else f for f in files]
        docs = encode_documents(Tokenizer.from_file(str(PAIR_TOKENIZER)), files)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        for doc in shuffle_documents(docs, args.seed, train=True):
            f.write(json.dumps({"ids": doc.tolist()}) + "\n")
    print(f"{len(files)} files, {len(docs)} documents, {sum(len(d) for d in docs)} tokens; chat examples kept "
          f"{kept}, left out {dropped} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
