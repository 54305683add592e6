"""Bicubic resizing of 8-bit images exactly as Pillow does it (`Image.resize(..., BICUBIC)`), which is what
transformers' Gemma 4 image processor calls: a separable convolution with Keys' cubic kernel (a = -0.5), widened by
the scale when shrinking (antialiasing), its weights normalized and then fixed to 22 fractional bits; the
horizontal pass first, each pass rounded and clipped to 0..255."""

from __future__ import annotations

import numpy as np

_PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images
_SUPPORT = 2.0  # the cubic kernel's radius at scale 1


def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(first input index [out], fixed-point weights [out, taps]) of one axis; taps past an output's window are 0."""
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support = _SUPPORT * filter_scale
    taps = int(np.ceil(support)) * 2 + 1
    center = (np.arange(out_size) + 0.5) * scale
    # Pillow rounds the window's ends by truncation toward zero of x + 0.5, then clamps them to the image
    lo = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    hi = np.minimum(np.trunc(center + support + 0.5), in_size).astype(np.int64)
    x = np.arange(taps)[None, :]
    inside = x < (hi - lo)[:, None]
    w = np.where(inside, _cubic((x + lo[:, None] - center[:, None] + 0.5) / filter_scale), 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.where(total != 0, w / np.where(total == 0, 1, total), w)
    fixed = np.where(w < 0, np.trunc(-0.5 + w * (1 << _PRECISION_BITS)), np.trunc(0.5 + w * (1 << _PRECISION_BITS)))
    return lo, fixed.astype(np.int64)


def _pass(image: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One axis of the resize, uint8 in and out."""
    moved = np.moveaxis(image, axis, 0).astype(np.int64)  # [in, ...]
    lo, w = _weights(moved.shape[0], out_size)
    idx = np.minimum(lo[:, None] + np.arange(w.shape[1])[None, :], moved.shape[0] - 1)  # [out, taps]
    acc = np.einsum("ot,ot...->o...", w, moved[idx]) + (1 << (_PRECISION_BITS - 1))
    out = np.clip(acc >> _PRECISION_BITS, 0, 255).astype(np.uint8)
    return np.moveaxis(out, 0, axis)


def resize_bicubic(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, C] -> uint8 [height, width, C], Pillow's bicubic resize bit for bit."""
    if image.dtype != np.uint8 or image.ndim != 3:
        raise ValueError(f"resize_bicubic takes a uint8 [height, width, channels] image, got {image.dtype} "
                         f"{image.shape}")
    if height <= 0 or width <= 0:
        raise ValueError(f"cannot resize to {height}x{width}")
    if width != image.shape[1]:
        image = _pass(image, width, 1)
    if height != image.shape[0]:
        image = _pass(image, height, 0)
    return image
