"""Dense softmax attention and its causal / sliding-window mask: the math every attention path shares.

The model's dense K/V views call it directly, and the paged kernels use it as their plain-XLA reference (gather the
pages, then attend densely). It lives with the kernels so that they stay self-contained: kernels import nothing
from the model (docs/DESIGN.md, "Layers").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
_MASKED = float(jnp.finfo(jnp.float32).min)


def dot_product_attention(q: Array, k: Array, v: Array, allowed: Array) -> Array:
    """Softmax attention with scale 1.0 (q_norm/k_norm replace 1/sqrt(D)) and grouped KV heads.

    q: [B, T, nH, D]; k, v: [B, S, nKV, D]; allowed: [B, T, S] bool. Query head h reads KV head h // (nH/nKV).
    Returns [B, T, nH, D] in q's dtype. Rows with no allowed key (padding) give finite garbage, never NaN.
    """
    B, T, nH, D = q.shape
    nKV = k.shape[2]
    qg = q.reshape(B, T, nKV, nH // nKV, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(allowed[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(B, T, nH, D)


def causal_window_mask(q_pos: Array, k_pos: Array, window: int | None) -> Array:
    """[B, T, S]: key at k_pos visible from q_pos iff q_pos - window < k_pos <= q_pos (window=None: causal)."""
    allowed = k_pos[:, None, :] <= q_pos[:, :, None]
    if window is not None:
        allowed &= k_pos[:, None, :] > q_pos[:, :, None] - window
    return allowed


IMAGE_ATTENTION = ("causal", "sliding_layers", "all_layers")


def image_runs(vision: Array, positions: Array) -> tuple[Array, Array]:
    """(first, last) [B, T] int32: for each token of a run of consecutive image soft tokens (`vision` [B, T] bool: one
    image, or video frame, as transformers delimits them) the positions of its run's first and last token; for
    every other token its own position. Positions must count up by one along T within a run (a forward's tokens)."""
    positions = positions.astype(jnp.int32)
    starts = vision & ~jnp.pad(vision[:, :-1], ((0, 0), (1, 0)))
    ends = vision & ~jnp.pad(vision[:, 1:], ((0, 0), (0, 1)))
    big = jnp.iinfo(jnp.int32).max
    first = jax.lax.cummax(jnp.where(starts, positions, -big), axis=1)
    last = jax.lax.cummin(jnp.where(ends, positions, big), axis=1, reverse=True)
    return jnp.where(vision, first, positions), jnp.where(vision, last, positions)


def image_bounds(q_pos: Array, runs: tuple[Array, Array], window: int | None, rule: str) -> Array | None:
    """[B, T, 2]: the interval [lo, hi] of key positions each query sees when an image's soft tokens also see each
    other ahead of them, or None where the layer stays causal (`causal_window_mask`). `runs`: the queries' image runs
    (`image_runs`); `rule` (the text config's `image_attention`), as transformers builds its masks:
      * "causal": None;
      * "sliding_layers" (Gemma 4 "vision"): full layers (window None) stay causal; in sliding layers a query sees
        (keys not ahead of it, or in its image) within the window: (q - window, last];
      * "all_layers" (the unified 12B): in every layer a query sees `causal_window_mask`'s keys plus every key of
        its own image, wherever it lies: [min(q - window + 1, first), last], or [0, last] in full layers.
    Both are intervals because an image is a run of consecutive positions holding its query (first <= q <= last).
    """
    if rule not in IMAGE_ATTENTION:
        raise ValueError(f"image_attention must be one of {IMAGE_ATTENTION}, got {rule!r}")
    if rule == "causal" or (rule == "sliding_layers" and window is None):
        return None
    first, last = runs
    hi = jnp.maximum(q_pos, last)
    if window is None:
        lo = jnp.zeros_like(q_pos)
    elif rule == "sliding_layers":
        lo = q_pos - (window - 1)
    else:
        lo = jnp.minimum(q_pos - (window - 1), first)
    return jnp.stack([jnp.maximum(lo, 0), hi], axis=-1).astype(jnp.int32)


def bounds_mask(k_pos: Array, bounds: Array) -> Array:
    """[B, T, S]: key at k_pos [B, S] visible iff lo <= k_pos <= hi, bounds [B, T, 2] = (lo, hi) (`image_bounds`)."""
    return (k_pos[:, None, :] >= bounds[..., :1]) & (k_pos[:, None, :] <= bounds[..., 1:])
