"""The HTTP layer: an ASGI (Starlette) app with the OpenAI-compatible endpoints, /health and /metrics.

    POST /v1/completions        POST /v1/chat/completions     (JSON or SSE streams)
    GET  /v1/models             GET  /health                  GET /metrics (Prometheus)

A generation request's body is read up to `max_request_bytes` (413 beyond) and prepared (parsed, validated, its
chat rendered, tokenized) by prepare.py: on the event loop when small, in a worker process when large, so that no
body delays the streams the loop runs.

An accepted generation request is answered by generation.py: a raw ASGI callable that watches the connection while
it runs, so that a client going away cancels the request in the engine at once.

`OpenAIServer.app` wraps the routes in one edge that every response passes: it counts each response (by endpoint
and status, 499 for a client that left before its answer), refuses a request that carries both Content-Length and
Transfer-Encoding (ambiguous framing: the classic request-smuggling shape), and answers an exception no handler
caught with a JSON 500. Every body is JSON that encodes (lone surrogates a client sent are replaced when echoed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from gemma4_mtp_jax.engine import RequestError
from gemma4_mtp_jax.model.sampling import SamplingParams
from gemma4_mtp_jax.server.async_engine import AsyncEngine, QueueFull, ShuttingDown
from gemma4_mtp_jax.server.chat import TextTokenizer
from gemma4_mtp_jax.server.chat_output import OutputParsers
from gemma4_mtp_jax.server.errors import APIError, bad_request, json_bytes
from gemma4_mtp_jax.server.generation import CLIENT_CLOSED, Generation, GenerationResponse
from gemma4_mtp_jax.server.metrics import Metrics
from gemma4_mtp_jax.server.logprobs import TokenPieces
from gemma4_mtp_jax.server.media import MediaLoader
from gemma4_mtp_jax.server.prepare import Prepared, RequestPreparer, ServerSettings
from gemma4_mtp_jax.server.protocol import GenerationParams
from gemma4_mtp_jax.server.structured import compile_structured, grammar_compiler
from gemma4_mtp_jax.steps.device_state import MAX_STOP_IDS

log = logging.getLogger("gemma4_mtp_jax.server")

_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions", "/v1/models": "models",
              "/health": "health", "/metrics": "metrics"}  # metric labels; any other path counts as "other"
_INTERNAL_ERROR = APIError(500, "Internal server error", code="internal_error")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed` (choice 0: the seed itself, so n = 1 is unchanged)."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=4).digest(), "little")


def _json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json_bytes(obj), status_code=status, headers=headers, media_type="application/json")


def _error_response(e: APIError) -> Response:
    return _json_response(e.body(), e.status, e.headers)


class OpenAIServer:
    def __init__(self, engine: AsyncEngine, tokenizer: TextTokenizer | None, settings: ServerSettings,
                 metrics: Metrics, eos_ids: frozenset[int] = frozenset(), media: MediaLoader | None = None):
        self.engine = engine
        self.media = media  # a target with encoders: chat's image and audio parts (server/media.py)
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = metrics
        self.eos_ids = frozenset(eos_ids)
        self.preparer = RequestPreparer(settings, tokenizer)
        self.token_pieces = TokenPieces(tokenizer)  # token strings and bytes for logprobs, cached
        self.output_parsers = OutputParsers.select(tokenizer, settings.tool_call_parser, settings.reasoning_parser)
        # Structured output's grammars for this tokenizer (its vocabulary indexed once, here: it holds the GIL).
        self.grammars = None if tokenizer is None else grammar_compiler(tokenizer.tokenizer.to_str(),
                                                                        settings.vocab_size, self.eos_ids)
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
            if self.grammars is not None:
                self.grammars.shutdown()

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

    def _samplings(self, prepared: Prepared) -> list[SamplingParams]:
        """One SamplingParams per choice to generate (best_of of them): choice 0 has the request's seed, choice i
        one derived from (seed, i), so a seeded request is reproducible and its choices differ."""
        s, p = self.settings, prepared.params
        temperature = s.default_temperature if p.temperature is None else p.temperature
        seed = p.seed if p.seed is not None else secrets.randbits(32)
        # best_of > n ranks the choices by their logprobs: the engine computes them even when not asked for.
        logprobs = 0 if p.logprobs is None and p.best_of > p.n else p.logprobs
        # echo with logprobs: the prompt's, computed by the first choice's prefill
        prompt_logprobs = p.logprobs if p.echo and p.logprobs is not None else None
        # protocol.py and prepare.py checked every field against what SamplingParams takes; the server's defaults
        # come from the checkpoint's generation_config, and a bad one there is not the client's fault (500, logged).
        top_k = s.default_top_k if p.top_k is None else p.top_k
        top_p = s.default_top_p if p.top_p is None else p.top_p
        base = SamplingParams(
            temperature, top_k, top_p, seed, min_p=p.min_p, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
            logit_bias=tuple(sorted(p.logit_bias.items())), min_tokens=p.min_tokens,
            allowed_token_ids=None if p.allowed_token_ids is None else tuple(sorted(p.allowed_token_ids)),
            bad_token_ids=prepared.bad_token_ids, logprobs=logprobs)
        return [dataclasses.replace(base, prompt_logprobs=prompt_logprobs)] + [
            dataclasses.replace(base, seed=choice_seed(seed, i)) for i in range(1, p.best_of)]

    async def _grammars(self, p: GenerationParams, choices: int) -> list[Any] | None:
        """Each choice's grammar matcher for a request with structured output (compiled off the event loop, in the
        compiler's threads, within a time limit: structured.compile_structured), or None."""
        if p.structured is None:
            return None
        if self.grammars is None:
            raise bad_request(f"'{p.structured.param}' needs the checkpoint's tokenizer, which this server has not",
                              p.structured.param)
        compiled = await compile_structured(self.grammars, p.structured)
        self.metrics.structured_requests.inc()
        return [compiled.matcher() for _ in range(choices)]

    def _stop_ids(self, p: GenerationParams) -> frozenset[int] | None:
        """The token ids that end the request: the model's EOS (unless ignore_eos) and `stop_token_ids`; None: the
        engine's own EOS ids."""
        if not p.stop_token_ids:
            return frozenset() if p.ignore_eos else None
        ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
        if len(ids) > MAX_STOP_IDS:
            raise bad_request(f"'stop_token_ids': at most {MAX_STOP_IDS} stop token ids with the model's "
                              f"{len(self.eos_ids)} end-of-sequence ids, got {len(ids)}", "stop_token_ids")
        return ids

    async def _load_media(self, prepared: Prepared) -> tuple[list[int], Any, int]:
        """A chat's images and audio, fetched, decoded and encoded in a thread (the event loop runs every stream):
        (the prompt with its placeholders expanded, its PromptMedia, its max_tokens: without one given, what the
        longer prompt leaves)."""
        params = prepared.params
        if self.media is None:
            raise bad_request(f"{params.media[0].where}: this model takes no images or audio", "messages")
        ids, media = await asyncio.to_thread(self.media.load, prepared.prompt_ids, params.media)
        L = self.settings.max_model_len
        if len(ids) >= L:
            raise bad_request(f"This model's maximum context length is {L} tokens; the prompt has {len(ids)} tokens "
                              f"with its media's soft tokens", "messages", "context_length_exceeded")
        max_tokens = prepared.max_tokens if params.max_tokens is not None else min(prepared.max_tokens, L - len(ids))
        return ids, media, max_tokens

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
            stop_ids = self._stop_ids(params)
            if params.echo and params.logprobs is not None and not self.settings.prompt_logprobs:
                raise bad_request("'echo' with 'logprobs' needs the prompt's logprobs: this server was started "
                                  "without --enable-prompt-logprobs", "echo", "unsupported_parameter")
            media, max_tokens = None, prepared.max_tokens
            if params.media:
                prompt_ids, media, max_tokens = await self._load_media(prepared)
            samplings = self._samplings(prepared)
            grammars = await self._grammars(params, len(samplings))
            rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
            streams = await self.engine.submit(prompt_ids, max_tokens, samplings, stop_ids, rid, grammars, media)
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
        if params.tools and self.output_parsers.tool_call_ids is not None:
            self.metrics.tool_call_requests.inc()
        gen = Generation(self, rid, streams, params, prompt_ids, arrival, endpoint)
        return GenerationResponse(gen)


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
