"""The Gemma 4 assistant (MTP drafter): 4 Q-only decoder layers over the target's K/V, and its LM heads."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma4_mtp_jax.model.config import AssistantConfig
from gemma4_mtp_jax.kernels.attention_inputs import rms_norm
from gemma4_mtp_jax.kernels.centroid_head import centroid_head
from gemma4_mtp_jax.model.attention import DraftKV
from gemma4_mtp_jax.model.decoder import DecoderLayer, residual_norms
from gemma4_mtp_jax.model.layers import Embedding, Linear, RMSNorm, Weight

Array = jax.Array


class CentroidHead(nn.Module):
    """The centroid-masked LM head of the E2B/E4B assistants (transformers' Gemma4AssistantMaskedEmbedder).

    Centroid scores pick the top-k token clusters; only their tokens get logits. The head's rows are stored
    permuted by `token_ordering` (done once at load time), so cluster c's tokens are the contiguous rows
    c*V/C .. (c+1)*V/C-1 of `ordered_embedding`, and `token_ordering` maps a row back to its token id.
    """

    num_centroids: int
    top_k: int
    vocab_size: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hn: Array) -> tuple[Array, Array]:
        """hn [B, Ha] -> (sparse logits [B, K*V/C], their canonical token ids [B, K*V/C] int32)."""
        C, V = self.num_centroids, self.vocab_size
        Ha = hn.shape[-1]
        centroids = Weight((C, Ha), self.param_dtype, name="centroids")()
        table = self.param("ordered_embedding", nn.initializers.normal(1.0), (V, Ha), self.param_dtype)
        ordering = self.param("token_ordering", lambda *_: jnp.arange(V, dtype=jnp.int32))
        # The plain-XLA path of the kernels' module is the reference semantics; the draft step picks the kernels.
        return centroid_head(hn, centroids, table, ordering, self.top_k, mode="sparse", impl="xla")


def scatter_sparse_logits(logits: Array, ids: Array, vocab_size: int) -> Array:
    """Full-vocab logits as transformers builds them: unselected tokens get min(selected) - 1.

    transformers takes the min over the whole batch, but its drafter only ever runs one sequence; per row keeps
    a sequence's draft distribution independent of its batch neighbours and equals transformers at batch 1.
    """
    fill = jnp.min(logits, axis=-1, keepdims=True) - 1.0
    full = jnp.broadcast_to(fill, (logits.shape[0], vocab_size)).astype(logits.dtype)
    return full.at[jnp.arange(logits.shape[0])[:, None], ids].set(logits)


class Gemma4Assistant(nn.Module):
    """One draft step: (scaled target embedding of the token, h) -> (normed draft hidden hn, next h).

    `concat(E_target(tok) * sqrt(Hb), h)` -> pre_projection (no sqrt(Ha) scaling) -> Q-only layers at the
    query position P = committed length -> norm = hn; post_projection(hn) is the next step's h. The logits come
    from hn through the tied draft-dim head (`logits`) or the centroid head (`sparse_logits`). No softcap.
    """

    cfg: AssistantConfig
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg, text, pd = self.cfg, self.cfg.text, self.param_dtype
        self.pre_projection = Linear(text.hidden_size, pd)
        # Its projections stay whole: XLA does not split the 256-wide matmuls' contraction, and the split-K kernels
        # would only make each layer's input a buffer of its own (docs/decisions/0008-split-k-projections.md).
        self.layers = [DecoderLayer(text, i, pd, split_k=False, name=f"layers_{i}") for i in range(text.num_layers)]
        self.norm = RMSNorm(text.rms_norm_eps, True, pd)
        self.post_projection = Linear(cfg.backbone_hidden_size, pd)
        if cfg.use_ordered_embeddings:
            self.masked_embedding = CentroidHead(cfg.num_centroids, cfg.centroid_top_k, text.vocab_size, pd)
        else:
            self.embed_tokens = Embedding(text.vocab_size, text.hidden_size, pd)

    def __call__(self, token_embedding: Array, h: Array, kv: DraftKV) -> tuple[Array, Array]:
        """token_embedding, h: [B, Hb] -> hn [B, Ha], h_next [B, Hb]."""
        x = self.pre_projection(jnp.concatenate([token_embedding, h.astype(token_embedding.dtype)], -1))[:, None]
        positions = kv.lengths[:, None]  # docs/DESIGN.md convention 1: the bonus position, constant within a round
        # As in the target, each layer's last kernel applies the norm that reads its output (the next layer's
        # input_layernorm, after the last layer the final norm); at init each layer norms its own input.
        eps = self.cfg.text.rms_norm_eps
        norms = None if self.is_initializing() else residual_norms(self.variables["params"], len(self.layers))
        normed = None if norms is None else rms_norm(x, eps, norms[0])
        for i, layer in enumerate(self.layers):
            x, normed, _ = layer(x, positions, kv, normed_x=normed, next_norm=None if norms is None else norms[i + 1])
        hn = (self.norm(x) if normed is None else normed)[:, 0]
        return hn, self.post_projection(hn)

    def logits(self, hn: Array) -> Array:
        """Full-vocab logits [B, V] (the centroid head fills unselected tokens as transformers does)."""
        if self.cfg.use_ordered_embeddings:
            sparse, ids = self.masked_embedding(hn)
            return scatter_sparse_logits(sparse, ids, self.cfg.text.vocab_size)
        return self.embed_tokens.attend(hn)
