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


def image_block_mask(q_pos: Array, k_pos: Array, q_blocks: Array, k_blocks: Array, window: int | None,
                     rule: str) -> Array:
    """[B, T, S]: `causal_window_mask` widened so that an image's soft tokens also see each other ahead of them.

    q_blocks [B, T] / k_blocks [B, S]: which image a token belongs to (the same id for every soft token of one
    image, -1 for any other token). `rule` (the text config's `image_attention`):
      * "causal": no widening;
      * "sliding_layers" (Gemma 4 "vision"): full layers (window None) stay causal; in sliding layers a query sees
        (key not ahead of it, or in its image) and key within the window: k_pos > q_pos - window;
      * "all_layers" (the unified 12B as transformers' forward builds it): in every layer a query sees
        `causal_window_mask`'s keys plus every key of its own image, wherever it lies.
    """
    allowed = causal_window_mask(q_pos, k_pos, window)
    if rule == "causal" or (rule == "sliding_layers" and window is None):
        return allowed
    same = (q_blocks[:, :, None] == k_blocks[:, None, :]) & (q_blocks[:, :, None] >= 0)
    if rule == "all_layers":
        return allowed | same
    if rule != "sliding_layers":
        raise ValueError(f"image_attention must be one of {IMAGE_ATTENTION}, got {rule!r}")
    near = k_pos[:, None, :] > q_pos[:, :, None] - window
    return (allowed | same) & near
