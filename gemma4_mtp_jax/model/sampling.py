"""Per-request sampling inside the jitted step: greedy, temperature, top-k, top-p, min-p, seeded; and the logits
processing that depends on a request's history (penalties, logit bias, min_tokens, allowed tokens) and its
logprobs.

Every request carries its own parameters as rows of small arrays, so one compiled program serves any mix of
greedy and sampled requests. A request's random key is derived from its seed and the position being
sampled, so its samples do not depend on which other requests share the batch.

Processing is a function of the logits at a position and the tokens before it (`process_logits`), so a verify
forward applies it at each of its k+1 positions exactly as k+1 decode steps would: speculation stays lossless.
Programs of the "processed" variant (`ProcessingBatch` among their inputs) run it; the others skip it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_TOP_LOGPROBS = 20  # alternatives per position a processed program returns (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request: a fixed row width in every processed step's inputs
MAX_BIAS = 100.0  # |logit_bias| values, as OpenAI bounds them
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, and repetition_penalty's upper bound (OpenAI, vLLM)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off; min_p 0 = off.

    Processing (any of these away from its default puts the request in the processed programs):
    presence_penalty / frequency_penalty subtract from the logits of tokens the request has output (once, or per
    occurrence), repetition_penalty divides positive (multiplies negative) logits of tokens in its prompt or output,
    logit_bias adds to given tokens, min_tokens bans the stop ids until that many tokens are out, allowed_token_ids
    and bad_token_ids restrict the vocabulary, and logprobs (0..MAX_TOP_LOGPROBS) returns each emitted token's
    log-probability with that many alternatives."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob (raw model) and this many top alternatives

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
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= MAX_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_PENALTY}], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ValueError(f"logit_bias of token {token} must be in [-{MAX_BIAS}, {MAX_BIAS}], got {bias}")
        if not (isinstance(self.min_tokens, (int, np.integer)) and 0 <= self.min_tokens <= INT32_MAX):
            raise ValueError(f"min_tokens must be an integer in [0, {INT32_MAX}], got {self.min_tokens}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {getattr(self, name)}")

    @property
    def processed(self) -> bool:
        """Whether the request needs the processed programs (anything beyond temperature, top-k and top-p)."""
        return (self.min_p > 0 or self.uses_history or bool(self.logit_bias) or self.min_tokens > 0
                or self.allowed_token_ids is not None or bool(self.bad_token_ids) or self.logprobs is not None)

    @property
    def uses_history(self) -> bool:
        """Whether its logits depend on the tokens before them (penalties): the device counts them for it."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def token_ids(self) -> list[int]:
        """Every token id the request names (logit_bias, allowed and bad tokens): for range checks."""
        return ([t for t, _ in self.logit_bias] + list(self.allowed_token_ids or ()) + list(self.bad_token_ids))

    def allowed_mask(self, vocab_size: int) -> np.ndarray:
        """The tokens it may emit as a bitmask [ceil(V/32)] int32 (bit j of word i: token 32i+j; bits past V 0)."""
        if self.allowed_token_ids is None and not self.bad_token_ids:
            return _every_token(vocab_size)  # most requests: built once per vocabulary, not per request
        allowed = np.zeros((mask_words(vocab_size) * 32,), bool)
        if self.allowed_token_ids is None:
            allowed[:vocab_size] = True
        else:
            allowed[list(self.allowed_token_ids)] = True
        allowed[list(self.bad_token_ids)] = False
        return pack_bits(allowed)

    def processing_row(self, prompt_len: int) -> dict:
        """Its ProcessingBatch row (for a request with `prompt_len` prompt tokens)."""
        ids = np.full((MAX_LOGIT_BIAS,), -1, np.int32)
        values = np.zeros((MAX_LOGIT_BIAS,), np.float32)
        for i, (token, bias) in enumerate(self.logit_bias):
            ids[i], values[i] = token, bias
        return dict(min_p=self.min_p, presence=self.presence_penalty, frequency=self.frequency_penalty,
                    repetition=self.repetition_penalty, min_tokens=self.min_tokens, prompt_len=prompt_len,
                    bias_ids=ids, bias_values=values)

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


def filter_logits(logits: Array, top_k: Array, top_p: Array, min_p: Array | None = None) -> Array:
    """Mask (to -inf) tokens outside each row's min-p set, top-k and top-p nucleus. logits [B, V] float32.

    min-p keeps the tokens whose probability is at least min_p times the most likely one's (applied first, as in
    vLLM). The nucleus keeps the smallest set of highest-probability tokens whose mass reaches top_p (the token that
    crosses the threshold included), computed after top-k, as in transformers' TopK then TopP warpers.
    """
    B, V = logits.shape
    if min_p is not None:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); min_p 0 keeps everything.
        floor = jnp.max(logits, -1, keepdims=True) + jnp.log(min_p)[:, None]
        logits = jnp.where(logits >= floor, logits, -jnp.inf)
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


@functools.lru_cache(maxsize=4)
def _every_token(vocab_size: int) -> np.ndarray:
    """The bitmask of a whole vocabulary (read-only: shared by the requests that restrict nothing)."""
    allowed = np.zeros((mask_words(vocab_size) * 32,), bool)
    allowed[:vocab_size] = True
    mask = pack_bits(allowed)
    mask.setflags(write=False)
    return mask


def mask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask over the vocabulary."""
    return -(-vocab_size // 32)


def pack_bits(allowed: np.ndarray) -> np.ndarray:
    """A boolean vector [32 n] as a bitmask [n] int32 (bit j of word i: entry 32i+j)."""
    bits = allowed.reshape(-1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return bits.sum(1).astype(np.uint32).view(np.int32)


def unpack_bits(words: Array, vocab_size: int) -> Array:
    """A bitmask [..., W] int32 as booleans [..., V] (inside a program)."""
    v = jnp.arange(vocab_size, dtype=jnp.int32)
    return (jnp.right_shift(jnp.take(words, v // 32, axis=-1), v % 32) & 1) != 0


def process_logits(logits: Array, rows: Any, history: Any, stop_ids: Array, positions: Array,
                   inputs: Array | None = None) -> Array:
    """A request's processing of its logits at T consecutive positions. logits [B, T, V] float32; `rows` a
    ProcessingRows (penalties, bias, min_tokens, prompt_len per row); `history` a device_state.History: counts
    [B, V] int32, the request's output tokens before the first position's input, seen [B, V], its prompt's tokens,
    and allowed [B, V], the tokens it may emit; stop_ids [B, S] (-1 = none): what min_tokens bans; positions [B, T]:
    where each position's input token sits (the sampled token goes at position + 1); inputs [B, T]: those input
    tokens, which are output tokens and count before their position is processed (None: nothing new counts, as for
    a prompt's last token at the end of a prefill).

    In vLLM's order: allowed tokens (and at the first M positions the grammar's: `rows.mask`, bitmasks [B, M, W]),
    logit bias, min_tokens, then the repetition penalty (prompt and output tokens) and the frequency and presence
    penalties (output tokens). Returns the processed logits [B, T, V]; temperature, min-p, top-k and top-p come
    after (`filter_logits`)."""
    B, T, V = logits.shape
    vocab = jnp.arange(V, dtype=jnp.int32)
    b = jnp.arange(B)[:, None]
    counts, may, in_prompt = history.counts, history.allowed, history.seen
    ids = rows.bias_ids
    bias = jnp.zeros((B, V), jnp.float32).at[b, jnp.maximum(ids, 0)].add(jnp.where(ids >= 0, rows.bias_values, 0.0))
    is_stop = jnp.zeros((B, V), bool).at[b, jnp.maximum(stop_ids, 0)].max(stop_ids >= 0)
    rep = rows.repetition[:, None]
    out = []
    for j in range(T):
        if inputs is not None:
            counts = counts + (vocab[None, :] == inputs[:, j:j + 1]).astype(jnp.int32)
        grammar = unpack_bits(rows.mask[:, j], V) if j < rows.mask.shape[1] else True
        logit = jnp.where(may & grammar, logits[:, j], -jnp.inf) + bias
        too_early = (positions[:, j] + 1 - rows.prompt_len) < rows.min_tokens  # the sampled token's output index
        logit = jnp.where(is_stop & too_early[:, None], -jnp.inf, logit)
        logit = jnp.where(in_prompt | (counts > 0), jnp.where(logit > 0, logit / rep, logit * rep), logit)
        logit = logit - rows.frequency[:, None] * counts - rows.presence[:, None] * (counts > 0)
        out.append(logit)
    return jnp.stack(out, 1)


def top_logprobs_count(vocab_size: int) -> int:
    """Alternatives per position a processed program returns."""
    return min(MAX_TOP_LOGPROBS, vocab_size)


def token_logprobs(processed: Array, temperature: Array, tokens: Array) -> tuple[Array, Array, Array]:
    """Log-probabilities of the target's distribution after processing, at each row's temperature (1 for greedy
    rows), before min-p/top-k/top-p truncation. processed [B, T, V], tokens [B, T] (-1: none). Returns (the
    tokens' logprobs [B, T], the top ids [B, T, K] and their logprobs [B, T, K], K = top_logprobs_count(V))."""
    temp = jnp.where(temperature > 0, temperature, 1.0)
    lp = jax.nn.log_softmax(processed / temp[:, None, None], -1)
    chosen = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[..., None], -1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lp, top_logprobs_count(processed.shape[-1]))
    return chosen, top_ids.astype(jnp.int32), top_lp


def request_keys(seed: Array, position: Array) -> Array:
    """One PRNG key per row from (request seed, position of the token being sampled)."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seed, position)


def sample(logits: Array, params: SamplingBatch, position: Array, *, sampled: bool = True,
           min_p: Array | None = None) -> Array:
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
    filtered = filter_logits(logits / temp[:, None], params.top_k, params.top_p, min_p)
    keys = request_keys(params.seed, position)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, filtered).astype(jnp.int32)
    return jnp.where(params.temperature > 0, drawn, greedy)


def any_sampled(rows: list[tuple]) -> bool:
    """Whether some row (a `SamplingParams.row()`) samples: which program variant a step runs (`sample`)."""
    return any(row[0] > 0 for row in rows)
