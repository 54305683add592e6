"""The paged KV state: a functional pytree owned by the target.

One page pool per KV group: sliding and full layers differ in head dim and KV heads, so each group has its
own pages and its own page table per sequence. Every layer that owns K/V has a `[nKV, num_pages, page_size, D]`
K and V array of its group's pool (a page id names the same slot in all of them); KV-shared layers and the
assistant own nothing and read their store layer's pages.

Full layers map position p to page `table[p // page_size]`. Sliding layers keep a ring of R pages per
sequence (R * page_size >= W + k + 2 slots): position p lives in `table[(p // page_size) % R]`, so a sliding
layer's memory per sequence is bounded by its window, not by the context. Page 0 of each pool is never handed
out: padding rows point at it and write their garbage there.

The jitted steps take the pages donated and return them; the writes below are scatters into the donated
buffers, which XLA performs in place.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp

from gemma4_mtp_jax.config import SLIDING, TextConfig
from gemma4_mtp_jax.model.attention import causal_window_mask, dot_product_attention

Array = jax.Array
NULL_PAGE = 0


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Static geometry of the KV state (hashable: it is part of every compiled step's identity)."""

    page_size: int
    num_pages: tuple[tuple[str, int], ...]  # group -> pages in its pool (page 0 included, never allocated)
    pages_per_seq: tuple[tuple[str, int], ...]  # group -> page-table width (ring length R for sliding)
    max_model_len: int

    def pages(self, group: str) -> int:
        return dict(self.num_pages)[group]

    def table_width(self, group: str) -> int:
        return dict(self.pages_per_seq)[group]

    def ring_pages(self, group: str) -> int | None:
        return self.table_width(group) if group == SLIDING else None

    def pages_needed(self, group: str, num_tokens: int) -> int:
        """Pages a sequence of `num_tokens` positions needs in `group` (the whole ring for sliding)."""
        if group == SLIDING:
            return self.table_width(group)
        return math.ceil(num_tokens / self.page_size)


def make_layout(cfg: TextConfig, *, page_size: int, max_model_len: int, num_pages: dict[str, int],
                num_speculative_tokens: int = 0) -> KVLayout:
    groups = sorted({cfg.layers[i].layer_type for i in cfg.store_layers.values()})
    widths = {}
    for g in groups:
        if g == SLIDING:
            # The drafter reads P-1-W..P-1 while the verify step writes up to P+k: W + k + 2 slots.
            slots = cfg.sliding_window + num_speculative_tokens + 2
            widths[g] = min(math.ceil(slots / page_size), math.ceil(max_model_len / page_size))
        else:
            widths[g] = math.ceil(max_model_len / page_size)
    for g in groups:
        if num_pages.get(g, 0) < widths[g] + 1:
            raise ValueError(
                f"num_pages['{g}']={num_pages.get(g, 0)} cannot hold even one sequence of max_model_len={max_model_len} "
                f"({widths[g]} pages of {page_size} tokens, plus the reserved page 0)"
            )
    return KVLayout(page_size, tuple((g, num_pages[g]) for g in groups), tuple(widths.items()), max_model_len)


def owning_layers(cfg: TextConfig) -> list[int]:
    return [i for i, lc in enumerate(cfg.layers) if lc.kv_mode != "reuse"]


def init_pages(cfg: TextConfig, layout: KVLayout, dtype) -> dict[int, tuple[Array, Array]]:
    """Zeroed K/V pools: owning layer -> (K, V), each [nKV, num_pages, page_size, D]."""
    out = {}
    for i in owning_layers(cfg):
        lc = cfg.layers[i]
        shape = (lc.num_kv_heads, layout.pages(lc.layer_type), layout.page_size, lc.head_dim)
        out[i] = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    return out


def abstract_pages(cfg: TextConfig, layout: KVLayout, dtype) -> dict[int, tuple[jax.ShapeDtypeStruct, ...]]:
    return jax.eval_shape(lambda: init_pages(cfg, layout, dtype))


def page_slots(table: Array, positions: Array, page_size: int, ring_pages: int | None) -> tuple[Array, Array]:
    """(page id, offset) of each position [B, T]; padding positions (< 0) go to the null page."""
    logical = jnp.maximum(positions, 0) // page_size
    if ring_pages is not None:
        logical = logical % ring_pages
    page = jnp.take_along_axis(table, logical, axis=1)
    page = jnp.where(positions >= 0, page, NULL_PAGE)
    return page, jnp.maximum(positions, 0) % page_size


def write_kv(pages: tuple[Array, Array], k: Array, v: Array, page: Array, offset: Array) -> tuple[Array, Array]:
    """Scatter k, v [B, T, nKV, D] into the pools at (page, offset) [B, T]."""
    kp, vp = pages
    kp = kp.at[:, page, offset].set(jnp.moveaxis(k, 2, 0).astype(kp.dtype))
    vp = vp.at[:, page, offset].set(jnp.moveaxis(v, 2, 0).astype(vp.dtype))
    return kp, vp


def context_positions(table_width: int, page_size: int, start: Array, ring_pages: int | None) -> Array:
    """Positions held by each slot of a sequence's pages before writing at `start` [B]: [B, width*page_size].

    Full layers: slot j holds position j. A ring of C slots: slot s holds the newest position p < start with
    p = s (mod C). Slots holding nothing yet (p < 0 or p >= start) get -1... encoded as a huge value so that
    no causal mask ever admits them.
    """
    S = table_width * page_size
    slot = jnp.arange(S, dtype=jnp.int32)[None, :]
    start = start[:, None]
    if ring_pages is None:
        pos = jnp.broadcast_to(slot, (start.shape[0], S))
    else:
        pos = start - 1 - jnp.mod(start - 1 - slot, S)
    return jnp.where((pos >= 0) & (pos < start), pos, jnp.iinfo(jnp.int32).max)


def gather_pages(pages: Array, table: Array) -> Array:
    """[nKV, P, page, D] pool + [B, n] table -> [B, n*page, nKV, D] dense copy of the sequences' pages."""
    g = jnp.take(pages, table, axis=1)  # [nKV, B, n, page, D]
    nKV, B, n, ps, D = g.shape
    return jnp.moveaxis(g.reshape(nKV, B, n * ps, D), 0, 2)


@flax.struct.dataclass
class PagedKV:
    """The KV view (see model/attention.py) over the paged state, for one forward over tokens [B, T].

    Decode/verify (`prefill=False`, T <= k+1): the new K/V are written first, then attention reads the pages
    in place (Pallas kernel on GPU). Prefill chunks (`prefill=True`): attention reads the context that was in
    the pages before the chunk (gathered; prefill is compute-bound) plus the chunk's own K/V, so a chunk may be
    longer than the sliding ring's slack.
    """

    pages: dict[int, tuple[Array, Array]]
    tables: dict[str, Array]  # group -> [B, width] page ids
    positions: Array  # [B, T], -1 for padding
    start: Array  # [B] position of the first token of this forward (the committed length before it)
    layer_group: dict[int, str] = flax.struct.field(pytree_node=False)
    page_size: int = flax.struct.field(pytree_node=False)
    ring_pages: int | None = flax.struct.field(pytree_node=False)
    prefill: bool = flax.struct.field(pytree_node=False)
    attention_impl: str = flax.struct.field(pytree_node=False, default="auto")
    new: dict[int, tuple[Array, Array]] = flax.struct.field(default_factory=dict)
    before: dict[int, tuple[Array, Array]] = flax.struct.field(default_factory=dict)

    def _ring(self, group: str) -> int | None:
        return self.ring_pages if group == SLIDING else None

    def store(self, layer: int, k: Array, v: Array) -> "PagedKV":
        group = self.layer_group[layer]
        page, offset = page_slots(self.tables[group], self.positions, self.page_size, self._ring(group))
        written = write_kv(self.pages[layer], k, v, page, offset)
        return self.replace(
            pages={**self.pages, layer: written},
            new={**self.new, layer: (k, v)},
            before={**self.before, layer: self.pages[layer]},
        )

    def attend(self, layer: int, q: Array, q_pos: Array, window: int | None) -> Array:
        group = self.layer_group[layer]
        table = self.tables[group]
        if self.prefill:
            kp, vp = self.before[layer]
            k_ctx, v_ctx = gather_pages(kp, table), gather_pages(vp, table)
            ctx_pos = context_positions(table.shape[1], self.page_size, self.start, self._ring(group))
            k_new, v_new = self.new[layer]
            k = jnp.concatenate([k_ctx, k_new.astype(k_ctx.dtype)], axis=1)
            v = jnp.concatenate([v_ctx, v_new.astype(v_ctx.dtype)], axis=1)
            new_pos = jnp.where(self.positions >= 0, self.positions, jnp.iinfo(jnp.int32).max)
            k_pos = jnp.concatenate([ctx_pos, new_pos], axis=1)
            return dot_product_attention(q, k, v, causal_window_mask(q_pos, k_pos, window))
        from gemma4_mtp_jax.kernels.paged_attention import attend_paged

        kp, vp = self.pages[layer]
        return attend_paged(q, kp, vp, table, q_pos, window=window, ring_pages=self._ring(group),
                            impl=self.attention_impl)
