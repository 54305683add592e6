"""The Gemma 4 decoder layer, shared by the target and the assistant (whose layers are all Q-only)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.config import SLIDING, TextConfig
from gemma4_mtp_jax.model.attention import KVView, Projections
from gemma4_mtp_jax.model.layers import MLP, Experts, Linear, RMSNorm, Router, Weight, gelu_tanh, rope_inv_freq
from gemma4_mtp_jax.sharding import tensor_parallel_size

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

        k = v = k_norm = qkv = None
        # attention_k_eq_v full layers use the un-normed, un-roped K projection as V (no v_proj).
        names = ("q_proj",) if lc.kv_mode == "reuse" else ("q_proj", "k_proj") + (() if lc.k_eq_v else ("v_proj",))
        widths = {"q_proj": nH * D, "k_proj": nKV * D, "v_proj": nKV * D}
        if len(names) > 1 and tensor_parallel_size() == 1:
            # One matmul over the three weights side by side (the GEMM reads their concatenation in place), its
            # output handed whole to the attention-inputs kernel: XLA's own merge of the three matmuls left a copy
            # that put the slices back together before the kernel (benchmarks/RESULTS.md, fifteenth session).
            # Under tensor parallelism q and k / v split by different heads, so each keeps its own matmul.
            w = jnp.concatenate([Weight((widths[n], x.shape[-1]), self.param_dtype, name=n)() for n in names])
            qkv = jnp.einsum("...i,oi->...o", x, w.astype(x.dtype))  # [B, T, (nH + nKV [+ nKV]) D]
            parts = jnp.split(qkv, np.cumsum([widths[n] for n in names])[:-1].tolist(), axis=-1)
        else:
            parts = [Linear(widths[n], self.param_dtype, name=n)(x) for n in names]
        q = parts[0].reshape(B, T, nH, D)
        if len(parts) > 1:
            k = parts[1].reshape(B, T, nKV, D)
            v = parts[2].reshape(B, T, nKV, D) if len(parts) > 2 else None
            k_norm = norm_weight("k_norm")
        p = Projections(q, k, v, norm_weight("q_norm"), k_norm, positions,
                        rope_inv_freq(cfg.rope[lc.layer_type], D), cfg.rms_norm_eps, qkv)
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
