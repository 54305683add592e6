"""Training data for an assistant: corpus text or token ids cut into sequences, mixed with the target's own
continuations of corpus prompts (generated once, up front, with the engine), and a held-out split.

Inputs (`--data`, files or directories searched recursively, in sorted order):
  * text (`.txt`, `.md`, `.text`, `.rst`, or any explicitly named file): one document per file, tokenized with
    the target's tokenizer (`tokenizer.json` next to the checkpoint);
  * `.jsonl`: one document per line, `{"text": ...}` (tokenized) or `{"ids": [...]}` / `{"tokens": [...]}`;
  * `.ids`: one document per line, token ids separated by spaces or commas;
  * `.npy`: an integer array, 1-D (one document) or 2-D (one document per row).
Documents are cut into windows of `seq_len` tokens; a shorter tail is kept (padded) if a round fits into it.

A prepared dataset is saved under `--out`/data, so a resumed run trains on exactly the same sequences.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from gemma4_mtp_jax.model.runtime import Target
from gemma4_mtp_jax.model.sampling import SamplingParams

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
DATA_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".ids", ".npy")


class DataError(ValueError):
    """Unreadable or unusable training data; the message names the file."""


@dataclasses.dataclass
class Sequences:
    """Sequences padded to one length T. Tokens from `gen_start` on are the target's own output (the corpus
    prompt before it); gen_start = length for corpus sequences."""

    tokens: np.ndarray  # [N, T] int32
    lengths: np.ndarray  # [N] int32
    gen_start: np.ndarray  # [N] int32

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def take(self, idx: np.ndarray) -> "Sequences":
        return Sequences(self.tokens[idx], self.lengths[idx], self.gen_start[idx])

    @staticmethod
    def concat(parts: Sequence["Sequences"]) -> "Sequences":
        return Sequences(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("tokens", "lengths", "gen_start")))

    @staticmethod
    def from_lists(seqs: Sequence[Sequence[int]], T: int, pad_id: int, gen_start: Sequence[int] | None = None):
        tokens = np.full((len(seqs), T), pad_id, np.int32)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = s
        lengths = np.array([len(s) for s in seqs], np.int32)
        starts = lengths.copy() if gen_start is None else np.asarray(gen_start, np.int32)
        return Sequences(tokens, lengths, starts)

    def save(self, path: Path) -> None:
        np.savez(path, tokens=self.tokens, lengths=self.lengths, gen_start=self.gen_start)

    @staticmethod
    def load(path: Path) -> "Sequences":
        with np.load(path) as z:
            return Sequences(z["tokens"], z["lengths"], z["gen_start"])


@dataclasses.dataclass
class Dataset:
    train: Sequences
    heldout: Sequences  # corpus sequences, then the target's greedy continuations of their prompts
    info: dict

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)  # parents: --out itself
        tmp = directory / "info.json.tmp"
        self.train.save(directory / "train.npz")
        self.heldout.save(directory / "heldout.npz")
        tmp.write_text(json.dumps(self.info, indent=2))
        os.replace(tmp, directory / "info.json")  # written last: its presence marks a complete dataset

    @staticmethod
    def load(directory: Path) -> "Dataset":
        info = json.loads((directory / "info.json").read_text())
        return Dataset(Sequences.load(directory / "train.npz"), Sequences.load(directory / "heldout.npz"), info)

    @staticmethod
    def exists(directory: Path) -> bool:
        return (directory / "info.json").is_file()


def data_files(paths: Sequence[str]) -> list[Path]:
    """The files named by --data: files as given, directories searched recursively for known suffixes."""
    out: list[Path] = []
    for arg in paths:
        p = Path(arg).expanduser()
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in DATA_SUFFIXES)
            if not found:
                raise DataError(f"--data {arg}: no data files ({', '.join(DATA_SUFFIXES)}) in this directory")
            out.extend(found)
        else:
            raise DataError(f"--data {arg}: no such file or directory")
    return out


def _ids(value, where: str, vocab_size: int) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError):
        raise DataError(f"{where}: token ids must be integers") from None
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise DataError(f"{where}: token id {int(arr.max() if arr.max() >= vocab_size else arr.min())} is outside "
                        f"the target's vocabulary 0..{vocab_size - 1}")
    return arr.astype(np.int32)


def read_documents(path: Path, tokenizer, vocab_size: int) -> Iterator[np.ndarray]:
    """The documents of one data file as token-id arrays."""
    suffix = path.suffix.lower()

    def encode(text: str, where: str) -> np.ndarray:
        if tokenizer is None:
            raise DataError(f"{where}: text data needs the target's tokenizer.json next to the checkpoint "
                            "(or give token ids: .ids, .npy, or .jsonl with \"ids\")")
        return _ids(tokenizer.encode(text).ids, where, vocab_size)

    if suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: not a readable .npy array ({e})") from None
        if arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"{path}: expected a 1-D or 2-D integer array of token ids, got {arr.dtype} {arr.shape}")
        for row in arr.reshape(-1, arr.shape[-1]) if arr.ndim == 2 else [arr]:
            yield _ids(row, str(path), vocab_size)
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text (token ids go in .npy or .ids files)") from None
    if suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e})") from None
            if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                yield encode(rec["text"], where)
            elif isinstance(rec, dict) and isinstance(rec.get("ids", rec.get("tokens")), list):
                yield _ids(rec.get("ids", rec.get("tokens")), where, vocab_size)
            else:
                raise DataError(f"{where}: expected an object with \"text\" (a string) or \"ids\" (a list of ints)")
    elif suffix == ".ids":
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    ids = [int(t) for t in line.replace(",", " ").split()]
                except ValueError:
                    raise DataError(f"{path}:{n}: expected token ids separated by spaces or commas") from None
                yield _ids(ids, f"{path}:{n}", vocab_size)
    else:
        yield encode(text, str(path))


def windows(doc: np.ndarray, seq_len: int, min_len: int) -> Iterator[np.ndarray]:
    """Consecutive windows of seq_len tokens; a tail shorter than min_len is dropped."""
    for s in range(0, len(doc), seq_len):
        w = doc[s:s + seq_len]
        if len(w) >= min_len:
            yield w


def read_corpus(paths: Sequence[str], tokenizer, vocab_size: int, seq_len: int, min_len: int,
                max_sequences: int) -> tuple[list[np.ndarray], dict]:
    """Sequences (token arrays of length min_len..seq_len) from the --data files, read in order until
    max_sequences are collected."""
    files = data_files(paths)
    seqs: list[np.ndarray] = []
    used = 0
    with tqdm(total=max_sequences, desc="reading data", unit="seq", leave=False) as bar:
        for f in files:
            used += 1
            for doc in read_documents(f, tokenizer, vocab_size):
                for w in windows(doc, seq_len, min_len):
                    seqs.append(w)
                    bar.update(1)
                if len(seqs) >= max_sequences:
                    break
            if len(seqs) >= max_sequences:
                break
    if not seqs:
        raise DataError(f"--data {' '.join(paths)}: no sequence of at least {min_len} tokens")
    return seqs[:max_sequences], {"files": len(files), "files_read": used,
                                  "corpus_sequences": min(len(seqs), max_sequences)}


def continuations(target: Target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  sampling: Sequence[SamplingParams], max_num_seqs: int, desc: str) -> list[list[int]]:
    """The target's continuations of `prompts` (without the prompts), by `generate` on one engine, in chunks so
    that the progress bar moves."""
    from gemma4_mtp_jax.engine import Engine, EngineConfig
    from gemma4_mtp_jax.generate import generate

    if not prompts:
        return []
    prompt_max = max(len(p) for p in prompts)
    # prompts are short and of one length: prefill programs only up to the power of two that holds them
    chunk = min(256, max(16, 1 << (prompt_max - 1).bit_length()))
    engine = Engine(target, EngineConfig(max_num_seqs=max(1, min(max_num_seqs, len(prompts))),
                                         max_model_len=max(prompt_max + max_new_tokens, 2), prefill_chunk=chunk,
                                         min_prefill_bucket=chunk))
    out: list[list[int]] = []
    chunk = 4 * engine.config.max_num_seqs
    with tqdm(total=len(prompts), desc=desc, unit="seq") as bar:
        for s in range(0, len(prompts), chunk):
            results = generate(target, prompts[s:s + chunk], max_new_tokens, list(sampling[s:s + chunk]), engine=engine)
            out.extend(r.tokens for r in results)
            bar.update(len(results))
            bar.set_postfix(tokens=sum(len(t) for t in out))
    return out


@dataclasses.dataclass(frozen=True)
class DataOptions:
    seq_len: int
    k: int
    prompt_len: int  # corpus tokens the target continues from
    heldout_fraction: float
    max_heldout: int
    self_distill_fraction: float
    self_distill_temperature: float
    self_distill_top_p: float
    max_train_sequences: int
    gen_batch: int
    seed: int


def build_dataset(target: Target, paths: Sequence[str], tokenizer, opts: DataOptions) -> Dataset:
    """Read, split and self-distill (see the module docstring)."""
    if not 0.0 <= opts.self_distill_fraction <= 1.0:
        raise DataError(f"--self-distill-fraction {opts.self_distill_fraction}: must be in [0, 1]")
    if not 0.0 < opts.heldout_fraction < 1.0:
        raise DataError(f"--heldout-fraction {opts.heldout_fraction}: must be in (0, 1)")
    if not 1 <= opts.prompt_len <= opts.seq_len - opts.k - 1:
        raise DataError(f"--prompt-len {opts.prompt_len}: must be in 1..seq_len-k-1 = {opts.seq_len - opts.k - 1}")
    V = target.config.vocab_size
    pad = target.config.pad_token_id or 0
    min_len = opts.k + 2  # room for one round: P >= 1 and P+k-1 <= length-1
    n_heldout_max = opts.max_heldout
    corpus, info = read_corpus(paths, tokenizer, V, opts.seq_len, min_len,
                               opts.max_train_sequences + n_heldout_max)
    rng = np.random.default_rng([opts.seed, 1])
    order = rng.permutation(len(corpus))
    n_heldout = min(n_heldout_max, max(1, int(round(opts.heldout_fraction * len(corpus)))))
    if len(corpus) - n_heldout < 1:
        raise DataError(f"--data: {len(corpus)} sequence(s) leave nothing to train on after the held-out split")
    heldout = [corpus[i] for i in order[:n_heldout]]
    train = [corpus[i] for i in order[n_heldout:]][: opts.max_train_sequences]

    # The target continues the prompts of a fraction of the training sequences (replacing them) and of every
    # held-out sequence (greedy: where the continuation is the target's greedy text, acceptance is exact).
    n_gen = int(round(opts.self_distill_fraction * len(train)))
    can = [i for i in rng.permutation(len(train)) if len(train[i]) > opts.prompt_len][:n_gen]
    held_can = [i for i in range(len(heldout)) if len(heldout[i]) > opts.prompt_len]
    prompts = [train[i][: opts.prompt_len].tolist() for i in can] + [heldout[i][: opts.prompt_len].tolist()
                                                                     for i in held_can]
    sampled = SamplingParams(opts.self_distill_temperature, 0, opts.self_distill_top_p)
    sampling = [dataclasses.replace(sampled, seed=(opts.seed * 1_000_003 + i) % 2**32)
                if opts.self_distill_temperature > 0 else SamplingParams() for i in range(len(can))]
    sampling += [SamplingParams()] * len(held_can)
    gen = continuations(target, prompts, opts.seq_len - opts.prompt_len, sampling, opts.gen_batch,
                        "target continuations")
    for i, g in zip(can, gen[: len(can)]):
        train[i] = np.concatenate([train[i][: opts.prompt_len], np.asarray(g, np.int32)])
    starts = np.array([len(s) for s in train], np.int32)
    starts[can] = opts.prompt_len
    held_gen = [np.concatenate([heldout[i][: opts.prompt_len], np.asarray(g, np.int32)])
                for i, g in zip(held_can, gen[len(can):])]
    held_gen = [h for h in held_gen if len(h) >= max(min_len, opts.prompt_len + opts.k)]
    T = opts.seq_len
    train_s = Sequences.from_lists([s.tolist() for s in train], T, pad, starts)
    held_s = Sequences.concat([
        Sequences.from_lists([s.tolist() for s in heldout], T, pad),
        Sequences.from_lists([s.tolist() for s in held_gen], T, pad, [opts.prompt_len] * len(held_gen)),
    ])
    info.update({
        "train_sequences": len(train_s), "train_self_distilled": len(can),
        "heldout_corpus": len(heldout), "heldout_greedy": len(held_gen),
        "train_tokens": int(train_s.lengths.sum()), "options": dataclasses.asdict(opts),
    })
    return Dataset(train_s, held_s, info)


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """The training sequences of batch `step`: epochs of seeded permutations of 0..n-1, read in order; a pure
    function of the step, so a resumed run continues with exactly the batches an uninterrupted one would see."""
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, offsets = flat // n, flat % n
    perms = {int(e): np.random.default_rng([seed, 2, int(e)]).permutation(n) for e in np.unique(epochs)}
    return np.array([perms[int(e)][o] for e, o in zip(epochs, offsets)], np.int64)
