"""How media soft tokens enter the text model (transformers' `Gemma4Model.forward`, line for line in effect):

  1. every placeholder (image, video or audio token id) is embedded as the pad token, scaled as any token;
  2. the soft tokens (already in the text model's space, not scaled) overwrite the placeholders, in order: the
     n-th image placeholder of the batch (row-major) takes the n-th valid image soft token, audio likewise;
  3. per-layer embeddings (E2B / E4B) take the pad token's identity at a placeholder, and their projection reads
     the merged embeddings;
  4. with `TextConfig.image_attention` other than "causal", the soft tokens of one image (a run of image or video
     placeholders: the begin / end-of-image tokens around it are text) attend to each other
     (`kernels.dense_attention.image_bounds`).

Shapes stay static: an encoder's output keeps its padding rows and a validity mask, and the merge gathers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.model.media_config import MediaConfig

Array = jax.Array


def text_tokens(tokens: Array, cfg: MediaConfig) -> Array:
    """tokens [B, T] with every media placeholder replaced by the pad id (what the embeddings look up)."""
    is_media = jnp.isin(tokens, jnp.asarray(cfg.media_token_ids, tokens.dtype))
    return jnp.where(is_media, jnp.asarray(cfg.pad_token_id, tokens.dtype), tokens)


def vision_tokens(tokens: Array, cfg: MediaConfig) -> Array:
    """[B, T] bool: the image (and video frame) soft tokens' placeholders, whose runs are the images
    (`kernels.dense_attention.image_runs`)."""
    return (tokens == cfg.image_token_id) | (tokens == cfg.video_token_id)


def compact(soft: Array, valid: Array) -> tuple[Array, Array]:
    """Encoder outputs [n, S, H] with their mask [n, S] -> ([n * S, H] with the valid rows first, in order; the
    number of valid rows)."""
    flat, keep = soft.reshape(-1, soft.shape[-1]), valid.reshape(-1)
    order = jnp.argsort(~keep, stable=True)
    return flat[order], jnp.sum(keep)


def merge_soft_tokens(embeds: Array, tokens: Array, token_id: int, soft: Array, valid: Array) -> Array:
    """embeds [B, T, H] with the placeholders `token_id` of `tokens` [B, T] overwritten, in row-major order, by the
    valid rows of the encoder output soft [n, S, H] (valid [n, S]). The counts must agree (`check_counts`)."""
    rows, _ = compact(soft.astype(embeds.dtype), valid)
    at = tokens == token_id
    idx = jnp.cumsum(at.reshape(-1)) - 1
    taken = jnp.take(rows, jnp.clip(idx, 0, rows.shape[0] - 1), axis=0).reshape(embeds.shape)
    return jnp.where(at[..., None], taken, embeds)


def check_counts(tokens: np.ndarray, token_id: int, valid: np.ndarray, what: str) -> None:
    """Refuse a prompt whose placeholders `token_id` do not number the encoder's valid soft tokens."""
    want, have = int(np.sum(np.asarray(tokens) == token_id)), int(np.sum(np.asarray(valid)))
    if want != have:
        raise ValueError(f"the prompt holds {want} {what} placeholder tokens (id {token_id}), but the {what} "
                         f"encoder gave {have} soft tokens")
