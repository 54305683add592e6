"""The engine thread: one thread owns the (not thread-safe) Engine; asyncio handlers talk to it through queues.

    handler (event loop) --submit/cancel/drain/stop--> command queue --> engine thread: engine.add_request /
    cancel / step --> Delta --loop.call_soon_threadsafe--> the request's asyncio queue --> handler

Every request the server accepted ends with exactly one final Delta (finished=True) whose finish_reason is the
engine's ("stop", "length", or "error": its own part of a step failed), "cancelled" (the handler asked: client
gone, stop string reached), "abort" (the shutdown grace period ran out) or "error" (the step's program raised: the
requests in that step fail, those still waiting stay queued, and the engine thread lives on).

Admission is bounded: at most `max_num_seqs + max_queue_len` requests are in flight; past that `submit` raises
QueueFull with a Retry-After estimate, so nothing already accepted is ever dropped. An HTTP request with n choices
is n engine requests, submitted together (all or none, on one engine): choices 1.. wait in the engine until choice
0's prompt is prefilled (`after`), then find its pages in the prefix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Sequence

from gemma4_mtp_jax.engine import Engine, Request, RequestError, StepEvent
from gemma4_mtp_jax.engine.request import TokenLogprob
from gemma4_mtp_jax.engine.speculation import output_position_bucket
from gemma4_mtp_jax.model.sampling import SamplingParams

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5
REQUEST_FAILED = "the server failed while serving this request"  # what the client is told; the log has the detail


class QueueFull(Exception):
    def __init__(self, retry_after: int, in_flight: int):
        super().__init__(f"server at capacity ({in_flight} requests in flight)")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


@dataclasses.dataclass
class Delta:
    """New tokens of one request from one engine step (several per step is normal with speculative decoding)."""

    tokens: list[int]
    time: float  # time.perf_counter() in the engine thread when the step finished
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "abort" | "error"
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them

    def merge(self, later: "Delta") -> "Delta":
        logprobs = None if self.logprobs is None or later.logprobs is None else self.logprobs + later.logprobs
        return dataclasses.replace(later, tokens=self.tokens + later.tokens, logprobs=logprobs)


class RequestStream:
    """The handler's side of one request: `async for delta in stream.deltas()` until the final one."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, prompt: list[int], max_tokens: int,
                 sampling: SamplingParams, stop_ids: frozenset[int] | None, after: "RequestStream | None" = None,
                 grammar: Any = None, media: Any = None):
        self.id = request_id
        self.loop = loop
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.after = after  # a sibling choice's stream: the engine admits this one once that one's prompt is in
        self.grammar = grammar  # structured output: its own grammar matcher (engine/grammar.py), or None
        self.media = media  # the prompt's images and audio (engine/media.PromptMedia), or None
        self.arrival = time.perf_counter()
        self.request: Request | None = None  # the engine's Request, once added (engine thread)
        self.owner: AsyncEngine | None = None  # the engine serving it
        self.accepted: asyncio.Future = loop.create_future()
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._closed = False  # engine thread: the final Delta was sent
        self.done = False  # handler: the final Delta was received

    # engine thread -> loop
    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        def set_():
            if not self.accepted.done():
                if error is not None:
                    self.accepted.set_exception(error)
                else:
                    self.accepted.set_result(result)
        self._post(set_)

    async def deltas(self) -> AsyncIterator[Delta]:
        while not self.done:
            d = await self._queue.get()
            while not d.finished and not self._queue.empty():  # the client lags: send what piled up at once
                d = d.merge(self._queue.get_nowait())
            self.done = d.finished
            yield d


class AsyncEngine:
    def __init__(self, engine: Engine, max_queue_len: int = 256, metrics=None):
        self.engine = engine
        self.max_num_seqs = engine.config.max_num_seqs
        self.max_queue_len = max_queue_len
        self.metrics = metrics
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._active: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._deadline: float | None = None  # engine thread: abort what is left at this time.monotonic()
        self.draining = False
        self.alive = False
        self.last_error: str | None = None
        self._latency_ema: float | None = None
        # Where the gauges go (Replicas publishes the sum over its engines instead of one engine's numbers).
        self.publish_gauges: Callable[[dict[str, Any]], None] | None = None
        self.snapshot: dict[str, Any] = {**engine.stats(), "preemptions": 0, "prefix_cache_queries": 0,
                                         "prefix_cache_hits": 0}
        self._publish()

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        if self._thread is not None:
            return
        self.alive = True
        self._thread = threading.Thread(target=self._main, name="gemma4-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is left, end the engine thread and any compiling left (engine.close)."""
        self.draining = True
        if self._thread is not None:
            self._cmds.put(("stop", None))
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the engine thread did not stop within %.0fs", timeout)
            self._thread = None
        self.engine.close()

    def begin_drain(self, grace_s: float) -> None:
        """Stop admitting; requests still in flight `grace_s` seconds from now are aborted. Signal-handler safe."""
        self.draining = True
        self._cmds.put(("drain", time.monotonic() + max(0.0, grace_s)))

    def cancel(self, stream: RequestStream) -> None:
        if not stream.done:
            self._cmds.put(("cancel", stream))

    def fail_all(self, error: str) -> None:
        """End every request now with an error, from any thread and without the engine thread, which may never
        return (a program waiting in a collective for a process that died). No request is admitted after."""
        log.error("failing the %d request(s) in flight: %s", len(self._active), error)
        self.draining = True
        self.last_error = error
        for stream in list(self._active.values()):
            self._close(stream, Delta([], time.perf_counter(), True, "error", REQUEST_FAILED))

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: queued requests x mean latency / running slots (1..60)."""
        ema = self._latency_ema or 1.0
        queued = max(1, self.in_flight - self.max_num_seqs + 1)
        return int(min(60, max(1, math.ceil(ema * queued / self.max_num_seqs))))

    # ------------------------------------------------------------------ event loop
    async def submit(self, prompt: list[int], max_tokens: int, samplings: Sequence[SamplingParams],
                     stop_ids: frozenset[int] | None = None, request_id: str | None = None,
                     grammars: Sequence[Any] | None = None, media: Any = None) -> list[RequestStream]:
        """Queue one request per SamplingParams (the choices of one prompt), all or none; returns once the engine
        took them. Their ids: `request_id`, or `request_id-i` for several. `grammars`: each choice's grammar
        matcher (structured output); `media`: the prompt's (engine/media.PromptMedia), shared by the choices.
        Raises QueueFull, ShuttingDown, RequestError."""
        if self.draining or not self.alive:
            raise ShuttingDown("the server is shutting down" if self.draining else "the engine is not running")
        loop = asyncio.get_running_loop()
        rid = request_id or f"req-{id(loop)}-{time.perf_counter_ns()}"
        streams: list[RequestStream] = []
        with self._lock:
            n = len(self._active)
            if n + len(samplings) > self.max_num_seqs + self.max_queue_len:
                raise QueueFull(self.retry_after(), n)
            for i, sampling in enumerate(samplings):
                stream = RequestStream(rid if len(samplings) == 1 else f"{rid}-{i}", loop, prompt, max_tokens,
                                       sampling, stop_ids, after=streams[0] if streams else None,
                                       grammar=None if grammars is None else grammars[i], media=media)
                stream.owner = self
                self._active[stream.id] = stream
                streams.append(stream)
        for stream in streams:
            self._cmds.put(("add", stream))
        try:
            added = await asyncio.shield(asyncio.gather(*(s.accepted for s in streams), return_exceptions=True))
        except asyncio.CancelledError:
            for stream in streams:
                self._cmds.put(("cancel", stream))
            raise
        failed = next((r for r in added if isinstance(r, BaseException)), None)
        if failed is not None:  # the others are in the engine: take them out
            for stream in streams:
                self._cmds.put(("cancel", stream))
            raise failed
        return streams

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # pragma: no cover - a bug in this file; fail every request rather than hang
            log.exception("the engine thread died")
            self.last_error = f"engine thread died: {e!r}"
            self._close_all("error", self.last_error)
        finally:
            self.alive = False
            self._publish()

    def _take_commands(self) -> list[tuple[str, Any]]:
        cmds = []
        if not self.engine.has_work:
            timeout = IDLE_POLL_S
            if self._deadline is not None:
                timeout = min(timeout, max(0.0, self._deadline - time.monotonic()))
            try:
                cmds.append(self._cmds.get(timeout=timeout))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                return cmds

    def _loop(self) -> None:
        while True:
            for kind, arg in self._take_commands():
                if kind == "add":
                    self._add(arg)
                elif kind == "cancel":
                    self._cancel(arg, "cancelled")
                elif kind == "drain":
                    self._deadline = arg if self._deadline is None else min(self._deadline, arg)
                elif kind == "stop":
                    self._close_all("abort", "the server is shutting down")
                    return
            if self._deadline is not None and time.monotonic() >= self._deadline and self._active:
                log.warning("shutdown grace period over: aborting %d request(s)", len(self._active))
                self._close_all("abort", "the server shut down before this request finished")
            if self.engine.has_work:
                self._step()
            self._publish()

    def _add(self, stream: RequestStream) -> None:
        if stream._closed:
            return
        try:
            after = None if stream.after is None else stream.after.request
            media = {} if stream.media is None else {"media": stream.media}  # text: the call as it always was
            req = self.engine.add_request(stream.prompt, stream.max_tokens, stream.sampling, stream.stop_ids,
                                          request_id=stream.id, after=after, grammar=stream.grammar, **media)
        except (RequestError, ValueError) as e:
            self._forget(stream)
            stream._closed = True
            stream._resolve(error=RequestError(str(e)))
            return
        except Exception as e:
            log.exception("engine.add_request failed")
            self._forget(stream)
            stream._closed = True
            stream._resolve(error=e)
            return
        stream.request = req
        stream._resolve(req)

    def _cancel(self, stream: RequestStream, reason: str, error: str | None = None) -> None:
        req = stream.request
        if req is not None and not req.finished:
            try:
                self.engine.cancel(req)
            except Exception:  # pragma: no cover
                log.exception("engine.cancel failed for %s", stream.id)
        self._close(stream, Delta([], time.perf_counter(), True, reason, error))

    def _close(self, stream: RequestStream, delta: Delta) -> None:
        self._forget(stream)
        if stream._closed:
            return
        stream._closed = True
        if not stream.accepted.done():
            stream._resolve(stream.request)
        stream._post(stream._queue.put_nowait, delta)
        if delta.finish_reason in ("stop", "length"):
            lat = delta.time - stream.arrival
            self._latency_ema = lat if self._latency_ema is None else 0.8 * self._latency_ema + 0.2 * lat
        rounds = stream.request.accepted_per_round if stream.request is not None else None
        if self.metrics and rounds:
            self.metrics.request_acceptance_length.observe((sum(rounds) + len(rounds)) / len(rounds))

    def _forget(self, stream: RequestStream) -> None:
        with self._lock:
            self._active.pop(stream.id, None)

    def _close_all(self, reason: str, error: str) -> None:
        for stream in list(self._active.values()):
            self._cancel(stream, reason, error)

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:
            # The program shared by the step's requests failed: they all fail (including any that finished inside
            # the step, whose final event is lost with it); requests still waiting were not part of it.
            in_step = [s for s in self._active.values() if s.request is not None and s.request.status != "waiting"]
            log.exception("engine step failed: failing its %d request(s)", len(in_step))
            self.last_error = f"{type(e).__name__}: {e}"
            if self.metrics:
                self.metrics.engine_errors.inc()
            for stream in in_step:
                self._cancel(stream, "error", REQUEST_FAILED)
            return
        self.last_error = None
        if self.metrics:
            self.metrics.engine_steps.inc()
        now = time.perf_counter()
        for ev in events:
            stream = self._active.get(ev.request.id)
            if stream is None or stream._closed:
                continue
            try:
                self._deliver(stream, ev, now)
            except Exception:  # this stream's bookkeeping; the others' events still go out
                log.exception("delivering the tokens of %s failed", stream.id)
                self._cancel(stream, "error", REQUEST_FAILED)

    def _deliver(self, stream: RequestStream, ev: StepEvent, now: float) -> None:
        req = ev.request
        if self.metrics and ev.accepted is not None:
            self._count_speculation(ev)
        reason = req.finish_reason if ev.finished else None
        d = Delta(list(ev.new_tokens), now, ev.finished, reason, REQUEST_FAILED if reason == "error" else None,
                  ev.logprobs)
        if ev.finished:
            self._close(stream, d)
        else:
            stream._post(stream._queue.put_nowait, d)

    def _count_speculation(self, ev: StepEvent) -> None:
        """The step's speculative round of one sequence (`ev.drafted` drafts, `ev.accepted` of them accepted) into
        the metrics."""
        m, accepted, drafted = self.metrics, ev.accepted, ev.drafted
        m.draft_tokens.inc(drafted)
        m.accepted_tokens.inc(accepted)
        for j in range(drafted):
            m.drafted_per_position.labels(position=str(j)).inc()
        for j in range(accepted):
            m.accepted_per_position.labels(position=str(j)).inc()
        where = output_position_bucket(ev.request.round_starts[-1])
        m.drafted_by_output_position.labels(output_position=where).inc(drafted)
        m.accepted_by_output_position.labels(output_position=where).inc(accepted)
        m.accepted_per_round.observe(accepted)

    def _publish(self) -> None:
        # programs_compiled stays below programs_total while the larger buckets' programs compile in the
        # background (compile_in_background); programs_untuned above 0 until the tuned replacements land (GPU).
        snap = {**self.engine.stats(), "in_flight": len(self._active)}
        grown = {key: snap[key] - self.snapshot[key] for key in ("preemptions", "prefix_cache_queries",
                                                                 "prefix_cache_hits")}
        previous = self.snapshot.get("speculative_steps", {})
        self.snapshot = snap
        m = self.metrics
        if m:
            m.kv_cache_bytes.set(snap["kv_cache_bytes"])
            for key, counter in (("preemptions", m.preemptions), ("prefix_cache_queries", m.prefix_cache_queries),
                                 ("prefix_cache_hits", m.prefix_cache_hits)):
                if grown[key] > 0:
                    counter.inc(grown[key])
            for size, n in snap["speculative_steps"].items():
                if n > previous.get(size, 0):
                    m.speculative_steps.labels(drafts=str(size)).inc(n - previous.get(size, 0))
            for j, a in enumerate(self.engine.speculation.overall_rates() if self.engine.k else ()):
                m.acceptance_estimate.labels(position=str(j)).set(a)
            if self.publish_gauges is not None:
                self.publish_gauges(snap)
            else:
                set_gauges(m, snap)


def set_gauges(m, snap: dict[str, Any]) -> None:
    """The Prometheus gauges from a snapshot (queue depth, running, KV pages and bytes)."""
    m.kv_cache_bytes.set(snap["kv_cache_bytes"])
    m.waiting.set(snap["waiting"])
    m.running.set(snap["running"])
    for g, n in snap["kv_pages_in_use"].items():
        m.kv_pages_in_use.labels(group=g).set(n)
    for g, n in snap["kv_pages_total"].items():
        m.kv_pages_total.labels(group=g).set(n)


def merge_snapshots(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """The sum of several engines' snapshots (numbers add, per-group page counts add group by group)."""
    out: dict[str, Any] = {}
    for snap in snaps:
        for key, value in snap.items():
            if isinstance(value, dict):
                acc = out.setdefault(key, {})
                for g, n in value.items():
                    acc[g] = acc.get(g, 0) + n
            else:
                out[key] = out.get(key, 0) + value
    return out


class Replicas:
    """Data parallelism: independent engines (each on its own devices) behind one server. A request goes to the
    replica with the fewest requests in flight; cancels go to the replica that holds the request. Quacks like
    an AsyncEngine for the app: /health and the gauges report the sum over the replicas."""

    def __init__(self, replicas: list[AsyncEngine], metrics=None):
        if not replicas:
            raise ValueError("Replicas needs at least one engine")
        self.replicas = replicas
        self.metrics = metrics
        for r in replicas:
            r.publish_gauges = self._publish_gauges

    @property
    def snapshot(self) -> dict[str, Any]:
        return merge_snapshots([r.snapshot for r in self.replicas])

    def _publish_gauges(self, _snap: dict[str, Any]) -> None:
        if self.metrics is not None:
            set_gauges(self.metrics, self.snapshot)

    @property
    def alive(self) -> bool:
        return all(r.alive for r in self.replicas)

    @property
    def draining(self) -> bool:
        return any(r.draining for r in self.replicas)

    @property
    def last_error(self) -> str | None:
        return next((f"replica {i}: {r.last_error}" for i, r in enumerate(self.replicas) if r.last_error), None)

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas)

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def stop(self, timeout: float = 30.0) -> None:
        for r in self.replicas:
            r.stop(timeout)

    def begin_drain(self, grace_s: float) -> None:
        for r in self.replicas:
            r.begin_drain(grace_s)

    def cancel(self, stream: RequestStream) -> None:
        (stream.owner or self.replicas[0]).cancel(stream)

    async def submit(self, prompt: list[int], max_tokens: int, samplings: Sequence[SamplingParams],
                     stop_ids: frozenset[int] | None = None, request_id: str | None = None,
                     grammars: Sequence[Any] | None = None, media: Any = None) -> list[RequestStream]:
        """To the least-loaded replica (ties: the lowest index), every choice to the same one (they share the
        prompt's pages). Raises as AsyncEngine.submit."""
        replica = min(self.replicas, key=lambda r: r.in_flight)
        return await replica.submit(prompt, max_tokens, samplings, stop_ids, request_id, grammars, media)
