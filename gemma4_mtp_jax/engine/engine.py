"""The continuous-batching engine: requests join and leave between steps; every step is a compiled program.

Data flows one way: a request is admitted when the pages its prompt needs are free (it waits otherwise, and is
refused at once if it could never fit), its prompt is prefilled in bucketed chunks, then it joins the decode batch,
padded to the next batch bucket. Pages are taken as sequences grow; when the pool runs dry, the newest sequences
are preempted: their pages go back, they wait at the head of the queue, and on resuming their K/V is recomputed
from their tokens (prompt and output so far), so their output is the one an unpreempted run gives. With the prefix
cache, a request's leading full pages whose tokens another request already computed are shared instead of
recomputed (docs/DESIGN.md, "Prefix cache"). All programs are compiled at start-up; serving never compiles.

The engine wires four parts and runs each step through them: the scheduler (who runs, scheduler.py), the KV cache
manager (pages, slots, the prefix cache, kv_cache.py), the runner (rows, dispatch, results, runner.py) and the
program set (programs/program_set.py). `Engine.step` is schedule -> run -> update.

One request cannot fail another: each request's part of a step (its pages, its row of the batch's host arrays, taking
its new tokens) is built and checked on its own, and a request whose part raises ends alone with finish reason
"error" (its pages freed) while the step goes on with the others. Only the compiled program itself is shared: when
it raises, `step` raises.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from gemma4_mtp_jax.model.config import check_pair
from gemma4_mtp_jax.steps.device_state import FINISH_LENGTH, FINISH_STOP, MAX_STOP_IDS, DeviceState, unpack_logprobs
from gemma4_mtp_jax.engine.config import EngineConfig
from gemma4_mtp_jax.engine.kv_cache import KVCacheManager
from gemma4_mtp_jax.engine.memory import out_of_memory_explained, pool_sizes
from gemma4_mtp_jax.engine.media import PromptMedia, media_refusal
from gemma4_mtp_jax.engine.request import Request, RequestError, StepEvent, TokenLogprob
from gemma4_mtp_jax.engine.runner import Dispatched, Row, Runner, bucket
from gemma4_mtp_jax.engine.scheduler import Scheduler
from gemma4_mtp_jax.engine.speculation import SpeculationPolicy, round_sizes
from gemma4_mtp_jax.programs.executable_cache import ExecutableCache
from gemma4_mtp_jax.kernels.attention_inputs import quantized
from gemma4_mtp_jax.kernels.device_budget import check_fp8_support, target_device
from gemma4_mtp_jax.model.kv_state import KVLayout, kv_cache_scales, make_layout, page_bytes
from gemma4_mtp_jax.programs.program_set import ProgramSet
from gemma4_mtp_jax.model.runtime import Assistant, Target, shapes_only
from gemma4_mtp_jax.model.sampling import SamplingParams
from gemma4_mtp_jax.model.sharding import Placement, ShardingError, check_tensor_parallel
from gemma4_mtp_jax.steps.speculative import AssistantDrafter, Drafter
from gemma4_mtp_jax.programs.compiled import CompiledSteps, placement_for

_FINISH_REASONS = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}


def _speculative_tokens(config: EngineConfig, assistant: Assistant | None) -> int:
    """The drafts per round (k): 0 without an assistant; else the configured k, or the assistant's own."""
    if assistant is None:
        if config.num_speculative_tokens:
            raise ValueError("num_speculative_tokens needs an assistant")
        return 0
    k = config.num_speculative_tokens
    if k is None:
        k = int(assistant.generation_config.get("num_assistant_tokens") or 4)
    if not 1 <= k <= 16:
        raise ValueError(f"num_speculative_tokens must be in 1..16, got {k}")
    return k


def _placement(target: Target, tp: int, devices: Sequence[jax.Device] | None) -> Placement | None:
    """Where the engine runs: None (the default device, no sharding) for one device and no explicit devices."""
    check_tensor_parallel(target.config, tp)
    if devices is None:
        if tp == 1:
            return None
        if tp > len(jax.devices()):
            raise ShardingError(f"tensor_parallel_size={tp} but only {len(jax.devices())} devices are visible")
        devices = jax.devices()[:tp]
    if len(devices) != tp:
        raise ShardingError(f"tensor_parallel_size={tp} but {len(devices)} devices were given")
    return Placement.over(devices)


def _eos_ids(target: Target) -> frozenset[int]:
    eos = target.generation_config.get("eos_token_id", target.config.eos_token_ids)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class Engine:
    """Serves a target, and speculates with `assistant` when one is given (docs/DESIGN.md, "A request's path").

    The assistant sets the round's k and the K/V geometry its drafts need; `drafter` is what proposes the drafts
    inside the speculative program (default: `AssistantDrafter(assistant)`, the assistant itself). The parts:
    `scheduler` (the queue, the batch, preemption), `kv` (pages, slots, the prefix cache), `runner` (the device
    state, dispatching programs, reading results) and `programs` (the compiled programs and their warm-up)."""

    def __init__(self, target: Target, config: EngineConfig | None = None,
                 progress: Callable[[str, float], None] | None = None, assistant: Assistant | None = None,
                 drafter: Drafter | None = None, devices: Sequence[jax.Device] | None = None,
                 compiled_ahead: dict[str, Any] | None = None):
        """`devices`: the tensor_parallel_size devices this engine runs on (default: the first ones; a
        data-parallel server gives each replica its own). `compiled_ahead`: what `compile_ahead` returned for this
        configuration, the programs it compiled, taken instead of compiling or loading them."""
        if drafter is not None and assistant is None:
            raise ValueError("a drafter needs an assistant (it sets k and the drafts' K/V window)")
        self.target, self.assistant = target, assistant
        self.config = cfg = config or EngineConfig()
        tc = target.config
        if cfg.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {cfg.max_model_len}")
        if cfg.max_num_batched_tokens is not None and cfg.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {cfg.max_num_batched_tokens}")
        if assistant is not None:
            check_pair(tc, assistant.config)
        self.k = _speculative_tokens(cfg, assistant)
        if cfg.adaptive_speculation and assistant is None:
            raise ValueError("adaptive_speculation needs an assistant")
        self.speculation = SpeculationPolicy(self.k, cfg.adaptive_speculation)
        self.cache_dtype = cfg.kv_cache_dtype(target.dtype)
        if quantized(self.cache_dtype):
            check_fp8_support(devices if devices is not None else [target_device()],
                              "an fp8 KV cache (--kv-cache-dtype fp8; auto: the activations' dtype)")
        if assistant is not None and drafter is None:
            drafter = AssistantDrafter(assistant)
        self.placement = placement_for(_placement(target, cfg.tensor_parallel_size, devices), drafter, tc)
        self.layout = self._plan_layout(devices)
        draft_window = assistant.config.text.sliding_window if assistant else 0
        self.kv = KVCacheManager(self.layout, cfg.max_num_seqs, cfg.enable_prefix_caching,
                                 reach=max(tc.sliding_window - 1, draft_window) + 1)
        self.scheduler = Scheduler(cfg, self.kv, self.k)
        weights = (target.params, assistant.params if assistant else None)

        def explained(doing: str):
            return out_of_memory_explained(doing, cfg, weights, self.kv_cache_bytes())

        with explained("placing the weights"):
            self.steps = CompiledSteps(target, self.layout, self.cache_dtype, cfg.attention_impl, drafter=drafter,
                                       k=self.k, num_slots=cfg.max_num_seqs,
                                       round_sizes=round_sizes(self.k) if cfg.adaptive_speculation else (),
                                       placement=self.placement,
                                       pack_params=cfg.pack_params, max_batch=max(cfg.batch_buckets()),
                                       max_prefill_tokens=max(cfg.prefill_buckets()),
                                       structured=cfg.structured_outputs, prompt_logprobs=cfg.prompt_logprobs)
        self.programs = ProgramSet(self.steps, cfg.batch_buckets(), cfg.prefill_buckets(),
                                   background=cfg.compile_in_background)
        self.compile_times = self.programs.times
        # An engine of shapes alone (compile_ahead) compiles but never runs: no pools.
        state: DeviceState | None = None
        if not shapes_only(target.params):
            with explained("allocating the KV pools"):
                state = self.steps.arrays.init_state()
        self.runner = Runner(self.programs, self.kv, state, cfg.max_num_seqs, cfg.prefill_chunk)
        self.eos_ids = _eos_ids(target)
        self._ids = itertools.count()
        # Adaptive speculation: what the programs compiled and untuned were when round sizes were last timed, and
        # the round sizes timed in their untuned form (timed again once tuned).
        self._timed_mark: tuple | None = None
        self._timed_untuned: set[tuple[int, int]] = set()
        if cfg.compile_at_start:
            with explained("compiling the step programs (XLA's autotuner runs them)"):
                self.programs.start(progress, ExecutableCache.open(cfg.executable_cache_dir), compiled_ahead)
            self._time_round_sizes([])

    def _time_round_sizes(self, events: list[StepEvent]) -> None:
        """With adaptive speculation, time each batch bucket's compiled round sizes not timed yet
        (SpeculationPolicy.costs): at start-up, and between steps as the background compiles more or replaces
        untuned programs by tuned ones. The step in flight is read first (its events go to `events`), or it would be
        timed too."""
        programs = self.programs
        if not self.speculation.adaptive or self.runner.state is None:
            return
        mark = (programs.ready()[0], frozenset(programs.untuned))
        if mark == self._timed_mark:
            return
        self._timed_mark = mark
        costs = self.speculation.costs

        def untuned(b: int, r: int) -> bool:
            return f"speculative[{b}x{r}]" in programs.untuned

        todo = [(b, r) for b in programs.buckets()[0] for r in programs.round_sizes(b)
                if (b, r) not in costs or ((b, r) in self._timed_untuned and not untuned(b, r))]
        if todo and self.runner.in_flight is not None:
            events += self._update(self.runner.in_flight)
        for b, r in todo:
            costs[b, r] = self.runner.time_round(b, r)
            (self._timed_untuned.add if untuned(b, r) else self._timed_untuned.discard)((b, r))

    def _plan_layout(self, devices: Sequence[jax.Device] | None) -> KVLayout:
        """The KV layout: page geometry from the config and k, pools as given or planned (`memory.pool_sizes`)."""
        cfg, tc = self.config, self.target.config
        groups = sorted({tc.layers[i].layer_type for i in tc.store_layers.values()})
        geometry = dict(page_size=cfg.page_size, max_model_len=cfg.max_model_len, prefill_chunk=cfg.prefill_chunk,
                        num_speculative_tokens=self.k,
                        assistant_window=self.assistant.config.text.sliding_window if self.assistant else 0)
        # Under tensor parallelism the bytes all devices hold together: pages whole on every device (the layers the
        # assistant reads, KV heads the devices do not divide) and whole weights (the embedding) count once per
        # device, since the planning splits what it is given over the devices.
        pl = self.placement
        self.page_bytes = page_bytes(tc, cfg.page_size, self.cache_dtype, pl.page_copies(tc) if pl else None)
        geometry["scales"] = kv_cache_scales(tc, self.target.params, self.cache_dtype)
        num_pages = cfg.num_pages
        if num_pages is not None and cfg.kv_cache_bytes is not None:
            raise ValueError("EngineConfig: give num_pages or kv_cache_bytes, not both")
        if num_pages is None:
            probe = make_layout(tc, num_pages={g: 1 << 30 for g in groups}, **geometry)
            weights = (self.target.params, self.assistant.params if self.assistant else None)
            if pl is not None:
                weights += (pl.extra_copies(self.target.params, pl.target_params(tc, self.target.params)),
                            pl.extra_copies(weights[1]))
            num_pages = pool_sizes(probe, cfg, self.page_bytes, weights, devices)
        return make_layout(tc, num_pages=num_pages, **geometry)

    @property
    def state(self) -> DeviceState | None:
        """The device state (the runner's): pages, slots, the drafter's hidden buffer."""
        return self.runner.state

    def kv_cache_bytes(self) -> int:
        """Device memory of the KV pools (page 0 of each included)."""
        return sum(self.layout.pages(g) * self.page_bytes[g] for g, _ in self.layout.pages_per_seq)

    def stats(self) -> dict[str, Any]:
        """What a server reports of the engine now: sequences running and waiting, KV pages in use and in all per
        group, the pools' bytes, preemptions and prefix-cache tokens looked up and found so far, the programs
        compiled of those the buckets need, and those serving in their quick form, compiled without XLA's
        autotuning until the background swaps in their tuned versions (every program is in its final form, and the
        engine at its steady speed, once all are compiled and none is untuned); the speculative steps run, by drafts
        per round (SpeculationPolicy.chosen)."""
        kv, scheduler = self.kv, self.scheduler
        compiled, total = self.programs.ready()
        return {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
                "kv_pages_in_use": kv.pages_in_use(), "kv_pages_total": kv.pages_total(),
                "kv_cache_bytes": self.kv_cache_bytes(), "preemptions": scheduler.num_preemptions,
                "prefix_cache_queries": kv.queries, "prefix_cache_hits": kv.hits,
                "programs_compiled": compiled, "programs_total": total, "programs_untuned": len(self.programs.untuned),
                "speculative_steps": dict(self.speculation.chosen)}

    def close(self) -> None:
        """Stop compiling in the background: no further program starts, the ones compiling finish (waited for)."""
        self.programs.close()

    def pages_in_use(self) -> dict[str, int]:
        return self.kv.pages_in_use()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                    stop_ids: frozenset[int] | None = None, request_id: str | None = None,
                    speculative: bool = True, after: Request | None = None, grammar: Any = None,
                    media: PromptMedia | None = None) -> Request:
        """Queue a request. `after`: another request of the same prompt (n > 1: the choices after the first),
        admitted before this one; this one waits until `after`'s prompt is prefilled, then finds the prompt's
        full pages in the prefix cache (prefilled once, pages shared). `grammar`: a fresh matcher
        (engine/grammar.py) every output token must satisfy; such a request speculates only on an engine with
        masked rounds (EngineConfig.structured_outputs). `media`: the soft tokens of the prompt's images and audio
        (engine/media.MediaEncoder), whose placeholders the prompt holds expanded."""
        V = self.target.config.vocab_size
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise RequestError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < V]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {V})")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop_ids is not None and len(stop_ids) > MAX_STOP_IDS:
            raise RequestError(f"at most {MAX_STOP_IDS} stop token ids per request, got {len(stop_ids)}")
        bad = sorted(t for t in stop_ids or () if not 0 <= t < V)
        if bad:
            raise RequestError(f"stop token id {bad[0]} is outside the vocabulary [0, {V})")
        total = len(prompt) + max_new_tokens
        if total > self.config.max_model_len:
            raise RequestError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                               f"max_model_len={self.config.max_model_len}")
        for g, capacity in self.kv.pages_total().items():
            if self.layout.pages_needed(g, total) > capacity:
                raise RequestError(f"request needs {self.layout.pages_needed(g, total)} '{g}' pages; the pool has "
                                   f"{capacity}")
        sampling = sampling or SamplingParams()
        bad = [t for t in sampling.token_ids() if not 0 <= t < V]
        if bad:
            raise RequestError(f"token id {bad[0]} (logit_bias, allowed or bad tokens) is outside the vocabulary "
                               f"[0, {V})")
        if sampling.prompt_logprobs is not None and not self.config.prompt_logprobs:
            raise RequestError("prompt logprobs need an engine with prompt_logprobs (serve --enable-prompt-logprobs)")
        if media is not None and self.target.config.image_attention != "causal":
            media = media.images_whole(prompt, self.target.encoders.config.image_token_id)
        refusal = None if media is None else media_refusal(self.target, prompt, media, sampling, self.runner.chunk)
        if refusal:
            raise RequestError(refusal)
        if sampling.seed is None and sampling.temperature > 0:  # unseeded: a fresh draw, not the same seed for all
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(32))
        req = Request(request_id or f"req-{next(self._ids)}", prompt, max_new_tokens, sampling,
                      self.eos_ids if stop_ids is None else frozenset(stop_ids), speculative=speculative,
                      allowed_row=sampling.allowed_mask(V), after=after, grammar=grammar, media=media)
        if not req.allowed_row.any():
            raise RequestError("allowed_token_ids and bad tokens leave no token to emit")
        self.scheduler.add(req)
        return req

    def cancel(self, request: Request) -> None:
        if not request.finished:
            self.scheduler.finish(request, "cancelled")

    @property
    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or self.runner.in_flight is not None)

    # ------------------------------------------------------------------ steps
    def step(self) -> list[StepEvent]:
        """Pages for the decoding sequences' next tokens (preempting the newest if the pool is dry), admit what
        fits, prefill up to the token budget (everything when nothing decodes), then one decode step for the
        sequences that were decoding. A sequence whose prefill completes decodes from the next step.

        With async scheduling the decode step is dispatched before the previous one is read, so the returned events
        are the previous step's (and the prefills'); the previous step is read first when the pool cannot take the
        next step's pages without preempting (a preempted sequence's tokens must be known)."""
        events: list[StepEvent] = []
        decoding = self._schedule(events)
        previous = self._run(decoding, events)
        if previous is not None:
            events += self._update(previous)
        if self.runner.in_flight is not None and not self.config.async_scheduling:
            events += self._update(self.runner.in_flight)
        return events

    def run(self, on_event: Callable[[StepEvent], None] | None = None) -> None:
        while self.has_work:
            for ev in self.step():
                if on_event:
                    on_event(ev)

    def _schedule(self, events: list[StepEvent]) -> list[Request]:
        """This step's pages and admissions; returns the sequences that decode in it."""
        scheduler, runner = self.scheduler, self.runner
        decoding = scheduler.decoding()
        if runner.in_flight is not None and (
                not scheduler.grow_fits(decoding, runner.in_flight_members())
                or any(r.grammar is not None for r in runner.in_flight.requests)):
            # Read the step in flight first: a preempted sequence's tokens must be known, and a grammar's mask
            # for the next token depends on the tokens before it.
            events += self._update(runner.in_flight)
            decoding = scheduler.decoding()
        self._time_round_sizes(events)
        decoding = scheduler.grow(decoding, runner.in_flight_members(), events)
        scheduler.admit(self.programs.buckets()[0][-1], events)
        return decoding

    def _run(self, decoding: list[Request], events: list[StepEvent]) -> Dispatched | None:
        """Prefill up to this step's budget, then dispatch the decoding sequences' step. Returns the step that was
        in flight before (None if none), still to be read."""
        budget = self.scheduler.prefill_budget(decoding)
        for req in self.scheduler.prefilling():
            if budget is not None and budget <= 0:
                break
            rows = self._rows([req], events)
            if not rows:
                continue
            resumed = bool(req.output)  # a preempted sequence: its K/V is recomputed, its output kept
            used, packed = self.runner.prefill(req, rows[0], budget)
            if budget is not None:
                budget -= used
            if packed is not None:
                req.decoding = True
                if not resumed:
                    events.append(self._take(req, packed, time.perf_counter()))
        rows = self._rows(decoding, events)
        previous, self.runner.in_flight = self.runner.in_flight, None
        if rows:
            dispatched = self.runner.dispatch(rows, self._round_size(rows))
            events += [self.scheduler.fail(req, "filling its grammar's masks", e) for req, e in dispatched.failed]
        return previous

    def _round_size(self, rows: list[Row]) -> int:
        """The drafts this step's speculative round proposes (speculation.SpeculationPolicy; 0 without a drafter)."""
        if self.assistant is None:
            return 0
        masked = self.steps.structured
        batch = bucket(self.programs.buckets()[0], len(rows))
        return self.speculation.choose(batch, [r.req.position_acceptance if r.req.speculates(masked) else None
                                               for r in rows], self.programs.round_sizes(batch))

    def _rows(self, reqs: list[Request], events: list[StepEvent]) -> list[Row]:
        rows, failed = self.runner.rows(reqs)
        events += [self.scheduler.fail(req, "building its row of the batch", e) for req, e in failed]
        return rows

    def _update(self, dispatched: Dispatched) -> list[StepEvent]:
        """Read a dispatched step and take each row's new tokens. A row whose request ended meanwhile (it finished in
        the step before, or was cancelled) ran as padding: skipped."""
        now, events = time.perf_counter(), []
        for req, row_result in self.runner.collect(dispatched):
            if req.status != "running":
                continue
            events.append(self._take(req, row_result, now, dispatched.k))
            if not req.finished:
                self.kv.register(req)
        self.speculation.record_step([(ev.drafted, ev.accepted) for ev in events if ev.accepted is not None])
        return events

    def _take(self, req: Request, result: np.ndarray, now: float, k: int | None = None) -> StepEvent:
        """`req`'s new tokens from its row of a packed result (k+1 emitted tokens, n accepted, tokens kept, finish
        reason, then for a prefill or a processed step the tokens' logprobs: device_state.finish_round): the device
        decided where its output ends; the host only records it. k: a speculative round's drafts (None: a prefill's
        or a decode step's result, one token)."""
        positions = 1 + (k or 0)
        try:
            n, keep, reason = (int(x) for x in result[positions:positions + 3])
            kept = [int(t) for t in result[:keep]]
            for t in kept if req.grammar is not None else ():
                if not req.grammar.accept(t):
                    raise RuntimeError(f"token {t} broke the request's grammar")
            logprobs = None
            if req.sampling.logprobs is not None:
                columns = unpack_logprobs(result[positions + 3:], positions)
                logprobs = TokenLogprob.rows(*columns, req.sampling.logprobs, keep)
                req.logprobs += logprobs
            accepted = None
            if k and req.speculates(self.steps.structured):
                req.record_round(k, n)
                accepted = n
            req.output += kept
            req.token_times += [now] * len(kept)
            if req.first_token_at is None and kept:
                req.first_token_at = now
            if reason:
                self.scheduler.finish(req, _FINISH_REASONS[reason])
        except Exception as e:
            return self.scheduler.fail(req, "taking its new tokens", e)
        return StepEvent(req, kept, req.finished, accepted, logprobs, drafted=k if accepted is not None else 0)


def compile_ahead(target: Target, config: EngineConfig, assistant: Assistant | None = None,
                  progress: Callable[[str, float], None] | None = None,
                  stop: threading.Event | None = None) -> dict[str, Any]:
    """Compile the programs that an `Engine(target, config, assistant=...)` compiles before it returns, from shapes
    alone: `target` and `assistant` may hold jax.ShapeDtypeStruct parameters (`api.target_shapes`,
    `api.assistant_shapes`). Run while the weights load; the engine built after loading takes them
    (`Engine(..., compiled_ahead=...)`), and they go into `config.executable_cache_dir` for the next start. No
    device memory is taken: the pools are planned, not allocated. Returns the programs by executable-cache key; {}
    without an executable cache (whose keys say which programs are the engine's). Once `stop` is set no further
    program starts (ProgramSet.compile). {} for an fp8 cache, too."""
    cache = ExecutableCache.open(config.executable_cache_dir)
    if cache is None or quantized(config.kv_cache_dtype(target.dtype)):
        # An fp8 cache's scales come from the weights: programs compiled from shapes alone could never serve them
        # (kv_state.SHAPES_ONLY_SCALE), so the engine compiles its own.
        return {}
    programs = Engine(target, dataclasses.replace(config, compile_at_start=False), assistant=assistant).programs
    programs.compile(*programs.first_buckets(), progress, cache=cache, stop=stop, autotune=not programs.quick_start(),
                     round_sizes=programs.first_round_sizes())
    return programs.by_key
