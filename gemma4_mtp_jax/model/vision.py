"""Gemma 4's vision tower (`model.vision_tower.*`): pixel patches -> soft tokens, k x k patches pooled into one.

    patches [B, N, 3 p^2] in [0, 1], positions [B, N, 2] (x, y; (-1, -1) for padding)
      -> input_proj(2 x - 1) + pos_table[0][x] + pos_table[1][y]                      [B, N, Hv]
      -> num_layers x encoder layer (bidirectional over the image's own patches, 2-D RoPE)
      -> padding zeroed, average over each k x k cell of the patch grid, times sqrt(Hv)  [B, N / k^2, Hv]
      -> (standardize) (x - std_bias) * std_scale

An image's soft tokens are the cells in raster order (x fastest); cells beyond the image's own grid (the padding
an image smaller than the budget leaves) are invalid and dropped before they reach the text model.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma4_mtp_jax.kernels.attention_inputs import rms_norm
from gemma4_mtp_jax.kernels.dense_attention import dot_product_attention
from gemma4_mtp_jax.model.layers import Linear, RMSNorm
from gemma4_mtp_jax.model.media_config import VisionConfig
from gemma4_mtp_jax.model.media_layers import ClippableLinear

Array = jax.Array


def axial_rope(x: Array, positions: Array, theta: float) -> Array:
    """2-D RoPE of x [B, N, heads, D]: the first half of each head rotated (rotate-half style) by the patch's x
    coordinate, the second half by its y, both with the inverse frequencies of a D/2-wide RoPE."""
    D = x.shape[-1]
    half = D // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))  # [D/4]
    out = []
    for axis in range(2):
        ang = positions[..., axis].astype(jnp.float32)[..., None] * inv_freq  # [B, N, D/4]
        cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, :, None].astype(x.dtype)
        sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, :, None].astype(x.dtype)
        part = x[..., axis * half:(axis + 1) * half]
        q = half // 2
        rotated = jnp.concatenate([-part[..., q:], part[..., :q]], axis=-1)
        out.append(part * cos + rotated * sin)
    return jnp.concatenate(out, axis=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention over one image's patches (padding keys masked), scale 1: q / k normed per head with
    weights, v without one; q / k 2-D roped."""

    cfg: VisionConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, positions: Array, valid: Array) -> Array:
        cfg, pd = self.cfg, self.param_dtype
        B, N, _ = x.shape
        D, nH, nKV, clip = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.use_clipped_linears
        q = ClippableLinear(nH * D, clip, pd, name="q_proj")(x).reshape(B, N, nH, D)
        k = ClippableLinear(nKV * D, clip, pd, name="k_proj")(x).reshape(B, N, nKV, D)
        v = ClippableLinear(nKV * D, clip, pd, name="v_proj")(x).reshape(B, N, nKV, D)
        q = axial_rope(RMSNorm(cfg.rms_norm_eps, True, pd, name="q_norm")(q), positions, cfg.rope_theta)
        k = axial_rope(RMSNorm(cfg.rms_norm_eps, True, pd, name="k_norm")(k), positions, cfg.rope_theta)
        v = rms_norm(v, cfg.rms_norm_eps)
        allowed = jnp.broadcast_to(valid[:, None, :], (B, N, N))
        out = dot_product_attention(q, k, v, allowed).reshape(B, N, nH * D)
        return ClippableLinear(cfg.hidden_size, clip, pd, name="o_proj")(out)


class VisionMLP(nn.Module):
    cfg: VisionConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg, pd, clip = self.cfg, self.param_dtype, self.cfg.use_clipped_linears
        gate = ClippableLinear(cfg.intermediate_size, clip, pd, name="gate_proj")(x)
        up = ClippableLinear(cfg.intermediate_size, clip, pd, name="up_proj")(x)
        return ClippableLinear(cfg.hidden_size, clip, pd, name="down_proj")(jax.nn.gelu(gate, approximate=True) * up)


class VisionEncoderLayer(nn.Module):
    """Sandwich norms around attention and the MLP (as the text decoder layer, without layer_scalar)."""

    cfg: VisionConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, positions: Array, valid: Array) -> Array:
        eps, pd = self.cfg.rms_norm_eps, self.param_dtype
        norm = lambda name: RMSNorm(eps, True, pd, name=name)  # noqa: E731
        a = VisionAttention(self.cfg, pd, name="self_attn")(norm("input_layernorm")(x), positions, valid)
        x = x + norm("post_attention_layernorm")(a)
        f = VisionMLP(self.cfg, pd, name="mlp")(norm("pre_feedforward_layernorm")(x))
        return x + norm("post_feedforward_layernorm")(f)


class VisionEncoder(nn.Module):
    cfg: VisionConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, positions: Array, valid: Array) -> Array:
        for i in range(self.cfg.num_layers):
            x = VisionEncoderLayer(self.cfg, self.param_dtype, name=f"layers_{i}")(x, positions, valid)
        return x


class PatchEmbedder(nn.Module):
    """`input_proj` of the patch's pixels mapped to [-1, 1] (the image processor leaves them in [0, 1]), plus
    `position_embedding_table` [2, P, Hv]: row x of table 0 plus row y of table 1; none for padding."""

    cfg: VisionConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixels: Array, positions: Array, valid: Array) -> Array:
        cfg = self.cfg
        table = self.param("position_embedding_table", nn.initializers.ones,
                           (2, cfg.position_embedding_size, cfg.hidden_size), self.param_dtype)
        x = Linear(cfg.hidden_size, self.param_dtype, name="input_proj")(2 * (pixels.astype(self.param_dtype) - 0.5))
        where = jnp.maximum(positions, 0)
        pos = jnp.take(table[0], where[..., 0], axis=0) + jnp.take(table[1], where[..., 1], axis=0)
        return x + jnp.where(valid[..., None], pos, 0).astype(x.dtype)


def pool_cells(x: Array, positions: Array, valid: Array, k: int) -> tuple[Array, Array]:
    """Average each k x k cell of the patch grid (x [B, N, Hv], padding rows already zero) into its soft token, in
    float32: [B, N / k^2, Hv] and which of them are the image's own cells [B, N / k^2]. Cell (cx, cy) is soft token
    cx + (grid width / k) * cy; padding patches (positions -1) fall into cell 0 with zero values, and the divisor is
    always k^2 (as transformers)."""
    B, N, _ = x.shape
    S = N // k**2
    where = jnp.maximum(positions, 0)
    width = jnp.max(where[..., 0], axis=-1, keepdims=True) + 1  # [B, 1] patches per row of each image
    cell = where[..., 0] // k + (width // k) * (where[..., 1] // k)  # [B, N]
    weights = jax.nn.one_hot(cell, S, dtype=jnp.float32) / k**2  # [B, N, S]
    pooled = jnp.einsum("bns,bnh->bsh", weights, x.astype(jnp.float32))
    return pooled, jnp.any(weights != 0, axis=1)


class Gemma4VisionTower(nn.Module):
    """(patches [B, N, 3 p^2], positions [B, N, 2]) -> (soft tokens [B, N / k^2, Hv] in float32, valid [B, N / k^2]).

    N is the processor's patch budget (max_soft_tokens * k^2); an image of fewer patches is padded with positions
    (-1, -1), and only its first (grid width / k) * (grid height / k) soft tokens are valid."""

    cfg: VisionConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixels: Array, positions: Array) -> tuple[Array, Array]:
        cfg, k = self.cfg, self.cfg.pooling_kernel_size
        N = pixels.shape[1]
        if N % k**2:
            raise ValueError(f"vision tower: {N} patches do not pool into {k}x{k} cells")
        valid = jnp.any(positions != -1, axis=-1)
        x = PatchEmbedder(cfg, self.param_dtype, name="patch_embedder")(pixels, positions, valid)
        x = VisionEncoder(cfg, self.param_dtype, name="encoder")(x, positions, valid)
        x = jnp.where(valid[..., None], x, 0)
        if k > 1:
            pooled, cells = pool_cells(x, positions, valid, k)
        else:  # one patch a soft token (transformers keeps its padding rows here; they are not the image's)
            pooled, cells = x.astype(jnp.float32), valid
        # sqrt(Hv) in float32: in float16 the scaled values could overflow before standardization brings them back
        pooled = pooled * math.sqrt(cfg.hidden_size)
        if cfg.standardize:
            bias = self.variable("params", "std_bias", lambda: jnp.zeros((cfg.hidden_size,), self.param_dtype))
            scale = self.variable("params", "std_scale", lambda: jnp.ones((cfg.hidden_size,), self.param_dtype))
            pooled = (pooled - bias.value.astype(jnp.float32)) * scale.value.astype(jnp.float32)
        return pooled, cells
