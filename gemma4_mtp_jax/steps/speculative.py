"""The speculative step: k draft steps of the assistant, the target's verify forward on k+1 tokens, exact
acceptance, and the bookkeeping for the next round — one XLA program per batch bucket.

Per sequence the step starts from P committed tokens (K/V of positions 0..P-1 in the pages), the newest token
t (position P, not yet written) and h, the target's post-norm hidden at P-1. The assistant drafts d_1..d_k at
the constant query position P from the committed K/V only (docs/DESIGN.md conventions 1-2); the target runs on
[t, d_1..d_k] at positions P..P+k, writing their K/V. With n drafts accepted, the sequence gains d_1..d_n and a
bonus token; the next round starts from P' = P+n+1 and h' = the target hidden at P+n. Nothing depends on n
but data (convention 4): K/V written for rejected drafts lies beyond P' and is overwritten later.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from gemma4_mtp_jax.model.config import SLIDING, AssistantConfig, TextConfig
from gemma4_mtp_jax.steps.device_state import History, StepInputs, pack_logprobs
from gemma4_mtp_jax.steps.forward import StepSpec, forward_paged, lm_logits
from gemma4_mtp_jax.kernels.centroid_head import centroid_head
from gemma4_mtp_jax.model.kv_state import PagedDraftKV
from gemma4_mtp_jax.model.assistant import Gemma4Assistant
from gemma4_mtp_jax.model.target import Gemma4Target
from gemma4_mtp_jax.model.traced import traced_once
from gemma4_mtp_jax.model.runtime import Assistant, shapes_only
from gemma4_mtp_jax.model.sampling import SamplingBatch, filter_logits, process_logits, token_logprobs

Array = jax.Array
_NEG = -jnp.inf


@flax.struct.dataclass
class DraftHead:
    """What the draft loop needs of the assistant's head beyond its parameters: the suppressed tokens."""

    suppress: Array | None  # [V] bool: canonical order (dense head) or row order (centroid head)


def make_draft_head(assistant: Assistant) -> DraftHead:
    """The head's suppressed tokens as a mask; its shape alone for an assistant of shapes alone (compile_ahead)."""
    ids = assistant.generation_config.get("suppress_tokens") or []
    if not ids:
        return DraftHead(None)
    V = assistant.config.text.vocab_size

    def suppress(params: dict) -> Array:
        mask = jnp.zeros((V,), bool).at[jnp.asarray(ids, jnp.int32)].set(True)
        if assistant.config.use_ordered_embeddings:
            mask = mask[params["masked_embedding"]["token_ordering"]]  # row order
        return mask

    if shapes_only(assistant.params):
        return DraftHead(jax.eval_shape(suppress, assistant.params))
    return DraftHead(suppress(assistant.params))


def _key_for(seed: Array, position: Array, stream: int) -> Array:
    """Per-row keys from (request seed, round position, stream): independent of the batch's composition."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), p), stream))(seed, position)


def _draft_tokens(assistant: Assistant, params_a, head: DraftHead, hn: Array, sampling: SamplingBatch,
                  sampled_rows: Array, key_position: Array, step: Array | int, attention_impl: str,
                  sampled: bool) -> tuple[Array, Array, Array | None]:
    """One draft per row from the normed draft hidden hn [B, Ha]: (token [B], q [B, N], candidate ids [B, N]).

    q is the distribution a sampled row's draft was drawn from, over N candidates: the centroid head's
    top_k * V / C tokens (ids: their canonical ids), or the whole vocabulary for the dense head (ids None: the
    vocabulary in order). Greedy rows take the argmax and get q = 0. Everything that only sampling needs (the
    sparse logits, the top-k/top-p filter, the draw, the softmax) is traced only when `sampled` (static, decided
    on the host: some row samples; see `sampling.sample`): a greedy batch launches the head's argmax alone."""
    cfg = assistant.config
    B = hn.shape[0]
    temp = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)

    def draw(logits: Array, ids: Array | None) -> tuple[Array, Array]:
        filtered = filter_logits(logits / temp[:, None], sampling.top_k, sampling.top_p)
        pick = jax.vmap(jax.random.categorical)(_key_for(sampling.seed, key_position, 1 + step), filtered)
        pick = jnp.where(sampled_rows, pick, jnp.argmax(logits, -1))
        token = pick if ids is None else jnp.take_along_axis(ids, pick[:, None], 1)[:, 0]
        q = jnp.where(sampled_rows[:, None], jax.nn.softmax(filtered, -1), 0.0)
        return token.astype(jnp.int32), q

    if cfg.use_ordered_embeddings:
        me = params_a["masked_embedding"]
        impl = "xla" if attention_impl == "xla" else "auto"
        head_args = (hn, me["centroids"]["weight"], me["ordered_embedding"], me["token_ordering"], cfg.centroid_top_k,
                     head.suppress)
        n = cfg.centroid_top_k * (cfg.text.vocab_size // cfg.num_centroids)

        if not sampled:  # the fused gather-dot + argmax kernel; no distribution is needed
            token, _ = centroid_head(*head_args, mode="argmax", impl=impl)
            return token.astype(jnp.int32), jnp.zeros((B, n), jnp.float32), jnp.zeros((B, n), jnp.int32)
        logits, ids = centroid_head(*head_args, mode="sparse", impl=impl)
        return (*draw(logits.astype(jnp.float32), ids), ids)
    logits = assistant.module.apply({"params": params_a}, hn, method=Gemma4Assistant.logits)
    if head.suppress is not None:
        logits = jnp.where(head.suppress, _NEG, logits)
    logits = logits.astype(jnp.float32)
    if not sampled:
        return jnp.argmax(logits, -1).astype(jnp.int32), jnp.zeros(logits.shape, jnp.float32), None
    token, q = draw(logits, None)
    return token, q, None


def q_at(q: Array, q_ids: Array | None, tokens: Array) -> Array:
    """q [..., N] (over candidates q_ids [..., N], or the whole vocabulary if None) at tokens [...]."""
    if q_ids is None:
        return jnp.take_along_axis(q, tokens[..., None], -1)[..., 0]
    return jnp.sum(jnp.where(q_ids == tokens[..., None], q, 0.0), -1)  # a row's candidates are distinct tokens


def dense_q(q: Array, q_ids: Array | None, vocab_size: int) -> Array:
    """q [..., N] over candidates q_ids [..., N] as a distribution over the vocabulary [..., V]."""
    if q_ids is None:
        return q
    lead, n = q.shape[:-1], q.shape[-1]
    rows = q.reshape(-1, n)
    out = jnp.zeros((rows.shape[0], vocab_size), q.dtype).at[jnp.arange(rows.shape[0])[:, None],
                                                             q_ids.reshape(-1, n)].set(rows)
    return out.reshape(*lead, vocab_size)


def draft_sources(target: TextConfig, assistant: AssistantConfig) -> dict[int, int]:
    """Assistant layer -> the target's store layer of its type, whose pages it attends to."""
    return {i: target.store_layers[t] for i, t in enumerate(assistant.text.layer_types)}


def draft(spec: StepSpec, params_t, params_d, pages, hidden: Array,
          inputs: StepInputs) -> tuple[Array, Array, Array | None, Array]:
    """spec.k draft steps of the assistant (`spec.drafter`, an AssistantDrafter; params_d: its parameters and
    DraftHead) for rows whose newest token `inputs.rows.token` sits at position `inputs.rows.length` (P), with the
    target's hidden at P-1 in `hidden` [B, H]. Returns drafts [B, k], q [B, k, N] and its candidate ids [B, k, N] or
    None (see `_draft_tokens`; zeros for greedy rows, whose drafts are the argmax), and the normed draft hiddens
    [B, k, Ha]."""
    target, assistant, layout, attention_impl = spec.target, spec.drafter.assistant, spec.layout, spec.attention_impl
    params_a, head = params_d
    acfg = assistant.config
    lengths, sampling = inputs.rows.length, inputs.sampling
    source = draft_sources(target.config, acfg)
    kv = PagedDraftKV(pages=pages, tables=inputs.tables, lengths=lengths, source=source,
                      layer_group=dict(enumerate(acfg.text.layer_types)),
                      ring_pages=layout.ring_pages(SLIDING) if SLIDING in dict(layout.pages_per_seq) else None,
                      attention_impl=attention_impl, scales=layout.kv_scales())
    sampled_rows = sampling.temperature > 0

    def build():
        def draft_step(params_t, params_a, head, kv, sampling, sampled_rows, lengths, tok, h, s):
            emb = target.module.apply({"params": params_t}, tok, method=Gemma4Target.embed)
            hn, h = assistant.module.apply({"params": params_a}, emb, h, kv)
            tok, q, q_ids = _draft_tokens(assistant, params_a, head, hn, sampling, sampled_rows, lengths, s,
                                          attention_impl, spec.sampled)
            return tok, h, q, q_ids, hn

        return draft_step

    # The k steps share one trace: the step index (the draws' random stream) is an argument, not a constant.
    step = traced_once((target, assistant), ("draft_step", attention_impl, spec.sampled), build)
    tok, h = inputs.rows.token, hidden
    drafts, qs, ids, hns = [], [], [], []
    for s in range(spec.k):
        tok, h, q, q_ids, hn = step(params_t, params_a, head, kv, sampling, sampled_rows, lengths, tok, h,
                                    jnp.int32(s))
        drafts.append(tok)
        qs.append(q)
        ids.append(q_ids)
        hns.append(hn)
    q_ids = None if ids[0] is None else jnp.stack(ids, 1)
    return jnp.stack(drafts, 1), jnp.stack(qs, 1), q_ids, jnp.stack(hns, 1)


class Drafter(Protocol):
    """What proposes a round's k drafts inside the speculative program. The engine takes one as a component:
    `AssistantDrafter` (the MTP assistant) by default; anything else that drafts from the same inputs plugs in."""

    def params(self) -> Any:
        """The device arrays the drafter reads: an input of the compiled program (a pytree; () for none)."""

    def draft(self, spec: StepSpec, params_t, params_d, pages, hidden: Array,
              inputs: StepInputs) -> tuple[Array, Array, Array | None]:
        """spec.k drafts [B, k] int32 for rows whose newest token `inputs.rows.token` sits at position
        `inputs.rows.length` (the committed K/V in `pages`, the target's hidden at P-1 in `hidden`), and the
        distribution each draft was sampled from (exact verification needs it; zeros on greedy rows): q [B, k, N]
        over candidate ids [B, k, N], or over the whole vocabulary in order (N = V, ids None). `spec.sampled`:
        whether some row samples; when False every row is greedy and q may be all zeros."""


@dataclasses.dataclass(frozen=True)
class AssistantDrafter:
    """The MTP assistant drafts (`draft`), reading its parameters and its head's suppressed tokens."""

    assistant: Assistant

    def params(self) -> tuple[dict, DraftHead]:
        return self.assistant.params, make_draft_head(self.assistant)

    def kv_layers(self, target: TextConfig) -> set[int]:
        """The target's owning layers whose pages the draft steps read."""
        return set(draft_sources(target, self.assistant.config).values())

    def draft(self, spec: StepSpec, params_t, params_d, pages, hidden: Array,
              inputs: StepInputs) -> tuple[Array, Array, Array | None]:
        drafts, q, q_ids, _ = draft(spec, params_t, params_d, pages, hidden, inputs)
        return drafts, q, q_ids


def accept(drafts: Array, q: Array, q_ids: Array | None, target_logits: Array, sampling: SamplingBatch,
           spec_on: Array, positions: Array, sampled: bool = True,
           min_p: Array | None = None) -> tuple[Array, Array]:
    """Exact verification (docs/DESIGN.md convention 3). drafts [B, k], target_logits [B, k+1, V], q [B, k, N] the
    draft distributions over candidate ids q_ids [B, k, N] (None: N = V, the vocabulary in order).

    Greedy rows: the longest prefix of drafts equal to the target's argmax, then the target's token there.
    Sampled rows: accept d_j with probability min(1, p_j(d_j)/q_j(d_j)); at the first rejection draw from
    normalize(max(p_j - q_j, 0)); if all are accepted draw the bonus from p_k. p is the target's distribution
    at the request's temperature/min-p/top-k/top-p (the processed variant's logits arrive processed:
    sampling.process_logits). Rows with
    spec_on = False accept nothing. Returns (emitted tokens [B, k+1], -1 after the bonus; n accepted [B]).
    `sampled` (static): whether some row samples; when False only the greedy rule is traced.
    """
    B, k = drafts.shape
    logits = target_logits.astype(jnp.float32)
    greedy_rows = sampling.temperature <= 0
    argmax = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, k+1]
    n_greedy = jnp.sum(jnp.cumprod(drafts == argmax[:, :k], axis=1), axis=1)

    def sampled_path():
        temp = jnp.where(greedy_rows, 1.0, sampling.temperature)
        flat = logits.reshape(B * (k + 1), -1) / jnp.repeat(temp, k + 1)[:, None]
        flat = filter_logits(flat, jnp.repeat(sampling.top_k, k + 1), jnp.repeat(sampling.top_p, k + 1),
                             None if min_p is None else jnp.repeat(min_p, k + 1))
        p = jax.nn.softmax(flat, -1).reshape(B, k + 1, -1)
        p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]
        q_d = q_at(q, q_ids, drafts)
        u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(_key_for(sampling.seed, positions, 100))
        ok = u * q_d < p_d  # u < p/q without dividing; q_d > 0 for a draft sampled from q
        n = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)
        n = jnp.where(spec_on, n, 0)
        rows = jnp.arange(B)
        p_n = p[rows, n]
        if k == 0:  # no draft: the token comes from p alone
            q_n = jnp.zeros_like(p_n)
        else:
            m = jnp.minimum(n, k - 1)
            q_m = dense_q(q[rows, m], None if q_ids is None else q_ids[rows, m], p.shape[-1])
            q_n = jnp.where((spec_on & (n < k))[:, None], q_m, 0.0)
        residual = jnp.maximum(p_n - q_n, 0.0)
        residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_n)
        bonus = jax.vmap(jax.random.categorical)(_key_for(sampling.seed, positions, 101), jnp.log(residual))
        return n, bonus.astype(jnp.int32)

    if sampled:
        n_s, bonus_s = sampled_path()
    else:
        n_s, bonus_s = jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32)
    n = jnp.where(spec_on, jnp.where(greedy_rows, n_greedy, n_s), 0).astype(jnp.int32)
    bonus = jnp.where(greedy_rows, argmax[jnp.arange(B), n], bonus_s)
    j = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], 1)
    emitted = jnp.where(j < n[:, None], padded, jnp.where(j == n[:, None], bonus[:, None], -1))
    return emitted, n


def speculative_step(spec: StepSpec, params_t, params_d, pages, hidden_buf: Array, inputs: StepInputs,
                     history: History | None = None) -> tuple[Any, Array, Array, Array, Array, Array | None]:
    """One round for B sequences: `inputs.rows` (StepRows, resolved: each row's newest token at its length; length
    < 0 marks padding) and their page tables and sampling rows. `hidden_buf` [slots+1, H] holds each sequence's h
    by slot; both it and the pages are donated and updated in place. The drafts come from `spec.drafter`
    (`AssistantDrafter` in production): `draft_round`, then `verify_round`.

    The processed variant (`spec.processed`, with the rows' `history`) processes the target's logits at each
    verified position as a decode step would there (its counts include the newest token and the drafts before
    it: sampling.process_logits), so acceptance stays exact, and returns the emitted tokens' logprobs.

    Returns (pages, hidden_buf, emitted [B, k+1]: the accepted drafts and the bonus, -1 after it, n accepted [B],
    the verified tokens [B, k+1] (the newest token and the drafts), the emitted tokens' logprob columns
    (device_state.pack_logprobs) or None); where the sequence's output stops is decided after, with the decode
    step's rule (device_state.finish_round)."""
    drafts, q, q_ids = draft_round(spec, params_t, params_d, pages, hidden_buf, inputs)
    return verify_round(spec, params_t, pages, hidden_buf, inputs, history, drafts, q, q_ids)


def draft_round(spec: StepSpec, params_t, params_d, pages, hidden_buf: Array,
                inputs: StepInputs) -> tuple[Array, Array, Array | None]:
    """A round's drafts [B, k], and the distributions they were drawn from (q over candidate ids q_ids, or None:
    the vocabulary), from `spec.drafter`; reads the pages and the hidden buffer, writes nothing. Run alone (a
    program of its own) when the host must see the drafts before the verify: a grammar's masks at the verified
    positions depend on them."""
    rows = inputs.rows
    if spec.k == 0:  # a round that only verifies the newest token: a decode step that also keeps h for the next
        B = rows.token.shape[0]
        return jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0, 1), jnp.float32), None
    P = jnp.where(rows.length >= 0, rows.length, 0)
    return spec.drafter.draft(spec, params_t, params_d, pages, hidden_buf[rows.slot],
                              inputs.replace(rows=rows.replace(length=P)))


def verify_round(spec: StepSpec, params_t, pages, hidden_buf: Array, inputs: StepInputs, history: History | None,
                 drafts: Array, q: Array, q_ids: Array | None) -> tuple[Any, Array, Array, Array, Array, Array | None]:
    """The target's forward on each row's newest token and its `drafts`, exact acceptance against q, and the next h
    in the hidden buffer: the rest of `speculative_step` (which returns what this returns)."""
    pages, h_all, logits = verify_forward(spec, params_t, pages, inputs, drafts)
    return (pages, *verify_accept(spec, hidden_buf, inputs, history, drafts, q, q_ids, h_all, logits))


def _verified(rows: Any, drafts: Array) -> tuple[Array, Array, Array, Array]:
    """(valid rows [B], each row's newest position P [B] (0 for padding), the verified tokens [B, k+1]: the newest
    token and the drafts, and their positions [B, k+1], -1 on padding rows)."""
    valid = rows.length >= 0
    P = jnp.where(valid, rows.length, 0)
    tokens = jnp.concatenate([rows.token[:, None], drafts], 1)
    positions = jnp.where(valid[:, None], P[:, None] + jnp.arange(drafts.shape[1] + 1)[None, :], -1)
    return valid, P, tokens, positions


def verify_forward(spec: StepSpec, params_t, pages, inputs: StepInputs, drafts: Array) -> tuple[Any, Array, Array]:
    """The verify's target forward: writes the K/V of each row's newest token and its `drafts` [B, k], and returns
    (pages, the post-norm hidden [B, k+1, H], the logits [B, k+1, V]). Run alone (a program of its own) when the
    host computes the grammar masks `verify_accept` applies while the device runs it."""
    _, _, tokens, positions = _verified(inputs.rows, drafts)
    h_all, pages = forward_paged(spec, params_t, pages, tokens, positions, inputs.tables)
    return pages, h_all, lm_logits(spec.target, params_t, h_all, whole=spec.sampled or spec.processed)


def verify_accept(spec: StepSpec, hidden_buf: Array, inputs: StepInputs, history: History | None, drafts: Array,
                  q: Array, q_ids: Array | None, h_all: Array,
                  logits: Array) -> tuple[Array, Array, Array, Array, Array | None]:
    """The verify after its forward (`verify_forward`'s h_all and logits): the processed variant's processing at
    each verified position, exact acceptance against q, the next h into the hidden buffer. Returns (hidden_buf,
    emitted, n, the verified tokens, logprob columns or None), as `speculative_step` after its pages."""
    rows = inputs.rows
    valid, P, verify_tokens, positions = _verified(rows, drafts)
    min_p = logprobs = None
    if spec.processed:
        logits = process_logits(logits.astype(jnp.float32), inputs.processing, history, rows.stop_ids, positions,
                                verify_tokens)
        min_p = inputs.processing.min_p
    emitted, n = accept(drafts, q, q_ids, logits, inputs.sampling, rows.speculate & valid, P, spec.sampled, min_p)
    if spec.processed:
        logprobs = pack_logprobs(*token_logprobs(logits, inputs.sampling.temperature, emitted))
    h_next = h_all[jnp.arange(h_all.shape[0]), n]
    slots = rows.slot
    hidden_buf = hidden_buf.at[slots].set(jnp.where(valid[:, None], h_next, hidden_buf[slots]).astype(hidden_buf.dtype))
    return hidden_buf, emitted, n, verify_tokens, logprobs
