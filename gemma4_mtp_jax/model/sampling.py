"""Per-request sampling inside the jitted step: greedy, temperature, top-k, top-p, seeded.

Every request carries its own parameters as rows of small arrays, so one compiled program serves any mix of
greedy and sampled requests. A request's random key is derived from its seed and the position being
sampled, so its samples do not depend on which other requests share the batch.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        # The step holds these as float32 / int32 / uint32 rows: refuse what would not survive the cast.
        if not (0.0 <= self.temperature <= FLOAT32_MAX):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (isinstance(self.top_k, (int, np.integer)) and 0 <= self.top_k <= INT32_MAX):
            raise ValueError(f"top_k must be an integer in [0, {INT32_MAX}], got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= int(self.seed) < 2**32:
            raise ValueError(f"seed must be in [0, 2^32), got {self.seed}")

    def row(self) -> tuple[np.float32, np.int32, np.float32, np.uint32]:
        """This request's row of a SamplingBatch (raises if a value does not fit its dtype)."""
        return (np.float32(self.temperature), np.int32(self.top_k), np.float32(self.top_p),
                np.uint32(0 if self.seed is None else self.seed))


@flax.struct.dataclass
class SamplingBatch:
    """Rows of per-request parameters, padded to the batch bucket."""

    temperature: Array  # [B] float32
    top_k: Array  # [B] int32
    top_p: Array  # [B] float32
    seed: Array  # [B] uint32

    @staticmethod
    def from_params(params: list[SamplingParams], batch: int) -> "SamplingBatch":
        return SamplingBatch.from_rows([p.row() for p in params], batch)

    @staticmethod
    def from_rows(rows: list[tuple], batch: int) -> "SamplingBatch":
        """From `SamplingParams.row()`s (built one request at a time, so that one bad request fails alone)."""
        rows = list(rows) + [SamplingParams().row()] * (batch - len(rows))
        temperature, top_k, top_p, seed = zip(*rows) if rows else ((), (), (), ())
        return SamplingBatch(
            temperature=np.array(temperature, np.float32),
            top_k=np.array(top_k, np.int32),
            top_p=np.array(top_p, np.float32),
            seed=np.array(seed, np.uint32),
        )

    @staticmethod
    def abstract(batch: int, sharding=None) -> "SamplingBatch":
        """The shapes of a batch of `batch` rows (jax.ShapeDtypeStruct leaves, with `sharding`)."""
        def sds(dtype):
            return jax.ShapeDtypeStruct((batch,), dtype, sharding=sharding)

        return SamplingBatch(temperature=sds(jnp.float32), top_k=sds(jnp.int32), top_p=sds(jnp.float32),
                             seed=sds(jnp.uint32))


def filter_logits(logits: Array, top_k: Array, top_p: Array) -> Array:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. logits [B, V] float32.

    The nucleus keeps the smallest set of highest-probability tokens whose mass reaches top_p (the token that
    crosses the threshold included), computed after top-k, as in transformers' TopK then TopP warpers.
    """
    B, V = logits.shape
    order = jnp.argsort(-logits, axis=-1)  # stable: ties keep vocabulary order
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    rank = jnp.arange(V, dtype=jnp.int32)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (rank == 0)
    # Back to vocabulary order through the permutation itself: one scatter pass, where inverting `order` would be
    # a second sort of the whole vocabulary (0.7-1.0 ms of E2B's sampled speculative step at B = 16 on the H200:
    # `benchmarks/bench_spec.py --models e2b --batch 16 --sampled`).
    kept = jnp.zeros((B, V), jnp.bool_).at[jnp.arange(B)[:, None], order].set(keep, unique_indices=True)
    return jnp.where(kept, logits, -jnp.inf)


def request_keys(seed: Array, position: Array) -> Array:
    """One PRNG key per row from (request seed, position of the token being sampled)."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seed, position)


def sample(logits: Array, params: SamplingBatch, position: Array, *, sampled: bool = True) -> Array:
    """Next token per row [B] int32: argmax where temperature == 0, else a draw from the filtered softmax.

    `sampled` is static, decided on the host from the batch's rows: False when every row is greedy (the argmax
    alone: the vocabulary sort costs real time at V = 262144), True when some row samples. A `lax.cond` on the
    rows' temperatures would decide the same on the device, but XLA's GPU runtime copies a conditional's
    predicate to the host and holds the dispatching thread until the device gets there, which stalls the next
    step's dispatch behind this one."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampled:
        return greedy
    temp = jnp.where(params.temperature > 0, params.temperature, 1.0)
    filtered = filter_logits(logits / temp[:, None], params.top_k, params.top_p)
    keys = request_keys(params.seed, position)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filtered).astype(jnp.int32)
    return jnp.where(params.temperature > 0, drawn, greedy)


def any_sampled(rows: list[tuple]) -> bool:
    """Whether some row (a `SamplingParams.row()`) samples: which program variant a step runs (`sample`)."""
    return any(row[0] > 0 for row in rows)
