"""Logprobs in the OpenAI shapes: the engine's `TokenLogprob`s of the tokens a choice shows, as chat's
`{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}` or the completions API's
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`.

A token's string is its own decoded text (special tokens included, so that `<end_of_turn>` reads as itself); its
bytes are that text's UTF-8, except for a byte-fallback piece (`<0xE2>`: one byte of a character split over
several tokens), whose text alone is U+FFFD and whose bytes are the byte itself. Without a tokenizer a token reads
`token_id:<id>`, as vLLM's `return_tokens_as_token_ids` writes it. A logprob of -inf (a token the request's masks
or bias exclude) is sent as -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from gemma4_mtp_jax.engine.request import TokenLogprob

NEG_INF_LOGPROB = -9999.0
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclasses.dataclass
class TokenEntry:
    """One token a choice shows: its id, where its text starts in the choice's text, and its logprobs."""

    token: int
    offset: int
    logprob: TokenLogprob


def _finite(lp: float) -> float:
    lp = float(lp)  # (a NumPy scalar from the engine's arrays is no JSON number)
    return lp if math.isfinite(lp) else NEG_INF_LOGPROB


class TokenPieces:
    """Token id -> (string, bytes) as logprobs show it; cached (the same few thousand ids come back all the time)."""

    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        token = int(token)
        hit = self._cache.get(token)
        if hit is None:
            hit = self._cache[token] = self._piece(token)
        return hit

    def _piece(self, token: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            text = f"token_id:{token}"
            return text, list(text.encode())
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        if "\ufffd" in text:
            m = _BYTE_PIECE.fullmatch(self.tokenizer.id_to_token(token) or "")
            if m:
                return text, [int(m.group(1), 16)]
        return text, list(text.encode("utf-8", errors="replace"))


def chat_logprobs(entries: list[TokenEntry], pieces: TokenPieces) -> dict[str, Any]:
    """Chat's `logprobs` object for these tokens (a whole choice, or one chunk's tokens)."""
    def item(token: int, lp: float) -> dict[str, Any]:
        text, raw = pieces(token)
        return {"token": text, "logprob": _finite(lp), "bytes": raw}

    content = []
    for e in entries:
        d = item(e.token, e.logprob.logprob)
        d["top_logprobs"] = [item(t, lp) for t, lp in e.logprob.top]
        content.append(d)
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[TokenEntry], pieces: TokenPieces, base: int = 0,
                        prompt: list[TokenEntry | tuple[int, int, None]] | None = None) -> dict[str, Any]:
    """The completions API's `logprobs` object for these tokens; `text_offset` counts from the start of the choice's
    text, `base` characters of echoed prompt included. `top_logprobs` holds the top tokens and the chosen one (up to
    logprobs + 1 entries, as OpenAI documents). `prompt`: an echoed prompt's entries first (its first token has no
    logprob: null, as OpenAI sends it)."""
    def top(text: str, lp: TokenLogprob) -> dict[str, float]:
        out = {pieces(t)[0]: _finite(v) for t, v in lp.top}
        out.setdefault(text, _finite(lp.logprob))
        return out

    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, offset, lp in prompt or ():
        text = pieces(token)[0]
        tokens.append(text)
        offsets.append(offset)
        token_logprobs.append(None if lp is None else _finite(lp.logprob))
        top_logprobs.append(None if lp is None else top(text, lp))
    for e in entries:
        text = pieces(e.token)[0]
        tokens.append(text)
        token_logprobs.append(_finite(e.logprob.logprob))
        top_logprobs.append(top(text, e.logprob))
        offsets.append(base + e.offset)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
