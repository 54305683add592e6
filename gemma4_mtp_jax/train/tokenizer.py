"""A byte-level BPE tokenizer for a model trained from scratch (the demo pair), and the corpus as token ids.

Byte-level: the base alphabet is the 256 bytes, so every UTF-8 string encodes (no <unk>) and decodes back
exactly. The special tokens and their ids are the demo pair's (`demo.SPECIALS`, ids 0..5), and `<bos>` is
prepended by the tokenizer's post-processor, as Gemma's tokenizer does; the chat template is `demo.CHAT_TEMPLATE`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from gemma4_mtp_jax.weights.demo import BOS_ID, EOS_ID, SPECIALS


def train_bpe(files: Sequence[Path], vocab_size: int, min_frequency: int = 2):
    """A `tokenizers.Tokenizer` trained on `files` (UTF-8 text or chat .jsonl, whose "text" fields are read) with
    at most `vocab_size` tokens, the specials first. Training is deterministic for the same files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tok.train_from_iterator(_texts(files), trainer=trainer)
    for i, s in enumerate(SPECIALS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"tokenizer: special token {s} got id {tok.token_to_id(s)}, expected {i}")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS_ID)])
    return tok


def _texts(files: Iterable[Path]) -> Iterable[str]:
    for f in files:
        if f.suffix == ".jsonl":
            for line in f.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    yield json.loads(line)["text"]
        else:
            yield f.read_text(encoding="utf-8")


def encode_documents(tokenizer, files: Sequence[Path]) -> list[np.ndarray]:
    """Each document as `<bos> ... <eos>` token ids (uint16-safe int32): a text file is one document, each line of
    a chat .jsonl is one (its literal leading "<bos>", if any, is the same <bos>)."""
    docs = []
    for text in _texts(files):
        if text.startswith(SPECIALS[BOS_ID]):
            text = text[len(SPECIALS[BOS_ID]):]
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        docs.append(np.asarray([BOS_ID, *ids, EOS_ID], np.int32))
    return docs


def write_ids_jsonl(path: Path, docs: Sequence[np.ndarray]) -> None:
    """Documents as `{"ids": [...]}` lines (the assistant trainer's --data format for pre-tokenized text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for d in docs:
            f.write(json.dumps({"ids": d.tolist()}) + "\n")
