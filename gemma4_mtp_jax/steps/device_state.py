"""What the engine keeps on the device between steps, and the one place that decides where a sequence stops.

`DeviceState` is a single pytree: the KV page pools, the drafter's hidden buffer, per slot (a running sequence's
row) its newest token, that token's position and the tokens it may still produce, and the buffer each step's
packed host inputs are staged in (input_pack.py). Every compiled program takes it donated and returns it updated
in place. Because the slots carry the newest token and position, a decode or speculative step needs nothing from
the previous step's results on the host: the engine can dispatch step n+1 before it reads step n (docs/DESIGN.md,
"Overlap").

A step's result per row is one packed int32 array (docs/DESIGN.md convention 7): the emitted tokens, the drafts
accepted, how many tokens the sequence keeps and why it finished (`FINISH_*`), decided here by `stop_check`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.model.sampling import MAX_LOGIT_BIAS, SamplingBatch, unpack_bits

Array = jax.Array

MAX_STOP_IDS = 16  # stop token ids per request the step checks on the device
FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2  # the packed result's last column


@flax.struct.dataclass
class DeviceState:
    """The engine's device state. Slot arrays have num_slots + 1 rows: the last is the padding rows' slot, whose
    `remaining` stays 0."""

    pages: dict[int, tuple[Array, Array]]  # layer -> (K, V) [nKV, num_pages, page_size, D] (kv_state.py)
    hidden: Array | None  # [num_slots + 1, H]: the drafter's h per slot (convention 1); None without a drafter
    token: Array  # [num_slots + 1] int32: each sequence's newest token, not yet written
    length: Array  # [num_slots + 1] int32: that token's position
    remaining: Array  # [num_slots + 1] int32: tokens the sequence may still produce; 0 once it has finished
    inputs: Array  # [capacity] int32: the running step's host inputs, staged where they keep their address
    # Logits processing (sampling.process_logits), per slot; kept by the processed programs and every prefill:
    counts: Array  # [num_slots + 1, V] int32: the sequence's output tokens whose K/V is committed, by token
    seen: Array  # [num_slots + 1, V] bool: its prompt's tokens
    allowed: Array  # [num_slots + 1, V] bool: the tokens it may emit


class _HostRows:
    """Per-row host inputs of a step. Each subclass declares its fields once (`_fields`: shape per row, dtype, the
    value a padding row holds); its concrete form (`stack`: numpy, rows then padding) and its abstract form
    (`abstract`: the shapes a program is compiled for) both derive from that."""

    @classmethod
    def _fields(cls, tokens: int | None) -> dict[str, tuple[tuple[int, ...], Any, Any]]:
        raise NotImplementedError

    @classmethod
    def stack(cls, rows: Sequence[Mapping[str, Any]], batch: int, tokens: int | None = None, **padding: Any):
        """`rows` (one mapping of field -> value per row) as [batch] host arrays; the rows past them padding (each
        field's padding value, or `padding`'s), as is a field a row leaves out."""
        out = {}
        for name, (shape, dtype, pad) in cls._fields(tokens).items():
            a = np.full((batch, *shape), padding.get(name, pad), dtype)
            for r, row in enumerate(rows):
                if name in row:
                    a[r] = row[name]
            out[name] = a
        return cls(**out)

    @classmethod
    def abstract(cls, batch: int, tokens: int | None = None, sharding: Any = None):
        """The shapes of `stack(..., batch, tokens)` (jax.ShapeDtypeStruct leaves, with `sharding`)."""
        return cls(**{name: jax.ShapeDtypeStruct((batch, *shape), dtype, sharding=sharding)
                      for name, (shape, dtype, _) in cls._fields(tokens).items()})


@flax.struct.dataclass
class StepRows(_HostRows):
    """A decode or speculative step's per-row host inputs [B]. A fresh row (a sequence's first step after its
    prefill, or a benchmark's fixed inputs) brings its token, length and remaining from the host; every other row
    reads them from its slot, where the previous step left them (`resolve`)."""

    slot: Array  # [B] int32 (padding rows: the spare last slot, `stack(..., slot=num_slots)`)
    fresh: Array  # [B] bool
    token: Array  # [B] int32 (fresh rows)
    length: Array  # [B] int32 (fresh rows; -1: a padding row)
    remaining: Array  # [B] int32 (fresh rows)
    stop_ids: Array  # [B, MAX_STOP_IDS] int32, -1 padded
    speculate: Array  # [B] bool: draft for this row (speculative steps; rows without accept nothing)

    @classmethod
    def _fields(cls, tokens: int | None) -> dict[str, tuple[tuple[int, ...], Any, Any]]:
        return {"slot": ((), np.int32, 0), "fresh": ((), np.bool_, True), "token": ((), np.int32, 0),
                "length": ((), np.int32, -1), "remaining": ((), np.int32, 0),
                "stop_ids": ((MAX_STOP_IDS,), np.int32, -1), "speculate": ((), np.bool_, False)}

    def resolve(self, state: "DeviceState") -> "StepRows":
        """Each row's token, length and remaining: the host's for fresh rows, else its slot's. A row whose sequence
        has finished (remaining 0: a step dispatched before the host read that it stopped) runs as padding, length
        -1, so it writes nothing."""
        token = jnp.where(self.fresh, self.token, state.token[self.slot])
        length = jnp.where(self.fresh, self.length, state.length[self.slot])
        remaining = jnp.where(self.fresh, self.remaining, state.remaining[self.slot])
        return self.replace(token=token, length=jnp.where(remaining > 0, length, -1), remaining=remaining)


@flax.struct.dataclass
class PrefillRows(_HostRows):
    """A prefill chunk's per-row host inputs: each row writes the K/V of `tokens` at `positions` (-1: padding) and
    samples after its token at `last_index`, through the stop rule (meaningful on a prompt's final chunk)."""

    slot: Array  # [B] int32: where the drafter's first h goes
    tokens: Array  # [B, T] int32
    positions: Array  # [B, T] int32 (-1 padded)
    last_index: Array  # [B] int32
    stop_ids: Array  # [B, MAX_STOP_IDS] int32, -1 padded
    remaining: Array  # [B] int32: tokens the sequence may still produce
    next_tokens: Array  # [B, T] int32: the token after each of `tokens` where known (a scored prefill's), else -1

    @classmethod
    def _fields(cls, tokens: int | None) -> dict[str, tuple[tuple[int, ...], Any, Any]]:
        return {"next_tokens": ((tokens,), np.int32, -1),
                "slot": ((), np.int32, 0), "tokens": ((tokens,), np.int32, 0), "positions": ((tokens,), np.int32, -1),
                "last_index": ((), np.int32, 0), "stop_ids": ((MAX_STOP_IDS,), np.int32, -1),
                "remaining": ((), np.int32, 0)}


@flax.struct.dataclass
class ProcessingRows(_HostRows):
    """A processed program's per-row processing parameters (`SamplingParams.processing_row`); the bitmasks of the
    tokens its grammar allows at its first M positions (`mask`: all ones without a grammar; M = 1, or k+1 for a
    verify that follows a draft program: engine.runner); and for a prefill each row's allowed-token bitmask, which
    the prefill writes into the slot. Sized by (allowed words: a prefill's ceil(V/32), else 0; M; mask words)."""

    min_p: Array  # [B] float32
    presence: Array  # [B] float32
    frequency: Array  # [B] float32
    repetition: Array  # [B] float32
    min_tokens: Array  # [B] int32
    prompt_len: Array  # [B] int32
    bias_ids: Array  # [B, MAX_LOGIT_BIAS] int32, -1 padded
    bias_values: Array  # [B, MAX_LOGIT_BIAS] float32
    allowed: Array  # [B, ceil(V/32)] int32 (prefill) or [B, 0]
    mask: Array  # [B, M, ceil(V/32)] int32

    @classmethod
    def _fields(cls, words: tuple[int, int, int] | None) -> dict[str, tuple[tuple[int, ...], Any, Any]]:
        allowed_words, masked, mask_words = words or (0, 0, 0)
        return {"min_p": ((), np.float32, 0.0), "presence": ((), np.float32, 0.0),
                "frequency": ((), np.float32, 0.0), "repetition": ((), np.float32, 1.0),
                "min_tokens": ((), np.int32, 0), "prompt_len": ((), np.int32, 0),
                "bias_ids": ((MAX_LOGIT_BIAS,), np.int32, -1), "bias_values": ((MAX_LOGIT_BIAS,), np.float32, 0.0),
                "allowed": ((allowed_words,), np.int32, -1), "mask": ((masked, mask_words), np.int32, -1)}


@flax.struct.dataclass
class StepInputs:
    """Everything a step program takes from the host, as one pytree (packed into one array: input_pack.py): the
    rows, each KV group's page tables [B, width] and the rows' sampling parameters."""

    rows: StepRows | PrefillRows
    tables: dict[str, Array]
    sampling: SamplingBatch
    processing: ProcessingRows | None = None  # a prefill's, or a processed step's; None otherwise

    @staticmethod
    def abstract(batch: int, table_widths: Sequence[tuple[str, int]], tokens: int | None = None,
                 sharding: Any = None, processed: bool = False, words: int = 0, masked: int = 1) -> "StepInputs":
        """A prefill's inputs (PrefillRows of `tokens` per row, processing rows with `words`-word allowed
        masks) or, for tokens None, a decode or speculative step's (StepRows; processing rows if `processed`, with
        grammar masks for `masked` positions), as shapes."""
        rows = StepRows.abstract(batch, sharding=sharding) if tokens is None else PrefillRows.abstract(
            batch, tokens, sharding)
        tables = {g: jax.ShapeDtypeStruct((batch, w), jnp.int32, sharding=sharding) for g, w in table_widths}
        processing = None
        if tokens is not None or processed:
            processing = ProcessingRows.abstract(batch, (words if tokens is not None else 0, masked, words), sharding)
        return StepInputs(rows, tables, SamplingBatch.abstract(batch, sharding), processing)


def init_slots(num_slots: int) -> tuple[Array, Array, Array]:
    """Zeroed (token, length, remaining) slot arrays: every slot finished until the engine fills it."""
    shape = (num_slots + 1,)
    return jnp.zeros(shape, jnp.int32), jnp.full(shape, -1, jnp.int32), jnp.zeros(shape, jnp.int32)


def processing_shapes(num_slots: int, vocab_size: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(counts, seen, allowed) of the device state as shapes."""
    shape = (num_slots + 1, vocab_size)
    return (jax.ShapeDtypeStruct(shape, jnp.int32), jax.ShapeDtypeStruct(shape, jnp.bool_),
            jax.ShapeDtypeStruct(shape, jnp.bool_))


def init_processing(num_slots: int, vocab_size: int) -> tuple[Array, Array, Array]:
    """No tokens counted or seen, every token allowed: (counts, seen, allowed)."""
    shape = (num_slots + 1, vocab_size)
    return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.bool_), jnp.ones(shape, jnp.bool_)


@flax.struct.dataclass
class History:
    """What `sampling.process_logits` reads of each row's sequence, gathered from its slot: output token counts
    [B, V] int32, prompt tokens [B, V] bool, allowed tokens [B, V] bool."""

    counts: Array
    seen: Array
    allowed: Array

    @staticmethod
    def of(state: DeviceState, slots: Array) -> "History":
        return History(state.counts[slots], state.seen[slots], state.allowed[slots])


def prefill_history(state: DeviceState, rows: PrefillRows, processing: ProcessingRows) -> tuple[DeviceState, History]:
    """A prefill chunk's part of its rows' histories: a sequence's first chunk (position 0) starts them afresh; the
    chunk's tokens before prompt_len are prompt tokens (seen), the later ones (a preempted sequence's output,
    recomputed) count; the allowed tokens come from the host. A sequence with a history-dependent request is never
    given cached prefix pages (kv_cache.cached_prefix), so its first chunk starts at 0 and every token passes here."""
    V = state.counts.shape[1]
    B = rows.tokens.shape[0]
    b = jnp.arange(B)[:, None]
    slot = rows.slot
    first = (rows.positions[:, 0] == 0)[:, None]
    valid = rows.positions >= 0
    output = valid & (rows.positions >= processing.prompt_len[:, None])
    counts = jnp.where(first, 0, state.counts[slot]).at[b, jnp.where(output, rows.tokens, V)].add(1, mode="drop")
    seen = jnp.where(first, False, state.seen[slot]).at[b, jnp.where(valid & ~output, rows.tokens, V)].set(
        True, mode="drop")
    allowed = unpack_bits(processing.allowed, V)
    state = state.replace(counts=state.counts.at[slot].set(counts), seen=state.seen.at[slot].set(seen),
                          allowed=state.allowed.at[slot].set(allowed))
    return state, History(counts, seen, allowed)


def stop_check(emitted: Array, n: Array, stop_ids: Array, remaining: Array) -> tuple[Array, Array]:
    """How many of a round's n+1 emitted tokens a sequence keeps, and why it finished (FINISH_*): its output ends
    at its first stop id (kept; "stop" wins when both apply) or when `remaining` tokens are reached. emitted
    [B, k+1] (-1 after the bonus), stop_ids [B, S] (-1 = none)."""
    k1 = emitted.shape[1]
    j = jnp.arange(k1)[None, :]
    hit = jnp.any((emitted[..., None] == stop_ids[:, None, :]) & (stop_ids[:, None, :] >= 0), -1) & (j <= n[:, None])
    first_stop = jnp.where(jnp.any(hit, 1), jnp.argmax(hit, 1), k1)
    keep = jnp.minimum(jnp.minimum(n + 1, remaining), first_stop + 1)
    reason = jnp.where(first_stop < keep, FINISH_STOP, jnp.where(keep >= remaining, FINISH_LENGTH, FINISH_NONE))
    return keep.astype(jnp.int32), reason.astype(jnp.int32)


def count_inputs(state: DeviceState, rows: StepRows, inputs: Array, n: Array) -> DeviceState:
    """A processed round's bookkeeping of output tokens: each active row's inputs [B, k+1] (its newest token and
    drafts) up to the n [B] accepted are committed, so they count from now on (sampling.process_logits)."""
    take = (jnp.arange(inputs.shape[1])[None, :] <= n[:, None]) & (rows.length >= 0)[:, None]
    counts = state.counts.at[rows.slot[:, None], jnp.maximum(inputs, 0)].add(take.astype(jnp.int32))
    return state.replace(counts=counts)


def pack_logprobs(chosen: Array, top_ids: Array, top_lp: Array) -> Array:
    """`sampling.token_logprobs`' output as int32 columns [B, T (1 + 2K)] (floats by their bits): what a processed
    program appends to its packed result (`unpack_logprobs` reads it)."""
    B = chosen.shape[0]
    bits = jax.lax.bitcast_convert_type
    return jnp.concatenate([bits(chosen, jnp.int32), top_ids.reshape(B, -1),
                            bits(top_lp, jnp.int32).reshape(B, -1)], 1)


def unpack_logprobs(columns: np.ndarray, positions: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A host row's logprob columns (`pack_logprobs`) as (chosen [T], top ids [T, K], top logprobs [T, K])."""
    T = positions
    K = (columns.shape[-1] // T - 1) // 2
    chosen = columns[:T].view(np.float32)
    top_ids = columns[T:T + T * K].reshape(T, K)
    top_lp = columns[T + T * K:T + 2 * T * K].view(np.float32).reshape(T, K)
    return chosen, top_ids, top_lp


def finish_round(state: DeviceState, rows: StepRows, emitted: Array, n: Array,
                 logprobs: Array | None = None) -> tuple[DeviceState, Array]:
    """The round's stop rule and the slots' next values, for `rows` resolved (`StepRows.resolve`). Returns (state,
    packed [B, k+4] int32: emitted tokens (k+1, -1 after the bonus), n accepted, tokens kept, FINISH_* reason,
    then a processed program's `logprobs` columns (`pack_logprobs`) if given); a padding or finished row keeps 0."""
    length, remaining = rows.length, rows.remaining
    active = length >= 0
    keep, reason = stop_check(emitted, n, rows.stop_ids, remaining)
    keep = jnp.where(active, keep, 0)
    reason = jnp.where(active, reason, FINISH_NONE)
    last = jnp.take_along_axis(emitted, jnp.maximum(keep - 1, 0)[:, None], 1)[:, 0]
    slot_token = jnp.where(active, last, state.token[rows.slot])
    slot_length = jnp.where(active, length + keep, state.length[rows.slot])
    slot_remaining = jnp.where(active & (reason == FINISH_NONE), remaining - keep, 0)
    state = state.replace(token=state.token.at[rows.slot].set(slot_token),
                          length=state.length.at[rows.slot].set(slot_length),
                          remaining=state.remaining.at[rows.slot].set(slot_remaining))
    packed = jnp.concatenate([emitted, n[:, None], keep[:, None], reason[:, None]]
                             + ([] if logprobs is None else [logprobs]), 1).astype(jnp.int32)
    return state, packed
