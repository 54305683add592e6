"""The Gemma 4 decoder layer, shared by the target and the assistant (whose layers are all Q-only)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma4_mtp_jax.config import SLIDING, TextConfig
from gemma4_mtp_jax.model.attention import KVView, Projections
from gemma4_mtp_jax.model.layers import MLP, Experts, Linear, RMSNorm, Router, Weight, gelu_tanh, rope_inv_freq

Array = jax.Array


class Attention(nn.Module):
    """q_norm'ed, RoPE'd queries; layers that own K/V also project, norm and rope K (V: v_norm, no weight)
    and store them in the view (which does all of it, `KVView.prepare`); every layer then attends to the K/V
    of its `kv_source`."""

    cfg: TextConfig
    layer: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, positions: Array, kv: KVView) -> tuple[Array, KVView]:
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
        out = kv.attend(lc.kv_source, q, positions, window)  # [B, T, nH, D]
        return Linear(cfg.hidden_size, self.param_dtype, name="o_proj")(out.reshape(B, T, nH * D)), kv


class DecoderLayer(nn.Module):
    """Sandwich-norm attention and feed-forward blocks [+ MoE beside the MLP] [+ per-layer input], then the
    whole residual stream times `layer_scalar`."""

    cfg: TextConfig
    layer: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array, positions: Array, kv: KVView, per_layer_input: Array | None = None):
        cfg, lc = self.cfg, self.cfg.layers[self.layer]
        H, pd = cfg.hidden_size, self.param_dtype
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, True, pd, name=name)  # noqa: E731

        residual = x
        a, kv = Attention(cfg, self.layer, pd, name="self_attn")(norm("input_layernorm")(x), positions, kv)
        x = residual + norm("post_attention_layernorm")(a)

        residual = x
        f = MLP(H, lc.intermediate_size, pd, name="mlp")(norm("pre_feedforward_layernorm")(x))
        if cfg.enable_moe_block:
            weights, idx = Router(cfg.num_experts, cfg.top_k_experts, cfg.rms_norm_eps, pd, name="router")(residual)
            e = Experts(cfg.num_experts, cfg.moe_intermediate_size, pd, name="experts")(
                norm("pre_feedforward_layernorm_2")(residual), weights, idx
            )
            f = norm("post_feedforward_layernorm_1")(f) + norm("post_feedforward_layernorm_2")(e)
        x = residual + norm("post_feedforward_layernorm")(f)

        if cfg.hidden_size_per_layer_input:
            g = gelu_tanh(Linear(cfg.hidden_size_per_layer_input, pd, name="per_layer_input_gate")(x)) * per_layer_input
            x = x + norm("post_per_layer_input_norm")(Linear(H, pd, name="per_layer_projection")(g))

        layer_scalar = self.param("layer_scalar", nn.initializers.ones, (1,), pd)
        return x * layer_scalar.astype(x.dtype), kv
