"""The unified 12B's encoder-free image embedder (`model.vision_embedder.*` in the checkpoint): one soft token per
merged pixel patch, no attention.

    patches [B, N, 3 m^2] (m = patch_size * pooling_kernel_size), positions [B, N, 2] ((-1, -1): padding)
      -> patch_ln1 -> patch_dense (with bias) -> patch_ln2                              [B, N, E]
      -> + pos_embedding[x, 0] + pos_embedding[y, 1] (a coordinate of -1 adds nothing) -> pos_norm
Its output goes through `embed_vision` (RMSNorm without weight, projection) like Gemma 4's towers'. The LayerNorms
are torch's defaults (eps 1e-5, with bias).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma4_mtp_jax.model.media_config import UnifiedVisionConfig
from gemma4_mtp_jax.model.media_layers import BiasedLinear, LayerNorm

Array = jax.Array


class UnifiedVisionEmbedder(nn.Module):
    """(patches [B, N, 3 m^2], positions [B, N, 2]) -> (embeddings [B, N, E], valid [B, N])."""

    cfg: UnifiedVisionConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixels: Array, positions: Array) -> tuple[Array, Array]:
        cfg, pd = self.cfg, self.param_dtype
        E = cfg.mm_embed_dim
        x = LayerNorm(1e-5, True, pd, name="patch_ln1")(pixels.astype(pd))
        x = LayerNorm(1e-5, True, pd, name="patch_ln2")(BiasedLinear(E, pd, name="patch_dense")(x))
        table = self.param("pos_embedding", nn.initializers.zeros, (cfg.mm_posemb_size, 2, E), pd)
        where = jnp.maximum(positions, 0)
        pos = sum(jnp.where((positions[..., a] != -1)[..., None], jnp.take(table[:, a], where[..., a], axis=0), 0)
                  for a in range(2))
        x = LayerNorm(1e-5, True, pd, name="pos_norm")(x + pos.astype(x.dtype))
        return x, jnp.all(positions != -1, axis=-1)
