"""Building blocks of Gemma 4: norms, projections, RoPE, feed-forward blocks.

Parameters keep the Hugging Face names and layouts (`weight` of a projection is `[out, in]`), so a checkpoint
maps onto the parameter tree by name alone and nothing is transposed at load time.

A projection whose parameters hold a scale beside its weight (`weight_scale`; the experts' `gate_up_proj_scale`,
`down_proj_scale`) is an fp8 one (weights/quantize.py): the weight is float8_e4m3fn and the matmul multiplies each
output channel by its scale. `init` creates no scale, so the abstract shapes are the unquantized model's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.model.config import RopeConfig
from gemma4_mtp_jax.kernels.attention_inputs import rms_norm
from gemma4_mtp_jax.kernels.device_budget import kernels_interpreted
from gemma4_mtp_jax.kernels.feed_forward import feed_forward_block, mlp
from gemma4_mtp_jax.kernels.grouped_matmul import routed_experts
from gemma4_mtp_jax.kernels.split_k import SplitSum, split_matmul
from gemma4_mtp_jax.model.sharding import expert_parallel, vocab_parallel

Array = jax.Array


class RMSNorm(nn.Module):
    """Gemma 4 RMSNorm: multiplies by `weight` itself (not 1 + weight); `with_scale=False` for v_norm / router."""

    eps: float = 1e-6
    with_scale: bool = True
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype) if self.with_scale else None
        return rms_norm(x, self.eps, w)


def _scale_of(module: nn.Module, name: str) -> Array | None:
    """The scale parameter `name` of an fp8 weight of `module`, or None (unquantized; and at init)."""
    return module.get_variable("params", name) if module.has_variable("params", name) else None


class Weight(nn.Module):
    """A bare `weight` parameter under its own name, for checkpoint tensors used by a kernel, not a matmul here."""

    shape: tuple[int, ...]
    param_dtype: jnp.dtype = jnp.float32
    init: Callable = nn.initializers.normal(0.02)

    @nn.compact
    def __call__(self) -> Array:
        return self.param("weight", self.init, self.shape, self.param_dtype)

    def scale(self) -> Array | None:
        """The per-output-channel scale of an fp8 `weight` ([shape[0]] float32), None for an unquantized one."""
        return _scale_of(self, "weight_scale")


class Linear(nn.Module):
    """y = x @ weight.T with the PyTorch `[out, in]` weight layout (no bias anywhere in Gemma 4). With `splits` > 1
    the contraction is split in that many parts and the unsummed partial products are returned (a `SplitSum`), for
    a consumer that adds them in its own kernel (kernels/split_k.py)."""

    features: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, splits: int = 1) -> Array | SplitSum:
        w = self.param("weight", nn.initializers.normal(0.02), (self.features, x.shape[-1]), self.param_dtype)
        return split_matmul(x, w, splits, _scale_of(self, "weight_scale"))


def scaled_embedding_lookup(table: Array, ids: Array, hidden_size: int) -> Array:
    """table[ids] * sqrt(H), the scale first cast to the table dtype (bf16: sqrt(1536) -> 39.25), as transformers."""
    scale = jnp.asarray(math.sqrt(hidden_size), dtype=table.dtype)
    return jnp.take(table, ids, axis=0) * scale


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [head_dim/2] (float32). Proportional RoPE rotates only the first `factor*head_dim/2` pairs,
    with frequencies of a full `head_dim` RoPE; the remaining pairs have frequency 0 (identity).

    A numpy constant, not traced: XLA did not fold the traced power, and computed it in kernels of its own in every
    step program. transformers' float32 steps (the exponent, theta to its power, the reciprocal), each computed in
    float64 and rounded to float32: numpy's own float32 power is the CPU's SIMD routine, and gave values 1 ulp apart
    on two machines' CPUs, where float64's rounds the same everywhere."""
    n_rot = int(rope.partial_rotary_factor * head_dim // 2)
    exponent = (np.arange(0, 2 * n_rot, 2, dtype=np.float64) / head_dim).astype(np.float32)
    power = (rope.theta ** exponent.astype(np.float64)).astype(np.float32)  # float32's power, correctly rounded
    inv = (1.0 / power.astype(np.float64)).astype(np.float32)
    return np.concatenate([inv, np.zeros((head_dim // 2 - n_rot,), np.float32)])


class MLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)); down_proj split in `splits` parts (see `Linear`). `block` is the whole
    feed-forward block after attention (the residual add and both norms, then this) in one kernel
    (kernels/feed_forward.py), where `plan_block` gives it a plan."""

    hidden_size: int
    intermediate_size: int
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        H, I, pd = self.hidden_size, self.intermediate_size, self.param_dtype
        self.gate_proj, self.up_proj = Weight((I, H), pd), Weight((I, H), pd)
        self.down_proj = Weight((H, I), pd)

    def __call__(self, x: Array, splits: int = 1) -> Array | SplitSum:
        scales = (self.gate_proj.scale(), self.up_proj.scale(), self.down_proj.scale())
        return mlp(x, self.gate_proj(), self.up_proj(), self.down_proj(), splits, scales)

    def quantized(self) -> bool:
        """Whether the weights are fp8 (the block's kernel then declines them: `plan_block`)."""
        return self.gate_proj.scale() is not None

    def block(self, a: Array | SplitSum, residual: Array, post_attention_norm: Array, pre_feedforward_norm: Array,
              *, eps: float, splits: int) -> tuple[Array, SplitSum]:
        """(residual + rms_norm(a, post_attention_norm), this MLP of its pre_feedforward norm as `splits`
        partials), through the kernel."""
        return feed_forward_block(a, residual, post_attention_norm, pre_feedforward_norm, self.gate_proj(),
                                  self.up_proj(), self.down_proj(), eps=eps, splits=splits,
                                  interpret=kernels_interpreted())


class Router(nn.Module):
    """Softmax router over the un-normed residual: top-k, renormalised, times `per_expert_scale`."""

    num_experts: int
    top_k: int
    eps: float
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, r: Array) -> tuple[Array, Array]:
        H = r.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (H,), self.param_dtype)
        per_expert_scale = self.param("per_expert_scale", nn.initializers.ones, (self.num_experts,), self.param_dtype)
        z = RMSNorm(self.eps, with_scale=False)(r) * scale.astype(r.dtype) * jnp.asarray(H**-0.5, r.dtype)
        scores = Linear(self.num_experts, self.param_dtype, name="proj")(z)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)  # [..., E]
        weights, idx = jax.lax.top_k(probs, self.top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights * jnp.take(per_expert_scale, idx).astype(jnp.float32)
        return weights, idx


class Experts(nn.Module):
    """The MoE experts. `gate_up_proj` [E, 2*Im, H] (first Im rows: gate), `down_proj` [E, H, Im] (fp8: with
    `gate_up_proj_scale` [E, 2*Im] and `down_proj_scale` [E, H]).

    Only the routed experts run (`routed_experts`: (token, expert) pairs sorted by expert through a grouped
    matmul that never reads an expert no token chose); all shapes are static, the routing decides only which
    rows land in which group.
    """

    num_experts: int
    moe_intermediate_size: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, weights: Array, idx: Array) -> Array:
        E, Im, H = self.num_experts, self.moe_intermediate_size, x.shape[-1]
        gate_up = self.param("gate_up_proj", nn.initializers.normal(0.02), (E, 2 * Im, H), self.param_dtype)
        down = self.param("down_proj", nn.initializers.normal(0.02), (E, H, Im), self.param_dtype)
        scales = _scale_of(self, "gate_up_proj_scale"), _scale_of(self, "down_proj_scale")  # [E, 2 Im], [E, H]
        lead, k = x.shape[:-1], idx.shape[-1]
        # Router statistics for the benchmarks (a no-op unless "intermediates" is mutable): the experts this call
        # had to read, which is what a memory-bound step costs.
        self.sow("intermediates", "experts_touched", jnp.sum(jnp.any(jax.nn.one_hot(idx.reshape(-1), E) > 0, axis=0)))
        out = expert_parallel(routed_experts, x.reshape(-1, H), weights.reshape(-1, k), idx.reshape(-1, k),
                              gate_up, down, *(() if scales[0] is None else scales))
        return out.reshape(*lead, H)


class Embedding(nn.Module):
    """A `[num, features]` table: scaled lookup (Gemma4TextScaledWordEmbedding) and, tied, the LM head."""

    num_embeddings: int
    features: int
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.weight = self.param("weight", nn.initializers.normal(1.0), (self.num_embeddings, self.features), self.param_dtype)

    def __call__(self, ids: Array, scale_dim: int) -> Array:
        return scaled_embedding_lookup(self.weight, ids, scale_dim)

    def attend(self, x: Array, split: bool = False) -> Array:
        """The tied LM head's logits; `split`: each device computes its own vocabulary rows' under tensor
        parallelism (sharding.vocab_parallel: the target's head; the assistant's runs whole)."""
        w = vocab_parallel(self.weight) if split else self.weight
        return jnp.einsum("...h,vh->...v", x, w.astype(x.dtype))
