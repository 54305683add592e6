"""Images -> the vision encoders' inputs, as transformers' Gemma 4 image processor (its Pillow backend) makes them:

  1. resize, keeping the aspect ratio, to the largest size whose sides are multiples of patch_size * k (k: the
     pooling kernel) and which holds at most max_soft_tokens * k^2 patches (`target_size`); bicubic, as Pillow;
  2. rescale to [0, 1] (uint8 / 255; no mean / std normalization: the tower maps to [-1, 1] itself);
  3. cut into p x p patches in raster order, each flattened (row, column, channel) into 3 p^2 values, with its
     (x, y) grid position;
  4. pad to the budget of max_soft_tokens * k^2 patches with zero patches at position (-1, -1).

An image gives (width / p / k) * (height / p / k) soft tokens. For the unified 12B the patch is p * k pixels wide
and each becomes one soft token (its embedder has no pooling); the layout is otherwise the same.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from gemma4_mtp_jax.media.resample import resize_bicubic

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the budgets Gemma 4 was trained with


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """patch_size p, pooling_kernel_size k and the soft-token budget per image (the processor's
    `max_soft_tokens`; 280 by default, the video processor's 70)."""

    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 280

    def __post_init__(self):
        if self.patch_size <= 0 or self.pooling_kernel_size <= 0:
            raise ValueError(f"patch_size={self.patch_size} and pooling_kernel_size={self.pooling_kernel_size} "
                             f"must be positive")
        if self.max_soft_tokens <= 0:
            raise ValueError(f"max_soft_tokens={self.max_soft_tokens} must be positive")

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2


def target_size(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """(height, width) an image is resized to: the aspect ratio kept, both sides multiples of p * k, at most
    max_patches patches. A side that would round to 0 becomes one cell, the other then as many cells as the
    aspect ratio's integer part, within the budget."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image of {height}x{width} pixels")
    p, k = cfg.patch_size, cfg.pooling_kernel_size
    side = p * k
    factor = math.sqrt(cfg.max_patches * p * p / (height * width))
    h, w = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
    longest = (cfg.max_patches // k**2) * side
    if h == 0 and w == 0:
        raise ValueError(f"image of {height}x{width} pixels resizes to nothing at {side}-pixel cells")
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    if h * w > cfg.max_patches * p * p:
        raise ValueError(f"image of {height}x{width} pixels would take {h}x{w} pixels, over the budget of "
                         f"{cfg.max_patches} patches")
    return h, w


def num_soft_tokens(height: int, width: int, cfg: ImageProcessorConfig) -> int:
    """How many soft tokens (so placeholders) an image of this size takes."""
    h, w = target_size(height, width, cfg)
    return (h // cfg.patch_size) * (w // cfg.patch_size) // cfg.pooling_kernel_size**2


def as_rgb(image: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] from a uint8 image [H, W] (grey), [H, W, 1], [H, W, 3] or [H, W, 4] (alpha dropped, as
    Pillow's convert("RGB") does)."""
    image = np.asarray(image)
    if image.dtype != np.uint8:
        raise ValueError(f"images must be uint8, got {image.dtype}")
    if image.ndim == 2:
        image = image[..., None]
    if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
        raise ValueError(f"an image must be [height, width] or [height, width, 1|3|4], got {image.shape}")
    if image.shape[-1] == 1:
        return np.repeat(image, 3, axis=-1)
    return image[..., :3]


def patchify(image: np.ndarray, patch: int) -> tuple[np.ndarray, np.ndarray]:
    """float [H, W, C] -> (patches [H/p * W/p, p * p * C], each flattened row, column, channel; positions
    [H/p * W/p, 2] as (x, y)), patches in raster order."""
    H, W, C = image.shape
    ph, pw = H // patch, W // patch
    patches = image.reshape(ph, patch, pw, patch, C).transpose(0, 2, 1, 3, 4).reshape(ph * pw, patch * patch * C)
    gx, gy = np.meshgrid(np.arange(pw), np.arange(ph), indexing="xy")
    return patches, np.stack([gx, gy], axis=-1).reshape(-1, 2)


def process_image(image: np.ndarray, cfg: ImageProcessorConfig, *, unified: bool = False
                  ) -> tuple[np.ndarray, np.ndarray, int]:
    """One image (uint8 [H, W, C]) -> (patches [budget, 3 q^2] float32, positions [budget, 2] int32, soft tokens).

    q is p for Gemma 4's towers (budget max_soft_tokens * k^2 patches) and p * k for the unified 12B's embedder
    (budget max_soft_tokens)."""
    rgb = as_rgb(image)
    h, w = target_size(rgb.shape[0], rgb.shape[1], cfg)
    if (h, w) != rgb.shape[:2]:
        rgb = resize_bicubic(rgb, h, w)
    pixels = (rgb.astype(np.float64) * (1 / 255)).astype(np.float32)  # transformers rescales in float64
    q = cfg.patch_size * (cfg.pooling_kernel_size if unified else 1)
    patches, positions = patchify(pixels, q)
    budget = cfg.max_soft_tokens if unified else cfg.max_patches
    n = patches.shape[0]
    out = np.zeros((budget, patches.shape[1]), np.float32)
    out[:n] = patches
    pos = np.full((budget, 2), -1, np.int32)
    pos[:n] = positions
    soft = n if unified else n // cfg.pooling_kernel_size**2
    return out, pos, soft


def process_images(images: list[np.ndarray], cfg: ImageProcessorConfig, *, unified: bool = False
                   ) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """A prompt's images -> (patches [n, budget, 3 q^2], positions [n, budget, 2], soft tokens per image)."""
    if not images:
        raise ValueError("no images to process")
    done = [process_image(im, cfg, unified=unified) for im in images]
    return np.stack([d[0] for d in done]), np.stack([d[1] for d in done]), [d[2] for d in done]
