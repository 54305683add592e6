"""Building blocks the media encoders use and the text model does not: clipped projections, LayerNorm, a projection
with a bias, and the projection of soft tokens into the text model. Parameter names and layouts are the
checkpoint's (a weight is `[out, in]`), as in `layers.py`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma4_mtp_jax.kernels.attention_inputs import rms_norm
from gemma4_mtp_jax.model.layers import Linear

Array = jax.Array


class ClippableLinear(nn.Module):
    """`linear` (no bias) whose input and output are clamped to the checkpoint's `input_min` / `input_max` /
    `output_min` / `output_max` (scalars) when the tower was trained with clipped linears (quantization-aware
    training left the bounds in the checkpoint); without them it is the plain projection."""

    features: int
    clipped: bool
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        if self.clipped:
            bound = lambda name, v: self.param(name, nn.initializers.constant(v), (), self.param_dtype)  # noqa: E731
            lo, hi = bound("input_min", -jnp.inf), bound("input_max", jnp.inf)
            x = jnp.clip(x, lo.astype(x.dtype), hi.astype(x.dtype))
        y = Linear(self.features, self.param_dtype, name="linear")(x)
        if self.clipped:
            y = jnp.clip(y, bound("output_min", -jnp.inf).astype(y.dtype), bound("output_max", jnp.inf).astype(y.dtype))
        return y


class BiasedLinear(nn.Module):
    """y = x @ weight.T + bias (`weight` [out, in], `bias` [out])."""

    features: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        w = self.param("weight", nn.initializers.normal(0.02), (self.features, x.shape[-1]), self.param_dtype)
        b = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
        return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype)) + b.astype(x.dtype)


class LayerNorm(nn.Module):
    """torch's LayerNorm over the last axis (biased variance, eps inside the root), in float32; `weight` and,
    with `use_bias`, `bias`."""

    eps: float = 1e-5
    use_bias: bool = True
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        n = x.shape[-1]
        w = self.param("weight", nn.initializers.ones, (n,), self.param_dtype)
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps) * w.astype(jnp.float32)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (n,), self.param_dtype).astype(jnp.float32)
        return y.astype(x.dtype)


class MultimodalEmbedder(nn.Module):
    """An encoder's soft tokens [..., M] into the text model's space [..., H]: an RMSNorm without a weight, then
    `embedding_projection` (transformers' `Gemma4MultimodalEmbedder`). The result enters the text model as is: it
    is not multiplied by sqrt(H) as token embeddings are."""

    text_hidden_size: int
    eps: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x = rms_norm(x.astype(self.param_dtype), self.eps)
        return Linear(self.text_hidden_size, self.param_dtype, name="embedding_projection")(x)
