"""Images and audio in the prompt, against transformers 5.24 on the tiny multimodal checkpoints of hf_tiny.py:

* the encoders' soft tokens (Gemma 4's vision tower on e2b / b31b, its audio tower on e2b, the unified 12B's
  encoder-free embedders on u12b) and the target's logits on prompts mixing text, images and audio, against
  `...ForConditionalGeneration` (float32, the non-paged reference forward);
* the attention of an image's soft tokens to each other: causal on e2b, within sliding layers on b31b ("vision"),
  in every layer on u12b; the references are also run without the image blocks to show the tests would notice;
* the preprocessing (image resizing and patching, log-mel features, soft-token counts, placeholder expansion)
  against transformers' Gemma 4 image processor (Pillow backend) and audio feature extractor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_tiny
from hf_tiny import assert_close

# Soft tokens enter the text model unnormalized (pooled x sqrt(H), standardized), so a mixed prompt's logits carry
# more float32 rounding than a text prompt's (1e-4 in test_parity_target.py): measured up to 1.1e-4 on e2b's
# (|logits| up to 7.5), the encoders' own outputs 2e-6.
EMBED_ATOL, LOGIT_ATOL = 1e-4, 2e-4


@pytest.fixture(scope="module")
def models(tiny_ckpts):
    """{family: (our Target, transformers' model)} of the three multimodal layouts."""
    import transformers

    g = hf_tiny.import_gemma4_mtp_jax()
    out = {}
    for family, layout, cls in (("e2b", "target_multimodal", "Gemma4ForConditionalGeneration"),
                                ("b31b", "target_multimodal", "Gemma4ForConditionalGeneration"),
                                ("u12b", "target", "Gemma4UnifiedForConditionalGeneration")):
        path = tiny_ckpts[family][layout]
        out[family] = (g.load_target(str(path), dtype="float32"),
                       hf_tiny._quiet_load(getattr(transformers, cls), str(path)))
    return out


def _image(rng, height: int, width: int, patch: int, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Random pixels in [0, 1] cut as the processor cuts them: (patches [budget, 3 patch^2], positions)."""
    from gemma4_mtp_jax.media.image_processing import patchify

    patches, positions = patchify(rng.random((height, width, 3)).astype(np.float32), patch)
    out, pos = np.zeros((budget, patches.shape[1]), np.float32), np.full((budget, 2), -1, np.int64)
    out[: len(patches)], pos[: len(patches)] = patches, positions
    return out, pos


def _images(family: str, rng) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Two images of different shapes (one padded within the budget): 12 and 3 soft tokens. The tiny sliding
    window is 8, so the first image's block is wider than the window."""
    if family == "u12b":  # 4x4-pixel merged patches, one soft token each; budget 12
        shapes, patch, budget = ((12, 16), (4, 12)), 4, 12
    else:  # 2x2-pixel patches pooled 2x2; budget 12 soft tokens = 48 patches
        shapes, patch, budget = ((8, 24), (12, 4)), 2, 48
    done = [_image(rng, h, w, patch, budget) for h, w in shapes]
    return np.stack([d[0] for d in done]), np.stack([d[1] for d in done]), [12, 3]


def _audio(family: str, rng) -> tuple[np.ndarray, np.ndarray, int]:
    """One clip: 37 log-mel frames (10 soft tokens) of 16 bins, or for u12b 5 waveform frames of 8 samples, the
    last one padding."""
    if family == "u12b":
        mask = np.array([[True] * 4 + [False]])
        return rng.standard_normal((1, 5, 8)).astype(np.float32), mask, 4
    return rng.standard_normal((1, 37, hf_tiny.AUDIO_MEL_BINS)).astype(np.float32), np.ones((1, 37), bool), 10


@pytest.mark.parametrize("family", ["e2b", "b31b", "u12b"])
def test_image_embeddings(models, family):
    target, hf = models[family]
    pixels, positions, counts = _images(family, np.random.default_rng(1))
    with torch.no_grad():
        want = hf.model.get_image_features(torch.tensor(pixels), torch.tensor(positions), return_dict=True)
    want = torch.cat(want.pooler_output).numpy()
    soft, valid = target.encoders._image(target.encoders.params, pixels, positions)
    soft, valid = np.asarray(soft), np.asarray(valid)
    assert valid.sum(axis=1).tolist() == counts
    assert_close(f"{family} image soft tokens", soft[valid], want, EMBED_ATOL)


@pytest.mark.parametrize("family", ["e2b", "u12b"])
def test_audio_embeddings(models, family):
    target, hf = models[family]
    features, mask, count = _audio(family, np.random.default_rng(2))
    features = np.concatenate([features, features[:, ::-1]])  # a second clip, half of it padding
    mask = np.concatenate([mask, mask.copy()])
    mask[1, mask.shape[1] // 2:] = False
    with torch.no_grad():
        out = hf.model.get_audio_features(torch.tensor(features), torch.tensor(mask), return_dict=True)
    want, want_valid = out.pooler_output.numpy(), out.attention_mask.numpy()
    soft, valid = target.encoders._audio(target.encoders.params, features, mask)
    soft, valid = np.asarray(soft), np.asarray(valid)
    np.testing.assert_array_equal(valid, want_valid)
    assert int(valid[0].sum()) == count
    assert_close(f"{family} audio soft tokens", soft[valid], want[want_valid], EMBED_ATOL)


def _prompt(target, counts: list[int], audio: int | None, rng) -> np.ndarray:
    """[1, T]: text, each image's expanded placeholders, [audio's], text, built by `expand_placeholders`."""
    from gemma4_mtp_jax.media.placeholders import expand_placeholders

    cfg = target.encoders.config
    text = lambda n: rng.integers(3, 400, n).tolist()  # noqa: E731  (below the media ids)
    ids = text(5) + [cfg.image_token_id] + text(4) + [cfg.image_token_id] + text(3)
    if audio is not None:
        ids += [cfg.audio_token_id] + text(2)
    return np.asarray([expand_placeholders(ids, cfg, counts, [] if audio is None else [audio])])


@pytest.mark.parametrize("family", ["e2b", "b31b", "u12b"])
def test_mixed_prompt_logits(models, family):
    """Text + two images (+ audio where the model has it): logits against transformers' forward, given
    mm_token_type_ids as its processor gives them. Run without them, transformers applies no image blocks: on
    b31b and u12b that changes the logits (so the blocks are exercised), on e2b (causal) it does not."""
    from gemma4_mtp_jax.media.placeholders import media_token_types

    g = hf_tiny.import_gemma4_mtp_jax()
    target, hf = models[family]
    rng = np.random.default_rng(3)
    pixels, positions, counts = _images(family, rng)
    has_audio = target.encoders.config.audio is not None
    features, mask, audio = _audio(family, rng) if has_audio else (None, None, None)
    ids = _prompt(target, counts, audio, rng)
    kw = dict(pixel_values=torch.tensor(pixels), image_position_ids=torch.tensor(positions))
    if has_audio:
        kw.update(input_features=torch.tensor(features), input_features_mask=torch.tensor(mask))
    types = torch.tensor([media_token_types(ids[0], target.encoders.config)])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), mm_token_type_ids=types, use_cache=False, **kw).logits.numpy()
        causal = hf(input_ids=torch.tensor(ids), use_cache=False, **kw).logits.numpy()
    out = g.multimodal_forward(target, ids, pixels=pixels, pixel_positions=positions, audio_features=features,
                               audio_mask=mask)
    assert_close(f"{family} mixed-prompt logits", out.logits, want, LOGIT_ATOL)
    expected = {"e2b": "causal", "b31b": "sliding_layers", "u12b": "all_layers"}[family]
    assert target.config.image_attention == expected
    effect = float(np.abs(causal - want).max())
    assert (effect > 1e-2) == (expected != "causal"), f"{family}: image blocks changed the logits by {effect:.3g}"


def test_placeholder_count_mismatch_is_refused(models):
    g = hf_tiny.import_gemma4_mtp_jax()
    target, _ = models["b31b"]
    pixels, positions, counts = _images("b31b", np.random.default_rng(4))
    ids = _prompt(target, [counts[0], counts[1] + 1], None, np.random.default_rng(4))
    with pytest.raises(ValueError, match="16 image placeholder tokens .* gave 15 soft tokens"):
        g.multimodal_forward(target, ids, pixels=pixels, pixel_positions=positions)


def test_expand_placeholders(models):
    from gemma4_mtp_jax.media.placeholders import expand_placeholders, media_token_types

    cfg = models["e2b"][0].encoders.config
    I, A = cfg.image_token_id, cfg.audio_token_id
    got = expand_placeholders([7, I, 8, A, I], cfg, [2, 1], [3])
    assert got == [7, cfg.boi_token_id, I, I, cfg.eoi_token_id, 8, cfg.boa_token_id, A, A, A, cfg.eoa_token_id,
                   cfg.boi_token_id, I, cfg.eoi_token_id]
    assert media_token_types(got, cfg) == [0, 0, 1, 1, 0, 0, 0, 3, 3, 3, 0, 0, 1, 0]
    with pytest.raises(ValueError, match="2 image placeholder"):
        expand_placeholders([I, I], cfg, [4])


# ----------------------------------------------------------------------------------------------------------------------
# Preprocessing against transformers' processors
# ----------------------------------------------------------------------------------------------------------------------
# (height, width) of the test images: one already at its target size (no resampling), one only narrowed, one
# upscaled, one shrunk on both axes, one so thin that a side rounds to one cell (not 3 pixels: transformers would
# read a [3, W, 3] array as channels-first)
IMAGE_SIZES = [(24, 40), (16, 33), (9, 13), (61, 47), (5, 90)]


def test_image_processor():
    """Patches, positions and soft-token counts as transformers' Gemma 4 image processor (Pillow backend) gives
    them, at patch 4, pooling 2 and a budget of 70 soft tokens. Pixels: exact where the image is resized along
    one axis or not at all; where both axes change, Pillow 13 picks the order of its two passes by a rule of its
    own, and a pixel may differ by a few levels (measured: at most 12/255 on noise, a mean under 1/255)."""
    pil = pytest.importorskip("PIL")  # noqa: F841  (transformers' processor needs it)
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from gemma4_mtp_jax.media.image_processing import ImageProcessorConfig, num_soft_tokens, process_images

    cfg = ImageProcessorConfig(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    ref = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    rng = np.random.default_rng(5)
    images = []
    for h, w in IMAGE_SIZES:  # smooth content plus noise, as photographs
        yy, xx = np.mgrid[0:h, 0:w]
        base = 127 + 100 * np.sin(xx[..., None] / 5.0 + yy[..., None] / 7.0 + np.arange(3))
        images.append(np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8))
    want = ref(images, return_tensors="np")
    pixels, positions, counts = process_images(images, cfg)
    assert counts == list(want["num_soft_tokens_per_image"])
    assert counts == [num_soft_tokens(h, w, cfg) for h, w in IMAGE_SIZES]
    np.testing.assert_array_equal(positions, want["image_position_ids"])
    diff = np.abs(pixels - want["pixel_values"])
    for i, (h, w) in enumerate(IMAGE_SIZES):
        th, tw = (positions[i, :, 1].max() + 1) * 4, (positions[i, :, 0].max() + 1) * 4
        if th == h or tw == w:
            assert diff[i].max() == 0, f"image {i} ({h}x{w} -> {th}x{tw}): max diff {diff[i].max()}"
        assert diff[i].max() <= 12 / 255 + 1e-6 and diff[i].mean() < 1 / 255, (i, diff[i].max(), diff[i].mean())


def test_audio_features():
    """Log-mel features and frame masks equal transformers' extractor's (a batch of two clips of different
    lengths, so one is padded); the soft-token count per clip is its processor's."""
    from transformers import Gemma4AudioFeatureExtractor

    from gemma4_mtp_jax.media.audio_features import audio_features, num_soft_tokens

    rng = np.random.default_rng(6)
    clips = [(0.3 * rng.standard_normal(4000)).astype(np.float32),
             (0.1 * np.sin(np.arange(2777) * 0.05)).astype(np.float32)]
    want = Gemma4AudioFeatureExtractor()(clips, return_tensors="np")
    features, mask = audio_features(clips)
    np.testing.assert_array_equal(mask, want["input_features_mask"])
    assert_close("log-mel features", features, want["input_features"], 1e-5)
    assert [num_soft_tokens(m) for m in mask] == [_processor_count(m) for m in want["input_features_mask"]]


def _processor_count(mask: np.ndarray) -> int:
    """Gemma4Processor.replace_audio_token's count: the mask through two stride-2 convolutions' length rule."""
    t = len(mask)
    for _ in range(2):
        t_out = (t + 2 - 3) // 2 + 1
        mask = mask[::2][:t_out]
        t = len(mask)
    return int(mask.sum())
