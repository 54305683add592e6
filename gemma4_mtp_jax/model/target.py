"""The Gemma 4 target: the text decoder of E2B, E4B, 26B-A4B and 31B."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma4_mtp_jax.model.config import TextConfig
from gemma4_mtp_jax.kernels.attention_inputs import rms_norm
from gemma4_mtp_jax.model.attention import DenseKV, KVView
from gemma4_mtp_jax.model.decoder import DecoderLayer, residual_norms
from gemma4_mtp_jax.model.layers import Embedding, Linear, RMSNorm
from gemma4_mtp_jax.model.traced import traced_once

Array = jax.Array


def layer_major(ple: Array) -> Array:
    """The per-layer inputs [B, T, L, P] as [L, B, T, P], materialized once: left to itself, XLA re-computes the
    normed projection inside each layer's slice (one extra kernel per layer). Each layer gets the whole stack and
    its index: at decode the split-K gate kernel reads its slice in place; where XLA slices it (larger calls),
    each slice is copied out by a kernel of its own (35 at E2B: `benchmarks/kernel_count.py --models e2b
    --by-scope 3`)."""
    return jax.lax.optimization_barrier(jnp.moveaxis(ple, -2, 0))


def representative(cfg: TextConfig, i: int) -> int:
    """The first layer of layer i's kind: same attention type and shapes, same K/V role (storing its own or
    reading another layer's), same MLP. Layers of one kind differ only in their weights, pages and per-layer input,
    so one traced program serves them all."""
    def kind(j: int) -> tuple:
        lc = cfg.layers[j]
        return (lc.layer_type, lc.head_dim, lc.num_kv_heads, lc.kv_mode, lc.kv_source == j, lc.intermediate_size,
                lc.k_eq_v)

    return next(j for j in range(i + 1) if kind(j) == kind(i))


def _layer_program(cfg: TextConfig, rep: int, param_dtype) -> Callable:
    """(params, x, positions, kv, per_layer_input, normed_x, next_norm) -> (x, next_norm(x), kv): decoder layer
    `rep`, traced once per program."""
    def build():
        module = DecoderLayer(cfg, rep, param_dtype, parent=None)  # a top-level module of its own

        def decoder_layer(params, x, positions, kv, ple, normed_x, next_norm):
            return module.apply({"params": params}, x, positions, kv, ple, normed_x=normed_x, next_norm=next_norm)

        return decoder_layer

    return traced_once((cfg,), ("decoder_layer", rep, jnp.dtype(param_dtype).name), build)


def _run_layer(cfg: TextConfig, i: int, param_dtype, params, x: Array, positions: Array, kv,
               ple: tuple[Array, Array] | None, normed_x: Array, next_norm: Array):
    """Decoder layer i on a view that can be narrowed (`only`/`absorb`), run as its kind's representative."""
    rep = representative(cfg, i)
    layers = {cfg.layers[rep].kv_source: cfg.layers[i].kv_source}  # the K/V it attends to
    if cfg.layers[i].kv_mode != "reuse":
        layers[rep] = i  # the K/V it stores (its own)
    x, x_next, view = _layer_program(cfg, rep, param_dtype)(params, x, positions, kv.only(layers), ple, normed_x,
                                                            next_norm)
    return x, x_next, kv.absorb(view, layers)


class Gemma4Target(nn.Module):
    """tokens [B, T], positions [B, T] -> logits [B, T, V] (softcapped), post-norm hidden [B, T, H], K/V view.

    Parameter names follow the checkpoint (`embed_tokens`, `layers_{i}`, `norm`, PLE tensors), with the
    `model.` / `model.language_model.` prefix dropped and `layers.{i}` written `layers_{i}`.
    """

    cfg: TextConfig
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg, pd = self.cfg, self.param_dtype
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, pd)
        if cfg.hidden_size_per_layer_input:  # per-layer embeddings (E2B/E4B)
            L, P = cfg.num_layers, cfg.hidden_size_per_layer_input
            self.embed_tokens_per_layer = Embedding(cfg.vocab_size_per_layer_input, L * P, pd)
            self.per_layer_model_projection = Linear(L * P, pd)
            self.per_layer_projection_norm = RMSNorm(cfg.rms_norm_eps, True, pd)
        self.layers = [DecoderLayer(cfg, i, pd, name=f"layers_{i}") for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, True, pd)

    def embed(self, tokens: Array) -> Array:
        """The scaled input embedding E[tok] * sqrt(H) (the assistant embeds its input tokens with it too)."""
        return self.embed_tokens(tokens, self.cfg.hidden_size)

    def __call__(self, tokens: Array, positions: Array, kv: KVView | None = None, *, logits: bool = True,
                 inputs_embeds: Array | None = None):
        """`inputs_embeds` [B, T, H]: the input embeddings to use instead of `embed(tokens)` (a prompt with media:
        soft tokens in place of the placeholders, `multimodal.merge_soft_tokens`); `tokens` then still give the
        per-layer embeddings' token identities, with the placeholders replaced by the pad id."""
        cfg = self.cfg
        x = self.embed(tokens) if inputs_embeds is None else inputs_embeds.astype(self.param_dtype)
        if kv is None:
            kv = DenseKV(positions)
        ple = self._per_layer_inputs(tokens, x) if cfg.hidden_size_per_layer_input else None
        if ple is not None:
            ple = layer_major(ple)
        # Each layer's last kernel also applies the norm that reads its output (the next layer's input_layernorm,
        # after the last layer the final norm), so `normed` is the next layer's input, normed. At init there are no
        # weights to hand over yet: each layer norms its own input.
        norms = None if self.is_initializing() else residual_norms(self.variables["params"], cfg.num_layers)
        normed = None if norms is None else rms_norm(x, cfg.rms_norm_eps, norms[0])
        # Over the paged state every layer runs through a program traced once per kind of layer (`_run_layer`):
        # tracing 60 layers one by one took 2-6 s per step program at 31B, the critical path of start-up.
        traced_once = hasattr(kv, "only") and norms is not None
        for i, layer in enumerate(self.layers):
            # The whole stack and the layer's index: the kernel after per_layer_input_gate reads the layer's slice.
            ple_i = None if ple is None else (ple, jnp.int32(i))
            next_norm = None if norms is None else norms[i + 1]
            if traced_once:
                x, normed, kv = _run_layer(cfg, i, self.param_dtype, self.variables["params"][f"layers_{i}"], x,
                                           positions, kv, ple_i, normed, next_norm)
            else:
                x, normed, kv = layer(x, positions, kv, ple_i, normed_x=normed, next_norm=next_norm)
        hidden = self.norm(x) if normed is None else normed
        return (self.lm_logits(hidden) if logits else None), hidden, kv

    def _per_layer_inputs(self, tokens: Array, inputs_embeds: Array) -> Array:
        """PLE: token identity plus a normed projection of the input embedding, one P-vector per layer [B,T,L,P]."""
        cfg = self.cfg
        L, P, H = cfg.num_layers, cfg.hidden_size_per_layer_input, cfg.hidden_size
        token_identity = self.embed_tokens_per_layer(tokens, P).reshape(*tokens.shape, L, P)
        ctx = self.per_layer_model_projection(inputs_embeds) * jnp.asarray(H**-0.5, inputs_embeds.dtype)
        ctx = self.per_layer_projection_norm(ctx.reshape(*tokens.shape, L, P))
        return (ctx + token_identity) * jnp.asarray(2.0**-0.5, ctx.dtype)

    def lm_logits(self, hidden: Array) -> Array:
        out = self.embed_tokens.attend(hidden, split=True)
        cap = self.cfg.final_logit_softcapping
        if cap:
            out = jnp.tanh(out / cap) * cap
        return out
