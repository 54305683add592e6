"""A generation request once accepted: the engine's deltas for it become detokenized text, usage and metrics, sent
as one JSON answer or as server-sent events by a raw ASGI callable that watches the connection while it runs: when
the client goes away (mid-stream, or while waiting for a non-streamed answer) the request is cancelled in the engine
and its KV pages are freed at once."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, AsyncIterator

from gemma4_mtp_jax.server.async_engine import REQUEST_FAILED, Delta, RequestStream
from gemma4_mtp_jax.server.detokenize import TextStream
from gemma4_mtp_jax.server.errors import APIError, json_bytes
from gemma4_mtp_jax.server.protocol import GenerationParams

log = logging.getLogger("gemma4_mtp_jax.server")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
CLIENT_CLOSED = 499  # nginx's status for a client that went away before its answer (never sent, only counted)


@dataclasses.dataclass
class Output:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


class Generation:
    """One accepted request: engine deltas -> detokenized text outputs, metrics, usage, and clean cancellation."""

    def __init__(self, server: Any, stream: RequestStream, params: GenerationParams, prompt_ids: list[int],
                 arrival: float, endpoint: str):
        self.server = server
        self.stream = stream
        self.params = params
        self.prompt_ids = prompt_ids
        self.arrival = arrival
        self.endpoint = endpoint
        self.created = int(time.time())
        self.text = TextStream(server.tokenizer, prompt_ids, params.stop)
        self.finish_reason: str | None = None
        self._last_token_time: float | None = None
        self.closed = False

    @property
    def usage(self) -> dict[str, int]:
        n = self.text.num_tokens
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": n, "total_tokens": len(self.prompt_ids) + n}

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
                self._observe(d, len(new_ids))
                if self.text.stopped:  # a stop string: done, whatever the engine would still produce
                    if not d.finished:
                        self.server.engine.cancel(self.stream)
                    self._finish("stop")
                    yield Output(text, new_ids, "stop")
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
                    yield Output(text, new_ids, reason)
                    return
                if text or new_ids:
                    yield Output(text, new_ids)
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

    # ------------------------------------------------------------------ response bodies
    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.stream.id, "object": obj, "created": self.created, "model": self.server.settings.model_name}

    async def full_response(self) -> dict[str, Any]:
        texts, ids, reason = [], [], None
        async for out in self.outputs():
            texts.append(out.text)
            ids += out.token_ids
            reason = out.finish_reason or reason
        text = "".join(texts)
        if self.params.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": reason}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            body = self._base("text_completion")
        if self.params.return_token_ids:
            choice["token_ids"] = ids
            body["prompt_token_ids"] = self.prompt_ids
        body.update(choices=[choice], usage=self.usage, system_fingerprint=None)
        return body

    def _chunk(self, text: str | None, ids: list[int] | None, finish_reason: str | None,
               role: bool = False) -> bytes:
        if self.params.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._base("text_completion")
        if self.params.return_token_ids and ids is not None:
            choice["token_ids"] = ids
        body["choices"] = [choice]
        if self.params.include_usage:
            body["usage"] = None
        return b"data: " + json_bytes(body) + b"\n\n"

    async def sse(self) -> AsyncIterator[bytes]:
        p = self.params
        try:
            if p.kind == "chat":
                yield self._chunk("", [] if p.return_token_ids else None, None, role=True)
            if p.return_token_ids:
                first = self._base("chat.completion.chunk" if p.kind == "chat" else "text_completion")
                first.update(choices=[], prompt_token_ids=self.prompt_ids)
                yield b"data: " + json_bytes(first) + b"\n\n"
            async for out in self.outputs():
                if out.text or (p.return_token_ids and out.token_ids):
                    yield self._chunk(out.text, out.token_ids, None)
                if out.finish_reason is not None:
                    yield self._chunk("" if p.kind == "completion" else None, [] if p.return_token_ids else None,
                                      out.finish_reason)
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
                log.error("response for %s failed", gen.stream.id, exc_info=exc)

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
