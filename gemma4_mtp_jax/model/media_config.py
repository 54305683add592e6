"""The configs of Gemma 4's media encoders and of how their soft tokens enter the text model, read from the
multimodal wrapper's config.json (`vision_config`, `audio_config` and the placeholder token ids beside them).

Gemma 4 (`gemma4`: E2B, E4B, 26B-A4B, 31B) has a vision tower (a ViT over 2-D patches, pooled k x k) and, on E2B /
E4B, an audio tower (a conformer over log-mel frames); each is followed by a projection into the text model
(`embed_vision` / `embed_audio`). The unified 12B (`gemma4_unified`) has no towers: its image embedder projects raw
pixel patches and its audio embedder raw waveform frames. docs/DESIGN.md, "Vision and audio", has the details.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gemma4_mtp_jax.model.config import FAMILIES, ConfigError


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Gemma 4's vision tower (transformers' `Gemma4VisionConfig`)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    use_clipped_linears: bool
    standardize: bool  # soft tokens get (x - std_bias) * std_scale after pooling


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    """Gemma 4's audio tower (transformers' `Gemma4AudioConfig`)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    subsampling_conv_channels: tuple[int, int]
    conv_kernel_size: int
    residual_weight: float
    attention_chunk_size: int
    attention_context_left: int
    attention_context_right: int
    attention_logit_cap: float
    attention_invalid_logits_value: float
    use_clipped_linears: bool
    rms_norm_eps: float
    gradient_clipping: float
    output_proj_dims: int


@dataclasses.dataclass(frozen=True)
class UnifiedVisionConfig:
    """The unified 12B's encoder-free image embedder (`Gemma4UnifiedVisionConfig`): one soft token per
    (patch_size * pooling_kernel_size)^2 pixel patch."""

    patch_size: int
    pooling_kernel_size: int
    mm_embed_dim: int
    mm_posemb_size: int
    output_proj_dims: int
    rms_norm_eps: float

    @property
    def model_patch_size(self) -> int:
        return self.patch_size * self.pooling_kernel_size


@dataclasses.dataclass(frozen=True)
class UnifiedAudioConfig:
    """The unified 12B's audio embedder: one soft token per `audio_embed_dim` raw waveform samples."""

    audio_embed_dim: int
    rms_norm_eps: float


@dataclasses.dataclass(frozen=True)
class MediaConfig:
    """Which encoders a target has and the token ids that place their soft tokens in a prompt.

    A prompt holds one `image_token_id` (`audio_token_id`) per soft token of an image (audio clip), between
    `boi_token_id` / `eoi_token_id` (`boa_token_id` / `eoa_token_id`); the text model embeds those placeholders as
    `pad_token_id` and then overwrites them with the soft tokens, in order."""

    text_hidden_size: int
    vision: VisionConfig | UnifiedVisionConfig | None
    audio: AudioConfig | UnifiedAudioConfig | None
    image_token_id: int
    video_token_id: int
    audio_token_id: int
    boi_token_id: int
    eoi_token_id: int
    boa_token_id: int
    eoa_token_id: int
    pad_token_id: int
    unified: bool  # the 12B's encoder-free embedders (UnifiedVisionConfig / UnifiedAudioConfig)

    @property
    def media_token_ids(self) -> tuple[int, ...]:
        """The placeholder ids a soft token replaces (image, video frame, audio)."""
        return (self.image_token_id, self.video_token_id, self.audio_token_id)


def _get(d: dict, key: str, where: str, default: Any) -> Any:
    value = d.get(key, default)
    if value is None:
        raise ConfigError(f"{where}: field '{key}' is null")
    return value


def _vision(d: dict, where: str) -> VisionConfig:
    rope = d.get("rope_parameters") or {}
    kind = rope.get("rope_type", "axial")
    if kind != "axial":
        raise ConfigError(f"{where}: rope_parameters.rope_type='{kind}' is not supported (expected 'axial')")
    act = d.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{where}: hidden_activation='{act}' is not supported (expected 'gelu_pytorch_tanh')")
    if d.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true is not supported")
    H, nH = int(_get(d, "hidden_size", where, 768)), int(_get(d, "num_attention_heads", where, 12))
    cfg = VisionConfig(
        hidden_size=H,
        intermediate_size=int(_get(d, "intermediate_size", where, 3072)),
        num_layers=int(_get(d, "num_hidden_layers", where, 16)),
        num_heads=nH,
        num_kv_heads=int(_get(d, "num_key_value_heads", where, 12)),
        head_dim=int(d.get("head_dim") or H // nH),
        rms_norm_eps=float(_get(d, "rms_norm_eps", where, 1e-6)),
        rope_theta=float(rope.get("rope_theta", 100.0)),
        patch_size=int(_get(d, "patch_size", where, 16)),
        pooling_kernel_size=int(_get(d, "pooling_kernel_size", where, 3)),
        position_embedding_size=int(_get(d, "position_embedding_size", where, 10 * 1024)),
        use_clipped_linears=bool(d.get("use_clipped_linears", False)),
        standardize=bool(d.get("standardize", False)),
    )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"{where}: num_attention_heads={nH} is not a multiple of num_key_value_heads="
                          f"{cfg.num_kv_heads}")
    if cfg.head_dim % 4:  # two axes, each rotated as halves
        raise ConfigError(f"{where}: head_dim={cfg.head_dim} must be a multiple of 4 for the 2-D RoPE")
    return cfg


def _audio(d: dict, where: str) -> AudioConfig:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act='{act}' is not supported (expected 'silu')")
    channels = tuple(int(c) for c in _get(d, "subsampling_conv_channels", where, (128, 32)))
    if len(channels) != 2:
        raise ConfigError(f"{where}: subsampling_conv_channels must have 2 entries, got {list(channels)}")
    H, nH = int(_get(d, "hidden_size", where, 1024)), int(_get(d, "num_attention_heads", where, 8))
    if H % nH:
        raise ConfigError(f"{where}: hidden_size={H} is not a multiple of num_attention_heads={nH}")
    return AudioConfig(
        hidden_size=H,
        num_layers=int(_get(d, "num_hidden_layers", where, 12)),
        num_heads=nH,
        subsampling_conv_channels=channels,  # type: ignore[arg-type]
        conv_kernel_size=int(_get(d, "conv_kernel_size", where, 5)),
        residual_weight=float(_get(d, "residual_weight", where, 0.5)),
        attention_chunk_size=int(_get(d, "attention_chunk_size", where, 12)),
        attention_context_left=int(_get(d, "attention_context_left", where, 13)),
        attention_context_right=int(_get(d, "attention_context_right", where, 0)),
        attention_logit_cap=float(_get(d, "attention_logit_cap", where, 50.0)),
        attention_invalid_logits_value=float(_get(d, "attention_invalid_logits_value", where, -1.0e9)),
        use_clipped_linears=bool(d.get("use_clipped_linears", True)),
        rms_norm_eps=float(_get(d, "rms_norm_eps", where, 1e-6)),
        gradient_clipping=float(_get(d, "gradient_clipping", where, 1e10)),
        output_proj_dims=int(_get(d, "output_proj_dims", where, 1536)),
    )


def _unified_vision(d: dict, where: str) -> UnifiedVisionConfig:
    return UnifiedVisionConfig(
        patch_size=int(_get(d, "patch_size", where, 16)),
        pooling_kernel_size=int(_get(d, "pooling_kernel_size", where, 3)),
        mm_embed_dim=int(_get(d, "mm_embed_dim", where, 3840)),
        mm_posemb_size=int(_get(d, "mm_posemb_size", where, 1120)),
        output_proj_dims=int(_get(d, "output_proj_dims", where, 3840)),
        rms_norm_eps=float(_get(d, "rms_norm_eps", where, 1e-6)),
    )


def _unified_audio(d: dict, where: str) -> UnifiedAudioConfig:
    return UnifiedAudioConfig(audio_embed_dim=int(_get(d, "audio_embed_dim", where, 640)),
                              rms_norm_eps=float(_get(d, "rms_norm_eps", where, 1e-6)))


def parse_media_config(d: dict, where: str = "config.json") -> MediaConfig | None:
    """The media config of a multimodal target's config.json (`gemma4` / `gemma4_unified`); None for a text-only
    config (`gemma4_text`, `gemma4_unified_text`) and for a wrapper with neither `vision_config` nor
    `audio_config`."""
    wrappers = {wrapper: text for text, (wrapper, _) in FAMILIES.items()}
    mt = d.get("model_type")
    if mt not in wrappers or not (d.get("vision_config") or d.get("audio_config")):
        return None
    unified = mt == "gemma4_unified"
    text = d.get("text_config") or {}
    vision = audio = None
    if d.get("vision_config"):
        vw = f"{where}: vision_config"
        vision = _unified_vision(d["vision_config"], vw) if unified else _vision(d["vision_config"], vw)
    if d.get("audio_config"):
        aw = f"{where}: audio_config"
        audio = _unified_audio(d["audio_config"], aw) if unified else _audio(d["audio_config"], aw)
    if "hidden_size" not in text:
        raise ConfigError(f"{where}: text_config.hidden_size is missing")
    return MediaConfig(
        text_hidden_size=int(text["hidden_size"]),
        vision=vision,
        audio=audio,
        image_token_id=int(_get(d, "image_token_id", where, 258_880)),
        video_token_id=int(_get(d, "video_token_id", where, 258_884)),
        audio_token_id=int(_get(d, "audio_token_id", where, 258_881)),
        boi_token_id=int(_get(d, "boi_token_id", where, 255_999)),
        eoi_token_id=int(_get(d, "eoi_token_id", where, 258_882)),
        boa_token_id=int(_get(d, "boa_token_id", where, 256_000)),
        # transformers names the end-of-audio id `eoa_token_index` (every other id is `*_token_id`)
        eoa_token_id=int(d.get("eoa_token_id", _get(d, "eoa_token_index", where, 258_883))),
        pad_token_id=int(text.get("pad_token_id", 0) if text.get("pad_token_id") is not None else 0),
        unified=unified,
    )
