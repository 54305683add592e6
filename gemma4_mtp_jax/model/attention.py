"""The K/V views the decoder layers attend through (the attention math itself is `kernels.dense_attention`).

Every decoder layer reaches K/V only through a view: `prepare` (a layer hands over its raw q / k / v projections
and gets back what the view's `attend` takes as its queries; a layer that owns K/V has its new keys and values
stored) and `attend` (read the K/V of a given layer). The layer passes `prepare`'s result to `attend` untouched.
The dense views here return the queries themselves; the paged KV state plugs in behind the same two calls, so the
layers never know where K/V live. It may turn the projections into queries and paged K/V in one kernel
(`kernels.attention_inputs`), and for a Q-only layer hand the projections back for the paged-attention kernel to
norm and rope the queries as it loads them.
"""

from __future__ import annotations

from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp

from gemma4_mtp_jax.kernels.attention_inputs import normed_and_roped
from gemma4_mtp_jax.kernels.dense_attention import bounds_mask, causal_window_mask, dot_product_attention, image_bounds

Array = jax.Array


@flax.struct.dataclass
class Projections:
    """A layer's raw projections and what turns them into attention inputs: q [B, T, nH, D] gets `q_norm` and RoPE;
    k [B, T, nKV, D] gets `k_norm` and RoPE, v (or, where v is None, the raw k: attention_k_eq_v) an RMSNorm
    without a weight. k None: the layer has queries only (it reads another layer's K/V, or is the assistant's)."""

    q: Array
    k: Array | None
    v: Array | None
    q_norm: Array  # [D]
    k_norm: Array | None  # [D]
    positions: Array  # [B, T]
    inv_freq: Array  # [D/2]
    eps: float = flax.struct.field(pytree_node=False)

    def normed_and_roped(self) -> tuple[Array, Array | None, Array | None]:
        """(queries, keys, values) in plain XLA; keys and values None for a layer with queries only."""
        return normed_and_roped(self.q, self.k, self.v, self.q_norm, self.k_norm, self.positions, self.inv_freq,
                                eps=self.eps)


class KVView(Protocol):
    """`prepare` returns (queries, view): the queries as `attend` takes them, an Array [B, T, nH, D] of normed and
    roped queries or anything else the view's `attend` accepts (the paged views: a Q-only layer's `Projections`);
    `attend(layer, queries, q_pos, window)` attends them to layer `layer`'s K/V at mask positions q_pos."""

    def prepare(self, layer: int, p: Projections) -> tuple[Array | Projections, "KVView"]: ...

    def attend(self, layer: int, q: Array | Projections, q_pos: Array, window: int | None) -> Array: ...


@flax.struct.dataclass
class DenseKV:
    """K/V of the tokens of one forward pass ([B, T, nKV, D] per owning layer), at positions `positions`.

    With `runs` (the tokens' image runs, `kernels.dense_attention.image_runs`) and a rule other than "causal"
    (`TextConfig.image_attention`), an image's tokens also attend to each other (`image_bounds`)."""

    positions: Array  # [B, T]
    layers: dict[int, tuple[Array, Array]] = flax.struct.field(default_factory=dict)
    runs: tuple[Array, Array] | None = None  # (first, last) [B, T] each
    image_attention: str = flax.struct.field(pytree_node=False, default="causal")

    def prepare(self, layer: int, p: Projections) -> tuple[Array, "DenseKV"]:
        q, k, v = p.normed_and_roped()
        return q, (self if k is None else self.replace(layers={**self.layers, layer: (k, v)}))

    def attend(self, layer: int, q: Array, q_pos: Array, window: int | None) -> Array:
        k, v = self.layers[layer]
        # the queries are this pass's own tokens, so their runs are the keys' too
        bounds = None if self.runs is None else image_bounds(q_pos, self.runs, window, self.image_attention)
        if bounds is None:
            allowed = causal_window_mask(q_pos, self.positions, window)
        else:
            allowed = bounds_mask(self.positions, bounds)
        return dot_product_attention(q, k, v, allowed)


@flax.struct.dataclass
class DraftKV:
    """What the assistant sees: the target's committed K/V (docs/DESIGN.md convention 2).

    `by_layer` maps each assistant layer to the target K/V of its attention type ([B, S, nKV, D], key j at
    position j). With `lengths` = P committed tokens, full layers see keys 0..P-1 and sliding layers the last
    W+1 of them, P-1-W..P-1 (transformers' drafter mask, minus its stale rejected drafts).
    """

    by_layer: dict[int, tuple[Array, Array]]
    lengths: Array  # [B] committed tokens = the query position

    def prepare(self, layer: int, p: Projections) -> tuple[Array, "DraftKV"]:
        if p.k is not None:
            raise ValueError(f"assistant layer {layer} tried to store K/V, but assistant layers are Q-only")
        return p.normed_and_roped()[0], self

    def attend(self, layer: int, q: Array, q_pos: Array, window: int | None) -> Array:
        k, v = self.by_layer[layer]
        B, S = k.shape[:2]
        k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        last = jnp.broadcast_to((self.lengths - 1)[:, None], q_pos.shape)  # newest committed key
        allowed = causal_window_mask(last, k_pos, None if window is None else window + 1)
        return dot_product_attention(q, k, v, allowed)
