"""Gemma 4's audio tower (`model.audio_tower.*`, E2B / E4B): log-mel frames -> soft tokens, a conformer.

    features [B, T, F] (F mel bins), mask [B, T] (True: a real frame)
      -> 2 x (conv 3x3 stride 2, LayerNorm over channels, ReLU), frames and bins halved each time
      -> input_proj_linear of (bins/4 x channels)                                     [B, T/4, Ha]
      -> num_layers x conformer layer: 1/2 FFN, chunked local self-attention, light conv, 1/2 FFN, norm
      -> output_proj (with a bias)                                                    [B, T/4, output_proj_dims]

One soft token per 4 frames (40 ms of 10 ms frames); a soft token is valid where the subsampled mask is.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.model.layers import Linear, RMSNorm, Weight
from gemma4_mtp_jax.model.media_config import AudioConfig
from gemma4_mtp_jax.model.media_layers import BiasedLinear, ClippableLinear, LayerNorm

Array = jax.Array


def _clip(x: Array, bound: float) -> Array:
    # transformers clamps to min(gradient_clipping, the dtype's max): a finite bound in every dtype
    bound = min(bound, float(jnp.finfo(x.dtype).max))
    return jnp.clip(x, -bound, bound)


class SubsampleConvProjection(nn.Module):
    cfg: AudioConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, features: Array, mask: Array) -> tuple[Array, Array]:
        cfg, pd = self.cfg, self.param_dtype
        c0, c1 = cfg.subsampling_conv_channels
        x = features.astype(pd)[:, None]  # [B, 1, T, F]
        x, mask = _Conv(c0, cfg.rms_norm_eps, pd, name="layer0")(x, mask)
        x, mask = _Conv(c1, cfg.rms_norm_eps, pd, name="layer1")(x, mask)
        B, C, T, F = x.shape
        # transformers sizes input_proj_linear as (c0 / 4) * c1: the mel bins must number c0
        x = jnp.moveaxis(x, 1, -1).reshape(B, T, F * C)  # [B, T, bins x channels], channels fastest
        return Linear(cfg.hidden_size, pd, name="input_proj_linear")(x), mask


class _Conv(nn.Module):
    """One subsampling step (`layerN`): masked frames zeroed, conv 3x3 stride 2 padding 1 (no bias), LayerNorm over
    channels (no bias), ReLU. x [B, C, T, F] -> [B, C', ceil(T/2), ceil(F/2)]; the mask keeps every other frame."""

    channels: int
    eps: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, mask: Array) -> tuple[Array, Array]:
        w = Weight((self.channels, x.shape[1], 3, 3), self.param_dtype, name="conv")()  # OIHW, no bias
        x = x * mask[:, None, :, None].astype(x.dtype)  # masked frames enter as zeros
        y = jax.lax.conv_general_dilated(x, w.astype(x.dtype), (2, 2), ((1, 1), (1, 1)),
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        y = LayerNorm(self.eps, False, self.param_dtype, name="norm")(jnp.moveaxis(y, 1, -1))
        return jnp.moveaxis(jax.nn.relu(y), -1, 1), mask[:, ::2]


def relative_positions(cfg: AudioConfig) -> np.ndarray:
    """The sinusoids [L, Ha] of relative distances L-1..0 (L = context // 2 + 1), sin then cos halves."""
    context = cfg.attention_chunk_size + cfg.attention_context_left - 1 + cfg.attention_context_right
    n = cfg.hidden_size // 2
    inv = np.exp(np.arange(n, dtype=np.float32) * -(math.log(10000.0) / max(n - 1, 1))).astype(np.float32)
    t = np.arange(context // 2, -1, -1, dtype=np.float32)[:, None] * inv[None]
    return np.concatenate([np.sin(t), np.cos(t)], axis=-1).astype(np.float32)


def blocked_mask(valid: Array, cfg: AudioConfig) -> Array:
    """[B, blocks, C, S] which keys of each chunk's context a query may attend: a real frame at most
    context_left - 2 frames back or context_right - 1 ahead of the query (transformers' sliding mask over the
    subsampled frames, gathered into the chunked layout; positions outside the sequence are masked)."""
    B, T = valid.shape
    C, P, F = cfg.attention_chunk_size, cfg.attention_context_left - 1, cfg.attention_context_right
    nb = -(-T // C)
    q = jnp.arange(nb * C).reshape(nb, C)  # query position of (block, row)
    k = jnp.arange(nb)[:, None] * C - P + jnp.arange(C + P + F)[None]  # key position of (block, context col)
    dist = q[:, :, None] - k[:, None, :]  # [nb, C, S]
    near = ((dist >= 0) & (dist < P)) | ((dist < 0) & (-dist < F))
    inside = (k >= 0) & (k < T)
    key_valid = jnp.take(valid, jnp.clip(k, 0, T - 1), axis=1) & inside[None]  # [B, nb, S]
    return near[None] & (q < T)[None, :, :, None] & key_valid[:, :, None, :]


class AudioAttention(nn.Module):
    """Chunked local attention with a learned relative-position term (Transformer-XL style) and a logit softcap.
    Queries come in chunks of C frames; each chunk attends to a context of C + P + F frames (P = context_left - 1
    back, F = context_right ahead). Queries are scaled per dimension by softplus(per_dim_scale) / (sqrt(D) ln 2),
    keys by ln(1 + e) / ln 2."""

    cfg: AudioConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, valid: Array) -> Array:
        cfg, pd, clip = self.cfg, self.param_dtype, self.cfg.use_clipped_linears
        B, T, H = x.shape
        nH = cfg.num_heads
        D = H // nH
        C, P, F = cfg.attention_chunk_size, cfg.attention_context_left - 1, cfg.attention_context_right
        S = C + P + F
        nb = -(-T // C)
        per_dim_scale = self.param("per_dim_scale", nn.initializers.zeros, (D,), pd)
        proj = lambda name: ClippableLinear(H, clip, pd, name=name)(x).astype(jnp.float32).reshape(B, T, nH, D)  # noqa
        q = proj("q_proj") * ((D**-0.5) / math.log(2)) * jax.nn.softplus(per_dim_scale.astype(jnp.float32))
        k = proj("k_proj") * (math.log(1 + math.e) / math.log(2))
        v = proj("v_proj")

        q = jnp.pad(q, ((0, 0), (0, nb * C - T), (0, 0), (0, 0))).reshape(B, nb, C, nH, D)
        idx = jnp.arange(nb)[:, None] * C + jnp.arange(S)[None]  # [nb, S] into the left-padded sequence

        def context(a: Array) -> Array:  # [B, T, nH, D] -> [B, nb, S, nH, D]
            a = jnp.pad(a, ((0, 0), (P, F + C - 1), (0, 0), (0, 0)))
            return a[:, idx]

        k, v = context(k), context(v)
        rel = Linear(nH * D, pd, name="relative_k_proj")(jnp.asarray(relative_positions(cfg), pd))
        rel = rel.astype(jnp.float32).reshape(-1, nH, D)  # [L, nH, D]
        ac = jnp.einsum("bncid,bnjid->bincj", q, k)  # [B, nH, nb, C, S]
        bd = jnp.einsum("bncid,lid->bincl", q, rel)  # [B, nH, nb, C, L]
        # the relative shift: row i of each chunk moves i places, so column j reads distance L - 1 - (j - i)
        L = bd.shape[-1]
        bd = jnp.pad(bd, ((0, 0),) * 4 + ((0, S + 1 - L),)).reshape(B, nH, nb, C * (S + 1))
        bd = bd[..., : C * S].reshape(B, nH, nb, C, S)
        logits = jnp.tanh((ac + bd) / cfg.attention_logit_cap) * cfg.attention_logit_cap
        logits = jnp.where(blocked_mask(valid, cfg)[:, None], logits, cfg.attention_invalid_logits_value)
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bincj,bnjid->bncid", probs, v).reshape(B, nb * C, H)[:, :T]
        return ClippableLinear(H, clip, pd, name="post")(out.astype(x.dtype))


class AudioFeedForward(nn.Module):
    """Half-step FFN: clipped, normed, SiLU MLP (4x), clipped, normed, times residual_weight, plus the input."""

    cfg: AudioConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg, pd, clip = self.cfg, self.param_dtype, self.cfg.use_clipped_linears
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, True, pd, name=name)  # noqa: E731
        h = norm("pre_layer_norm")(_clip(x, cfg.gradient_clipping))
        h = ClippableLinear(4 * cfg.hidden_size, clip, pd, name="ffw_layer_1")(h)
        h = ClippableLinear(cfg.hidden_size, clip, pd, name="ffw_layer_2")(jax.nn.silu(h))
        h = norm("post_layer_norm")(_clip(h, cfg.gradient_clipping))
        return x + h * cfg.residual_weight


class LightConv1d(nn.Module):
    """Norm, GLU projection, causal depthwise conv over time (kernel K, left-padded K - 1), clip, norm, SiLU,
    projection, plus the input."""

    cfg: AudioConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg, pd, clip = self.cfg, self.param_dtype, self.cfg.use_clipped_linears
        H, K = cfg.hidden_size, cfg.conv_kernel_size
        h = RMSNorm(cfg.rms_norm_eps, True, pd, name="pre_layer_norm")(x)
        h = ClippableLinear(2 * H, clip, pd, name="linear_start")(h)
        h = h[..., :H] * jax.nn.sigmoid(h[..., H:])
        w = Weight((H, 1, K), pd, name="depthwise_conv1d")()  # one K-tap filter per channel
        hp = jnp.pad(h, ((0, 0), (K - 1, 0), (0, 0)))
        T = x.shape[1]
        h = sum(hp[:, j:j + T] * w[:, 0, j].astype(h.dtype) for j in range(K))
        h = RMSNorm(cfg.rms_norm_eps, True, pd, name="conv_norm")(_clip(h, cfg.gradient_clipping))
        return x + ClippableLinear(H, clip, pd, name="linear_end")(jax.nn.silu(h))


class AudioLayer(nn.Module):
    cfg: AudioConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, valid: Array) -> Array:
        cfg, pd = self.cfg, self.param_dtype
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, True, pd, name=name)  # noqa: E731
        x = AudioFeedForward(cfg, pd, name="feed_forward1")(x)
        a = AudioAttention(cfg, pd, name="self_attn")(norm("norm_pre_attn")(_clip(x, cfg.gradient_clipping)), valid)
        x = x + norm("norm_post_attn")(_clip(a, cfg.gradient_clipping))
        x = LightConv1d(cfg, pd, name="lconv1d")(x)
        x = AudioFeedForward(cfg, pd, name="feed_forward2")(x)
        return norm("norm_out")(_clip(x, cfg.gradient_clipping))


class Gemma4AudioTower(nn.Module):
    """(features [B, T, F], mask [B, T]) -> (soft tokens [B, ceil(T/4), output_proj_dims], valid [B, ceil(T/4)])."""

    cfg: AudioConfig
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, features: Array, mask: Array) -> tuple[Array, Array]:
        cfg, pd = self.cfg, self.param_dtype
        if features.shape[-1] // 4 != cfg.subsampling_conv_channels[0] // 4:
            raise ValueError(f"audio tower: {features.shape[-1]} mel bins, but the checkpoint's subsampling expects "
                             f"{cfg.subsampling_conv_channels[0]}")
        x, valid = SubsampleConvProjection(cfg, pd, name="subsample_conv_projection")(features, mask.astype(bool))
        for i in range(cfg.num_layers):
            x = AudioLayer(cfg, pd, name=f"layers_{i}")(x, valid)
        return BiasedLinear(cfg.output_proj_dims, pd, name="output_proj")(x), valid
