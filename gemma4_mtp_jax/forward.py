"""The target's pure step functions over the paged KV state: forward, logits, a prefill chunk, a decode step.

Pure functions of (parameters, pages, small host arrays): `step.py` compiles them into programs and the speculative
step (`speculative.py`) builds on `forward_paged` and `lm_logits`. Positions of -1 mark padding (docs/DESIGN.md
convention 6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gemma4_mtp_jax.config import SLIDING, owning_layers
from gemma4_mtp_jax.kv_state import KVLayout, PagedKV
from gemma4_mtp_jax.model.target import Gemma4Target
from gemma4_mtp_jax.runtime import Target
from gemma4_mtp_jax.sampling import SamplingBatch, sample

Array = jax.Array


def _layer_groups(target: Target) -> dict[int, str]:
    return {i: target.config.layers[i].layer_type for i in owning_layers(target.config)}


def make_kv_view(target: Target, layout: KVLayout, pages, tables, positions: Array, *, attention_impl: str) -> PagedKV:
    groups = dict(layout.pages_per_seq)
    return PagedKV(pages=pages, tables=tables, positions=positions, layer_group=_layer_groups(target),
                   page_size=layout.page_size,
                   ring_pages=layout.ring_pages(SLIDING) if SLIDING in groups else None,
                   attention_impl=attention_impl)


def forward_paged(target: Target, layout: KVLayout, params, pages, tokens: Array, positions: Array, tables,
                  *, attention_impl: str):
    """Target forward over tokens [B, T] at positions [B, T] (-1 = padding): (post-norm hidden, new pages).
    Prefill chunks, decode and verify all write their K/V first, then read the pages in place."""
    kv = make_kv_view(target, layout, pages, tables, positions, attention_impl=attention_impl)
    _, hidden, kv = target.module.apply({"params": params}, tokens, positions, kv, logits=False)
    return hidden, kv.pages


def lm_logits(target: Target, params, hidden: Array) -> Array:
    return target.module.apply({"params": params}, hidden, method=Gemma4Target.lm_logits)


def prefill_step(target: Target, layout: KVLayout, attention_impl: str, params, pages, tokens, positions, tables,
                 last_index, sampling: SamplingBatch):
    """One prompt chunk per row. Writes its K/V and samples from the logits at `last_index` (the row's last
    real token; only meaningful on a prompt's final chunk). Returns (pages, token [B], hidden at last [B, H]).
    Prefill always takes `sample`'s sampling path: one draw per row is cheap next to a chunk's forward, and one
    variant per bucket keeps start-up short."""
    hidden, pages = forward_paged(target, layout, params, pages, tokens, positions, tables,
                                  attention_impl=attention_impl)
    rows = jnp.arange(tokens.shape[0])
    h_last = hidden[rows, last_index]
    logits = lm_logits(target, params, h_last)
    next_pos = positions[rows, last_index] + 1
    return pages, sample(logits, sampling, next_pos), h_last


def decode_step(target: Target, layout: KVLayout, attention_impl: str, params, pages, tokens, positions, tables,
                sampling: SamplingBatch, sampled: bool):
    """One token per row: tokens, positions [B] (-1 = padding row). Returns (pages, next token [B]). `sampled`
    (static): whether some row samples (`sampling.sample`)."""
    hidden, pages = forward_paged(target, layout, params, pages, tokens[:, None], positions[:, None], tables,
                                  attention_impl=attention_impl)
    logits = lm_logits(target, params, hidden[:, 0])
    return pages, sample(logits, sampling, positions + 1, sampled=sampled)
