"""Structured output on the host: a grammar compiled against the checkpoint's vocabulary, and a matcher per request
that fills the token bitmask of each position a step samples or verifies.

The grammar engine is llguidance (docs/decisions/0019-grammar-engine.md). A `GrammarSpec` says what the output must
be: JSON valid against a schema (`json`; "any JSON object" is the schema {"type": "object"}), a full match of a
regular expression (`regex`), one of a list of strings (`choice`) or a sentence of a Lark grammar (`lark`, the
library's own syntax). `compile_grammar` turns it into a `CompiledGrammar` once per distinct spec (the server
caches them: `GrammarCompiler`), and each request gets its own `GrammarMatcher` from it.

A bitmask is [ceil(V/32)] int32 words for the model's vocabulary size V: bit j of word i allows token 32*i + j;
the bits past V are 0. Once the grammar is complete it allows only the stop ids (EOS and end-of-turn) the
vocabulary was made with, so the model can stop; a stop id is allowed wherever the grammar may end.

A matcher is driven from one thread at a time (the engine's). Its mask fills drop the GIL.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import os
import threading
from typing import Iterable, Sequence

import llguidance
import numpy as np

# Whitespace a JSON grammar allows between two tokens of the document: pretty-printed output (newlines and the
# indentation of a few levels) fits, and a model cannot pad its output with whitespace forever.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,64}"
GRAMMAR_KINDS = ("json", "regex", "choice", "lark")


class GrammarError(ValueError):
    """A grammar that cannot be compiled or matched; the message is the library's reason."""


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must be. `source`: for `json` the schema as canonical JSON (`canonical_json`), for
    `regex` the pattern, for `choice` the JSON array of the strings, for `lark` the grammar's text. Two equal specs
    compile to the same grammar: the spec is the cache's key."""

    kind: str
    source: str

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> GrammarSpec:
        return cls("json", canonical_json(schema))

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        return cls("choice", canonical_json(list(choices)))

    def grammar(self) -> str:
        """The spec as llguidance's grammar text (its JSON form)."""
        if self.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(
                self.source, defaults={"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE})
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            # Lark string literals read JSON's escapes: each choice is matched as exactly its text.
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(self.source))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.LLMatcher.grammar_from_lark(self.source)


def canonical_json(value) -> str:
    """Compact JSON with keys in the client's order: a schema's property order is the order the output's
    properties take, so two schemas that differ only in it are different grammars."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class Vocabulary:
    """The checkpoint's tokenizer as the grammar engine reads it: each token's bytes, the model's vocabulary size
    (the logits' width, which may exceed the tokenizer's) and the stop ids a complete grammar allows. Building it
    takes ~2.5 s for a 262144-token vocabulary and holds the GIL all along: one per server, made at start-up."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_ids: Iterable[int]):
        stop = sorted(set(stop_ids))
        if not stop:
            raise ValueError("a grammar needs at least one stop id, or the model could never end its output")
        self.vocab_size = vocab_size
        self.stop_ids = tuple(stop)
        self.words = -(-vocab_size // 32)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=stop)
        # Parser limits bound the work of one compilation and of one mask, whatever the grammar (the library's
        # defaults); errors are not verbose: they go back to the client, without the grammar's dump.
        self.limits = llguidance.LLParserLimits(verbose_errors=False)

    def new_masks(self, *shape: int) -> np.ndarray:
        """Zeroed bitmasks of shape [*shape, words]."""
        return np.zeros((*shape, self.words), np.int32)

    def allow_all(self, out: np.ndarray) -> None:
        """Fill `out` ([..., words]) with the mask that allows every token of the vocabulary."""
        out[...] = -1
        if self.vocab_size % 32:
            out[..., -1] = np.int32(np.uint32((1 << (self.vocab_size % 32)) - 1).view(np.int32))


class CompiledGrammar:
    """A grammar compiled for a vocabulary; `matcher()` starts a fresh match of it (cheap: a copy)."""

    def __init__(self, spec: GrammarSpec, vocab: Vocabulary, prototype: llguidance.LLMatcher):
        self.spec = spec
        self.vocab = vocab
        self._prototype = prototype
        self._lock = threading.Lock()  # copies are taken from any thread; the prototype is never matched

    def matcher(self) -> GrammarMatcher:
        with self._lock:
            return GrammarMatcher(self._prototype.deep_copy(), self.vocab)


def compile_grammar(spec: GrammarSpec, vocab: Vocabulary) -> CompiledGrammar:
    """Compile `spec` and compute its first mask (which builds the lexer's start state and finds the errors that
    only show there). Raises GrammarError with the library's reason. Takes milliseconds for usual schemas, ~0.3 s
    for a hostile one (the parser limits bound it): call it off the event loop and off the engine thread."""
    try:
        grammar = spec.grammar()
    except ValueError as e:  # a schema or pattern the converter refuses
        raise GrammarError(str(e)) from None
    m = llguidance.LLMatcher(vocab.tokenizer, grammar, log_level=0, limits=vocab.limits)
    if m.is_error():
        raise GrammarError(m.get_error())
    scratch = vocab.new_masks()
    m.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
    if m.is_error():
        raise GrammarError(m.get_error())
    if not scratch.any():
        raise GrammarError("the grammar allows no output at all")
    return CompiledGrammar(spec, vocab, m)


class GrammarMatcher:
    """One request's place in its grammar.

    `accept` never breaks the matcher: a token the grammar forbids is refused (False) and the state is unchanged.
    A stop id accepted where the grammar may end completes the match (`is_terminated`); from there on only stop ids
    are allowed. A stop id counts as a token for `rollback` like any other."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: Vocabulary):
        self._m = matcher
        self.vocab = vocab
        self._stop = frozenset(vocab.stop_ids)
        # Per accepted token: (llguidance counted it, it is a stop id). A stop id taken where the grammar can no
        # longer grow is no token to the library, and `rollback` must undo exactly what was accepted.
        self._accepted: list[tuple[bool, bool]] = []

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the next token's bitmask into `out` ([words] int32, C-contiguous). Raises GrammarError when the
        grammar cannot go on (a mask past the parser limits). After a stop id only stop ids are allowed."""
        if out.dtype != np.int32 or out.shape != (self.vocab.words,) or not out.flags.c_contiguous:
            raise ValueError(f"a mask is a contiguous [{self.vocab.words}] int32 array, got {out.dtype} {out.shape}")
        if self.is_terminated():
            out[:] = 0
            for t in self.vocab.stop_ids:
                out[t >> 5] |= np.uint32(1 << (t & 31)).view(np.int32)
            return
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._m.is_error():
            raise GrammarError(self._m.get_error())

    def accept(self, token: int) -> bool:
        """Advance by `token` if the grammar allows it; False (and no change) if it does not."""
        stop = token in self._stop
        if stop and (self.is_terminated() or self._m.is_stopped()):
            self._accepted.append((False, True))
            return True
        if self.is_terminated():
            return False
        if self._m.try_consume_tokens([token]) != 1:
            return False
        self._accepted.append((True, stop))
        return True

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens."""
        if not 0 <= n <= len(self._accepted):
            raise ValueError(f"cannot roll back {n} tokens: {len(self._accepted)} were accepted")
        if n == 0:
            return
        counted = sum(c for c, _ in self._accepted[-n:])
        del self._accepted[-n:]
        if counted and not self._m.rollback(counted):
            raise GrammarError(f"the matcher could not roll back {counted} tokens")

    def is_terminated(self) -> bool:
        """A stop id was accepted: the output is complete."""
        return bool(self._accepted) and self._accepted[-1][1]

    @property
    def num_accepted(self) -> int:
        return len(self._accepted)

    def fill_draft_masks(self, drafts: Sequence[int], out: np.ndarray) -> int:
        """The masks of a speculative round's k+1 verified positions into `out` ([k+1, words]): row i is the mask
        after drafts[:i]. The walk stops at the first draft the grammar forbids (the device rejects it, so the rows
        after its position are never used: they are left as they were); the matcher ends where it started.
        Returns the number of rows written."""
        k = len(drafts)
        if out.shape != (k + 1, self.vocab.words):
            raise ValueError(f"masks for {k} drafts are [{k + 1}, {self.vocab.words}], got {out.shape}")
        walked = 0
        try:
            for i in range(k):
                self.fill_mask(out[i])
                if not allows(out[i], drafts[i]) or not self.accept(drafts[i]):
                    return i + 1
                walked += 1
            self.fill_mask(out[k])
            return k + 1
        finally:
            self.rollback(walked)


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether a [words] bitmask allows `token`."""
    return 0 <= token < 32 * mask.shape[-1] and bool((int(mask[token >> 5]) >> (token & 31)) & 1)


class RoundMasks:
    """Fills a whole batch's round of masks at once, in llguidance's own thread pool (the GIL released): the
    engine's way to keep B x (k+1) fills within a device step (docs/decisions/0019-grammar-engine.md)."""

    def __init__(self, threads: int | None = None):
        self.threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._executor = llguidance.LLExecutor(num_threads=self.threads)

    def fill(self, matchers: Sequence[GrammarMatcher], drafts: Sequence[Sequence[int]],
             out: np.ndarray) -> list[tuple[int, GrammarError]]:
        """out[b] ([B, k+1, words], C-contiguous int32) gets what `matchers[b].fill_draft_masks(drafts[b], out[b])`
        writes in the rows that count: up to the first draft the grammar forbids, or the first stop id (past it
        the sequence has ended). Every matcher ends where it started. Returns the matchers that could not go on
        (by index, with the library's reason; their rows of `out` mean nothing), so that each fails alone."""
        if len(matchers) != len(drafts) or out.ndim != 3 or out.shape[0] != len(matchers):
            raise ValueError(f"{len(matchers)} matchers, {len(drafts)} draft lists and masks {out.shape} disagree")
        k1, words = out.shape[1], out.shape[2]
        if out.dtype != np.int32 or not out.flags.c_contiguous or any(len(d) != k1 - 1 for d in drafts):
            raise ValueError(f"masks must be contiguous int32 [B, k+1, words] for k = {k1 - 1} drafts each")
        for m in matchers:
            if m.vocab.words != words:
                raise ValueError(f"masks of {words} words for a vocabulary of {m.vocab.words}")
        self._executor.unsafe_compute_mask_ptr_with_draft_token(
            [(m._m, b * k1, list(d)) for b, (m, d) in enumerate(zip(matchers, drafts))],
            out.ctypes.data, words * 4, out.shape[0] * k1)
        return [(b, GrammarError(m._m.get_error())) for b, m in enumerate(matchers) if m._m.is_error()]


class GrammarCompiler:
    """Compiles specs in a small thread pool of its own (never the event loop's thread nor the engine's) and keeps
    the newest `cache_size` compiled grammars, keyed by their spec. Concurrent requests for one spec share one
    compilation. A failed compilation is cached too: the same spec fails again at once. The caller bounds the wait
    (`Future.result(timeout)`, or the server's asyncio wrapper); a compilation that outlives its wait finishes in
    the background (the parser limits bound it) and is cached for the next request."""

    def __init__(self, vocab: Vocabulary, *, workers: int | None = None, cache_size: int = 256):
        self.vocab = vocab
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers or min(4, os.cpu_count() or 1), thread_name_prefix="grammar")
        self._cache: collections.OrderedDict[GrammarSpec, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()

    def submit(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """A future of the `CompiledGrammar` of `spec` (done at once when cached); its exception is a
        GrammarError when the spec cannot compile."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None and not fut.cancelled():
                self._cache.move_to_end(spec)
                return fut
            fut = self._pool.submit(compile_grammar, spec, self.vocab)
            self._cache[spec] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> CompiledGrammar:
        """Blocking: the compiled grammar, GrammarError, or concurrent.futures.TimeoutError after `timeout` s."""
        return self.submit(spec).result(timeout)

    def __len__(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
