"""Prompts with images served by the engine, with speculation on (the tiny e2b multimodal target of hf_tiny.py and
its assistant, float32, CPU):

* greedy speculative == greedy plain == the reference forward's greedy continuation (`api.multimodal_forward`);
* the prefix cache: the same image finds every page of the prompt, a different image behind the same placeholder
  ids finds only the pages before it, and its tokens are the reference's for that image;
* a preempted request prefills again with its media;
* a family whose image tokens attend to each other refuses a prompt with an image.

Engines compile lazily (only the programs these prompts run).
"""

from __future__ import annotations

import numpy as np
import pytest

import hf_tiny

MAX_NEW = 6
BUDGET = 12  # soft tokens per image (the tiny tower: 2 x 2 patches pooled 2 x 2 -> one soft token per 4 x 4 pixels)


def _config(**kw):
    from gemma4_mtp_jax.engine import EngineConfig

    base = dict(max_num_seqs=2, max_model_len=64, page_size=4, prefill_chunk=16, min_prefill_bucket=16,
                compile_at_start=False, async_scheduling=False)
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def e2b(tiny_ckpts, jax_models):
    """(target, assistant, media encoder) of the tiny e2b pair, the target with its towers."""
    from gemma4_mtp_jax.engine.media import MediaEncoder

    target = jax_models.target(tiny_ckpts["e2b"]["target_multimodal"])
    assistant = jax_models.assistant(tiny_ckpts["e2b"]["assistant"])
    return target, assistant, MediaEncoder(target, max_image_tokens=BUDGET)


@pytest.fixture(scope="module")
def engines(e2b):
    from gemma4_mtp_jax.engine import Engine

    target, assistant, _ = e2b
    return {"plain": Engine(target, _config()), "spec": Engine(target, _config(), assistant=assistant)}


def _image(seed: int) -> np.ndarray:
    """8 x 24 uint8 pixels: exactly 2 x 6 cells, 12 soft tokens, no resizing."""
    return np.random.default_rng(seed).integers(0, 256, (8, 24, 3), dtype=np.uint8)


def _prompt(target) -> list[int]:
    """9 text tokens, the image (begin, 12 placeholders, end: positions 9..22), 6 text tokens."""
    from gemma4_mtp_jax.media.placeholders import expand_placeholders

    cfg = target.encoders.config
    rng = np.random.default_rng(7)
    ids = rng.integers(3, 400, 9).tolist() + [cfg.image_token_id] + rng.integers(3, 400, 6).tolist()
    return expand_placeholders(ids, cfg, [BUDGET])


def _assert_reference_greedy(target, prompt: list[int], image: np.ndarray, output: list[int]) -> None:
    """`output` is the greedy continuation of the non-paged reference forward: one forward over prompt + output,
    whose argmax after each position is the next token."""
    from gemma4_mtp_jax.media.image_processing import process_image

    g = hf_tiny.import_gemma4_mtp_jax()
    pixels, positions, _ = process_image(image, _encoder_config(target))
    ids = np.asarray([prompt + output])
    out = g.multimodal_forward(target, ids, pixels=pixels[None], pixel_positions=positions[None])
    greedy = np.argmax(np.asarray(out.logits)[0, len(prompt) - 1:-1], axis=-1)
    assert greedy.tolist() == output


def _encoder_config(target):
    from gemma4_mtp_jax.media.image_processing import ImageProcessorConfig

    v = target.encoders.config.vision
    return ImageProcessorConfig(v.patch_size, v.pooling_kernel_size, BUDGET)


def _serve(engine, encoder, prompt, image, **kw):
    media = encoder.prompt(prompt, [encoder.image(image)])
    req = engine.add_request(prompt, MAX_NEW, media=media, **kw)
    engine.run()
    return req


def test_speculative_equals_plain_equals_reference(e2b, engines):
    target, _, encoder = e2b
    prompt, image = _prompt(target), _image(1)
    plain = _serve(engines["plain"], encoder, prompt, image)
    spec = _serve(engines["spec"], encoder, prompt, image)
    assert spec.output == plain.output
    assert spec.drafts_per_round, "the multimodal request did not speculate"
    _assert_reference_greedy(target, prompt, image, plain.output)


def test_prefix_cache_keys_pages_by_image(e2b, engines):
    """Same prompt ids: the same image finds all its full pages but the newest; a different image the two pages
    before it (positions 0..7), and its output is the reference's for that image, not the cached one's."""
    target, _, encoder = e2b
    engine = engines["plain"]
    prompt = _prompt(target)
    engine.kv.reset_prefix_cache()
    first = _serve(engine, encoder, prompt, _image(2))
    hits = engine.kv.hits
    again = _serve(engine, encoder, prompt, _image(2))
    assert engine.kv.hits - hits == (len(prompt) - 1) // 4 * 4
    assert again.output == first.output
    hits = engine.kv.hits
    other = _serve(engine, encoder, prompt, _image(3))
    assert engine.kv.hits - hits == 8
    _assert_reference_greedy(target, prompt, _image(3), other.output)
    assert other.output != first.output


def test_preempted_request_prefills_again_with_its_media(e2b, engines):
    """A request preempted mid-decode resumes from its prompt (image included) and output, the prefix cache
    emptied so that it computes every page again: the same tokens."""
    target, _, encoder = e2b
    engine = engines["spec"]
    prompt, image = _prompt(target), _image(4)
    want = _serve(engine, encoder, prompt, image).output
    engine.kv.reset_prefix_cache()
    req = engine.add_request(prompt, MAX_NEW, media=encoder.prompt(prompt, [encoder.image(image)]))
    while len(req.output) < 2:  # without async scheduling no step stays in flight
        engine.step()
    engine.scheduler.preempt(req)
    engine.kv.reset_prefix_cache()  # so that the resumed prefill recomputes the image's positions
    engine.run()
    assert req.num_preemptions == 1
    assert req.output == want


def test_media_on_a_bidirectional_family_is_refused(tiny_ckpts, jax_models):
    from gemma4_mtp_jax.engine import Engine, RequestError
    from gemma4_mtp_jax.engine.media import MediaEncoder
    from gemma4_mtp_jax.media.placeholders import expand_placeholders

    target = jax_models.target(tiny_ckpts["b31b"]["target_multimodal"])
    encoder = MediaEncoder(target, max_image_tokens=BUDGET)
    cfg = target.encoders.config
    prompt = expand_placeholders([5, 6, cfg.image_token_id, 7], cfg, [BUDGET])
    engine = Engine(target, _config())
    with pytest.raises(RequestError, match="image_attention='sliding_layers'.*paged prefill does not implement"):
        engine.add_request(prompt, 4, media=encoder.prompt(prompt, [encoder.image(_image(5))]))


def test_media_mismatch_is_refused(e2b, engines):
    from gemma4_mtp_jax.engine import RequestError

    target, _, encoder = e2b
    prompt = _prompt(target)
    media = encoder.prompt(prompt, [encoder.image(_image(1))])
    with pytest.raises(RequestError, match="placeholder"):
        engines["plain"].add_request(prompt[1:], MAX_NEW, media=media)
    with pytest.raises(ValueError, match="13 image placeholder tokens"):
        encoder.prompt(prompt + [target.encoders.config.image_token_id], [encoder.image(_image(1))])
