"""Audio -> the audio tower's inputs, as transformers' `Gemma4AudioFeatureExtractor` makes them, and the number of
soft tokens a clip takes.

A 16 kHz mono waveform (float, [-1, 1]) is cut to at most 30 s and zero-padded to a multiple of 128 samples (in a
batch: to the longest clip, rounded up so). 160 zeros go in front (a "semicausal" STFT: the first frame is centred
on t = 0); frames of 320 samples (20 ms) every 160 (10 ms) get a periodic Hann window, a 512-point real FFT, its
magnitude through 128 triangular HTK-mel filters (0-8 kHz, unnormalized), then log(x + 0.001). A frame is real
where its window's last sample is real audio, and padded frames are zeroed. The tower keeps every 4th frame (two
stride-2 convolutions), so a clip of F real frames gives ceil(ceil(F / 2) / 2) soft tokens.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class AudioFeatureConfig:
    """The feature extractor's settings (transformers' defaults, those of the released checkpoints)."""

    sampling_rate: int = 16_000
    num_mel_bins: int = 128
    frame_length_ms: float = 20.0
    hop_length_ms: float = 10.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    mel_floor: float = 1e-3
    max_samples: int = 480_000  # 30 s
    pad_to_multiple_of: int = 128

    @property
    def frame_length(self) -> int:
        return int(round(self.sampling_rate * self.frame_length_ms / 1000.0))

    @property
    def hop_length(self) -> int:
        return int(round(self.sampling_rate * self.hop_length_ms / 1000.0))

    @property
    def fft_length(self) -> int:
        return 2 ** math.ceil(math.log2(self.frame_length))


def _hz_to_mel(f: np.ndarray | float) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + np.asarray(f, np.float64) / 700.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


def mel_filters(cfg: AudioFeatureConfig) -> np.ndarray:
    """[fft_length / 2 + 1, num_mel_bins] float64: triangles between consecutive points evenly spaced in HTK mel,
    peak 1 (no area normalization), sampled at the FFT bins' frequencies."""
    bins = cfg.fft_length // 2 + 1
    edges = _mel_to_hz(np.linspace(_hz_to_mel(cfg.min_frequency), _hz_to_mel(cfg.max_frequency),
                                   cfg.num_mel_bins + 2))
    freqs = np.linspace(0, cfg.sampling_rate // 2, bins)
    width = np.diff(edges)
    offset = edges[None, :] - freqs[:, None]  # [bins, mel + 2]
    rising = -offset[:, :-2] / width[:-1]
    falling = offset[:, 2:] / width[1:]
    return np.maximum(0.0, np.minimum(rising, falling))


def _window(n: int) -> np.ndarray:
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float32)  # periodic Hann


def pad_waveforms(waveforms: list[np.ndarray], cfg: AudioFeatureConfig) -> tuple[np.ndarray, np.ndarray]:
    """Clips -> ([n, L] float32, sample mask [n, L]): each cut to max_samples, all zero-padded to the longest,
    rounded up to a multiple of pad_to_multiple_of."""
    clips = []
    for i, w in enumerate(waveforms):
        w = np.asarray(w)
        if w.ndim != 1 or not np.issubdtype(w.dtype, np.floating):
            raise ValueError(f"audio clip {i}: expected a 1-D float waveform, got {w.dtype} {w.shape}")
        if not np.all(np.isfinite(w)):
            raise ValueError(f"audio clip {i}: the waveform holds non-finite samples")
        clips.append(w[: cfg.max_samples].astype(np.float32))
    longest = max(len(c) for c in clips)
    m = cfg.pad_to_multiple_of
    L = -(-longest // m) * m
    out, mask = np.zeros((len(clips), L), np.float32), np.zeros((len(clips), L), bool)
    for i, c in enumerate(clips):
        out[i, : len(c)], mask[i, : len(c)] = c, True
    return out, mask


def log_mel(waveform: np.ndarray, sample_mask: np.ndarray, cfg: AudioFeatureConfig) -> tuple[np.ndarray, np.ndarray]:
    """One padded clip [L] and its sample mask -> (features [frames, num_mel_bins] float32, frame mask [frames])."""
    fl, hop = cfg.frame_length, cfg.hop_length
    x = np.pad(waveform, (fl // 2, 0))
    real = np.pad(sample_mask, (fl // 2, 0))
    n = (len(x) - (fl + 1)) // hop + 1
    if n <= 0:
        return np.zeros((0, cfg.num_mel_bins), np.float32), np.zeros((0,), bool)
    starts = np.arange(n) * hop
    frames = x[starts[:, None] + np.arange(fl)[None, :]] * _window(fl)  # the extractor's frames are fl + 1 wide,
    spectrum = np.abs(np.fft.rfft(frames, n=cfg.fft_length, axis=-1))  # the last sample used only by preemphasis
    features = np.log(spectrum @ mel_filters(cfg) + cfg.mel_floor).astype(np.float32)
    frame_mask = real[starts + fl]  # the window's last sample (of fl + 1)
    return features * frame_mask[:, None], frame_mask


def audio_features(waveforms: list[np.ndarray], cfg: AudioFeatureConfig = AudioFeatureConfig()
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Clips -> (features [n, frames, num_mel_bins] float32, frame mask [n, frames]) for the audio tower."""
    if not waveforms:
        raise ValueError("no audio to process")
    padded, mask = pad_waveforms(waveforms, cfg)
    done = [log_mel(w, m, cfg) for w, m in zip(padded, mask)]
    return np.stack([d[0] for d in done]), np.stack([d[1] for d in done])


def num_soft_tokens(frame_mask: np.ndarray) -> int:
    """Soft tokens of one clip: its real frames after the tower's two stride-2 subsamplings."""
    m = np.asarray(frame_mask, bool)
    for _ in range(2):
        m = m[::2]
    return int(m.sum())
