"""Running the programs: a request's row of host inputs (its slot, page tables, sampling and stop rows), a batch's
rows packed as its program takes them, the program dispatched, and its one packed result read back.

A row is built for each request on its own, before the batch is assembled, so that a request whose row cannot be
built (a value that does not fit its dtype, a page table longer than its width) fails alone.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from gemma4_mtp_jax.steps.device_state import (DeviceState, PrefillRows, ProcessingRows, StepInputs, StepRows,
                                                unpack_logprobs)
from gemma4_mtp_jax.engine.grammar import RoundMasks
from gemma4_mtp_jax.engine.kv_cache import KVCacheManager
from gemma4_mtp_jax.engine.request import Request, TokenLogprob
from gemma4_mtp_jax.model.kv_state import NULL_PAGE
from gemma4_mtp_jax.programs.program_set import ProgramSet
from gemma4_mtp_jax.model.sampling import SamplingBatch, any_sampled


@dataclasses.dataclass
class Row:
    """One request's row of a step's host arrays."""

    req: Request
    slot: int
    tables: dict[str, np.ndarray]  # KV group -> [table width] int32
    sampling: tuple  # SamplingParams.row()
    stop_ids: np.ndarray  # [MAX_STOP_IDS] int32, -1 padded
    remaining: np.int32  # tokens the request may still produce
    # A row whose slot does not hold its values yet (its first decode step) brings its newest token and position.
    fresh: bool = False
    token: np.int32 = np.int32(0)
    length: np.int32 = np.int32(-1)
    # With a grammar: the tokens it allows next, [1, ceil(V/32)] int32 (filled when the row is built, so that a
    # grammar that fails fails its request alone)
    mask: np.ndarray | None = None

    def processing_row(self, prefill: bool = False) -> dict[str, Any]:
        """Its ProcessingRows values: the allowed-token mask (a prefill's alone), and what its grammar allows next
        (filled now: the tokens before are known)."""
        row = self.req.sampling.processing_row(len(self.req.prompt))
        if self.mask is not None:
            row["mask"] = self.mask
        return {**row, "allowed": self.req.allowed_row} if prefill else row

    def step_row(self, masked_rounds: bool = False) -> dict[str, Any]:
        """Its StepRows values. A row with a grammar speculates only in rounds whose verify takes the grammar's masks
        at every position (`masked_rounds`: the draft program, then the verify); otherwise its mask is known for
        its first position only."""
        return dict(slot=self.slot, fresh=self.fresh, token=self.token, length=self.length,
                    remaining=self.remaining, stop_ids=self.stop_ids,
                    speculate=self.req.speculates(masked_rounds))


class Dispatched(NamedTuple):
    """A decode or speculative step dispatched and not read yet: its requests by row, the same as a set (asked once
    per decoding sequence per step), the program's output on the device, whether it was the processed variant
    (its result then holds logprobs), a speculative round's drafts per row (0 for a decode step), and the requests
    whose grammar could not fill a masked round's masks (with why), which ran as padding rows and fail alone."""

    requests: list[Request]
    members: frozenset[Request]
    packed: jax.Array
    processed: bool = False
    k: int = 0
    failed: tuple[tuple[Request, Exception], ...] = ()


def bucket(buckets: list[int], n: int) -> int:
    """The smallest bucket that holds n."""
    for b in buckets:
        if b >= n:
            return b
    raise AssertionError(f"no bucket for {n} (buckets {buckets})")


class Runner:
    """Runs `programs` on the engine's device `state` for rows whose pages `kv` holds; at most one step is in flight
    (dispatched, not read)."""

    def __init__(self, programs: ProgramSet, kv: KVCacheManager, state: DeviceState | None, num_slots: int,
                 prefill_chunk: int):
        self.programs, self.kv, self.state = programs, kv, state
        self.prefill_chunk = prefill_chunk
        self.pad_slot = num_slots  # padding rows use the spare last slot
        self.in_flight: Dispatched | None = None
        self.mask_seconds = 0.0  # host time spent filling grammar masks (structured output), in all
        self._round_masks: RoundMasks | None = None

    def in_flight_members(self) -> frozenset[Request]:
        return frozenset() if self.in_flight is None else self.in_flight.members

    def row(self, req: Request) -> Row:
        row = Row(req, self.kv.seq(req).slot, self.kv.page_table(req), req.sampling.row(), req.stop_row,
                  np.int32(req.max_new_tokens - len(req.output)))
        if req.decoding and not req.on_device:
            row.fresh, row.token, row.length = True, np.int32(req.output[-1]), np.int32(req.num_tokens - 1)
        if req.grammar is not None:
            t0 = time.perf_counter()
            row.mask = np.empty((1, *req.allowed_row.shape), np.int32)
            req.grammar.fill_mask(row.mask[0])
            self.mask_seconds += time.perf_counter() - t0
        return row

    def rows(self, reqs: list[Request]) -> tuple[list[Row], list[tuple[Request, Exception]]]:
        """Each request's row, and the requests whose row could not be built (with why)."""
        rows, failed = [], []
        for req in reqs:
            try:
                rows.append(self.row(req))
            except Exception as e:
                failed.append((req, e))
        return rows, failed

    @staticmethod
    def _batch(rows: list[Row], batch: int, step_rows: Any, processing: ProcessingRows | None) -> StepInputs:
        """The rows' inputs padded to `batch` rows (padding rows point at the null page)."""
        tables = {}
        for g, t in rows[0].tables.items():
            table = np.full((batch, t.shape[0]), NULL_PAGE, np.int32)
            for r, row in enumerate(rows):
                table[r] = row.tables[g]
            tables[g] = table
        return StepInputs(step_rows, tables, SamplingBatch.from_rows([row.sampling for row in rows], batch),
                          processing)

    @property
    def chunk(self) -> int:
        """The most prompt tokens one prefill chunk takes."""
        return min(self.prefill_chunk, self.programs.buckets()[1][-1])

    def prefill(self, req: Request, row: Row, budget: int | None) -> tuple[int, np.ndarray | None]:
        """Write the K/V of `req`'s tokens but the newest (`row`: its row of host arrays): its prompt, or for a
        preempted sequence its prompt and output so far, whose newest token then feeds the next decode step. Goes
        on from where the last call stopped, in chunks, for up to `budget` tokens (None: to the end). Returns
        (tokens prefilled, the packed result of the last chunk when the prefill is complete, else None): a new
        request's first token, through the stop rule. The program also leaves the drafter's first h in the slot."""
        buckets = self.programs.buckets()[1]
        chunk = self.chunk
        todo = req.prompt + req.output[:-1]
        # Prompt logprobs come with the request's first prefill (a resumed one has them already).
        scored = req.sampling.prompt_logprobs is not None and not req.output
        ps = self.kv.layout.page_size
        words = len(req.allowed_row)
        processing = ProcessingRows.stack([row.processing_row(prefill=True)], 1, (words, 1, words))
        done, packed = 0, None
        while req.prefilled < len(todo) and (budget is None or done < budget):
            start = req.prefilled
            n = min(chunk, len(todo) - start, budget - done if budget is not None else chunk)
            cut = req.media.inside(start + n) if req.media is not None else None
            if cut is not None:  # an image kept whole: end the chunk before it, or past it when it starts the chunk
                n = cut[0] - start if cut[0] > start else cut[1] - start
            self.kv.advance_rings(req, (start + n - 1) // ps)
            row.tables = self.kv.page_table(req)
            T = bucket(buckets, n)
            following = todo[start + 1:start + n + 1]
            rows = PrefillRows.stack([dict(slot=row.slot, tokens=np.pad(todo[start:start + n], (0, T - n)),
                                           positions=np.pad(np.arange(start, start + n), (0, T - n),
                                                            constant_values=-1),
                                           last_index=n - 1, stop_ids=row.stop_ids, remaining=row.remaining,
                                           next_tokens=np.pad(following, (0, T - len(following)),
                                                              constant_values=-1))], 1, T)
            media = req.media.chunk(start, n, T) if req.media is not None else None
            self.state, packed = self.programs.prefill(self.state, self._batch([row], 1, rows, processing), scored,
                                                       media)
            if scored:
                result = self.programs.result(packed, prefill=True, scored=T)[0]
                self._take_prompt_logprobs(req, result, T, len(following))
            req.prefilled += n
            done += n
            self.kv.register(req)
        if req.prefilled < len(todo):
            return done, None
        return done, self.programs.result(packed, prefill=True)[0]

    @staticmethod
    def _take_prompt_logprobs(req: Request, result: np.ndarray, tokens: int, n: int) -> None:
        """A scored prefill chunk's prompt logprobs (after its sampled token's columns: CompiledSteps.result, for a
        chunk of `tokens` positions) for its first `n` tokens' successors, the prompt's tokens from the chunk's
        second on, onto `req.prompt_logprobs`."""
        per_position = (len(result) - 4) // (tokens + 1)
        columns = unpack_logprobs(result[4 + per_position:], tokens)
        req.prompt_logprobs += TokenLogprob.rows(*columns, req.sampling.prompt_logprobs, n)

    def step_inputs(self, rows: list[Row], processed: bool = False, masked_rounds: bool = False) -> StepInputs:
        """A decode or speculative step's host inputs for `rows`, padded to the batch bucket that holds them (with
        the rows' processing parameters for the processed variant; `masked_rounds`: see Row.step_row)."""
        B = bucket(self.programs.buckets()[0], len(rows))
        processing = None
        if processed:
            processing = ProcessingRows.stack([row.processing_row() for row in rows], B,
                                              (0, 1, len(rows[0].req.allowed_row)))
        step_rows = StepRows.stack([row.step_row(masked_rounds) for row in rows], B, slot=self.pad_slot)
        return self._batch(rows, B, step_rows, processing)

    def _padding(self, batch: int) -> StepInputs:
        """A step's inputs of `batch` padding rows: they read the null page and the spare slot and write nothing."""
        tables = {g: np.full((batch, width), NULL_PAGE, np.int32) for g, width in self.kv.layout.pages_per_seq}
        return StepInputs(StepRows.stack([], batch, slot=self.pad_slot), tables, SamplingBatch.from_rows([], batch),
                          None)

    def time_round(self, batch: int, k: int, repeats: int = 5) -> float:
        """Median seconds of the greedy speculative round of k drafts for a bucket of `batch` rows, after one run
        not timed; run on padding rows, which change nothing (no step may be in flight: it would be timed too)."""
        assert self.in_flight is None, "time_round with a step in flight"
        inputs, times = self._padding(batch), []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            self.state, packed = self.programs.step(self.state, inputs, False, False, k)
            self.programs.result(packed, k=k)
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    def _masked_round(self, rows: list[Row]) -> tuple[jax.Array, list[tuple[Request, Exception]]]:
        """A speculative round for a batch with a grammar, in three programs: the drafts, read here; the verify's
        target forward, during which each grammar's masks at the k+1 verified positions are walked through its
        row's drafts (a draft it forbids is rejected: its probability there is 0); the rest of the verify, which
        applies them. Returns that last program's output and the requests whose grammar could not go on (their
        rows run the last program as padding)."""
        programs, k = self.programs, self.programs.steps.k
        inputs = self.step_inputs(rows, masked_rounds=True)
        self.state, drafted, q, q_ids = programs.draft(self.state, inputs)
        self.state, verified = programs.verify(self.state, inputs, drafted)
        drafts = programs.drafts(drafted)  # waits for the drafts alone: the forward runs on while the masks fill
        words = len(rows[0].req.allowed_row)
        B = inputs.rows.slot.shape[0]
        processing = ProcessingRows.stack([row.processing_row() for row in rows], B, (0, k + 1, words))
        t0 = time.perf_counter()
        with_grammar = [r for r, row in enumerate(rows) if row.req.grammar is not None]
        masks = np.full((len(with_grammar), k + 1, words), -1, np.int32)
        if self._round_masks is None:  # llguidance's thread pool, made for the first masked round
            self._round_masks = RoundMasks()
        errors = self._round_masks.fill([rows[r].req.grammar for r in with_grammar],
                                        [drafts[r].tolist() for r in with_grammar], masks)
        processing.mask[:] = -1
        processing.mask[with_grammar] = masks
        self.mask_seconds += time.perf_counter() - t0
        failed = [(rows[with_grammar[i]].req, e) for i, e in errors]
        step_rows = inputs.rows
        if failed:  # padding rows now (StepRows' own): they write nothing, and their slots keep what they held
            pad = [with_grammar[i] for i, _ in errors]
            blank = StepRows.stack([], 1, slot=self.pad_slot)

            def padded(a: np.ndarray, b: np.ndarray) -> np.ndarray:
                a = a.copy()
                a[pad] = b[0]
                return a

            step_rows = jax.tree_util.tree_map(padded, step_rows, blank)
        self.state, packed = programs.accept(self.state, inputs.replace(rows=step_rows, processing=processing),
                                             drafted, q, q_ids, verified)
        return packed, failed

    def dispatch(self, rows: list[Row], k: int = 0) -> Dispatched:
        """One decode step, or with a drafter one draft-and-verify round of `k` drafts (a round size compiled for
        the batch's bucket), for `rows`, without waiting; it becomes the step in flight. A batch with a grammar on an
        engine with masked rounds runs `_masked_round` (of the engine's k) unless k is 0."""
        processed = any(row.req.processed for row in rows)
        sampled = processed or any_sampled([row.sampling for row in rows])
        steps = self.programs.steps
        if steps.drafter is None:
            k = 0
        failed = []
        if k and steps.structured and any(row.req.grammar is not None for row in rows):
            processed, k = True, steps.k
            packed, failed = self._masked_round(rows)
        else:
            self.state, packed = self.programs.step(self.state, self.step_inputs(rows, processed), sampled,
                                                    processed, k)
        for row in rows:
            row.req.on_device = True
        reqs = [row.req for row in rows]
        self.in_flight = Dispatched(reqs, frozenset(reqs), packed, processed, k, tuple(failed))
        return self.in_flight

    def collect(self, dispatched: Dispatched) -> list[tuple[Request, np.ndarray]]:
        """Read a dispatched step (the one host read of a step): each row's request and its packed result row."""
        if self.in_flight is dispatched:
            self.in_flight = None
        return list(zip(dispatched.requests, self.programs.result(dispatched.packed, processed=dispatched.processed,
                                                                  k=dispatched.k)))
