"""A multimodal target's media encoders as one Flax module whose parameter tree mirrors the checkpoint's names with
`model.` dropped (`vision_tower.encoder.layers_0...`, `embed_vision.embedding_projection.weight`, ...):

  * Gemma 4: `vision_tower` + `embed_vision`, and on E2B / E4B `audio_tower` + `embed_audio`;
  * the unified 12B: `vision_embedder` + `embed_vision`, `embed_audio` (no towers).

`image_features` / `audio_features` return soft tokens already in the text model's space with a validity mask;
the shapes are static (an image's padded patch budget, an audio clip's padded frames), so a compiled program
serves every image of one budget.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from gemma4_mtp_jax.model.audio import Gemma4AudioTower
from gemma4_mtp_jax.model.media_config import AudioConfig, MediaConfig, UnifiedVisionConfig, VisionConfig
from gemma4_mtp_jax.model.media_layers import MultimodalEmbedder
from gemma4_mtp_jax.model.unified_embedder import UnifiedVisionEmbedder
from gemma4_mtp_jax.model.vision import Gemma4VisionTower

Array = jax.Array


class Gemma4Encoders(nn.Module):
    cfg: MediaConfig
    param_dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg, pd, H = self.cfg, self.param_dtype, self.cfg.text_hidden_size
        if isinstance(cfg.vision, VisionConfig):
            self.vision_tower = Gemma4VisionTower(cfg.vision, pd)
            self.embed_vision = MultimodalEmbedder(H, cfg.vision.rms_norm_eps, pd)
        elif isinstance(cfg.vision, UnifiedVisionConfig):
            self.vision_embedder = UnifiedVisionEmbedder(cfg.vision, pd)
            self.embed_vision = MultimodalEmbedder(H, cfg.vision.rms_norm_eps, pd)
        if cfg.audio is not None:
            if isinstance(cfg.audio, AudioConfig):
                self.audio_tower = Gemma4AudioTower(cfg.audio, pd)
            self.embed_audio = MultimodalEmbedder(H, cfg.audio.rms_norm_eps, pd)

    def image_features(self, pixels: Array, positions: Array) -> tuple[Array, Array]:
        """(patches [B, N, 3 p^2] in [0, 1], positions [B, N, 2]) -> (soft tokens [B, S, H], valid [B, S]); S is
        N / k^2 for Gemma 4's tower (k x k patches pooled), N for the unified embedder."""
        if self.cfg.vision is None:
            raise ValueError("this checkpoint has no vision encoder (config.json has no vision_config)")
        if isinstance(self.cfg.vision, UnifiedVisionConfig):
            x, valid = self.vision_embedder(pixels, positions)
        else:
            x, valid = self.vision_tower(pixels, positions)
        return self.embed_vision(x), valid

    def audio_features(self, features: Array, mask: Array) -> tuple[Array, Array]:
        """Gemma 4: (log-mel features [B, T, F], mask [B, T]) -> (soft tokens [B, ceil(T/4), H], valid). Unified:
        (waveform frames [B, T, samples per token], mask [B, T]) -> ([B, T, H], mask)."""
        if self.cfg.audio is None:
            raise ValueError("this checkpoint has no audio encoder (config.json has no audio_config)")
        if isinstance(self.cfg.audio, AudioConfig):
            x, valid = self.audio_tower(features, mask)
        else:
            x, valid = features, mask.astype(bool)
        return self.embed_audio(x), valid

    def __call__(self, pixels: Array | None = None, positions: Array | None = None, features: Array | None = None,
                 mask: Array | None = None) -> tuple:
        """Every encoder at once (what `init` traces to create all parameters)."""
        out: tuple = ()
        if pixels is not None:
            out += self.image_features(pixels, positions)
        if features is not None:
            out += self.audio_features(features, mask)
        return out


def example_inputs(cfg: MediaConfig) -> dict[str, Array]:
    """The smallest inputs that reach every parameter (for `init` / `jax.eval_shape`)."""
    out: dict[str, Array] = {}
    if isinstance(cfg.vision, VisionConfig):
        k, p = cfg.vision.pooling_kernel_size, cfg.vision.patch_size
        grid = jnp.stack(jnp.meshgrid(jnp.arange(k), jnp.arange(k), indexing="xy"), -1).reshape(1, k * k, 2)
        out.update(pixels=jnp.zeros((1, k * k, 3 * p * p), jnp.float32), positions=grid.astype(jnp.int32))
    elif isinstance(cfg.vision, UnifiedVisionConfig):
        m = cfg.vision.model_patch_size
        out.update(pixels=jnp.zeros((1, 1, 3 * m * m), jnp.float32), positions=jnp.zeros((1, 1, 2), jnp.int32))
    if isinstance(cfg.audio, AudioConfig):
        out.update(features=jnp.zeros((1, 4, cfg.audio.subsampling_conv_channels[0]), jnp.float32),
                   mask=jnp.ones((1, 4), bool))
    elif cfg.audio is not None:
        out.update(features=jnp.zeros((1, 1, cfg.audio.audio_embed_dim), jnp.float32), mask=jnp.ones((1, 1), bool))
    return out
