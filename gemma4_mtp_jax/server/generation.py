"""A generation request once accepted: the engine's deltas for each of its choices become detokenized text,
logprobs, usage and metrics, sent as one JSON answer or as server-sent events (the choices' chunks interleaved as
they come, each with its index) by a raw ASGI callable that watches the connection while it runs: when the client
goes away (mid-stream, or while waiting for a non-streamed answer) every choice is cancelled in the engine and its
KV pages are freed at once."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, AsyncIterator

from gemma4_mtp_jax.engine.request import TokenLogprob
from gemma4_mtp_jax.server.async_engine import REQUEST_FAILED, Delta, RequestStream
from gemma4_mtp_jax.server.detokenize import TextStream
from gemma4_mtp_jax.server.errors import APIError, json_bytes
from gemma4_mtp_jax.server.logprobs import TokenEntry, chat_logprobs, completion_logprobs
from gemma4_mtp_jax.server.protocol import GenerationParams

log = logging.getLogger("gemma4_mtp_jax.server")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
CLIENT_CLOSED = 499  # nginx's status for a client that went away before its answer (never sent, only counted)


@dataclasses.dataclass
class Output:
    """A choice's next piece: its text, the token ids consumed, and (when asked) the logprobs of the tokens whose
    text has begun to show; the last piece carries finish_reason."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenEntry] | None = None  # None: not asked for


class Choice:
    """One choice of a generation, one engine request: its deltas -> detokenized text, logprobs, metrics, and clean
    cancellation."""

    def __init__(self, server: Any, stream: RequestStream, index: int, params: GenerationParams,
                 prompt_ids: list[int], arrival: float):
        self.server = server
        self.stream = stream
        self.index = index
        self.params = params
        self.arrival = arrival
        # A chat's output parser (tool calls, reasoning: chat_output.py; None: the text is the content), and the
        # special tokens whose text it reads.
        self.output, shown = server.output_parsers.for_request(params)
        self.text = TextStream(server.tokenizer, prompt_ids, params.stop, shown)
        self.logprobs: list[TokenLogprob] = []  # one per token consumed, when the engine sends them
        self._sent = 0  # the logprobs of the first `_sent` tokens went out
        self.finish_reason: str | None = None
        self._last_token_time: float | None = None
        self.closed = False

    @property
    def cumulative_logprob(self) -> float:
        """The choice's log-probability: its tokens' logprobs summed (best_of ranks choices by it)."""
        return sum(lp.logprob for lp in self.logprobs)

    def _observe(self, d: Delta, n_new: int) -> None:
        m = self.server.metrics
        if n_new:
            if self._last_token_time is None:
                m.ttft.observe(max(0.0, d.time - self.arrival))  # the other tokens of this step: no gap to measure
            else:
                gap = max(0.0, d.time - self._last_token_time) / n_new
                for _ in range(n_new):
                    m.itl.observe(gap)
            self._last_token_time = d.time
            m.generation_tokens.inc(n_new)

    def _take_logprobs(self, final: bool = False) -> list[TokenEntry] | None:
        """The logprobs of the tokens that have begun to show since the last call (all the text's at the end)."""
        if self.params.logprobs is None:
            return None
        end = min(self.text.shown(final), len(self.logprobs))
        t = self.text
        out = [TokenEntry(t.token_ids[i], t.offsets[i], self.logprobs[i]) for i in range(self._sent, end)]
        self._sent = max(self._sent, end)
        return out

    async def outputs(self) -> AsyncIterator[Output]:
        """Text as it becomes final; the last output carries finish_reason. Raises APIError if the request failed."""
        try:
            async for d in self.stream.deltas():
                before = self.text.num_tokens
                skip = ()
                if d.finished and d.finish_reason == "stop" and d.tokens and d.tokens[-1] in self._stop_ids():
                    skip = (d.tokens[-1],)  # the EOS that ended generation: counted, not shown
                text = self.text.push(d.tokens, skip_text=skip)
                new_ids = self.text.token_ids[before:]
                if d.logprobs is not None:
                    self.logprobs += d.logprobs[: len(new_ids)]
                self._observe(d, len(new_ids))
                if self.text.stopped:  # a stop string: done, whatever the engine would still produce
                    if not d.finished:
                        self.server.engine.cancel(self.stream)
                    self._finish("stop")
                    yield Output(text, new_ids, "stop", self._take_logprobs(final=True))
                    return
                if d.finished:
                    if d.finish_reason in ("abort", "error"):
                        self._finish(d.finish_reason)
                        status = 503 if d.finish_reason == "abort" else 500
                        raise APIError(status, d.error or "the request failed", code=d.finish_reason)
                    if d.finish_reason == "cancelled":  # not asked by us: treat as an abort
                        self._finish("cancelled")
                        raise APIError(503, "the request was cancelled by the server", code="cancelled")
                    text += self.text.finish()
                    reason = "stop" if self.text.stopped else (d.finish_reason or "stop")
                    self._finish(reason)
                    yield Output(text, new_ids, reason, self._take_logprobs(final=True))
                    return
                logprobs = self._take_logprobs()
                if text or new_ids or logprobs:
                    yield Output(text, new_ids, None, logprobs)
        except APIError:
            raise
        except Exception:  # this request's detokenizing or bookkeeping: it fails alone, as in the engine
            log.exception("request %s failed in the server", self.stream.id)
            self.server.engine.cancel(self.stream)
            self._finish("error")
            raise APIError(500, REQUEST_FAILED, code="error") from None
        finally:
            if not self.closed:  # the consumer went away (disconnect, task cancelled)
                self.server.engine.cancel(self.stream)
                self._finish("cancelled")

    def _stop_ids(self) -> frozenset[int]:
        req = self.stream.request
        return req.stop_ids if req is not None else self.server.eos_ids

    def _finish(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.finish_reason = reason
        m = self.server.metrics
        m.finished.labels(finish_reason=reason).inc()
        if reason in ("stop", "length") and self._last_token_time is not None:
            m.e2e.observe(max(0.0, self._last_token_time - self.arrival))

    def cancel(self) -> None:
        if not self.closed:
            self.server.engine.cancel(self.stream)
            self._finish("cancelled")

    def chat_reason(self, reason: str | None) -> str | None:
        """The finish reason of a chat choice: "tool_calls" when it stopped after calling tools (as OpenAI)."""
        if self.output is not None and self.output.num_tool_calls:
            self.server.metrics.tool_call_responses.inc()
            if reason == "stop":
                return "tool_calls"
        return reason


class Generation:
    """One accepted request: its choices (one engine request each) -> one JSON answer or one event stream, with
    usage over all of them; a failed choice fails the response, and every choice is cancelled with it."""

    def __init__(self, server: Any, request_id: str, streams: list[RequestStream], params: GenerationParams,
                 prompt_ids: list[int], arrival: float, endpoint: str):
        self.server = server
        self.id = request_id
        self.params = params
        self.prompt_ids = prompt_ids
        self.endpoint = endpoint
        self.created = int(time.time())
        self.choices = [Choice(server, s, i, params, prompt_ids, arrival) for i, s in enumerate(streams)]
        self.echo = self._prompt_text() if params.echo else ""

    def _prompt_text(self) -> str:
        if isinstance(self.params.prompt, str):
            return self.params.prompt
        tok = self.server.tokenizer
        return "" if tok is None else tok.decode(self.prompt_ids)

    @property
    def usage(self) -> dict[str, int]:
        """The prompt once, and every choice's tokens (those of best_of's choices not returned too)."""
        n = sum(c.text.num_tokens for c in self.choices)
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": n, "total_tokens": len(self.prompt_ids) + n}

    def cancel(self) -> None:
        for c in self.choices:
            c.cancel()

    async def _outputs(self) -> AsyncIterator[tuple[int, Output]]:
        """(choice index, output) of every choice as they come. The first choice that fails fails them all."""
        if len(self.choices) == 1:
            async for out in self.choices[0].outputs():
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, Output | APIError | None]] = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async for out in c.outputs():
                    queue.put_nowait((c.index, out))
            except APIError as e:
                queue.put_nowait((c.index, e))
                return
            queue.put_nowait((c.index, None))

        tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
        try:
            running = len(tasks)
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, APIError):
                    raise item
                else:
                    yield i, item
        finally:  # done, failed, or the consumer went away: the choices still running are cancelled
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ response bodies
    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.server.settings.model_name}

    def _logprobs(self, entries: list[TokenEntry] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        if self.params.kind == "chat":
            return chat_logprobs(entries, self.server.token_pieces)
        return completion_logprobs(entries, self.server.token_pieces, len(self.echo), self._prompt_logprobs())

    def _prompt_logprobs(self) -> list[tuple[int, int, Any]] | None:
        """An echoed prompt's (token, where its text starts, logprob), the logprobs from the first choice's engine
        request (its prefill computed them: SamplingParams.prompt_logprobs), in a whole answer; None otherwise."""
        req = self.choices[0].stream.request
        if not (self.echo and self.params.logprobs is not None and not self.params.stream and req is not None):
            return None
        text = TextStream(self.server.tokenizer)
        text.push(self.prompt_ids)
        return list(zip(self.prompt_ids, text.offsets, [None] + list(req.prompt_logprobs)))

    async def full_response(self) -> dict[str, Any]:
        texts: list[list[str]] = [[] for _ in self.choices]
        ids: list[list[int]] = [[] for _ in self.choices]
        logprobs: list[list[TokenEntry] | None] = [None] * len(self.choices)
        async for i, out in self._outputs():
            texts[i].append(out.text)
            ids[i] += out.token_ids
            if out.logprobs is not None:
                logprobs[i] = (logprobs[i] or []) + out.logprobs
        p = self.params
        ranked = self.choices
        if p.best_of > p.n:  # the n most likely choices, the likeliest first (as OpenAI and vLLM)
            ranked = sorted(self.choices, key=lambda c: c.cumulative_logprob, reverse=True)[: p.n]
        choices = []
        for index, c in enumerate(ranked):
            text = self.echo + "".join(texts[c.index])
            lp = self._logprobs(logprobs[c.index] if p.logprobs is not None else None)
            if p.kind == "chat":
                message = {"role": "assistant", "content": text} if c.output is None else c.output.message(text)
                choice = {"index": index, "message": message, "logprobs": lp,
                          "finish_reason": c.chat_reason(c.finish_reason)}
            else:
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
            if p.return_token_ids:
                choice["token_ids"] = ids[c.index]
            choices.append(choice)
        body = self._base("chat.completion" if p.kind == "chat" else "text_completion")
        if p.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        body.update(choices=choices, usage=self.usage, system_fingerprint=None)
        return body

    def _chunk(self, index: int, text: str | None, ids: list[int] | None, finish_reason: str | None,
               role: bool = False, logprobs: list[TokenEntry] | None = None,
               fields: dict[str, Any] | None = None) -> bytes:
        """One SSE event; a chat delta holds `fields` (content, reasoning_content, tool_calls) or `text`."""
        if self.params.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            delta.update(fields or {})
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": self._logprobs(logprobs),
                      "finish_reason": finish_reason}
            body = self._base("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text or "", "logprobs": self._logprobs(logprobs),
                      "finish_reason": finish_reason}
            body = self._base("text_completion")
        if self.params.return_token_ids and ids is not None:
            choice["token_ids"] = ids
        body["choices"] = [choice]
        if self.params.include_usage:
            body["usage"] = None
        return b"data: " + json_bytes(body) + b"\n\n"

    def _parsed_chunks(self, c: Choice, out: Output) -> list[bytes]:
        """A choice's output through its output parser: one chunk per delta (content, reasoning, tool calls in the
        order written), the output's token ids and logprobs on the first."""
        deltas = c.output.push(out.text) + (c.output.finish() if out.finish_reason is not None else [])
        ids = out.token_ids if self.params.return_token_ids and out.token_ids else None
        logprobs = out.logprobs or None
        if not deltas and (ids or logprobs):
            deltas = [{}]
        chunks = []
        for d in deltas:
            chunks.append(self._chunk(c.index, None, ids, None, logprobs=logprobs, fields=d))
            ids = logprobs = None
        return chunks

    async def sse(self) -> AsyncIterator[bytes]:
        p = self.params
        try:
            if p.kind == "chat":
                for c in self.choices:
                    yield self._chunk(c.index, "", [] if p.return_token_ids else None, None, role=True)
            if p.return_token_ids:
                first = self._base("chat.completion.chunk" if p.kind == "chat" else "text_completion")
                first.update(choices=[], prompt_token_ids=self.prompt_ids)
                yield b"data: " + json_bytes(first) + b"\n\n"
            if self.echo:
                for c in self.choices:
                    yield self._chunk(c.index, self.echo, None, None)
            async for i, out in self._outputs():
                c = self.choices[i]
                if c.output is not None:
                    for chunk in self._parsed_chunks(c, out):
                        yield chunk
                elif out.text or (p.return_token_ids and out.token_ids) or out.logprobs:
                    yield self._chunk(i, out.text, out.token_ids, None, logprobs=out.logprobs)
                if out.finish_reason is not None:
                    reason = c.chat_reason(out.finish_reason) if p.kind == "chat" else out.finish_reason
                    yield self._chunk(i, "" if p.kind == "completion" else None, [] if p.return_token_ids else None,
                                      reason)
        except APIError as e:
            yield b"data: " + json_bytes(e.body()) + b"\n\n"
        if p.include_usage:
            body = self._base("chat.completion.chunk" if p.kind == "chat" else "text_completion")
            body.update(choices=[], usage=self.usage)
            yield b"data: " + json_bytes(body) + b"\n\n"
        yield b"data: [DONE]\n\n"


class GenerationResponse:
    """ASGI response that runs a generation while watching for the client going away (then: cancel it)."""

    def __init__(self, gen: Generation):
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        gen = self.gen
        producer = asyncio.ensure_future(self._stream(send) if gen.params.stream else self._json(send))
        listener = asyncio.ensure_future(self._wait_disconnect(receive))
        try:
            await asyncio.wait({producer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (producer, listener):
                if not t.done():
                    t.cancel()
            await asyncio.gather(producer, listener, return_exceptions=True)
            gen.cancel()  # no-op when it finished normally
        if producer.done() and not producer.cancelled() and producer.exception() is not None:
            exc = producer.exception()
            if not isinstance(exc, OSError):
                log.error("response for %s failed", gen.id, exc_info=exc)

    @staticmethod
    async def _wait_disconnect(receive) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return

    async def _json(self, send) -> None:
        try:
            body, status, headers = json_bytes(await self.gen.full_response()), 200, []
        except APIError as e:
            body, status, headers = json_bytes(e.body()), e.status, list(e.headers.items())
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in headers]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        async for chunk in self.gen.sse():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
