"""The Gemma 4 decoder layer, shared by the target and the assistant (whose layers are all Q-only)."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma4_mtp_jax.model.config import SLIDING, TextConfig
from gemma4_mtp_jax.kernels.attention_inputs import rms_norm
from gemma4_mtp_jax.kernels.feed_forward import input_parts, plan_block
from gemma4_mtp_jax.kernels.split_k import SplitSum, add_normed, gelu_gate, plan_splits
from gemma4_mtp_jax.model.attention import KVView, Projections
from gemma4_mtp_jax.model.layers import MLP, Experts, Linear, RMSNorm, Router, Weight, rope_inv_freq
from gemma4_mtp_jax.model.sharding import tensor_parallel_size

Array = jax.Array


def splits_for(x: Array, K: int, N: int, split_k: bool = True) -> int:
    """How many parts the contraction of a projection of x (K -> N) is split into, its partials summed by the norm
    kernel after it (kernels/split_k.py); 1 without `split_k`, and under tensor parallelism, whose row-parallel
    projections are sharded along K and summed by an all-reduce."""
    if not split_k or tensor_parallel_size() > 1:
        return 1
    return plan_splits(math.prod(x.shape[:-1]), K, N, jnp.dtype(x.dtype).itemsize)


def residual_norms(params: dict, num_layers: int) -> list[Array]:
    """The weights of the norms that read a decoder's residual stream: every layer's input_layernorm, then the
    final norm's ([L + 1] of [H]), for each layer's last kernel to apply the next one (`next_norm`)."""
    return [params[f"layers_{i}"]["input_layernorm"]["weight"] for i in range(num_layers)] + [params["norm"]["weight"]]


class Attention(nn.Module):
    """q_norm'ed, RoPE'd queries; layers that own K/V also project, norm and rope K (V: v_norm, no weight)
    and store them in the view (which does all of it, `KVView.prepare`); every layer then attends to the K/V
    of its `kv_source`."""

    cfg: TextConfig
    layer: int
    param_dtype: jnp.dtype = jnp.float32
    split_k: bool = True

    @nn.compact
    def __call__(self, x: Array, positions: Array, kv: KVView, out_parts: int | None = None
                 ) -> tuple[Array | SplitSum, KVView]:
        """`out_parts`: o_proj split in that many parts for the kernel after it to add (None: `splits_for`)."""
        cfg, lc = self.cfg, self.cfg.layers[self.layer]
        B, T, _ = x.shape
        D, nH, nKV = lc.head_dim, cfg.num_heads, lc.num_kv_heads
        norm_weight = lambda name: Weight((D,), self.param_dtype, nn.initializers.ones, name=name)()  # noqa: E731

        q = Linear(nH * D, self.param_dtype, name="q_proj")(x).reshape(B, T, nH, D)
        k = v = k_norm = None
        if lc.kv_mode != "reuse":
            k = Linear(nKV * D, self.param_dtype, name="k_proj")(x).reshape(B, T, nKV, D)
            # attention_k_eq_v full layers use the un-normed, un-roped K projection as V (v None).
            v = None if lc.k_eq_v else Linear(nKV * D, self.param_dtype, name="v_proj")(x).reshape(B, T, nKV, D)
            k_norm = norm_weight("k_norm")
        p = Projections(q, k, v, norm_weight("q_norm"), k_norm, positions,
                        rope_inv_freq(cfg.rope[lc.layer_type], D), cfg.rms_norm_eps)
        q, kv = kv.prepare(self.layer, p)
        window = cfg.sliding_window if lc.layer_type == SLIDING else None
        out = kv.attend(lc.kv_source, q, positions, window).reshape(B, T, nH * D)
        o_proj = Linear(cfg.hidden_size, self.param_dtype, name="o_proj")
        parts = splits_for(out, nH * D, cfg.hidden_size, self.split_k) if out_parts is None else out_parts
        return o_proj(out, parts), kv


class DecoderLayer(nn.Module):
    """Sandwich-norm attention and feed-forward blocks [+ MoE beside the MLP] [+ per-layer input], then the
    whole residual stream times `layer_scalar`.

    The post-norms of o_proj and down_proj (and the per-layer-input gate) go through kernels/split_k.py, which adds
    the partial products of a projection split along its contraction in the same kernel; for an unsplit projection
    it is the plain math; `split_k` False keeps every projection whole. `per_layer_input` is (the stack of every
    layer's [L, B, T, P], this layer's index).

    The norm that reads the layer's output (the next layer's input_layernorm, or the model's final norm) is applied
    by the layer's last residual kernel when its weight is passed as `next_norm`: a norm on its own is a kernel per
    layer. `normed_x` is then the previous layer's output through this layer's input_layernorm; None, and the layer
    norms x itself. Returns (x, next_norm(x) or None, kv)."""

    cfg: TextConfig
    layer: int
    param_dtype: jnp.dtype = jnp.float32
    split_k: bool = True

    @nn.compact
    def __call__(self, x: Array, positions: Array, kv: KVView, per_layer_input: tuple[Array, Array] | None = None,
                 *, normed_x: Array | None = None, next_norm: Array | None = None
                 ) -> tuple[Array, Array | None, KVView]:
        cfg, lc = self.cfg, self.cfg.layers[self.layer]
        H, pd, eps = cfg.hidden_size, self.param_dtype, cfg.rms_norm_eps
        norm = lambda name: RMSNorm(eps, True, pd, name=name)  # noqa: E731
        norm_weight = lambda name: Weight((H,), pd, nn.initializers.ones, name=name)()  # noqa: E731

        input_norm = norm_weight("input_layernorm")
        residual = x
        mlp = MLP(H, lc.intermediate_size, pd, name="mlp")
        block_splits = None if cfg.enable_moe_block or tensor_parallel_size() > 1 else plan_block(
            math.prod(x.shape[:-1]), H, lc.intermediate_size, x.dtype, mlp.quantized())
        attention = Attention(cfg, self.layer, pd, self.split_k, name="self_attn")
        a, kv = attention(rms_norm(x, eps, input_norm) if normed_x is None else normed_x, positions, kv,
                          None if block_splits is None else input_parts(cfg.num_heads * lc.head_dim))
        post_attention = norm_weight("post_attention_layernorm")
        pre_feedforward = norm_weight("pre_feedforward_layernorm")
        if block_splits is not None:  # the attention block's residual add, its norms and the MLP in one kernel
            x, f = mlp.block(a, residual, post_attention, pre_feedforward, eps=eps, splits=block_splits)
        else:
            x, mlp_input = add_normed(a, residual, post_attention, eps=eps, next_weight=pre_feedforward)
            splits = 1 if cfg.enable_moe_block else splits_for(mlp_input, lc.intermediate_size, H, self.split_k)
            f = mlp(mlp_input, splits)
        residual = x
        if cfg.enable_moe_block:
            weights, idx = Router(cfg.num_experts, cfg.top_k_experts, eps, pd, name="router")(residual)
            e = Experts(cfg.num_experts, cfg.moe_intermediate_size, pd, name="experts")(
                norm("pre_feedforward_layernorm_2")(residual), weights, idx
            )
            f = norm("post_feedforward_layernorm_1")(f) + norm("post_feedforward_layernorm_2")(e)
        # The layer's last residual add also multiplies by layer_scalar: a kernel's operand must be a buffer, so a
        # separate multiply would be a kernel of its own.
        layer_scalar = self.param("layer_scalar", nn.initializers.ones, (1,), pd)
        P = cfg.hidden_size_per_layer_input
        x, x_next = add_normed(f, residual, norm_weight("post_feedforward_layernorm"), eps=eps,
                               scale=None if P else layer_scalar, next_weight=None if P else next_norm)

        if P:
            gate = Linear(P, pd, name="per_layer_input_gate")(x, splits_for(x, H, P, self.split_k))
            g = gelu_gate(gate, *per_layer_input)
            projection = Linear(H, pd, name="per_layer_projection")(g, splits_for(g, P, H, self.split_k))
            x, x_next = add_normed(projection, x, norm_weight("post_per_layer_input_norm"), eps=eps,
                                   scale=layer_scalar, next_weight=next_norm)
        return x, x_next, kv
