"""A prompt's images and audio as the engine takes them: the encoders' soft tokens at the prompt's placeholders.

The encoders run here, in programs of their own (one compiled shape per image budget and per audio frame bucket),
before the request is queued and outside every step program; the prefill then merges the soft tokens at the
placeholder positions (steps/forward.py). The request keeps them, so a preempted request prefills again with its
media; each item's content hash keys the prefix cache's pages that cover it (kv_cache.page_keys).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.media.audio_features import AudioFeatureConfig, audio_features
from gemma4_mtp_jax.media.image_processing import ImageProcessorConfig, process_image
from gemma4_mtp_jax.model.media_config import AudioConfig
from gemma4_mtp_jax.model.runtime import Target
from gemma4_mtp_jax.model.sampling import SamplingParams

MIN_AUDIO_FRAMES = 64  # the smallest audio bucket: clips are padded to a power of two of frames, at least this


@dataclasses.dataclass(frozen=True)
class MediaItem:
    """One image or audio clip, encoded: `kind` ("image" | "audio"), its soft tokens [n, H] float32 and a digest
    of the encoder's inputs (what the prefix cache keys its pages by)."""

    kind: str
    soft: np.ndarray
    digest: bytes

    @property
    def num_tokens(self) -> int:
        return int(self.soft.shape[0])


@dataclasses.dataclass(frozen=True)
class PromptMedia:
    """A prompt's soft tokens [P, H] at its P placeholder positions (ascending), and per item the span of prompt
    positions it covers with its digest: (first, end, digest). `whole`: the spans (first, end) that a prefill chunk
    holds whole, never cut: each run of image soft tokens where the model's image tokens see each other (their
    queries need every key of the run at once); empty otherwise."""

    soft: np.ndarray
    positions: np.ndarray
    spans: tuple[tuple[int, int, bytes], ...]
    whole: tuple[tuple[int, int], ...] = ()

    def images_whole(self, prompt: Sequence[int], image_token_id: int) -> "PromptMedia":
        """This prompt's media with each run of image soft tokens kept whole (runs of consecutive image placeholders
        among the soft tokens, as the forward delimits them: dense_attention.image_runs)."""
        ids = np.asarray(prompt, np.int64)
        at = self.positions[self.positions < len(ids)]  # a mismatch is refused later (media_refusal)
        at = at[ids[at] == image_token_id]
        breaks = np.flatnonzero(np.diff(at) != 1) + 1
        runs = tuple((int(r[0]), int(r[-1]) + 1) for r in np.split(at, breaks) if len(r))
        return dataclasses.replace(self, whole=runs)

    def inside(self, position: int) -> tuple[int, int] | None:
        """The `whole` span that a cut before `position` would split (first < position < end), or None."""
        return next(((f, e) for f, e in self.whole if f < position < e), None)

    def chunk(self, start: int, n: int, width: int) -> tuple[np.ndarray, np.ndarray] | None:
        """A prefill chunk's inputs for positions start..start+n-1 padded to `width`: (soft [1, width, H],
        at [1, width] bool: where a soft token replaces the token's embedding); None when the chunk holds none."""
        lo, hi = np.searchsorted(self.positions, [start, start + n])
        if lo == hi:
            return None
        soft = np.zeros((1, width, self.soft.shape[1]), self.soft.dtype)
        at = np.zeros((1, width), bool)
        where = self.positions[lo:hi] - start
        soft[0, where], at[0, where] = self.soft[lo:hi], True
        return soft, at


def prompt_media(prompt: Sequence[int], items: Sequence[MediaItem], image_token_id: int,
                 audio_token_id: int) -> PromptMedia:
    """The prompt's placeholders (expanded: media.placeholders) matched with `items`, in prompt order per kind: the
    i-th image's soft tokens take the image placeholders after the first i images'. The counts must agree."""
    ids = np.asarray(prompt, np.int64)
    soft_rows, where, spans = [], [], []
    for kind, token_id in (("image", image_token_id), ("audio", audio_token_id)):
        at = np.flatnonzero(ids == token_id)
        mine = [it for it in items if it.kind == kind]
        have = sum(it.num_tokens for it in mine)
        if have != len(at):
            raise ValueError(f"the prompt holds {len(at)} {kind} placeholder tokens (id {token_id}), but its "
                             f"{len(mine)} {kind}(s) give {have} soft tokens")
        used = 0
        for it in mine:
            span = at[used:used + it.num_tokens]
            spans.append((int(span[0]), int(span[-1]) + 1, it.digest))
            used += it.num_tokens
        soft_rows += [it.soft for it in mine]
        where.append(at)
    positions = np.concatenate(where)
    if not len(positions):
        raise ValueError("media given, but the prompt holds no image or audio placeholder")
    order = np.argsort(positions, kind="stable")
    return PromptMedia(np.concatenate(soft_rows)[order], positions[order].astype(np.int32),
                       tuple(sorted(spans)))


class MediaEncoder:
    """Runs `target`'s encoders on one image or clip at a time: images in their budget's one shape, clips padded
    to a power of two of frames, so a few compiled programs serve every request. `max_image_tokens`: the soft-token
    budget of an image (the processor's max_soft_tokens); `audio_config`: the feature extractor's settings
    (default: transformers' with as many mel bins as the audio tower takes)."""

    def __init__(self, target: Target, max_image_tokens: int = 280, audio_config: AudioFeatureConfig | None = None):
        if target.encoders is None:
            raise ValueError(f"{target.path}: the checkpoint has no media encoders")
        self.encoders = target.encoders
        # On the default device once (a loader may leave weights in host memory: each call would copy them).
        self.params = jax.device_put(target.encoders.params)
        self.config = cfg = target.encoders.config
        self.image_config = None if cfg.vision is None else ImageProcessorConfig(
            cfg.vision.patch_size, cfg.vision.pooling_kernel_size, max_image_tokens)
        if audio_config is None:  # the tower's first convolution takes one channel per mel bin
            bins = cfg.audio.subsampling_conv_channels[0] if isinstance(cfg.audio, AudioConfig) else 128
            audio_config = AudioFeatureConfig(num_mel_bins=bins)
        self.audio_config = audio_config

    def image(self, image: np.ndarray) -> MediaItem:
        """An image (uint8 [H, W, C]) -> its soft tokens."""
        if self.image_config is None:
            raise ValueError("this model takes no images (its checkpoint has no vision encoder)")
        pixels, positions, n = process_image(image, self.image_config, unified=self.config.unified)
        soft, valid = self.encoders._image(self.params, jnp.asarray(pixels[None]),
                                           jnp.asarray(positions[None]))
        rows = np.asarray(soft[0], np.float32)[np.asarray(valid[0])]
        assert len(rows) == n, f"the vision encoder gave {len(rows)} soft tokens, the processor counted {n}"
        return MediaItem("image", rows, _digest(b"image", pixels, positions))

    def audio(self, waveform: np.ndarray) -> MediaItem:
        """A mono clip (float [samples] at the feature extractor's sampling rate) -> its soft tokens."""
        if not isinstance(self.config.audio, AudioConfig):
            raise ValueError("this model takes no audio here (its checkpoint has no audio tower)")
        features, mask = audio_features([np.asarray(waveform, np.float32)], self.audio_config)
        frames = max(MIN_AUDIO_FRAMES, 1 << (features.shape[1] - 1).bit_length())
        pad = frames - features.shape[1]
        features = np.pad(features, ((0, 0), (0, pad), (0, 0)))
        mask = np.pad(mask, ((0, 0), (0, pad)))
        soft, valid = self.encoders._audio(self.params, jnp.asarray(features), jnp.asarray(mask))
        rows = np.asarray(soft[0], np.float32)[np.asarray(valid[0])]
        return MediaItem("audio", rows, _digest(b"audio", features, mask))

    def prompt(self, prompt: Sequence[int], items: Sequence[MediaItem]) -> PromptMedia:
        """`items` matched with `prompt`'s placeholders (`prompt_media`)."""
        return prompt_media(prompt, items, self.config.image_token_id, self.config.audio_token_id)


def _digest(kind: bytes, *arrays: np.ndarray) -> bytes:
    """The content hash of an item's encoder inputs (shape and dtype included)."""
    h = hashlib.blake2b(kind, digest_size=16)
    for a in arrays:
        h.update(repr((a.shape, a.dtype.str)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.digest()


def media_refusal(target: Target, prompt: Sequence[int], media: PromptMedia, sampling: SamplingParams,
                  chunk: int) -> str | None:
    """Why this engine cannot serve a media request exactly, or None: a target without encoders; an image longer
    than a prefill chunk (`chunk` tokens) on a family whose image tokens see each other (`TextConfig.image_attention`
    other than "causal": its run must be prefilled in one chunk, `PromptMedia.whole`); prompt logprobs (the scored
    prefill has no media variant); soft tokens off the placeholders."""
    if target.encoders is None:
        return f"{target.path.name}: the model has no media encoders, so a prompt cannot hold images or audio"
    cfg = target.encoders.config
    ids = np.asarray(prompt, np.int64)
    longest = max((e - f for f, e in media.whole), default=0)
    if longest > chunk:
        return (f"an image of {longest} soft tokens is longer than a prefill chunk ({chunk} tokens), and this "
                f"model's image tokens attend to each other (image_attention={target.config.image_attention!r}), so "
                f"an image must be prefilled in one chunk: raise the prefill chunk or lower the image's token budget")
    if sampling.prompt_logprobs is not None:
        return "prompt logprobs are not served for a prompt with images or audio"
    want = np.flatnonzero(np.isin(ids, [cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id]))
    if len(want) != len(media.positions) or np.any(want != media.positions):
        return (f"the prompt holds {len(want)} media placeholder tokens, but its media give soft tokens at "
                f"{len(media.positions)} positions, not all of them placeholders")
    return None
