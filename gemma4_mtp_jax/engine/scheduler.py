"""Who runs: the waiting queue and the running sequences, admission (first come, first served, when the KV cache
has the pages), the pages each decoding sequence needs for its next step, and preemption when the pool runs dry
(the newest running sequences go back to the head of the queue and later recompute their K/V). One request cannot
fail another: a request whose own part raises ends alone with finish reason "error"."""

from __future__ import annotations

import logging
import time
from collections import deque

from gemma4_mtp_jax.engine.config import EngineConfig
from gemma4_mtp_jax.engine.kv_cache import KVCacheManager
from gemma4_mtp_jax.engine.request import Request, StepEvent

log = logging.getLogger(__name__)


class Scheduler:
    """The queue and the batch over `kv`; `k`: the drafts a speculative round verifies past a sequence's newest
    token (0 without an assistant)."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, k: int):
        self.config, self.kv, self.k = config, kv, k
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def decoding(self) -> list[Request]:
        """The running sequences whose prefill is complete, oldest first."""
        return [r for r in self.running if r.decoding]

    def prefilling(self) -> list[Request]:
        return [r for r in self.running if not r.decoding]

    def finish(self, req: Request, reason: str) -> None:
        # Out of the batch first: if freeing fails (broken page accounting), the request must still be gone.
        req.status, req.finish_reason, req.finished_at = "finished", reason, time.perf_counter()
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.kv.release(req, cache=reason != "error", finished=True)

    def fail(self, req: Request, stage: str, exc: Exception) -> StepEvent:
        """`req`'s own part of the step raised: it alone ends with "error", its pages freed."""
        log.error("request %s failed while %s; the other requests go on", req.id, stage, exc_info=exc)
        req.error = f"{stage}: {type(exc).__name__}: {exc}"
        try:
            self.finish(req, "error")
        except Exception:
            log.exception("request %s: freeing its pages failed", req.id)
        return StepEvent(req, [], True)

    def preempt(self, req: Request) -> None:
        """Take a running sequence out to free its pages: it waits at the head of the queue and, when admitted
        again, recomputes its K/V from its tokens (a prefill of prompt + output but the newest)."""
        log.info("preempting request %s (%d tokens) to free KV pages", req.id, req.num_tokens)
        self.running.remove(req)
        self.kv.release(req, cache=True, finished=False)
        req.status, req.prefilled, req.decoding, req.on_device = "waiting", 0, False, False
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def tokens_ahead(self, req: Request, in_flight: frozenset[Request]) -> int:
        """An upper bound of `req`'s tokens when its next step runs: with a step in flight that runs it, up to k+1
        more than the host has read (never more than the request can reach)."""
        n = req.num_tokens + (self.k + 1 if req in in_flight else 0)
        return min(n, len(req.prompt) + req.max_new_tokens)

    def _short(self, req: Request, in_flight: frozenset[Request]) -> dict[str, int]:
        """Pages `req` still lacks for its next step: K/V up to its newest token, plus the k drafts a speculative
        round verifies past it."""
        return self.kv.pages_short(req, self.tokens_ahead(req, in_flight))

    def grow_fits(self, decoding: list[Request], in_flight: frozenset[Request]) -> bool:
        """Whether every decoding sequence's next pages fit the free pool without preempting anyone (False if one
        cannot count them: `grow` then fails it alone)."""
        try:
            return self.kv.fits([self._short(r, in_flight) for r in decoding])
        except Exception:
            return False

    def grow(self, decoding: list[Request], in_flight: frozenset[Request], events: list[StepEvent]) -> list[Request]:
        """Pages for this step's writes, oldest sequence first. When the pool cannot give them, the newest running
        sequences are preempted until it can (a sequence preempts itself if it is the newest). Returns the
        sequences that still decode this step; one whose allocation raises fails alone."""
        free = self.kv.allocators
        for req in decoding:
            if req.status != "running":
                continue  # preempted for an older one
            try:
                short = self._short(req, in_flight)
            except Exception as e:
                events.append(self.fail(req, "counting its pages", e))
                continue
            while req.status == "running" and any(n > free[g].num_free for g, n in short.items()):
                self.preempt(self.running[-1])
            if req.status != "running":
                continue
            try:
                last_page = (self.tokens_ahead(req, in_flight) - 1 + self.k) // self.kv.layout.page_size
                self.kv.grow(req, short, last_page)
            except Exception as e:
                events.append(self.fail(req, "allocating its pages", e))
        return [r for r in decoding if r.status == "running"]

    def admit(self, cap: int, events: list[StepEvent]) -> list[Request]:
        """Move the requests that fit from `waiting` to `running` (at most `cap` running) with the pages of their
        tokens so far; one whose pages cannot be taken fails alone (its StepEvent goes to `events`)."""
        admitted = []
        cap = min(self.config.max_num_seqs, cap)
        while self.waiting and len(self.running) < cap:
            req = self.waiting[0]
            if req.after is not None and not (req.after.decoding or req.after.finished):
                break  # a sibling of a prompt still prefilling: it waits to share that prompt's pages
            req.after = None
            n_cached, cached = self.kv.cached_prefix(req)
            if not self.kv.admission_fits(self.kv.pages_short(req, req.num_tokens), cached, len(self.running)):
                break  # first come, first served: wait for pages to free up
            self.waiting.popleft()
            req.status = "running"
            self.running.append(req)
            try:
                self.kv.admit(req, n_cached, cached)
            except Exception as e:
                events.append(self.fail(req, "allocating its pages", e))
                continue
            admitted.append(req)
        return admitted

    def prefill_budget(self, decoding: list[Request]) -> int | None:
        """Prompt tokens to prefill this step: a budget while other sequences decode, None (all) otherwise."""
        return (self.config.max_num_batched_tokens or self.config.prefill_chunk) if decoding else None
