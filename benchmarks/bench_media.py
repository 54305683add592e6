"""The media encoders' cost at real shapes (random bf16 weights): one image per image budget, one audio clip per
length, each as `engine/media.MediaEncoder` runs it (an image padded to its budget's patches, a clip to its
power-of-two frame bucket), in its own compiled program outside the step programs. Reports the compile time of
each shape and the median time per item after warm-up, beside the soft tokens it yields.

The encoder shapes are Gemma 4's vision tower (ViT: 16 layers, 768 wide, 16-pixel patches pooled 3 x 3) and audio
tower (conformer: 12 layers, 1024 wide, 128 mel bins), transformers 5.24's `Gemma4VisionConfig` /
`Gemma4AudioConfig` defaults, which E2B and E4B share; the text width (the projection's output) is the model's.

    python benchmarks/bench_media.py --models e4b --image-budgets 70 140 280 560 1120 --audio-seconds 5 10 30
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import TARGETS, environment, median_time, random_params, write_json  # noqa: E402
from gemma4_mtp_jax.api import abstract_encoder_params  # noqa: E402
from gemma4_mtp_jax.engine.media import MIN_AUDIO_FRAMES  # noqa: E402
from gemma4_mtp_jax.media.audio_features import AudioFeatureConfig, audio_features  # noqa: E402
from gemma4_mtp_jax.media.image_processing import ImageProcessorConfig, process_image  # noqa: E402
from gemma4_mtp_jax.model.media_config import parse_media_config  # noqa: E402
from gemma4_mtp_jax.model.runtime import Encoders  # noqa: E402

VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
              num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3)
AUDIO = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, subsampling_conv_channels=[128, 32])


def encoders_for(model: str, dtype) -> Encoders:
    """The model's vision and audio towers with random weights (audio: E2B / E4B only)."""
    d = {"model_type": "gemma4", "text_config": {"hidden_size": TARGETS[model]["hidden_size"]},
         "vision_config": VISION}
    if model in ("e2b", "e4b"):
        d["audio_config"] = AUDIO
    cfg = parse_media_config(d, f"{model} (benchmark shapes)")
    return Encoders(cfg, jax.device_put(random_params(abstract_encoder_params(cfg, dtype))), dtype)


def timed(fn, args: tuple, repeats: int) -> dict:
    """Compile (the first call) and median seconds per call after warm-up."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    return {"first_call_s": first, "median_ms": 1e3 * median_time(fn, args, repeats=repeats, warmup=2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["e4b"], choices=sorted(TARGETS))
    ap.add_argument("--image-budgets", nargs="+", type=int, default=[70, 140, 280, 560, 1120],
                    help="soft tokens per image (the processor's max_soft_tokens); each image a square within it")
    ap.add_argument("--audio-seconds", nargs="+", type=float, default=[5, 10, 30])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    results = {"env": environment(), "rows": []}
    for model in args.models:
        enc = encoders_for(model, jnp.bfloat16)
        v = enc.config.vision
        for budget in args.image_budgets:
            side = int(np.sqrt(budget)) * v.patch_size * v.pooling_kernel_size  # a square image filling the budget
            image = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            pixels, positions, n = process_image(image, ImageProcessorConfig(v.patch_size, v.pooling_kernel_size,
                                                                             budget))
            row = {"model": model, "item": "image", "budget": budget, "soft_tokens": n, "patches": len(pixels),
                   **timed(enc._image, (enc.params, jnp.asarray(pixels[None]), jnp.asarray(positions[None])),
                           args.repeats)}
            results["rows"].append(row)
            print(f"{model} image budget {budget:5d}: {n:5d} soft tokens, compile+first {row['first_call_s']:.2f} s, "
                  f"{row['median_ms']:.2f} ms", flush=True)
        if enc.config.audio is None:
            continue
        feat_cfg = AudioFeatureConfig(num_mel_bins=enc.config.audio.subsampling_conv_channels[0])
        for seconds in args.audio_seconds:
            clip = rng.standard_normal(int(seconds * feat_cfg.sampling_rate)).astype(np.float32) * 0.1
            features, mask = audio_features([clip], feat_cfg)
            frames = max(MIN_AUDIO_FRAMES, 1 << (features.shape[1] - 1).bit_length())
            pad = frames - features.shape[1]
            features, mask = np.pad(features, ((0, 0), (0, pad), (0, 0))), np.pad(mask, ((0, 0), (0, pad)))
            inputs = (enc.params, jnp.asarray(features), jnp.asarray(mask))
            row = {"model": model, "item": "audio", "seconds": seconds, "frames": frames,
                   **timed(enc._audio, inputs, args.repeats)}
            row["soft_tokens"] = int(np.asarray(enc._audio(*inputs)[1]).sum())
            results["rows"].append(row)
            print(f"{model} audio {seconds:4.0f} s ({frames} frames): {row['soft_tokens']} soft tokens, "
                  f"compile+first {row['first_call_s']:.2f} s, {row['median_ms']:.2f} ms", flush=True)
    write_json("bench_media.json", results)


if __name__ == "__main__":
    main()
