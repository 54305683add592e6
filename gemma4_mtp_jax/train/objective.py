"""The assistant's training objective: draft rounds exactly as the speculative step runs them, scored against the
frozen target.

A round at bonus position P (docs/DESIGN.md conventions 1-2, `speculative.draft`): the committed tokens are 0..P-1,
whose K/V the assistant reads through `DraftKV` (full layers: keys 0..P-1; sliding: P-1-W..P-1); the newest token
x_P is fed at query position P for all k steps; step 1 gets h = the target's post-norm hidden at P-1, step j > 1
gets the previous step's post_projection output and the previous step's own greedy draft. Draft j proposes token
P+j, so its teacher is the target's distribution at position P+j-1:

    loss_j = KL(p_target(. | x_<=P+j-1) || q_j) + ce_weight * (-log q_j(argmax p_target))
    loss   = sum_j w_j loss_j / sum_j w_j,     w_j = step_decay^(j-1)

averaged over the (sequence, P) pairs of a batch. Many P per sequence share one target forward: the assistant is
vmapped over the pairs of a sequence with that sequence's K/V unbatched, so the K/V are never copied per pair.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gemma4_mtp_jax.model.assistant import Gemma4Assistant
from gemma4_mtp_jax.model.attention import DraftKV
from gemma4_mtp_jax.model.target import Gemma4Target

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Objective:
    """The hyperparameters of the loss (what a checkpoint's loss values mean)."""

    k: int  # draft steps per round
    step_decay: float = 0.8  # weight of step j is step_decay^(j-1)
    ce_weight: float = 1.0  # weight of the cross-entropy on the target's greedy token, beside the KL (weight 1)

    def step_weights(self) -> Array:
        return self.step_decay ** jnp.arange(self.k, dtype=jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetPass:
    """What the frozen target provides for a batch of sequences (no gradient flows into any of it)."""

    hidden: Array  # [B, T, H] post-final-norm hidden states
    store_kv: dict[str, tuple[Array, Array]]  # layer type -> (K, V) [B, T, nKV, D] of the store layers


def target_pass(target: Gemma4Target, params_t, tokens: Array) -> TargetPass:
    """The target's forward on tokens [B, T] (positions 0..T-1) in its own dtype, logits skipped."""
    params_t = jax.lax.stop_gradient(params_t)  # frozen
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    _, hidden, kv = target.apply({"params": params_t}, tokens, positions, logits=False)
    store = {t: kv.layers[i] for t, i in target.cfg.store_layers.items()}
    return jax.lax.stop_gradient(TargetPass(hidden, store))


def target_log_probs(target: Gemma4Target, params_t, tp: TargetPass, positions: Array, k: int) -> Array:
    """log p_target at positions P+j-1 for j = 1..k: [B, N, k, V] float32 (positions [B, N], clipped into the
    sequence; pairs whose positions fall outside are masked by the caller)."""
    params_t = jax.lax.stop_gradient(params_t)  # frozen
    B, N = positions.shape
    T = tp.hidden.shape[1]
    at = jnp.clip(positions[..., None] + jnp.arange(k)[None, None, :], 0, T - 1).reshape(B, N * k)
    h = jnp.take_along_axis(tp.hidden, at[..., None], axis=1)  # [B, N*k, H]
    logits = target.apply({"params": params_t}, h, method=Gemma4Target.lm_logits)
    return jax.lax.stop_gradient(jax.nn.log_softmax(logits.astype(jnp.float32), -1)).reshape(B, N, k, -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drafts:
    log_q: Array  # [B, N, k, V] float32: the draft distributions
    tokens: Array  # [B, N, k] int32: the greedy drafts (what the served step feeds back and verifies)
    hn: Array  # [B, N, k, Ha]: the normed draft hiddens the logits come from


def draft_rounds(
    assistant: Gemma4Assistant,
    target: Gemma4Target,
    params_a,
    params_t,
    tokens: Array,
    tp: TargetPass,
    positions: Array,
    k: int,
    suppress: Array | None = None,
) -> Drafts:
    """k greedy draft steps for every bonus position P in positions [B, N] of the sequences tokens [B, T].

    `suppress` [V] bool (canonical order): tokens the served step never drafts (the assistant's generation_config
    `suppress_tokens`); they are excluded from the fed-back argmax, as in `speculative.draft`.
    """
    acfg = assistant.cfg
    params_t = jax.lax.stop_gradient(params_t)  # frozen: not even the embedding of fed-back drafts learns
    compute = tp.hidden.dtype  # the dtype served: the assistant computes in its input's dtype
    by_layer = {i: tuple(a.astype(compute) for a in tp.store_kv[t]) for i, t in enumerate(acfg.text.layer_types)}
    embed = lambda tok: target.apply({"params": params_t}, tok, method=Gemma4Target.embed)  # noqa: E731

    def step(emb: Array, h: Array, lengths: Array) -> tuple[Array, Array]:  # one (sequence-batch) draft step
        return assistant.apply({"params": params_a}, emb, h, DraftKV(by_layer, lengths))

    # vmapped over the N pairs of each sequence; by_layer is shared (unbatched) by all of them
    step_pairs = jax.vmap(step, in_axes=(1, 1, 1), out_axes=1)
    tok = jnp.take_along_axis(tokens, positions, axis=1)  # [B, N] the bonus token x_P
    h = jnp.take_along_axis(tp.hidden, jnp.maximum(positions - 1, 0)[..., None], axis=1)  # [B, N, H] at P-1
    log_qs, drafts, hns = [], [], []
    for _ in range(k):
        hn, h = step_pairs(embed(tok), h, positions)
        # the heads take [rows, Ha] (the centroid head selects clusters per row)
        logits = assistant.apply({"params": params_a}, hn.reshape(-1, hn.shape[-1]), method=Gemma4Assistant.logits)
        logits = logits.reshape(*hn.shape[:-1], -1).astype(jnp.float32)
        log_qs.append(jax.nn.log_softmax(logits, -1))
        greedy = logits if suppress is None else jnp.where(suppress, -jnp.inf, logits)
        tok = jax.lax.stop_gradient(jnp.argmax(greedy, -1).astype(jnp.int32))
        drafts.append(tok)
        hns.append(hn)
    return Drafts(jnp.stack(log_qs, 2), jnp.stack(drafts, 2), jnp.stack(hns, 2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundStats:
    """Sums over the valid pairs of a batch (divide by `pairs` for means)."""

    pairs: Array  # [] number of valid (sequence, P) pairs
    kl: Array  # [k] sum of KL(p_target || q_j)
    ce: Array  # [k] sum of -log q_j(target's greedy token)
    accepted_prefix: Array  # [k] pairs whose first j greedy drafts all equal the target's greedy tokens
    loss: Array  # [] sum of the per-pair weighted loss


def round_stats(objective: Objective, log_p: Array, drafts: Drafts, valid: Array) -> RoundStats:
    """Per-step KL, cross-entropy and greedy acceptance of the drafts against the target, summed over valid pairs.

    Acceptance is the served greedy rule (`speculative.accept`): draft j counts iff drafts 1..j all equal the
    target's argmax. It is exact where the sequence's tokens after P are the target's own greedy tokens (then an
    accepted draft is the token the target actually saw at that position)."""
    p = jnp.exp(log_p)
    kl = jnp.sum(p * (log_p - drafts.log_q), -1)  # [B, N, k]
    greedy_t = jnp.argmax(log_p, -1)
    ce = -jnp.take_along_axis(drafts.log_q, greedy_t[..., None], -1)[..., 0]
    w = objective.step_weights()
    per_pair = jnp.sum(w * (kl + objective.ce_weight * ce), -1) / jnp.sum(w)  # [B, N]
    v = valid.astype(jnp.float32)
    hit = jnp.cumprod((drafts.tokens == greedy_t).astype(jnp.float32), -1)
    sum_pairs = lambda x: jnp.sum(x * v[..., None], (0, 1))  # noqa: E731
    return RoundStats(jnp.sum(v), sum_pairs(kl), sum_pairs(ce), sum_pairs(hit), jnp.sum(per_pair * v))


def round_loss(
    objective: Objective,
    assistant: Gemma4Assistant,
    target: Gemma4Target,
    params_a,
    params_t,
    tokens: Array,
    tp: TargetPass,
    positions: Array,
    valid: Array,
    suppress: Array | None = None,
) -> tuple[Array, RoundStats]:
    """The training loss (mean over valid pairs) and its statistics; differentiable in params_a only."""
    log_p = target_log_probs(target, params_t, tp, positions, objective.k)
    drafts = draft_rounds(assistant, target, params_a, params_t, tokens, tp, positions, objective.k, suppress)
    stats = round_stats(objective, log_p, drafts, valid)
    return stats.loss / jnp.maximum(stats.pairs, 1.0), stats


def valid_positions(lengths: Array, T: int, k: int, first: Array | int = 1) -> Array:
    """[B, T] bool: bonus positions P with a full round inside the sequence: first <= P and P+k-1 <= length-1
    (P >= 1 always: step 1 needs the hidden at P-1)."""
    P = jnp.arange(T)[None, :]
    first = jnp.maximum(jnp.asarray(first), 1)
    first = first[:, None] if jnp.ndim(first) else first
    return (P >= first) & (P <= lengths[:, None] - k)


def sample_positions(key: Array, lengths: Array, T: int, n: int, k: int) -> tuple[Array, Array]:
    """n distinct bonus positions per sequence, uniformly among its valid ones: (positions [B, n], valid [B, n]).
    Sequences with fewer than n valid positions get all of them, padded with masked entries."""
    ok = valid_positions(lengths, T, k)
    scores = jnp.where(ok, jax.random.uniform(key, ok.shape), -1.0)
    top, positions = jax.lax.top_k(scores, n)
    return positions.astype(jnp.int32), top >= 0.0
