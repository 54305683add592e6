"""Incremental detokenization with stop strings.

`IncrementalDetokenizer` turns token ids into text as they arrive without ever splitting a UTF-8 character: it
decodes a small sliding window of ids and holds text back while the window's decoding ends in U+FFFD (an
incomplete multi-byte character, whose remaining bytes are still to come). The window starts a few tokens
before the new ones, so tokenizers whose decoding of a token depends on its left neighbour (SentencePiece's
leading-space handling) give the same text as decoding everything at once.

`StopStringMatcher` never lets text past a stop string out, and holds back the tail of the text that could still
become the start of a stop string until the next piece decides it.

`TextStream` combines both: tokens in, (text, stopped) out, and where each token's text starts, so that per-token
data (logprobs) goes out with the text it belongs to and stops where the text stops.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Protocol, Sequence

REPLACEMENT = "\ufffd"


class _Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """`hidden_ids`: with skip_special_tokens=False, the special tokens still dropped (the others show as text)."""

    def __init__(self, tokenizer: _Tokenizer, prompt_ids: Sequence[int] = (), context: int = 6,
                 skip_special_tokens: bool = True, hidden_ids: frozenset[int] = frozenset()):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._hidden = hidden_ids
        self._ids: list[int] = list(prompt_ids[-context:]) if context else []
        # ids[_prefix:_read] is text already emitted, kept as left context; ids[_read:] is not yet emitted.
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        if self._hidden:
            ids = [t for t in ids if t not in self._hidden]
        return self._tok.decode(list(ids), skip_special_tokens=self._skip) if ids else ""

    def push(self, token: int) -> str:
        """Add one token id; return the text that is now complete (possibly empty)."""
        self._ids.append(int(token))
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT):
            return ""  # nothing new yet, or a character still incomplete
        new = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return new

    def flush(self) -> str:
        """The text held back (an incomplete character at the very end decodes to U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix:])
        new = text[len(self._prefix_text):] if len(text) > len(self._prefix_text) else ""
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return new


class StopStringMatcher:
    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was reached). After a stop, emit nothing more."""
        if not self.stops:
            return text, False
        buf = self._held + text
        # Text emitted earlier never ends with the start of a stop string, so a match starts inside `buf`.
        first = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if first >= 0:
            self._held = ""
            return buf[:first], True
        keep = 0
        for k in range(min(len(buf), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


class TextStream:
    """Tokens in, text out, stopping at stop strings. `num_tokens` counts the tokens consumed (for usage).

    `offsets[i]`: where token i's text starts in the text (a token that ends inside a character: where that
    character starts); `emitted`: the characters returned so far. A token whose text has begun to be returned is
    `shown`. `shown_special_ids`: special tokens whose text is kept (the markers an output parser reads); every other
    special token is dropped, as always."""

    def __init__(self, tokenizer: _Tokenizer | None, prompt_ids: Sequence[int] = (), stop: Iterable[str] = (),
                 shown_special_ids: frozenset[int] = frozenset()):
        if tokenizer is None:
            self._detok = None
        elif shown_special_ids:
            self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=False,
                                                 hidden_ids=frozenset(tokenizer.special_ids) - shown_special_ids)
        else:
            self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stop = StopStringMatcher(stop)
        self.stopped = False
        self.num_tokens = 0
        self.token_ids: list[int] = []
        self.offsets: list[int] = []
        self.emitted = 0
        self._decoded = 0  # characters the detokenizer gave (the stop-string matcher may hold some back)
        self._skipped_tail = 0  # consumed tokens at the end that were `skip_text`

    def push(self, tokens: Iterable[int], skip_text: Iterable[int] = ()) -> str:
        """Feed tokens (until a stop string is reached); `skip_text`: ids counted but not decoded (the EOS)."""
        out = []
        skip = set(skip_text)
        for t in tokens:
            if self.stopped:
                break
            self.num_tokens += 1
            self.token_ids.append(int(t))
            self.offsets.append(self._decoded)
            self._skipped_tail = self._skipped_tail + 1 if t in skip else 0
            if self._detok is None or t in skip:
                continue
            piece = self._detok.push(t)
            self._decoded += len(piece)
            out.append(self._emit(*self._stop.push(piece)))
        return "".join(out)

    def _emit(self, text: str, stopped: bool) -> str:
        self.stopped = stopped
        self.emitted += len(text)
        return text

    def finish(self) -> str:
        """The text still held back, once generation has ended without a stop string."""
        if self.stopped or self._detok is None:
            return ""
        piece = self._detok.flush()
        self._decoded += len(piece)
        text = self._emit(*self._stop.push(piece))
        return text + ("" if self.stopped else self._emit(self._stop.flush(), False))

    def shown(self, final: bool = False) -> int:
        """How many of the tokens consumed belong to the text returned so far: those whose text has begun to be
        returned; once generation ended (`final`) without a stop string, all but the skipped ones at the end."""
        if self._detok is None or (final and not self.stopped):
            return self.num_tokens - self._skipped_tail
        return bisect.bisect_left(self.offsets, self.emitted)
