"""The programs an engine runs: which buckets exist, which of their programs are compiled, how they get compiled
(all at start-up, or the smallest buckets first and the rest in the background, the first ones without autotuning
where that is quicker, looked up in the executable cache), and running one.

The engine asks this set for "the prefill program of this chunk" or "the step program of this batch" with its
inputs; it never reads a program table or passes a program its parameters itself.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from gemma4_mtp_jax.steps.device_state import DeviceState, StepInputs
from gemma4_mtp_jax.programs.executable_cache import ExecutableCache, compile_for_cache, program_key
from gemma4_mtp_jax.kernels.device_budget import on_gpu
from gemma4_mtp_jax.programs.compiled import (VARIANTS, CompiledSteps, compile_lowered, compiler_options,
                                              quick_compiles)

log = logging.getLogger(__name__)

Progress = Callable[[str, float], None]


class ProgramSet:
    """An engine's compiled programs over `steps` (CompiledSteps: what each program computes) for its batch and
    prefill buckets. With `background`, `start` compiles the smallest buckets' programs and returns; a thread
    compiles the others, then replaces the first ones by autotuned versions where they were compiled without."""

    def __init__(self, steps: CompiledSteps, batch_buckets: list[int], prefill_buckets: list[int],
                 background: bool = False):
        self.steps = steps
        self.batch_buckets, self.prefill_buckets = batch_buckets, prefill_buckets
        self.background = background
        self.times: dict[str, float] = {}  # seconds per program: lowering and compiling, or loading
        self.restored: list[str] = []  # programs loaded from an executable cache (or handed over), by name
        # With an executable cache: every program compiled, loaded or handed over, by its cache key (what
        # `engine.compile_ahead` hands the engine built after the weights load).
        self.by_key: dict[str, Any] = {}
        self.untuned: set[str] = set()  # compiled without autotuning and not yet replaced by tuned ones
        self._warm_up: threading.Thread | None = None
        self._stop = threading.Event()
        self._num_programs: int | None = None
        self._all_compiled = True  # False while the scheduler must keep to the buckets compiled so far

    # ------------------------------------------------------------------ compiling
    def first_buckets(self) -> tuple[list[int], list[int]]:
        """(batch buckets, prefill buckets) compiled before `start` returns: every one, or with `background` the
        smallest of each."""
        if self.background:
            return [self.batch_buckets[0]], [self.prefill_buckets[0]]
        return self.batch_buckets, self.prefill_buckets

    def first_round_sizes(self) -> tuple[int, ...] | None:
        """The round sizes whose speculative programs `start` compiles for the first buckets (None: all of them):
        with `background`, the engine's k alone, the others later with the rest."""
        if self.background and self.steps.drafter is not None:
            return (self.steps.k,)
        return None

    def quick_start(self) -> bool:
        """Whether the first buckets' programs compile without autotuning (in the background mode, where XLA
        autotunes): they serve until the background thread replaces them, so the engine is ready sooner."""
        return self.background and quick_compiles()

    def start(self, progress: Progress | None = None, cache: ExecutableCache | None = None,
              given: dict[str, Any] | None = None) -> None:
        """Compile the first buckets' programs (`given`: some compiled already, by cache key), and in the
        background mode start the thread that compiles the rest."""
        self.times.update(self.compile(*self.first_buckets(), progress, cache=cache, given=given,
                                       autotune=not self.quick_start(), round_sizes=self.first_round_sizes()))
        rest_batch, rest_prefill = self.batch_buckets[1:], self.prefill_buckets[1:]
        more_sizes = self.first_round_sizes() not in (None, self.steps.round_sizes)
        if self.background and (rest_batch or rest_prefill or self.untuned or more_sizes):
            self._all_compiled = False
            self._warm_up = threading.Thread(target=self._compile_rest, args=(rest_batch, rest_prefill, progress,
                                                                               cache), name="gemma4-compile")
            self._warm_up.start()

    def _compile_rest(self, batch: list[int], prefill: list[int], progress: Progress | None,
                      cache: ExecutableCache | None) -> None:
        """The warm-up thread: the programs of the buckets left out at start-up, then the first buckets' programs
        again with autotuning where they were compiled without. A program replaced between two steps is the same
        computation, its GEMMs tiled otherwise (their sums rounded in another order, as between two batch
        buckets): the next step runs the tuned one."""
        t0 = time.perf_counter()
        try:
            times = self.compile(batch, prefill, progress, cache=cache, stop=self._stop)
            first = self.first_round_sizes()
            if first is not None and not self._stop.is_set():  # the first bucket's other round sizes
                others = tuple(r for r in self.steps.round_sizes if r not in first)
                times.update(self.compile(self.first_buckets()[0], [], progress, cache=cache, stop=self._stop,
                                          round_sizes=others))
            self.times.update(times)
            if times and not self._stop.is_set():
                log.info("compiled the last %d programs in the background in %.1fs: every bucket in use",
                         len(times), time.perf_counter() - t0)
            if self.untuned and not self._stop.is_set():
                # No progress per program: these fill no new bucket (the caller's count of programs stays right).
                t0, untuned = time.perf_counter(), len(self.untuned)
                self.times.update(self.compile(*self.first_buckets(), cache=cache, stop=self._stop,
                                               round_sizes=self.first_round_sizes()))
                log.info("%d of the first programs replaced by their autotuned versions in %.1fs",
                         untuned - len(self.untuned), time.perf_counter() - t0)
        except Exception:
            log.exception("compiling in the background failed: serving goes on with the programs compiled so far")

    def compile(self, batch_buckets: list[int], prefill_buckets: list[int], progress: Progress | None = None,
                threads: int | None = None, cache: ExecutableCache | None = None,
                stop: threading.Event | None = None, given: dict[str, Any] | None = None,
                autotune: bool = True, round_sizes: tuple[int, ...] | None = None) -> dict[str, float]:
        """Compile these buckets' programs now, so that serving never compiles. Tracing and lowering run one
        program at a time (they hold the GIL: ~3-4 s a program at 31B); each program's XLA compilation starts in a
        thread as soon as it is lowered (XLA releases the GIL), so compilations overlap the lowering of the
        programs after them, costliest first. With a `cache` (executable_cache.py), every program is first looked
        up there, all at once in the threads; a program found is loaded instead (no tracing, lowering or
        compiling; its name goes into `restored`), and every program compiled is stored. Returns seconds per
        program: its lowering plus its compilation (wall time in its thread), or its load. Once `stop` is set no
        further program is lowered (those compiling finish). `given`: programs compiled already, by cache key
        (another ProgramSet's `by_key` of the same configuration); one found there is taken as it is, like a load.
        `autotune` False: the programs not found are compiled without XLA's GEMM autotuning (`compile_lowered`),
        quicker to compile and slower to run; they are not stored in the cache, and their names go into `untuned`
        until a tuned compile replaces them. `round_sizes`: the speculative programs' sizes to compile (None: the
        steps' every one)."""
        steps = self.steps
        progs = sorted(steps.programs(batch_buckets, prefill_buckets, round_sizes),
                       key=lambda p: p[0].startswith("prefill"))
        # XLA:CPU compiling two programs at once segfaulted in the CPU suite (tests/test_speculative.py, an engine
        # built while others were alive); the CPU's programs are small and its cores few: one at a time there.
        threads = threads or (min(len(progs), os.cpu_count() or 1) if on_gpu() else 1)
        times: dict[str, float] = {}
        state_out = (steps.arrays.abstract_state(), 0)  # what most programs return: (state, its output array)
        outs = {p[0]: p[3]() if len(p) > 3 else state_out for p in progs}
        static = None if cache is None else steps.static_description()
        if cache is not None and static is None:
            log.info("executable cache: not used with a drafter of type %s", type(steps.drafter).__name__)
            cache = None

        def timed(fn, *args):
            t0 = time.perf_counter()
            return fn(*args), time.perf_counter() - t0

        def keep(name: str, store: Callable, compiled: Any, seconds: float, key: str | None, tuned: bool,
                 how: str | None = None) -> None:
            store(compiled)
            (self.untuned.discard if tuned else self.untuned.add)(name)
            times[name] = seconds
            if key is not None:
                self.by_key[key] = compiled
            if progress:
                progress(f"{name} ({how})" if how else name, seconds)

        pending: dict[concurrent.futures.Future, tuple] = {}

        def take(done) -> None:  # store finished compilations (and report them) from this thread
            for fut in done:
                name, store, t_lower, key, args = pending.pop(fut)
                (compiled, storable), t_compile = fut.result()
                keep(name, store, compiled, t_lower + t_compile, key, autotune, None if autotune else "untuned")
                # Untuned programs are not stored: a later start should find only tuned ones in the cache.
                if cache is not None and storable and autotune:
                    cache.store(key, compiled, args, outs[name])

        given = given or {}
        with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
            built = [(name, store, *build()) for name, build, store, *_ in progs]  # (name, store, jitted, args)
            keys = [None if cache is None else program_key(name, args, static, compiler_options())
                    for name, _, _, args in built]
            loads = [None if cache is None or key in given else pool.submit(timed, cache.load, key, args, outs[name])
                     for key, (name, _, _, args) in zip(keys, built)]
            for (name, store, jitted, args), key, load in zip(built, keys, loads):
                if stop is not None and stop.is_set():
                    break
                if key in given:
                    self.restored.append(name)
                    # Taken as compiled the way this call compiles (compile_ahead decides as the engine does). One
                    # that compile_ahead loaded from the cache counts as untuned: its replacement is then a load.
                    keep(name, store, given[key], 0.0, key, autotune, "compiled ahead")
                    continue
                compiled, t_load = load.result() if load is not None else (None, 0.0)
                if compiled is not None:
                    self.restored.append(name)
                    keep(name, store, compiled, t_load, key, True, "loaded from the executable cache")
                    continue
                t0 = time.perf_counter()
                low = jitted.lower(*args)
                fut = pool.submit(timed, compile_for_cache, functools.partial(compile_lowered, low, autotune))
                pending[fut] = (name, store, time.perf_counter() - t0, key, args)
                take([fut for fut in pending if fut.done()])
            take(concurrent.futures.as_completed(list(pending)))
        return times

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the background compiling is over; True when it is."""
        if self._warm_up is not None:
            self._warm_up.join(timeout)
            return not self._warm_up.is_alive()
        return True

    def close(self) -> None:
        """Stop compiling in the background: no further program starts, the ones compiling finish (waited for)."""
        if self._warm_up is not None:
            self._stop.set()
            if self._warm_up.is_alive():  # an XLA compilation cannot be cut short (0013-compile-in-background.md)
                log.info("waiting for the programs still compiling in the background (none further starts)")
            self._warm_up.join()

    # ------------------------------------------------------------------ what is compiled
    def ready(self) -> tuple[int, int]:
        """(programs compiled, programs the buckets need)."""
        steps = self.steps
        if self._num_programs is None:
            self._num_programs = len(steps.programs(self.batch_buckets, self.prefill_buckets))
        done = (len(steps.prefill) + len(steps.prefill_media) + len(steps.decode) + len(steps.speculative)
                + len(steps.draft) + len(steps.verify) + len(steps.accept))
        return done, self._num_programs

    def buckets(self) -> tuple[list[int], list[int]]:
        """(batch buckets, prefill buckets) usable now: every one, or while programs still compile in the
        background, those whose programs are compiled (a batch bucket's every variant)."""
        if self._all_compiled:
            return self.batch_buckets, self.prefill_buckets
        steps = self.steps
        batch = [b for b in self.batch_buckets if self._compiled(b, steps.k)
                 and (not (steps.structured and steps.drafter) or (b in steps.draft and b in steps.verify and b in steps.accept))]
        prefill = [t for t in self.prefill_buckets if (1, t) in steps.prefill
                   and (not steps.prompt_logprobs or (1, t, "scored") in steps.prefill)]
        if len(batch) == len(self.batch_buckets) and len(prefill) == len(self.prefill_buckets):
            self._all_compiled = True  # no more lookups
        return batch, prefill

    def _compiled(self, batch: int, k: int) -> bool:
        """Whether a batch bucket's step programs of every variant are compiled (with a drafter: its rounds of k)."""
        steps = self.steps
        if steps.drafter is None:
            return all((batch, *v) in steps.decode for v in VARIANTS)
        return all((batch, *v, k) in steps.speculative for v in VARIANTS)

    def round_sizes(self, batch: int) -> tuple[int, ...]:
        """The round sizes (drafts per round) whose speculative programs for `batch` rows are compiled now."""
        return tuple(k for k in self.steps.round_sizes if self._compiled(batch, k))

    # ------------------------------------------------------------------ running
    def prefill(self, state: DeviceState, inputs: StepInputs, scored: bool = False,
                media: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[DeviceState, jax.Array]:
        """One prefill chunk (inputs: one row of PrefillRows, host arrays) through its program, `scored`: the one
        that also returns the chunk's prompt logprobs: (state, its output: `result(out, prefill=True, scored=T)`
        reads the packed result). `media`: the chunk's soft tokens and where they go (engine/media.PromptMedia.chunk),
        through the media variant."""
        steps = self.steps
        B, T = inputs.rows.tokens.shape
        if media is None:
            return steps.compile_prefill(B, T, scored)(steps.program_params, state, steps.inputs(inputs))
        soft, at = media
        return steps.compile_prefill(B, T, scored, media=True)(steps.program_params, state, steps.inputs(inputs),
                                                               soft.astype(jax.numpy.dtype(steps.target.dtype)), at)

    def step(self, state: DeviceState, inputs: StepInputs, sampled: bool,
             processed: bool = False, k: int | None = None) -> tuple[DeviceState, jax.Array]:
        """One decode step, or with a drafter one draft-and-verify round of `k` drafts (None: the engine's k; one of
        `round_sizes(B)`), for `inputs` (StepRows, host arrays, and processing rows when `processed`) of a batch
        bucket, without waiting: (state, its output; `result(out, processed=processed, k=k)` reads the packed
        result). The variant (compiled.VARIANTS): `sampled`, some row samples (False: every row is greedy);
        `processed`, some row needs logits processing or logprobs."""
        steps = self.steps
        B = inputs.rows.slot.shape[0]
        packed = steps.inputs(inputs)
        if steps.drafter is None:
            return steps.compile_decode(B, sampled, processed)(steps.program_params, state, packed)
        return steps.compile_speculative(B, sampled, processed, k)(steps.program_params, steps.draft_params, state,
                                                                   packed)

    def draft(self, state: DeviceState, inputs: StepInputs) -> tuple[DeviceState, jax.Array, jax.Array, Any]:
        """A round's drafts alone (a structured engine's grammar batches): (state, the drafts' packed output:
        `drafts(out)` reads them, q, q_ids), to be verified by `verify`."""
        steps = self.steps
        B = inputs.rows.slot.shape[0]
        return steps.compile_draft(B)(steps.program_params, steps.draft_params, state, steps.inputs(inputs))

    def drafts(self, drafted: jax.Array) -> np.ndarray:
        """A draft program's drafts [B, k] on the host (waits for it)."""
        return np.asarray(drafted)[:, : self.steps.k]

    def verify(self, state: DeviceState, inputs: StepInputs, drafted: jax.Array) -> tuple[DeviceState, tuple]:
        """The verify's target forward on `draft`'s drafts (inputs: the draft's), without waiting: (state, what
        `accept` takes of it)."""
        steps = self.steps
        B = inputs.rows.slot.shape[0]
        state, h_all, logits = steps.compile_verify(B)(steps.program_params, state, steps.inputs(inputs), drafted)
        return state, (h_all, logits)

    def accept(self, state: DeviceState, inputs: StepInputs, drafted: jax.Array, q: jax.Array, q_ids: Any,
               verified: tuple) -> tuple[DeviceState, jax.Array]:
        """The rest of `verify` (`verified`: what it returned; inputs: processing rows with grammar masks at the k+1
        positions): (state, its output; `result(out, processed=True)` reads the round's packed result)."""
        steps = self.steps
        B = inputs.rows.slot.shape[0]
        return steps.compile_accept(B)(state, steps.inputs(inputs), drafted, q, q_ids, *verified)

    def result(self, out: jax.Array, prefill: bool = False, processed: bool = False, scored: int = 0,
               k: int | None = None) -> np.ndarray:
        """A program's packed result on the host (waits for the program; k: a speculative round's drafts)."""
        return self.steps.result(out, prefill, processed, scored, k)
