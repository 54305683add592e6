"""A generation request's body -> what the engine takes (`Prepared`: parameters, prompt token ids, max_tokens), or an
APIError: JSON parsing, validation (protocol.py), the chat template and tokenization (chat.py).

That work grows with the body, and the event loop runs every stream: a body of at most INLINE_BYTES is prepared on
the loop (a few milliseconds), a larger one in a worker process (`RequestPreparer`). Not in a thread: the JSON
parser (C code) and the garbage collector's passes over the objects a parse makes hold the GIL in long stretches,
so a thread stalls the loop too (tests/test_server_units.py::test_a_14_mib_body_delays_no_stream, 14 MiB of 400k
messages, on a busy 2-core machine: the stream's longest gap was 0.4-1.1 s with the body prepared on the loop,
0.16-0.23 s in a thread, at most 0.07 s, with engine steps of 0.02 s, in a worker process). In another process the
work costs the streams nothing, and only the small result comes back. A worker takes a few seconds to start (it
imports the package and loads the tokenizer): `serve` starts one with the server, more start as large bodies come
(up to MAX_WORKERS), and they live as long as the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from gemma4_mtp_jax.server.chat import TextTokenizer
from gemma4_mtp_jax.server.errors import APIError, bad_request
from gemma4_mtp_jax.server.media import MEDIA_MARKS
from gemma4_mtp_jax.server.protocol import (
    DEFAULT_MAX_MESSAGES,
    GenerationParams,
    parse_chat,
    parse_completion,
    parse_json,
    show_json,
)

log = logging.getLogger(__name__)

INLINE_BYTES = 16 * 2**10  # larger bodies are prepared in a worker process
MAX_WORKERS = 4  # worker processes at most (fewer on fewer CPUs); each holds a copy of the tokenizer
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20


@dataclasses.dataclass
class ServerSettings:
    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None
    aliases: tuple[str, ...] = ()  # other names accepted in "model" (e.g. the checkpoint path)
    default_temperature: float = 1.0
    default_top_k: int = 0
    default_top_p: float = 1.0
    default_completion_max_tokens: int = 16  # OpenAI's default for /v1/completions; chat: up to max_model_len
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES
    num_speculative_tokens: int = 0
    tool_call_parser: str = "auto"  # --tool-call-parser: auto, gemma4 or none (chat_output.py)
    reasoning_parser: str = "auto"  # --reasoning-parser
    prompt_logprobs: bool = False  # --enable-prompt-logprobs: the engine computes prompt logprobs (echo + logprobs)
    # The model's image and audio token ids ({"image": id, "audio": id}) when it has encoders, else None.
    media_token_ids: dict[str, int] | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclasses.dataclass
class Prepared:
    params: GenerationParams
    prompt_ids: list[int]
    max_tokens: int
    bad_token_ids: tuple[int, ...] = ()  # `bad_words` as the single tokens the engine bans


class Preparer:
    """Request bodies -> `Prepared`, with the server's settings and tokenizer: the same code on the event loop and in
    the worker processes."""

    def __init__(self, settings: ServerSettings, tokenizer: TextTokenizer | None):
        self.settings = settings
        self.tokenizer = tokenizer

    def prepare(self, raw: bytes, kind: str) -> Prepared:
        """`kind`: "completion" or "chat". Raises APIError."""
        body = parse_json(raw)
        params = parse_completion(body) if kind == "completion" else parse_chat(body, self.settings.max_messages)
        self._check_model(params.model)
        prompt_ids = self._prompt_ids(params)
        max_tokens = self._max_tokens(params, len(prompt_ids))
        if params.min_tokens > max_tokens:
            raise bad_request(f"'min_tokens' ({params.min_tokens}) must be <= the request's max_tokens ({max_tokens})",
                              "min_tokens")
        for ids, param in ((params.logit_bias, "logit_bias"), (params.allowed_token_ids or (), "allowed_token_ids"),
                           (params.stop_token_ids, "stop_token_ids")):
            self._check_vocabulary(ids, param)
        bad = self._bad_token_ids(params.bad_words)
        if params.allowed_token_ids is not None and set(params.allowed_token_ids) <= set(bad):
            raise bad_request("'bad_words' ban every token of 'allowed_token_ids': none is left to emit", "bad_words")
        return Prepared(params, prompt_ids, max_tokens, bad)

    def _check_vocabulary(self, ids, param: str) -> None:
        V = self.settings.vocab_size
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            raise bad_request(f"'{param}': token id {bad} is outside the vocabulary [0, {V})", param)

    def _bad_token_ids(self, words: list[str]) -> tuple[int, ...]:
        """`bad_words` -> the token ids to ban: each word as it would start the text and after a space, as vLLM
        reads them. The engine bans single tokens, so a word must be one token (without the space); its spaced form
        is banned too when that is one other token."""
        if not words:
            return ()
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer (tokenizer.json): 'bad_words' can't be read",
                              "bad_words")
        out: dict[int, None] = {}
        for w in words:
            word = w.lstrip()
            ids = self.tokenizer.encode(word, special=False)
            if len(ids) != 1:
                raise bad_request(f"'bad_words': {show_json(w)} is {len(ids)} tokens; this server bans single-token "
                                  f"words only", "bad_words")
            out[ids[0]] = None
            spaced = self.tokenizer.encode(" " + word, special=False)
            if len(spaced) == 1:
                out[spaced[0]] = None
        return tuple(out)

    def _check_model(self, model: str | None) -> None:
        s = self.settings
        if model is None or model == s.model_name or model in s.aliases:
            return
        raise APIError(404, f"The model {show_json(model, 200)} does not exist; this server serves '{s.model_name}'",
                       param="model", code="model_not_found")

    def _tokenize(self, p: GenerationParams, param: str) -> list[int]:
        """Token ids of a completions prompt (param "prompt") or of a chat (messages, tools and template variables:
        "messages")."""
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer (tokenizer.json): " + (
                "send the prompt as token ids" if param == "prompt" else "chat is not available"), param)
        try:
            if param == "messages":
                return self.tokenizer.encode_chat(p.messages, p.tools, p.chat_template_kwargs, self._marks(p))
            return self.tokenizer.encode(p.prompt)
        except APIError:
            raise
        except Exception as e:  # the tokenizer is a function of the text alone: a text it refuses is the client's
            log.warning("the tokenizer refused '%s': %s: %s", param, type(e).__name__, e)
            raise bad_request(f"'{param}' could not be tokenized ({type(e).__name__})", param,
                              "invalid_string") from None

    def _marks(self, p: GenerationParams) -> dict[str, int] | None:
        """The media marks of a chat with image / audio parts -> the model's token ids for them."""
        if not p.media:
            return None
        tokens = self.settings.media_token_ids
        if tokens is None:
            raise bad_request(f"{p.media[0].where}: this model takes no images or audio", "messages")
        return {MEDIA_MARKS[kind]: tokens[kind] for kind in {part.kind for part in p.media}}

    def _prompt_ids(self, p: GenerationParams) -> list[int]:
        L = self.settings.max_model_len
        if p.kind == "chat":
            ids, where = self._tokenize(p, "messages"), "messages"
        elif isinstance(p.prompt, str):
            ids, where = self._tokenize(p, "prompt"), "prompt"
        else:
            ids, where = list(p.prompt), "prompt"
            V = self.settings.vocab_size
            if len(ids) < L:  # (a longer one is refused below, without scanning it)
                bad = next((t for t in ids if not 0 <= t < V), None)
                if bad is not None:
                    raise bad_request(f"prompt token id {show_json(bad)} is outside the vocabulary [0, {V})", "prompt")
        if not ids:
            raise bad_request("the prompt is empty after tokenization", where)
        if len(ids) >= L:
            raise bad_request(f"This model's maximum context length is {L} tokens; the prompt has {len(ids)} tokens "
                              f"(at least one token must be left to generate)", where, "context_length_exceeded")
        return ids

    def _max_tokens(self, p: GenerationParams, prompt_len: int) -> int:
        """The request's max_tokens; without one: completions OpenAI's 16, chat what the context has left (both
        capped by the context)."""
        L = self.settings.max_model_len
        room = L - prompt_len
        if p.max_tokens is None:
            return room if p.kind == "chat" else min(self.settings.default_completion_max_tokens, room)
        if p.max_tokens > room:
            raise bad_request(f"This model's maximum context length is {L} tokens; you asked for "
                              f"{prompt_len + p.max_tokens} ({prompt_len} in the prompt, {p.max_tokens} to generate)",
                              "max_tokens", "context_length_exceeded")
        return p.max_tokens


class RequestPreparer:
    """Prepares each request: a body of at most INLINE_BYTES on the event loop, a larger one in a pool of worker
    processes, started with the first such body (with the settings and the tokenizer's files as they are then)."""

    def __init__(self, settings: ServerSettings, tokenizer: TextTokenizer | None):
        self.local = Preparer(settings, tokenizer)
        self._worker_args = (settings, None if tokenizer is None else str(tokenizer.directory))
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False

    async def prepare(self, raw: bytes, kind: str) -> Prepared:
        if len(raw) <= INLINE_BYTES:
            return self.local.prepare(raw, kind)
        pool = self._workers()
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, _prepare_in_worker, raw, kind)
        except BrokenProcessPool:  # a worker died (killed, out of memory): its requests fail, the next get a new pool
            log.error("a worker process preparing requests died; starting new ones")
            if self._pool is pool:
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise APIError(500, "the server failed while reading this request", code="internal_error") from None

    def start(self) -> None:
        """Start a worker process now, in the background, so that the first large body need not wait for one."""
        self._workers().submit(_ready)

    def _workers(self) -> ProcessPoolExecutor:
        if self._closed:  # a request still being read when the server stopped: no workers to start any more
            raise APIError(503, "The server is shutting down", code="shutting_down")
        if self._pool is None:
            import multiprocessing

            # spawn: a fork would copy the JAX runtime's threads and locks mid-use
            self._pool = ProcessPoolExecutor(min(MAX_WORKERS, os.cpu_count() or 1),
                                             multiprocessing.get_context("spawn"), initializer=_start_worker,
                                             initargs=self._worker_args)
        return self._pool

    def close(self) -> None:
        """Stop the worker processes (work not yet begun is dropped). Blocks until they exit."""
        pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


_worker: Preparer | None = None  # the worker process's own


def _start_worker(settings: ServerSettings, tokenizer_dir: str | None) -> None:
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server stops us
    _worker = Preparer(settings, None if tokenizer_dir is None else TextTokenizer(tokenizer_dir))


def _prepare_in_worker(raw: bytes, kind: str) -> Prepared:
    return _worker.prepare(raw, kind)


def _ready() -> None:
    pass
