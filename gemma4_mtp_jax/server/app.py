"""The HTTP layer: an ASGI (Starlette) app with the OpenAI-compatible endpoints, /health and /metrics.

    POST /v1/completions        POST /v1/chat/completions     (JSON or SSE streams)
    GET  /v1/models             GET  /health                  GET /metrics (Prometheus)

A generation request's body is read up to `max_request_bytes` (413 beyond) and prepared (parsed, validated, its
chat rendered, tokenized) by prepare.py: on the event loop when small, in a worker process when large, so that no
body delays the streams the loop runs.

Generation responses are raw ASGI callables that watch the connection while they run: when the client goes
away (mid-stream, or while waiting for a non-streamed answer) the request is cancelled in the engine and its KV
pages are freed at once.

`OpenAIServer.app` wraps the routes in one edge that every response passes: it counts each response (by endpoint
and status, 499 for a client that left before its answer), refuses a request that carries both Content-Length and
Transfer-Encoding (ambiguous framing: the classic request-smuggling shape), and answers an exception no handler
caught with a JSON 500. Every body is JSON that encodes (lone surrogates a client sent are replaced when echoed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from gemma4_mtp_jax.engine import RequestError
from gemma4_mtp_jax.model.sampling import SamplingParams
from gemma4_mtp_jax.server.async_engine import (
    REQUEST_FAILED,
    AsyncEngine,
    Delta,
    QueueFull,
    RequestStream,
    ShuttingDown,
)
from gemma4_mtp_jax.server.chat import TextTokenizer
from gemma4_mtp_jax.server.detokenize import TextStream
from gemma4_mtp_jax.server.errors import APIError, bad_request, json_bytes
from gemma4_mtp_jax.server.metrics import Metrics
from gemma4_mtp_jax.server.prepare import RequestPreparer, ServerSettings
from gemma4_mtp_jax.server.protocol import GenerationParams

log = logging.getLogger("gemma4_mtp_jax.server")

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions", "/v1/models": "models",
              "/health": "health", "/metrics": "metrics"}  # metric labels; any other path counts as "other"
CLIENT_CLOSED = 499  # nginx's status for a client that went away before its answer (never sent, only counted)
_INTERNAL_ERROR = APIError(500, "Internal server error", code="internal_error")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


def _json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json_bytes(obj), status_code=status, headers=headers, media_type="application/json")


def _error_response(e: APIError) -> Response:
    return _json_response(e.body(), e.status, e.headers)


class OpenAIServer:
    def __init__(self, engine: AsyncEngine, tokenizer: TextTokenizer | None, settings: ServerSettings,
                 metrics: Metrics, eos_ids: frozenset[int] = frozenset()):
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = metrics
        self.eos_ids = frozenset(eos_ids)
        self.preparer = RequestPreparer(settings, tokenizer)
        metrics.spec_tokens.set(settings.num_speculative_tokens)
        self.routes = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ],
            exception_handlers={HTTPException: self._http_exception, Exception: self._internal_error},
            lifespan=self._lifespan,
        )
        self.app = _Edge(self.routes, metrics)

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        return _error_response(_INTERNAL_ERROR)

    # ------------------------------------------------------------------ lifecycle
    @asynccontextmanager
    async def _lifespan(self, app):
        self.engine.start()
        try:
            yield
        finally:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.engine.stop)
            await loop.run_in_executor(None, self.preparer.close)

    def begin_drain(self, grace_s: float) -> None:
        """Refuse new requests (503); abort those still running after `grace_s` seconds. Signal-handler safe."""
        self.engine.begin_drain(grace_s)

    # ------------------------------------------------------------------ small endpoints
    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            e = APIError(404, f"No route for {request.method} {request.url.path}", code="not_found")
        elif exc.status_code == 405:
            e = APIError(405, f"Method {request.method} is not allowed on {request.url.path}",
                         code="method_not_allowed", headers=dict(exc.headers or {}))
        else:
            e = APIError(exc.status_code, str(exc.detail))
        return _error_response(e)

    async def health(self, request: Request) -> Response:
        snap = self.engine.snapshot
        if not self.engine.alive:
            status = "dead"
        elif self.engine.draining:
            status = "draining"
        elif self.engine.last_error:
            status = "degraded"
        else:
            status = "ok"
        # Steady speed: every bucket's program compiled and none still in its quick untuned form. Until then
        # the server serves, but slower (a benchmark waits for this, not for ready).
        final = snap["programs_compiled"] == snap["programs_total"] and snap["programs_untuned"] == 0
        body = {"status": status, "model": self.settings.model_name, **snap, "programs_final": final,
                "num_speculative_tokens": self.settings.num_speculative_tokens,
                "last_error": self.engine.last_error}
        return _json_response(body, 200 if status in ("ok", "degraded") else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except APIError as e:
            return _error_response(e)
        card = {"id": self.settings.model_name, "object": "model", "created": self.settings.created,
                "owned_by": "gemma4_mtp_jax", "max_model_len": self.settings.max_model_len}
        return _json_response({"object": "list", "data": [card]})

    # ------------------------------------------------------------------ generation endpoints
    async def completions(self, request: Request):
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request):
        return await self._generate(request, "chat")

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def _sampling(self, p: GenerationParams) -> SamplingParams:
        s = self.settings
        temperature = s.default_temperature if p.temperature is None else p.temperature
        seed = p.seed if p.seed is not None else secrets.randbits(32)
        # protocol.py checked every field against what SamplingParams takes; the server's defaults come from the
        # checkpoint's generation_config, and a bad one there is not the client's fault (500, logged).
        return SamplingParams(temperature, s.default_top_k if p.top_k is None else p.top_k,
                              s.default_top_p if p.top_p is None else p.top_p, seed)

    def _rejected(self, endpoint: str, e: APIError) -> Response:
        if e.status >= 500:
            log.warning("%s -> %d: %s", endpoint, e.status, e.message)
        return _error_response(e)

    async def _generate(self, request: Request, kind: str):
        endpoint = "completions" if kind == "completion" else "chat.completions"
        arrival = time.perf_counter()
        try:
            self._authorize(request)
            if self.engine.draining:
                raise APIError(503, "The server is shutting down", code="shutting_down")
            prepared = await self.preparer.prepare(await self._read_body(request), kind)
            params, prompt_ids = prepared.params, prepared.prompt_ids
            sampling = self._sampling(params)
            rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
            stop_ids = frozenset() if params.ignore_eos else None  # None: the model's EOS ids
            stream = await self.engine.submit(prompt_ids, prepared.max_tokens, sampling, stop_ids, rid)
        except APIError as e:
            return self._rejected(endpoint, e)
        except QueueFull as e:
            return self._rejected(endpoint, APIError(
                429, f"The server is at capacity ({e}); retry after {e.retry_after}s", code="server_overloaded",
                headers={"Retry-After": str(e.retry_after)}))
        except ShuttingDown as e:
            return self._rejected(endpoint, APIError(503, str(e), code="shutting_down"))
        except RequestError as e:  # the engine's own checks on what the server passed on (prompt and length)
            return self._rejected(endpoint, bad_request(str(e), "prompt" if kind == "completion" else "messages",
                                                        "invalid_prompt"))
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED)
        except Exception:
            log.exception("unexpected error while admitting a request")
            return self._rejected(endpoint, _INTERNAL_ERROR)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        gen = _Generation(self, stream, params, prompt_ids, arrival, endpoint)
        return _GenerationResponse(gen)


class _Edge:
    """The ASGI app the HTTP server runs: `routes` behind the checks and the counting every HTTP request gets."""

    def __init__(self, routes, metrics: Metrics):
        self.routes = routes
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.routes(scope, receive, send)
        endpoint = _ENDPOINTS.get(scope["path"], "other")
        started = disconnected = False

        async def counted_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        async def watched_receive():
            nonlocal disconnected
            message = await receive()
            disconnected = disconnected or message["type"] == "http.disconnect"
            return message

        names = {name for name, _ in scope["headers"]}
        if b"transfer-encoding" in names and b"content-length" in names:
            e = APIError(400, "The request carries both Content-Length and Transfer-Encoding; send one (RFC 9112 "
                              "section 6.1)", code="ambiguous_framing", headers={"Connection": "close"})
            return await _error_response(e)(scope, receive, counted_send)
        try:
            await self.routes(scope, watched_receive, counted_send)
        except Exception:  # Starlette already answered with _internal_error (and re-raised, for the log)
            log.exception("%s %s failed", scope["method"], scope["path"])
            if not started:
                await _error_response(_INTERNAL_ERROR)(scope, receive, counted_send)
            return
        if not started:
            if disconnected:  # the client left before its answer (a generation cancelled on disconnect)
                self.metrics.requests.labels(endpoint, str(CLIENT_CLOSED)).inc()
            else:
                log.error("%s %s returned no response", scope["method"], scope["path"])
                await _error_response(_INTERNAL_ERROR)(scope, receive, counted_send)


@dataclasses.dataclass
class _Output:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


class _Generation:
    """One accepted request: engine deltas -> detokenized text outputs, metrics, usage, and clean cancellation."""

    def __init__(self, server: OpenAIServer, stream: RequestStream, params: GenerationParams, prompt_ids: list[int],
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

    async def outputs(self) -> AsyncIterator[_Output]:
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
                    yield _Output(text, new_ids, "stop")
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
                    yield _Output(text, new_ids, reason)
                    return
                if text or new_ids:
                    yield _Output(text, new_ids)
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


class _GenerationResponse:
    """ASGI response that runs a generation while watching for the client going away (then: cancel it)."""

    def __init__(self, gen: _Generation):
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
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        async for chunk in self.gen.sse():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
