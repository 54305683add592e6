"""Prompts with images served by the engine, with speculation on (the tiny e2b multimodal target of hf_tiny.py and
its assistant, float32, CPU):

* greedy speculative == greedy plain == the reference forward's greedy continuation (`api.multimodal_forward`);
* the prefix cache: the same image finds every page of the prompt, a different image behind the same placeholder
  ids finds only the pages before it, and its tokens are the reference's for that image;
* a preempted request prefills again with its media;
* families whose image tokens see each other (b31b, u12b): an image kept in one prefill chunk and out of a
  prefix-cache hit's cut, served exactly; an image longer than a chunk refused;
* an audio clip padded to its frame bucket keeps its soft tokens; a fetched image within the limits;
* the server (the same checkpoint, a word-level tokenizer written for it): a data: URL image's prompt and greedy
  answer, streamed and not, equal to the engine's; a WAV clip's soft-token count; 400s naming each bad part.

Engines compile lazily (only the programs these prompts run).
"""

from __future__ import annotations

import json

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


def _assert_reference_greedy(target, encoder, prompt: list[int], image: np.ndarray, output: list[int],
                             logprobs=None) -> None:
    """`output` is the greedy continuation of the non-paged reference forward: one forward over prompt + output,
    whose argmax after each position is the next token; `logprobs` (Request.logprobs): the output tokens' logprobs
    under that forward's logits, to 1e-4."""
    from gemma4_mtp_jax.media.image_processing import process_image

    g = hf_tiny.import_gemma4_mtp_jax()
    pixels, positions, _ = process_image(image, encoder.image_config, unified=encoder.config.unified)
    ids = np.asarray([prompt + output])
    out = g.multimodal_forward(target, ids, pixels=pixels[None], pixel_positions=positions[None])
    logits = np.asarray(out.logits, np.float64)[0, len(prompt) - 1:-1]
    assert np.argmax(logits, axis=-1).tolist() == output
    if logprobs is not None:
        want = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        hf_tiny.assert_close("output logprobs", np.array([lp.logprob for lp in logprobs]),
                             want[np.arange(len(output)), output], 1e-4)


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
    _assert_reference_greedy(target, encoder, prompt, image, plain.output)


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
    _assert_reference_greedy(target, encoder, prompt, _image(3), other.output)
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


@pytest.fixture(scope="module")
def bidirectional(tiny_ckpts, jax_models):
    """{family: (target, assistant, media encoder)} of the families whose image tokens see each other: b31b in its
    sliding layers, u12b in every layer."""
    from gemma4_mtp_jax.engine.media import MediaEncoder

    out = {}
    for family, layout in (("b31b", "target_multimodal"), ("u12b", "target")):
        target = jax_models.target(tiny_ckpts[family][layout])
        out[family] = (target, jax_models.assistant(tiny_ckpts[family]["assistant"]),
                       MediaEncoder(target, max_image_tokens=BUDGET))
    return out


@pytest.mark.parametrize("family", ["b31b", "u12b"])
def test_images_see_themselves_when_served(bidirectional, family):
    """The prefill keeps the image (soft tokens at 10..21) in one chunk of 16, though it straddles the first chunk's
    end, and its tokens see each other through the paged attention: greedy spec == plain == the reference forward's.
    A prompt sharing the text and image but not what follows them finds cached pages only before the image (8
    positions: the page boundaries 12, 16 and 20 lie inside it, and a prefill resumed there would lose the image's
    first keys in u12b's sliding layers), and is the reference's too. Output logprobs are compared too: greedy tokens
    alone miss a wrong mask on b31b. An image longer than a prefill chunk is refused by name."""
    from gemma4_mtp_jax.engine import Engine, RequestError
    from gemma4_mtp_jax.model.sampling import SamplingParams

    target, assistant, encoder = bidirectional[family]
    plain, spec = Engine(target, _config()), Engine(target, _config(), assistant=assistant)
    prompt, image, sampling = _prompt(target), _image(1), SamplingParams(logprobs=0)
    want = _serve(plain, encoder, prompt, image, sampling=sampling)
    got = _serve(spec, encoder, prompt, image, sampling=sampling)
    assert got.output == want.output
    assert got.drafts_per_round, "the multimodal request did not speculate"
    _assert_reference_greedy(target, encoder, prompt, image, want.output, want.logprobs)
    _assert_reference_greedy(target, encoder, prompt, image, got.output, got.logprobs)

    other = prompt[:23] + [t + 1 for t in prompt[23:]]
    hits = plain.kv.hits
    req = _serve(plain, encoder, other, image, sampling=sampling)
    assert plain.kv.hits - hits == 8
    _assert_reference_greedy(target, encoder, other, image, req.output, req.logprobs)

    short = Engine(target, _config(prefill_chunk=8, min_prefill_bucket=8))
    with pytest.raises(RequestError, match="image of 12 soft tokens is longer than a prefill chunk .8 tokens."):
        short.add_request(prompt, 4, media=encoder.prompt(prompt, [encoder.image(image)]))


def test_server_prefill_chunk_holds_an_image(tiny_ckpts):
    """The server raises --prefill-chunk to a power of two of at least --max-image-tokens where image tokens see each
    other (b31b), and leaves it where they do not (e2b) or where it is already enough."""
    import argparse

    from gemma4_mtp_jax.server.cli import _prefill_chunk

    args = lambda chunk: argparse.Namespace(prefill_chunk=chunk, max_image_tokens=BUDGET)  # noqa: E731
    assert _prefill_chunk(args(8), tiny_ckpts["b31b"]["target_multimodal"]) == 16
    assert _prefill_chunk(args(12), tiny_ckpts["b31b"]["target_multimodal"]) == 12
    assert _prefill_chunk(args(8), tiny_ckpts["e2b"]["target_multimodal"]) == 8


def test_media_mismatch_is_refused(e2b, engines):
    from gemma4_mtp_jax.engine import RequestError

    target, _, encoder = e2b
    prompt = _prompt(target)
    media = encoder.prompt(prompt, [encoder.image(_image(1))])
    with pytest.raises(RequestError, match="placeholder"):
        engines["plain"].add_request(prompt[1:], MAX_NEW, media=media)
    with pytest.raises(ValueError, match="13 image placeholder tokens"):
        encoder.prompt(prompt + [target.encoders.config.image_token_id], [encoder.image(_image(1))])


def test_audio_bucket_padding_keeps_the_soft_tokens(e2b):
    """A clip padded to its frame bucket gives the soft tokens of the clip alone (padding frames are masked)."""
    from gemma4_mtp_jax.media.audio_features import audio_features

    _, _, encoder = e2b
    clip = (0.2 * np.sin(np.arange(5000) * 0.03)).astype(np.float32)
    item = encoder.audio(clip)
    features, mask = audio_features([clip], encoder.audio_config)
    soft, valid = encoder.encoders._audio(encoder.encoders.params, features, mask)
    hf_tiny.assert_close("bucketed audio soft tokens", item.soft, np.asarray(soft[0])[np.asarray(valid[0])], 1e-5)


def test_fetched_image_within_limits(e2b):
    """With fetching allowed, an http URL's image is the same item as its data: URL's; a larger file than the
    limit, or fetching not allowed, is a 400 naming the part."""
    import http.server
    import threading

    from gemma4_mtp_jax.server.errors import APIError
    from gemma4_mtp_jax.server.media import MediaLoader, MediaPart, MediaSettings, read_part

    target, _, encoder = e2b
    url = _png(_image(9))
    png = read_part({"type": "image_url", "image_url": {"url": url}}, "here").data

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        prompt = [5, target.encoders.config.image_token_id, 6]
        part = MediaPart("messages[0].content[0]", "image", url=f"http://127.0.0.1:{httpd.server_port}/a.png")
        ids, media = MediaLoader(encoder, MediaSettings(allow_fetch=True)).load(prompt, [part])
        _, want = MediaLoader(encoder, MediaSettings()).load(prompt, [MediaPart("x", "image", data=png)])
        np.testing.assert_array_equal(media.soft, want.soft)
        assert media.spans == want.spans and len(ids) == len(prompt) + 1 + BUDGET
        for settings, message in ((MediaSettings(allow_fetch=True, max_fetch_bytes=len(png) - 1), "larger than"),
                                  (MediaSettings(), "--allow-media-fetch")):
            with pytest.raises(APIError, match=message) as e:
                MediaLoader(encoder, settings).load(prompt, [part])
            assert e.value.status == 400 and e.value.message.startswith("messages[0].content[0]: ")
    finally:
        httpd.shutdown()


# ----------------------------------------------------------------------------------------------------------------------
# The server: chat image_url / input_audio parts
# ----------------------------------------------------------------------------------------------------------------------
WORDS = 500  # the test tokenizer's plain words w0..w499 are ids 0..499; the special tokens follow
SPECIAL = ["<|image|>", "<|audio|>", "<|image>", "<image|>", "<|video|>", "<|audio>", "<audio|>", "<start_of_turn>",
           "<end_of_turn>", "<unk>"]  # ids 500..509 (the tiny checkpoints' media ids are 500..506)


def _write_tokenizer(directory) -> None:
    """A word-level tokenizer.json and chat template for the tiny e2b checkpoint (which has none)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(WORDS)} | {t: WORDS + i for i, t in enumerate(SPECIAL)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.ByteLevel()  # one the grammar compiler (llguidance) reads token bytes from
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.save(str(directory / "tokenizer.json"))
    template = ("{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"
                "{% if add_generation_prompt %}<start_of_turn>{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    gen = directory / "generation_config.json"  # an end of turn to stop at (the grammar compiler needs one)
    config = json.loads(gen.read_text()) if gen.exists() else {}
    gen.write_text(json.dumps(config | {"eos_token_id": [vocab["<end_of_turn>"]]}))


@pytest.fixture(scope="module")
def srv(tiny_ckpts, tmp_path_factory):
    import shutil

    from test_server_support import InProcessServer

    tdir = tmp_path_factory.mktemp("mm_server") / "target"
    shutil.copytree(tiny_ckpts["e2b"]["target_multimodal"], tdir)
    _write_tokenizer(tdir)
    s = InProcessServer(["--ckpt", str(tdir), "--assistant", str(tiny_ckpts["e2b"]["assistant"]),
                         "--served-model-name", "mm", "--executable-cache-dir", "none", "--no-access-log",
                         "--compilation-cache-dir", str(tmp_path_factory.mktemp("mm_jax_cache")),
                         "--max-num-seqs", "1", "--max-model-len", "64", "--prefill-chunk", "16", "--page-size", "4",
                         "--no-structured-outputs", "--speculative-k", "fixed", "--dtype", "float32",
                         "--max-image-tokens", str(BUDGET)])
    yield s
    s.close()


def _png(image: np.ndarray) -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _wav(seconds: float, rate: int = 8000) -> str:
    import base64
    import io
    import wave

    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate), w.writeframes(pcm.tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def _chat(srv, content: list, **kw):
    import json

    from test_server_support import request

    body = {"model": "mm", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_NEW,
            "temperature": 0, "return_token_ids": True, **kw}
    status, _, data = request(srv.host, srv.port, "POST", "/v1/chat/completions", body)
    return status, data if kw.get("stream") else json.loads(data)


def test_server_image_part_equals_engine(srv, e2b, engines):
    """A data: URL image: the prompt is the template's with the image's placeholders expanded, and the greedy
    answer (speculative on the server) is the plain engine's for that prompt and image, streamed or not."""
    target, _, encoder = e2b
    image = _image(6)
    content = [{"type": "text", "text": "w5 w6 w7 "}, {"type": "image_url", "image_url": {"url": _png(image)}},
               {"type": "text", "text": " w9 w10"}]
    status, out = _chat(srv, content)
    assert status == 200, out
    cfg = target.encoders.config
    turn, end = WORDS + SPECIAL.index("<start_of_turn>"), WORDS + SPECIAL.index("<end_of_turn>")
    want_prompt = [turn, 5, 6, 7, cfg.boi_token_id] + [cfg.image_token_id] * BUDGET + [cfg.eoi_token_id, 9, 10, end,
                                                                                       turn]
    assert out["prompt_token_ids"] == want_prompt
    want = _serve(engines["plain"], encoder, want_prompt, image)
    assert out["choices"][0]["token_ids"] == want.output[:len(out["choices"][0]["token_ids"])]
    assert out["usage"]["prompt_tokens"] == len(want_prompt)
    status, streamed = _chat(srv, content, stream=True)
    assert status == 200
    chunks = [json.loads(line[6:]) for line in streamed.decode().splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text == out["choices"][0]["message"]["content"]


def test_server_audio_part(srv, e2b):
    from gemma4_mtp_jax.media.audio_features import audio_features, num_soft_tokens
    from gemma4_mtp_jax.server.media import decode_wav

    import base64

    clip = _wav(0.5)
    status, out = _chat(srv, [{"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}},
                              {"type": "text", "text": "w4"}])
    assert status == 200, out
    wave16k = decode_wav(base64.b64decode(clip), 16000, "test")
    _, mask = audio_features([wave16k], e2b[2].audio_config)
    assert out["prompt_token_ids"].count(e2b[0].encoders.config.audio_token_id) == num_soft_tokens(mask[0])


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}, "could not be decoded"),
    ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGVsbG8="}}, "data:image/<type>;base64"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "--allow-media-fetch"),
    ({"type": "image_url", "image_url": {"url": "ftp://example.com/cat.png"}}, "data: URL or http"),
    ({"type": "input_audio", "input_audio": {"data": "aGVsbG8=", "format": "mp3"}}, "wav only"),
    ({"type": "input_audio", "input_audio": {"data": "aGVsbG8=", "format": "wav"}}, "not a readable WAV"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}, "could not be decoded"),
])
def test_server_bad_media_parts_are_400(srv, part, message):
    status, out = _chat(srv, [{"type": "text", "text": "w1"}, part])
    assert status == 400, out
    assert out["error"]["message"].startswith("messages[0].content[1]: ") and message in out["error"]["message"], out


def test_server_too_many_or_huge_media_are_400(srv):
    from gemma4_mtp_jax.server.media import MAX_MEDIA_PARTS

    part = {"type": "image_url", "image_url": {"url": _png(_image(8))}}
    status, out = _chat(srv, [part] * (MAX_MEDIA_PARTS + 1))
    assert status == 400 and f"at most {MAX_MEDIA_PARTS}" in out["error"]["message"], out
    status, out = _chat(srv, [{"type": "text", "text": "w1 \ufdd0"}])
    assert status == 400 and "messages[0].content[0]" in out["error"]["message"], out
    status, out = _chat(srv, [{"type": "input_audio", "input_audio": {"data": _wav(31, 1000), "format": "wav"}}])
    assert status == 400 and "more than 30 s" in out["error"]["message"], out
