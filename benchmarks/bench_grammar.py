"""Host cost of structured output: xgrammar against llguidance on the CPU (docs/decisions/0019-grammar-engine.md).

For each tokenizer (the demo pair's, 8192 tokens; and a synthetic Gemma-sized one, 262144 tokens, unless --tokenizer
names a real tokenizer.json) and each JSON schema (any object, as json_object asks; small; nested; enum-heavy;
hostile deep-and-wide):

- compile: the time from the schema to a matcher ready for its first mask (each library's own cache off or cold);
- a speculative round per sequence as the engine runs it: a mask filled at each of the k+1 verified positions
  (walking the matcher through the k drafts), the drafts rolled back, then the round's k+1 tokens accepted. The
  drafts are a valid JSON instance of the schema, tokenized greedily (longest token first), so every draft is
  allowed: the worst case (a rejected draft stops the walk early). Figures, medians over the rounds: microseconds
  per mask (its share of the walk: k+1 fills, k accepts, one rollback), per accepted token, and milliseconds per
  round of B sequences done one after the other on one thread (B = 1, 16, 64) and, for llguidance, through its own
  thread pool (`LLExecutor`, --threads). "cold" is the mean over the first walk of a freshly compiled grammar.

    python benchmarks/bench_grammar.py                       # both libraries, both tokenizers
    python benchmarks/bench_grammar.py --library llguidance --vocab 262144 --threads 2
    python benchmarks/bench_grammar.py --tokenizer /path/to/gemma/tokenizer.json

xgrammar is not a dependency of the package: `pip install xgrammar` first to compare (it pulls in torch,
transformers and triton), or pass `--library llguidance`.

The synthetic tokenizer is Gemma's kind (BPE with byte fallback, "▁" for a space; no merges: only the vocabulary
matters to a grammar engine): the 256 byte tokens, the words, numbers, punctuation runs and whitespace runs of the
Python standard library's sources with and without "▁" and their prefixes, CJK, Hangul and other characters, then
seeded random letter strings up to the size.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "gemma4_mtp_jax" / "demo_pair" / "target" / "tokenizer.json"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
EOS = 1


# ------------------------------------------------------------------------------------------------------ tokenizer
def synthetic_gemma_tokenizer(path: Path, vocab_size: int = 262144, seed: int = 0) -> Path:
    """Write a Gemma-like tokenizer.json of exactly `vocab_size` tokens to `path` (see the module's docstring)."""
    vocab: dict[str, int] = {}

    def add(piece: str) -> None:
        if piece and piece not in vocab and len(vocab) < vocab_size:
            vocab[piece] = len(vocab)

    for s in SPECIALS:
        add(s)
    for b in range(256):
        add(f"<0x{b:02X}>")
    counts: collections.Counter = collections.Counter()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    words = re.compile(r"[A-Za-z]+|[0-9]{1,3}|[^\sA-Za-z0-9]{1,3}| {2,16}|\n+")
    for f in sorted(stdlib.glob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for m in words.finditer(text):
            w = m.group().replace(" ", "▁")
            space = m.start() > 0 and text[m.start() - 1] == " "
            counts["▁" + w if space else w] += 1
    for ch in map(chr, range(0x20, 0x7F)):
        add(ch.replace(" ", "▁"))
    for w, _ in counts.most_common():
        add(w)
        if w[0] == "▁":
            add(w[1:])
        else:
            add("▁" + w)
    for w, _ in counts.most_common():  # sub-word pieces, as BPE's merges leave them
        for n in range(2, len(w)):
            add(w[:n])
    for lo, hi in ((0x4E00, 0xA000), (0xAC00, 0xD7A4), (0x0400, 0x0500), (0x3040, 0x3100), (0x0600, 0x0700)):
        for c in range(lo, hi):
            add(chr(c))
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < vocab_size:
        w = "".join(rng.choice(letters) for _ in range(rng.randint(3, 10)))
        add("▁" + w if rng.random() < 0.5 else w)
    data = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [dict(id=vocab[s], content=s, single_word=False, lstrip=False, rstrip=False,
                              normalized=False, special=True) for s in SPECIALS],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    path.write_text(json.dumps(data, ensure_ascii=False))
    return path


# -------------------------------------------------------------------------------------------------------- schemas
def schemas() -> dict[str, tuple[dict, object]]:
    """name -> (schema, a valid instance)."""
    small = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"], "additionalProperties": False}
    small_doc = {"name": "Ada Lovelace", "age": 36}
    item = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "price": {"type": "number"}, "in_stock": {"type": "boolean"},
        "dims": {"type": "object", "properties": {"w": {"type": "number"}, "h": {"type": "number"}},
                 "required": ["w", "h"], "additionalProperties": False}},
        "required": ["id", "tags", "price", "in_stock", "dims"], "additionalProperties": False}
    nested = {"type": "object", "properties": {
        "order": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                                      "address": {"type": "object", "properties": {
                                                          "street": {"type": "string"}, "city": {"type": "string"},
                                                          "zip": {"type": "string"}},
                                                          "required": ["street", "city", "zip"],
                                                          "additionalProperties": False}},
                     "required": ["name", "email", "address"], "additionalProperties": False},
        "items": {"type": "array", "items": item, "minItems": 1}},
        "required": ["order", "customer", "items"], "additionalProperties": False}
    nested_doc = {"order": "ABC-123456", "customer": {
        "name": "Grace Hopper", "email": "grace@example.com",
        "address": {"street": "1 Navy Way", "city": "Arlington", "zip": "22201"}},
        "items": [{"id": i, "tags": ["red", "large"], "price": 12.5 + i, "in_stock": i % 2 == 0,
                   "dims": {"w": 1.25, "h": 3.0}} for i in range(3)]}
    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 12)))
             for _ in range(1000)]
    enum = {"type": "object", "properties": {
        f"field_{i}": {"enum": words[200 * i: 200 * (i + 1)]} for i in range(5)},
        "required": [f"field_{i}" for i in range(5)], "additionalProperties": False}
    enum_doc = {f"field_{i}": words[200 * i + 137] for i in range(5)}
    # Hostile: 12 levels deep, each level 150 optional properties (anyOf of three types) and the next level.
    depth, width = 12, 150
    leaf = {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}
    hostile: dict = {"type": "object", "properties": {"end": {"type": "boolean"}}, "required": ["end"]}
    hostile_doc: dict = {"end": True}
    for d in range(depth):
        props = {f"p{d}_{j}": leaf for j in range(width)}
        props["next"] = hostile
        hostile = {"type": "object", "properties": props, "required": ["next"], "additionalProperties": False}
        hostile_doc = {f"p{d}_{width - 1}": d, "next": hostile_doc}
    # json_object: any JSON object; prose inside strings allows most of the vocabulary at once.
    free_doc = {"title": "On the Analytical Engine", "summary": "The engine might act upon other things besides "
                "number, were objects found whose mutual fundamental relations could be expressed.",
                "year": 1843, "notes": ["A", "B", "G"], "meta": {"translated": True, "pages": 65.5}}
    return {"object": ({"type": "object"}, free_doc), "small": (small, small_doc), "nested": (nested, nested_doc),
            "enum": (enum, enum_doc), "hostile": (hostile, hostile_doc)}


# ------------------------------------------------------------------------------------------------------ libraries
class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, threads: int):
        import llguidance

        self.ll = llguidance
        t = time.perf_counter()
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=EOS)
        self.tokenizer_s = time.perf_counter() - t
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict):
        g = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                      defaults={"whitespace_flexible": False})
        m = self.ll.LLMatcher(self.tok, g)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, out: np.ndarray) -> None:
        m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def fill_drafts_par(self, ms, drafts, out: np.ndarray) -> None:
        """Masks of all sequences' k+1 positions through the library's thread pool (rows i*(k+1) ...)."""
        k1 = len(drafts[0]) + 1
        self.executor.unsafe_compute_mask_ptr_with_draft_token(
            [(m, i * k1, list(d)) for i, (m, d) in enumerate(zip(ms, drafts))],
            out.ctypes.data, out.shape[1] * 4, out.shape[0])


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, threads: int):
        import xgrammar
        from tokenizers import Tokenizer

        self.xgr = xgrammar
        t = time.perf_counter()
        tk = Tokenizer.from_str(tokenizer_json)
        vocab = tk.get_vocab(with_added_tokens=True)
        encoded = [""] * vocab_size
        for piece, i in vocab.items():
            encoded[i] = piece
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        self.info = xgrammar.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                                           stop_token_ids=[EOS], add_prefix_space=meta["add_prefix_space"])
        self.tokenizer_s = time.perf_counter() - t
        self.threads = threads

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                            separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, out: np.ndarray) -> None:
        m.fill_next_token_bitmask(out[None], 0)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def rollback(self, m, n: int) -> None:
        m.rollback(n)


# ----------------------------------------------------------------------------------------------------- measuring
def greedy_tokens(tokenizer_json: str, text: str) -> list[int]:
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, eos_token=EOS).greedy_tokenize(text)


def measure(lib, schema: dict, tokens: list[int], batches: list[int], k: int, repeats: int) -> dict:
    compile_s = []
    for _ in range(repeats):
        t = time.perf_counter()
        compiled = lib.compile(schema)
        lib.fill(lib.matcher(compiled), np.zeros(-(-lib.vocab_size // 32), np.int32))  # the first mask too
        compile_s.append(time.perf_counter() - t)
    words = -(-lib.vocab_size // 32)
    out = np.zeros((k + 1, words), np.int32)
    rounds = [tokens[i: i + k + 1] for i in range(0, len(tokens) - k, k + 1)]
    res = {"compile_ms": 1e3 * statistics.median(compile_s), "tokens": len(tokens), "rounds": len(rounds)}
    for B in ["cold"] + batches:  # cold: one sequence, the first walk of a fresh grammar (lazy state included)
        if B == "cold":
            compiled = lib.compile(schema)
        ms = [lib.matcher(compiled) for _ in range(1 if B == "cold" else B)]
        fills, accepts, totals = [], [], []  # per round; medians, as other processes share the CPU
        for r in rounds:
            fill_s = accept_s = 0.0
            t0 = time.perf_counter()
            for m in ms:
                t = time.perf_counter()
                for i in range(k + 1):
                    lib.fill(m, out[i])
                    if i < k:
                        lib.accept(m, r[i])
                lib.rollback(m, k)
                t1 = time.perf_counter()
                for tok in r:
                    assert lib.accept(m, tok), "the instance's tokens must be accepted"
                fill_s += t1 - t
                accept_s += time.perf_counter() - t1
            totals.append(time.perf_counter() - t0)
            fills.append(fill_s / (len(ms) * (k + 1)))
            accepts.append(accept_s / (len(ms) * (k + 1)))
        res[f"B{B}"] = {"mask_us": 1e6 * (statistics.mean(fills) if B == "cold" else statistics.median(fills)),
                        "accept_us": 1e6 * statistics.median(accepts), "round_ms": 1e3 * statistics.median(totals)}
        if hasattr(lib, "fill_drafts_par") and B != "cold":
            ms = [lib.matcher(compiled) for _ in range(B)]
            big = np.zeros((B * (k + 1), words), np.int32)
            totals = []
            for r in rounds:
                t0 = time.perf_counter()
                lib.fill_drafts_par(ms, [r[:k]] * B, big)
                for m in ms:
                    for tok in r:
                        lib.accept(m, tok)
                totals.append(time.perf_counter() - t0)
            res[f"B{B}"]["round_par_ms"] = 1e3 * statistics.median(totals)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--library", choices=["llguidance", "xgrammar"], nargs="+", default=["llguidance", "xgrammar"])
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192, 262144],
                    help="8192: the demo pair's tokenizer; another size: a synthetic Gemma-like one of that size")
    ap.add_argument("--tokenizer", help="a real tokenizer.json instead of the synthetic one")
    ap.add_argument("--schema", nargs="+", default=["object", "small", "nested", "enum", "hostile"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--k", type=int, default=4, help="drafts per round (k + 1 masks)")
    ap.add_argument("--repeats", type=int, default=3, help="compilations timed (the median)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    all_schemas = schemas()
    from importlib.metadata import version

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?") if Path("/proc/cpuinfo").exists() else "?"
    print(f"{cpu}, {os.cpu_count()} CPUs; " + ", ".join(f"{n} {version(n)}" for n in args.library), flush=True)
    tmp_dir = tempfile.TemporaryDirectory()
    tmp = Path(tmp_dir.name)
    results = []
    sizes = ["real"] if args.tokenizer else args.vocab
    for size in sizes:
        if size == "real":
            path = Path(args.tokenizer)
        elif size == 8192:
            path = DEMO_TOKENIZER
        else:
            path = synthetic_gemma_tokenizer(tmp / f"tokenizer-{size}.json", size)
        text = path.read_text()
        from tokenizers import Tokenizer

        vocab_size = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
        for name in args.library:
            lib = (LLGuidance if name == "llguidance" else XGrammar)(text, vocab_size, args.threads)
            lib.vocab_size = vocab_size
            print(f"{name} V={vocab_size}: tokenizer set-up {1e3 * lib.tokenizer_s:.0f} ms", flush=True)
            for sname in args.schema:
                schema, doc = all_schemas[sname]
                tokens = greedy_tokens(text, json.dumps(doc, separators=(",", ":"))) + [EOS]
                r = measure(lib, schema, tokens, args.batch, args.k, args.repeats)
                r.update(library=name, vocab=vocab_size, schema=sname)
                results.append(r)
                per_b = "  ".join(
                    f"B={B}: mask {r[f'B{B}']['mask_us']:.1f} us, accept {r[f'B{B}']['accept_us']:.1f} us, "
                    f"round {r[f'B{B}']['round_ms']:.2f} ms"
                    + (f" (pool {r[f'B{B}']['round_par_ms']:.2f} ms)" if "round_par_ms" in r[f"B{B}"] else "")
                    for B in ["cold"] + args.batch)
                print(f"  {sname:8s} compile {r['compile_ms']:8.1f} ms  {r['tokens']} tokens  {per_b}", flush=True)
    tmp_dir.cleanup()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
