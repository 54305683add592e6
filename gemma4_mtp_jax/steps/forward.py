"""The target's pure step functions over the paged KV state: forward, logits, a prefill chunk, a decode step.

Pure functions of (parameters, pages, small host arrays): `step.py` compiles them into programs and the speculative
step (`speculative.py`) builds on `forward_paged` and `lm_logits`. Positions of -1 mark padding (docs/DESIGN.md
convention 6).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from gemma4_mtp_jax.kernels.dense_attention import image_runs
from gemma4_mtp_jax.model.config import SLIDING, owning_layers
from gemma4_mtp_jax.model.multimodal import vision_tokens
from gemma4_mtp_jax.steps.device_state import History, StepInputs, pack_logprobs
from gemma4_mtp_jax.model.kv_state import KVLayout, PagedKV
from gemma4_mtp_jax.model.target import Gemma4Target
from gemma4_mtp_jax.model.runtime import Target
from gemma4_mtp_jax.model.sharding import gathered
from gemma4_mtp_jax.model.sampling import process_logits, sample, token_logprobs

Array = jax.Array


def _layer_groups(target: Target) -> dict[int, str]:
    return {i: target.config.layers[i].layer_type for i in owning_layers(target.config)}


@dataclasses.dataclass(frozen=True, eq=False)
class StepSpec:
    """What a step function is traced for, beside its array arguments: the target, the KV layout, the attention
    implementation, whether some row samples (`sampling.sample`: decided on the host), and for the speculative
    round its drafter and k. Static: one program per spec and shapes."""

    target: Target
    layout: KVLayout
    attention_impl: str = "auto"
    sampled: bool = True
    # Some row needs logits processing or logprobs (sampling.SamplingParams.processed): the processed variant, which
    # also samples. Decided on the host, like `sampled`.
    processed: bool = False
    # A prefill that also returns the logprobs of its chunk's prompt tokens (prompt_logprobs: completions' echo).
    scored: bool = False
    drafter: Any = None  # speculative.Drafter (the round's drafts); None outside the speculative round
    k: int = 0  # drafts per round
    # Owning layers whose pages are whole on every device under tensor parallelism (sharding.Placement.whole_kv):
    # their writes are kept whole too (PagedKV.whole).
    whole_kv: frozenset[int] = frozenset()

    def but(self, **changes: Any) -> "StepSpec":
        return dataclasses.replace(self, **changes)


def make_kv_view(spec: StepSpec, pages, tables, positions: Array, runs: tuple[Array, Array] | None = None) -> PagedKV:
    """The paged view of one forward; `runs`: its tokens' image runs, where an image's tokens see each other."""
    layout = spec.layout
    groups = dict(layout.pages_per_seq)
    return PagedKV(pages=pages, tables=tables, positions=positions, layer_group=_layer_groups(spec.target),
                   page_size=layout.page_size,
                   ring_pages=layout.ring_pages(SLIDING) if SLIDING in groups else None,
                   attention_impl=spec.attention_impl, scales=layout.kv_scales(), whole=spec.whole_kv,
                   runs=runs, image_attention=spec.target.config.image_attention)


def forward_paged(spec: StepSpec, params, pages, tokens: Array, positions: Array, tables, media: tuple = ()):
    """Target forward over tokens [B, T] at positions [B, T] (-1 = padding): (post-norm hidden, new pages).
    Prefill chunks, decode and verify all write their K/V first, then read the pages in place. `media`: a
    prompt chunk's soft tokens (soft [B, T, H], at [B, T] bool), which replace the embeddings where `at` holds;
    the token there is embedded as the pad id, as model/multimodal.py does (per-layer embeddings included). Where
    the model's image tokens see each other, the image placeholders among them are runs of the images (the engine
    never splits an image over two chunks: engine/media.py), and their queries are bounded accordingly."""
    runs = None
    embeds = None
    if media:
        soft, at = media
        cfg = spec.target.encoders.config
        if spec.target.config.image_attention != "causal":
            runs = image_runs(at & vision_tokens(tokens, cfg), positions)
        tokens = jnp.where(at, jnp.asarray(cfg.pad_token_id, tokens.dtype), tokens)
        embeds = spec.target.module.apply({"params": params}, tokens, method=Gemma4Target.embed)
        embeds = jnp.where(at[..., None], soft.astype(embeds.dtype), embeds)
    kv = make_kv_view(spec, pages, tables, positions, runs)
    _, hidden, kv = spec.target.module.apply({"params": params}, tokens, positions, kv, logits=False,
                                             inputs_embeds=embeds)
    return hidden, kv.pages


def lm_logits(target: Target, params, hidden: Array, whole: bool = False) -> Array:
    """The target's logits [..., V]. Under tensor parallelism each device computes its vocabulary rows' (the LM
    head is vocabulary-parallel); `whole`: then gathered onto every device, in one all-gather, for what reads the
    whole vocabulary (sampling's filters, sorts and draws, logits processing, logprobs), which on split logits the
    partitioner serves with a dozen collectives of its own (`benchmarks/collectives.py`). A greedy argmax needs
    only each device's best."""
    logits = target.module.apply({"params": params}, hidden, method=Gemma4Target.lm_logits)
    return gathered(logits) if whole else logits


def processed_sample(spec: StepSpec, logits: Array, inputs: StepInputs, history: History, positions: Array,
                     counted: Array | None) -> tuple[Array, Array]:
    """The processed variant's sampling of one position per row: logits [B, V] after the token at `positions` [B]
    (`counted` [B]: that token, an output token that counts first; None: it is a prompt token). Returns (next token
    [B], its logprob columns: device_state.pack_logprobs)."""
    proc = inputs.processing
    processed = process_logits(logits.astype(jnp.float32)[:, None], proc, history, inputs.rows.stop_ids,
                               positions[:, None], None if counted is None else counted[:, None])[:, 0]
    token = sample(processed, inputs.sampling, positions + 1, min_p=proc.min_p)
    return token, pack_logprobs(*token_logprobs(processed[:, None], inputs.sampling.temperature, token[:, None]))


def prompt_logprobs(spec: StepSpec, params, hidden: Array, next_tokens: Array) -> Array:
    """A scored prefill's logprobs of each chunk token's successor under the model's own distribution (no processing,
    temperature 1): hidden [B, T, H], next_tokens [B, T] (-1: unknown). Returns logprob columns [B, T (1 + 2K)]
    (device_state.pack_logprobs)."""
    logits = lm_logits(spec.target, params, hidden, whole=True).astype(jnp.float32)  # [B, T, V]
    return pack_logprobs(*token_logprobs(logits, jnp.zeros(logits.shape[:1], jnp.float32), next_tokens))


def prefill_step(spec: StepSpec, params, pages, inputs: StepInputs, history: History, media: tuple = ()):
    """One prompt chunk per row (`inputs.rows`: PrefillRows). Writes its K/V and samples from the logits at
    `last_index` (the row's last real token; only meaningful on a prompt's final chunk), processed with the rows'
    `history` (device_state.prefill_history). Returns (pages, token [B], hidden at last [B, H], the token's logprob
    columns, and for a `spec.scored` prefill then the chunk's `prompt_logprobs` columns; `media`: forward_paged's).
    Prefill always takes the processed sampling path: one row's processing and draw are cheap next to a chunk's
    forward, and one variant per bucket keeps start-up short."""
    rows = inputs.rows
    hidden, pages = forward_paged(spec, params, pages, rows.tokens, rows.positions, inputs.tables, media)
    b = jnp.arange(rows.tokens.shape[0])
    h_last = hidden[b, rows.last_index]
    logits = lm_logits(spec.target, params, h_last, whole=True)
    token, logprobs = processed_sample(spec, logits, inputs, history, rows.positions[b, rows.last_index], None)
    if spec.scored:
        logprobs = jnp.concatenate([logprobs, prompt_logprobs(spec, params, hidden, rows.next_tokens)], 1)
    return pages, token, h_last, logprobs


def decode_step(spec: StepSpec, params, pages, inputs: StepInputs, history: History | None = None):
    """One token per row: `inputs.rows` (StepRows, resolved: each row's newest token at its length; -1 = padding
    row). Returns (pages, next token [B], its logprob columns or None); the processed variant (`history` given)
    processes the logits and returns logprobs."""
    tokens, positions = inputs.rows.token, inputs.rows.length
    hidden, pages = forward_paged(spec, params, pages, tokens[:, None], positions[:, None], inputs.tables)
    logits = lm_logits(spec.target, params, hidden[:, 0], whole=spec.sampled or spec.processed)
    if spec.processed:
        token, logprobs = processed_sample(spec, logits, inputs, history, positions, tokens)
        return pages, token, logprobs
    return pages, sample(logits, inputs.sampling, positions + 1, sampled=spec.sampled), None
