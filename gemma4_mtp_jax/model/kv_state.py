"""The paged KV state: a functional pytree owned by the target.

One page pool per KV group: sliding and full layers differ in head dim and KV heads, so each group has its
own pages and its own page table per sequence. Every layer that owns K/V has a `[nKV, num_pages, page_size, D]`
K and V array of its group's pool (a page id names the same slot in all of them); KV-shared layers and the
assistant own nothing and read their store layer's pages.

Full layers map position p to page `table[p // page_size]`. Sliding layers keep a ring of R pages per
sequence (R * page_size >= W + 2k + 2 + page_size slots, below): position p lives in `table[(p // page_size) % R]`, so
a sliding layer's memory per sequence is bounded by its window, not by the context. Page 0 of each pool is never handed
out: padding rows point at it and write their garbage there.

The jitted steps take the pages donated and return them; the writes (`kernels.attention_inputs`, a kernel on the GPU,
scatters elsewhere) go into the donated buffers in place.

A float8 cache (e4m3fn) holds each owning layer's K divided by its k_scale and V by its v_scale: static powers of
two computed from the target's weights (`kv_cache_scales`), kept in the layout, read back by every view of those
pages (the target's layers and the assistant's, which reads its store layers' pages with their scales).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.model.config import SLIDING, TextConfig, owning_layers
from gemma4_mtp_jax.kernels.attention_inputs import prepare_attention_inputs, quantized, rope_tables
from gemma4_mtp_jax.kernels.dense_attention import image_bounds
from gemma4_mtp_jax.kernels.device_budget import kernels_chosen
from gemma4_mtp_jax.kernels.paged_attention import attend_paged
from gemma4_mtp_jax.model.attention import Projections
from gemma4_mtp_jax.model.sharding import gathered, head_parallel, on_every_device, tensor_parallel_size

Array = jax.Array
NULL_PAGE = 0
Scales = dict[int, tuple[float, float]]  # owning layer -> (k_scale, v_scale) of its pages; absent: (1.0, 1.0)
UNSCALED = (1.0, 1.0)
# The scales of a float8 cache's programs compiled from parameter shapes alone, which have no weights to bound K by
# (`kv_cache_scales`): programs of the same shape and cost as the real ones (compile-only tools time and count
# them), but 3.0 is no power of two, so such a layout, and every program compiled for it, is never the one an engine
# with weights looks up (compiled programs are keyed by their layout).
SHAPES_ONLY_SCALE = 3.0


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Static geometry of the KV state (hashable: it is part of every compiled step's identity)."""

    page_size: int
    num_pages: tuple[tuple[str, int], ...]  # group -> pages in its pool (page 0 included, never allocated)
    pages_per_seq: tuple[tuple[str, int], ...]  # group -> page-table width (ring length R for sliding)
    max_model_len: int
    num_speculative_tokens: int = 0
    # owning layer -> (k_scale, v_scale) for a float8 cache (`kv_cache_scales`); empty otherwise (all 1.0)
    scales: tuple[tuple[int, float, float], ...] = ()

    def kv_scales(self) -> Scales:
        """Owning layer -> (k_scale, v_scale) of its pages (empty: every layer's are 1.0)."""
        return {i: (k, v) for i, k, v in self.scales}

    def pages(self, group: str) -> int:
        return dict(self.num_pages)[group]

    def table_width(self, group: str) -> int:
        return dict(self.pages_per_seq)[group]

    def ring_pages(self, group: str) -> int | None:
        return self.table_width(group) if group == SLIDING else None

    def pages_needed(self, group: str, num_tokens: int) -> int:
        """Pages a sequence of `num_tokens` tokens needs in `group` (the whole ring for sliding; for full layers,
        room for the k drafts verified past its last token too)."""
        if group == SLIDING:
            return self.table_width(group)
        return math.ceil((num_tokens + self.num_speculative_tokens) / self.page_size)


def make_layout(cfg: TextConfig, *, page_size: int, max_model_len: int, num_pages: dict[str, int],
                num_speculative_tokens: int = 0, prefill_chunk: int = 1, assistant_window: int = 0,
                scales: Scales | None = None) -> KVLayout:
    """The layout of these pools; `scales`: a float8 cache's (`kv_cache_scales`)."""
    groups = sorted({cfg.layers[i].layer_type for i in cfg.store_layers.values()})
    # The verify step writes K/V up to k positions past the last token a sequence keeps.
    max_positions = max_model_len + num_speculative_tokens
    widths = {}
    for g in groups:
        if g == SLIDING:
            # The drafter reads P-1-W..P-1 while the verify step writes up to P+k: W + k + 2 slots, and k + 1
            # more because the engine prepares a step's pages while the step before it (which may add k + 1
            # tokens) is still running; a prefill chunk of T tokens is written before its first query reads back
            # W-1 keys: W + T slots. Plus a page less one slot: the engine may re-point a slot to a fresh page when
            # its page is shared (prefix caching), which drops the slot's whole page at once.
            slots = (max(cfg.sliding_window, assistant_window) + max(2 * num_speculative_tokens + 3, prefill_chunk)
                     + page_size - 1)
            widths[g] = min(math.ceil(slots / page_size), math.ceil(max_positions / page_size))
        else:
            widths[g] = math.ceil(max_positions / page_size)
    for g in groups:
        if num_pages.get(g, 0) < widths[g] + 1:
            raise ValueError(
                f"num_pages['{g}']={num_pages.get(g, 0)} cannot hold even one sequence of "
                f"max_model_len={max_model_len} "
                f"({widths[g]} pages of {page_size} tokens, plus the reserved page 0)"
            )
    scales = tuple((i, float(k), float(v)) for i, (k, v) in sorted((scales or {}).items()))
    return KVLayout(page_size, tuple((g, num_pages[g]) for g in groups), tuple(widths.items()), max_model_len,
                    num_speculative_tokens, scales)


def _pow2_scale(bound: float, limit: float) -> float:
    """The smallest power of two s with bound / s <= limit."""
    return 2.0 ** math.ceil(math.log2(max(bound, 1e-30) / limit))


def kv_cache_scales(cfg: TextConfig, params: dict, cache_dtype) -> Scales:
    """Each owning layer's static (k_scale, v_scale) for a cache of `cache_dtype`: {} (every scale 1.0) unless it is
    float8. A power of two, the smallest under which every value the layer can write fits the format (e4m3fn:
    +-448), from a bound that holds for every input, no calibration:
    - V is RMS-normed without a weight (attention_k_eq_v layers: the raw K projection, normed the same way): per
      head sum(v_i^2) <= D, so |v_i| <= sqrt(D);
    - K is RMS-normed times k_norm's weight w, then RoPE'd, which rotates pairs of coordinates and keeps each pair's
      norm: |k_i| <= max|w| * sqrt(D).
    Division by a power of two is exact, and within the normal range e4m3's relative precision does not depend on
    the scale, so a finer (per-page) scale could only gain on values that would be subnormal
    (docs/decisions/0016-fp8-kv-cache.md). Writers clip to the range anyway: the bound is met up to the rounding of
    the activations' dtype. Parameters of shapes alone (a program compiled ahead of the weights) get
    SHAPES_ONLY_SCALE."""
    if not quantized(cache_dtype):
        return {}
    limit = float(jnp.finfo(cache_dtype).max)
    out: Scales = {}
    for i in owning_layers(cfg):
        w = params[f"layers_{i}"]["self_attn"]["k_norm"]["weight"]
        if isinstance(w, jax.ShapeDtypeStruct):
            out[i] = (SHAPES_ONLY_SCALE, SHAPES_ONLY_SCALE)
            continue
        root_d = math.sqrt(cfg.layers[i].head_dim)
        k_bound = float(np.abs(np.asarray(w, np.float32)).max()) * root_d  # on the host: no program to compile
        out[i] = (_pow2_scale(k_bound, limit), _pow2_scale(root_d, limit))
    return out


def page_bytes(cfg: TextConfig, page_size: int, dtype, copies: dict[int, int] | None = None) -> dict[str, int]:
    """Bytes one page takes in each KV group's pool: K and V of every layer of the group that owns K/V; an owning
    layer in `copies` that many times (its pages whole on each of that many tensor-parallel devices, where the
    others' are split: the bytes the devices hold together)."""
    itemsize = jnp.dtype(dtype).itemsize
    out: dict[str, int] = {}
    for i in owning_layers(cfg):
        lc = cfg.layers[i]
        one = 2 * lc.num_kv_heads * page_size * lc.head_dim * itemsize
        out[lc.layer_type] = out.get(lc.layer_type, 0) + one * (copies or {}).get(i, 1)
    return out


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


def _inputs_impl(attention_impl: str) -> str:
    """How the projections become attention inputs: as `attention_impl` asks, but through XLA under tensor
    parallelism (the kernel, a custom call, would need its own split by heads; not written yet)."""
    return "xla" if tensor_parallel_size() > 1 else attention_impl


def _attention_inputs(p: Projections, attention_impl: str, **slots) -> tuple[Array, tuple[Array, Array] | None]:
    """(queries, the layer's pages with the new K/V written) from `p`; `slots`: pages, page, offset, k_scale,
    v_scale (with K/V)."""
    return prepare_attention_inputs(p.q, p.k, p.v, p.q_norm, p.k_norm, p.positions, p.inv_freq, eps=p.eps,
                                    impl=_inputs_impl(attention_impl), **slots)


def _queries_in_kernel(attention_impl: str) -> bool:
    """Whether a Q-only layer hands its raw projections to the paged-attention kernel, which norms and ropes the
    queries as it loads them (one `attention_inputs` kernel less per Q-only layer): where the kernel may run."""
    return attention_impl == "pallas" or (attention_impl == "auto" and kernels_chosen())


def _queries_only(p: Projections, attention_impl: str) -> Array | Projections:
    """What a Q-only layer's `prepare` returns: the projections themselves where the paged kernel may turn them
    into queries (`_attend`), else the queries, as an owning layer's are made."""
    return p if _queries_in_kernel(attention_impl) else _attention_inputs(p, attention_impl)[0]


def _attend(q: Array | Projections, kp: Array, vp: Array, table: Array, mask_pos: Array, *, window: int | None,
            ring_pages: int | None, attention_impl: str, scales: tuple[float, float], split: bool = True,
            bounds: Array | None = None) -> Array:
    """`attend_paged` on each device's heads (`head_parallel`; `split` False: on all heads by every device,
    `on_every_device`), the pages read with their (k_scale, v_scale). For Projections (a Q-only layer's raw q), q_norm's
    weight and RoPE's tables at the projections' own positions go along, replicated, for the kernel to norm and
    rope the queries; where no kernel tiling fits, `attend_paged`'s XLA path does it in plain XLA. `bounds`: each
    query's visible keys where an image's tokens see each other (`dense_attention.image_bounds`), replicated."""
    extra: dict[str, Array] = {}
    eps = None
    if isinstance(q, Projections):
        extra["cos"], extra["sin"] = rope_tables(q.positions, q.inv_freq, q.q.dtype)
        extra["q_norm"], eps, q = q.q_norm, q.eps, q.q  # the raw projection
    if bounds is not None:
        extra["bounds"] = bounds
    names = tuple(extra)

    def fn(q, kp, vp, table, mask_pos, *arrays):
        return attend_paged(q, kp, vp, table, mask_pos, **dict(zip(names, arrays)), window=window,
                            ring_pages=ring_pages, eps=eps, impl=attention_impl, k_scale=scales[0],
                            v_scale=scales[1])

    run = head_parallel if split else on_every_device
    return run(fn, q, kp, vp, table, mask_pos, *extra.values())


@flax.struct.dataclass
class PagedKV:
    """The KV view (see model/attention.py) over the paged state, for one forward over tokens [B, T].

    `store` writes the new K/V into the pages first; `attend` then reads the pages in place, through the
    paged-attention kernel on GPU (its plain-XLA twin elsewhere) for prefill chunks, decode and verify alike.
    Writing before reading is what keeps the update in place (reading the old pages after an in-place write
    would force XLA to copy them); it is safe because a sliding ring holds W + max(2k+3, chunk) slots, so a
    forward's own writes never evict a key one of its queries still needs.
    """

    pages: dict[int, tuple[Array, Array]]
    tables: dict[str, Array]  # group -> [B, width] page ids
    positions: Array  # [B, T], -1 for padding
    layer_group: dict[int, str] = flax.struct.field(pytree_node=False)
    page_size: int = flax.struct.field(pytree_node=False)
    ring_pages: int | None = flax.struct.field(pytree_node=False)
    attention_impl: str = flax.struct.field(pytree_node=False, default="auto")
    scales: Scales = flax.struct.field(pytree_node=False, default_factory=dict)  # KVLayout.kv_scales
    # Layers whose pages are whole on every device under tensor parallelism (sharding.Placement.whole_kv). Their
    # pages are held whole after the write: left to itself, the partitioner splits the new K / V by head (the
    # attention after reads the pages by head), computing the projections on slices of their whole weights, and
    # gathers them again for the write.
    whole: frozenset[int] = flax.struct.field(pytree_node=False, default=frozenset())
    # A prefill chunk with images whose soft tokens see each other (`TextConfig.image_attention`): the tokens' image
    # runs (`dense_attention.image_runs`, each image whole within the chunk), from which `attend` bounds each query.
    runs: tuple[Array, Array] | None = None
    image_attention: str = flax.struct.field(pytree_node=False, default="causal")

    def _ring(self, group: str) -> int | None:
        return self.ring_pages if group == SLIDING else None

    def _scales(self, layer: int) -> tuple[float, float]:
        return self.scales.get(layer, UNSCALED)

    def prepare(self, layer: int, p: Projections) -> tuple[Array | Projections, "PagedKV"]:
        """The layer's queries, and its new K/V written into its pages (both by one kernel on the GPU). A Q-only
        layer gets its projections back where the paged kernel may norm and rope them itself (`attend`)."""
        if p.k is None:
            return _queries_only(p, self.attention_impl), self
        group = self.layer_group[layer]
        page, offset = page_slots(self.tables[group], self.positions, self.page_size, self._ring(group))
        k_scale, v_scale = self._scales(layer)
        q, pages = _attention_inputs(p, self.attention_impl, pages=self.pages[layer], page=page, offset=offset,
                                     k_scale=k_scale, v_scale=v_scale)
        if layer in self.whole:
            pages = tuple(map(gathered, pages))
        return q, self.replace(pages={**self.pages, layer: pages})

    def only(self, layers: dict[int, int]) -> "PagedKV":
        """The view of the K/V of layers `layers[r]` under the names r (the rest left out): a layer traced once
        for all layers of its kind runs as its representative r on each one's pages (read with their scales: a
        float8 cache's layers whose scales differ are traced apart)."""
        return self.replace(pages={r: self.pages[i] for r, i in layers.items()},
                            layer_group={r: self.layer_group[i] for r, i in layers.items()},
                            scales={r: self.scales[i] for r, i in layers.items() if i in self.scales},
                            whole=frozenset(r for r, i in layers.items() if i in self.whole))

    def absorb(self, view: "PagedKV", layers: dict[int, int]) -> "PagedKV":
        """This view with the pages `view` (from `only(layers)`) wrote put back under their own layers."""
        return self.replace(pages={**self.pages, **{i: view.pages[r] for r, i in layers.items()}})

    def attend(self, layer: int, q: Array | Projections, q_pos: Array, window: int | None) -> Array:
        group = self.layer_group[layer]
        kp, vp = self.pages[layer]
        bounds = None if self.runs is None else image_bounds(q_pos, self.runs, window, self.image_attention)
        return _attend(q, kp, vp, self.tables[group], q_pos, window=window, ring_pages=self._ring(group),
                       attention_impl=self.attention_impl, scales=self._scales(layer), bounds=bounds)


@flax.struct.dataclass
class PagedDraftKV:
    """The assistant's view of the target's pages (docs/DESIGN.md conventions 1-2), read-only.

    Assistant layer i attends to the pages of the target's store layer of its type through that group's page
    table. The query sits at P = `lengths` (RoPE), and sees only committed keys: full layers 0..P-1, sliding
    layers P-1-W..P-1 (W = the assistant's window), i.e. mask position P-1 with a window of W+1 keys. A float8
    cache's pages are read with the scales of the target layer that wrote them (`scales`, keyed by target layer).
    """

    pages: dict[int, tuple[Array, Array]]  # target pages, keyed by target layer
    tables: dict[str, Array]
    lengths: Array  # [B] committed tokens; 0 for padding rows (nothing visible)
    source: dict[int, int] = flax.struct.field(pytree_node=False)  # assistant layer -> target store layer
    layer_group: dict[int, str] = flax.struct.field(pytree_node=False)  # assistant layer -> group
    ring_pages: int | None = flax.struct.field(pytree_node=False)
    attention_impl: str = flax.struct.field(pytree_node=False, default="auto")
    scales: Scales = flax.struct.field(pytree_node=False, default_factory=dict)  # target layer -> its pages' scales

    def prepare(self, layer: int, p: Projections) -> tuple[Array | Projections, "PagedDraftKV"]:
        """The layer's queries, or (where the paged kernel may norm and rope them itself) its projections."""
        if p.k is not None:
            raise ValueError(f"assistant layer {layer} tried to store K/V, but assistant layers are Q-only")
        return _queries_only(p, self.attention_impl), self

    def attend(self, layer: int, q: Array | Projections, q_pos: Array, window: int | None) -> Array:
        """Queries roped at P (the projections' positions) attending with mask position P-1 and window W+1."""
        group, source = self.layer_group[layer], self.source[layer]
        kp, vp = self.pages[source]
        newest = jnp.broadcast_to((self.lengths - 1)[:, None], q_pos.shape)
        # Whole on every device, like the rest of the assistant: its source pages are whole too
        # (sharding.Placement.whole_kv), so its draft steps need no collective.
        return _attend(q, kp, vp, self.tables[group], newest, window=None if window is None else window + 1,
                       ring_pages=self.ring_pages if group == SLIDING else None, attention_impl=self.attention_impl,
                       scales=self.scales.get(source, UNSCALED), split=False)
