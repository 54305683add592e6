"""The OpenAI-compatible server over real HTTP on loopback: one in-process server (demo pair, small buckets) for the
module, driven by the official `openai` client and by raw HTTP.

Covers: completions and chat, streaming and not, greedy output equal to `generate`; 32 concurrent streams equal to
sequential runs with every KV page free afterwards; stop strings; a table of bad requests; client disconnects
(pages freed); overload (429 + Retry-After, nothing accepted is lost); an engine step that raises; metrics.
No request can hurt another: requests that once crashed a step or the error path get 400s; a fault in
one request of a running batch (engine or server side) fails it alone; every response is counted; slow clients
are cut off by the header / body deadlines; a property-based fuzz of every route never gets a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import openai  # in the test extra: a missing wheel fails, it does not skip
import pytest

from test_server_support import (
    MODEL,
    InProcessServer,
    fuzz_requests,
    health,
    jax_cache_settings,
    metric_samples,
    request,
    sample,
    server_argv,
    session_paths,
    wait_idle,
)

MAX_LEN = 128
HEADER_TIMEOUT = BODY_TIMEOUT = 3.0  # the server's --header/--body-timeout-seconds here (default 30)
MAX_MESSAGES, MAX_REQUEST_BYTES = 64, 8 * 2**20  # its --max-messages and --max-request-size


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return session_paths(tmp_path_factory)


@pytest.fixture(scope="module")
def srv(paths):
    tdir, adir, cache = paths
    t0 = time.time()
    s = InProcessServer(server_argv(tdir, adir, cache, "--header-timeout-seconds", str(HEADER_TIMEOUT),
                                    "--body-timeout-seconds", str(BODY_TIMEOUT), "--max-messages", str(MAX_MESSAGES),
                                    "--max-request-size", "8MiB", "--enable-prompt-logprobs",
                                    "--structured-outputs"))
    print(f"\n[test_server] server up in {time.time() - t0:.1f}s at {s.url}")
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(paths):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(paths[0] / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference(srv, paths):
    """Tokens from `gemma4_mtp_jax.generate.generate` on engines of its own (the server's config; the persistent
    compilation cache makes them cheap): `reference(ids, n)` on the target alone (greedy speculative decoding must
    give exactly its tokens), `reference(ids, n, sampling, speculative=True)` with the same assistant as the
    server (sampled drafts/acceptance draw their own random numbers: same distribution, not the same tokens as the
    target alone)."""
    import dataclasses

    from gemma4_mtp_jax import load_assistant, load_target
    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.generate import generate
    from gemma4_mtp_jax.model.sampling import SamplingParams

    target = load_target(paths[0])
    cfg = srv.engine.config
    engines = {}

    def engine(speculative):
        if speculative not in engines:
            if speculative:
                engines[True] = Engine(target, cfg, assistant=load_assistant(paths[1]))
            else:
                fields = {f.name for f in dataclasses.fields(cfg)}
                plain = dataclasses.replace(cfg, num_speculative_tokens=None) if "num_speculative_tokens" in fields \
                    else cfg
                engines[False] = Engine(target, plain)
        return engines[speculative]

    def run(prompt_ids, max_new_tokens, sampling=None, speculative=False):
        return generate(target, [list(prompt_ids)], max_new_tokens, sampling or SamplingParams(),
                        engine=engine(speculative))[0].tokens

    return run


def _extra(obj, key):
    return (obj.model_extra or {}).get(key)


@pytest.fixture
def slow_engine(srv, monkeypatch):
    """Make each engine step take at least `delay` seconds (so that requests are reliably in flight)."""
    engine = srv.engine
    real = engine.step
    state = {"delay": 0.03}

    def step():
        time.sleep(state["delay"])
        return real()

    monkeypatch.setattr(engine, "step", step)
    yield state
    monkeypatch.undo()
    wait_idle(srv.host, srv.port)


# ----------------------------------------------------------------------------------------------------------- basics
def test_models_health_metrics(srv, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, _, body = request(srv.host, srv.port, "GET", "/health")
    h = json.loads(body)
    assert status == 200 and h["status"] == "ok" and h["model"] == MODEL
    assert set(h["kv_pages_in_use"]) == set(h["kv_pages_total"]) and all(v > 0 for v in h["kv_pages_total"].values())
    assert h["kv_cache_bytes"] == srv.engine.kv_cache_bytes() > 0 and h["preemptions"] == 0
    samples = metric_samples(srv.host, srv.port)
    assert sample(samples, "gemma4_model_info", model=MODEL) == 1.0
    assert sample(samples, "gemma4_kv_cache_bytes") == h["kv_cache_bytes"]
    assert sample(samples, "gemma4_num_preemptions_total") == 0


def test_prefix_cache_hits_are_counted(srv, client, tok, reference):
    """The same prompt twice: the second finds every full page of its prompt in the prefix cache (hits and queries,
    in tokens, in /health and /metrics), and both answers are the target's own greedy tokens."""
    ids = tok.encode("The quick brown fox jumps over the lazy dog, and the dog sleeps on.").ids
    page = srv.args.page_size
    assert len(ids) > 2 * page
    expected = reference(ids, 12)
    before = wait_idle(srv.host, srv.port)
    for _ in range(2):
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
        assert _extra(r.choices[0], "token_ids") == expected
    h = wait_idle(srv.host, srv.port)
    full_pages = (len(ids) - 1) // page  # at least one prompt token is left to prefill (it gives the first token)
    assert h["prefix_cache_hits"] - before["prefix_cache_hits"] >= full_pages * page
    assert h["prefix_cache_queries"] - before["prefix_cache_queries"] == 2 * len(ids)
    samples = metric_samples(srv.host, srv.port)
    assert sample(samples, "gemma4_prefix_cache_hits_total") == h["prefix_cache_hits"]
    assert sample(samples, "gemma4_prefix_cache_queries_total") == h["prefix_cache_queries"]


@pytest.mark.parametrize("prompt", ["Hello", "Once upon a time"])
def test_completion_greedy_equals_generate(client, tok, reference, prompt):
    ids = tok.encode(prompt).ids
    expected = reference(ids, 24)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert _extra(r, "prompt_token_ids") == ids
    choice = r.choices[0]
    assert _extra(choice, "token_ids") == expected
    assert choice.text == tok.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("length" if len(expected) == 24 else "stop")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(expected)
    assert r.model == MODEL and r.object == "text_completion"

    # streaming: same text, several chunks, usage in the final chunk only when asked
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected) and not chunks[-1].choices
    assert all(c.usage is None for c in chunks[:-1])

    # token prompts are accepted as they are
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert r2.choices[0].text == choice.text


def test_chat_greedy_equals_generate(client, tok, reference):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    rendered = ("<bos><start_of_turn>system\nYou are terse.<end_of_turn>\n<start_of_turn>user\nHi there<end_of_turn>\n"
                "<start_of_turn>model\n")
    ids = tok.encode(rendered, add_special_tokens=False).ids
    assert ids[0] == 2 and ids.count(2) == 1  # exactly one BOS
    expected = reference(ids, 20)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert _extra(r, "prompt_token_ids") == ids
    assert _extra(r.choices[0], "token_ids") == expected
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == tok.decode(expected, skip_special_tokens=True)
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens

    # content as text parts; max_completion_tokens
    r3 = client.chat.completions.create(
        model=MODEL, max_completion_tokens=20, temperature=0,
        messages=[messages[0], {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text",
                                                                                              "text": "there"}]}])
    assert r3.choices[0].message.content == msg.content


def test_stop_strings(client, tok, reference):
    prompt = "Once upon a time"
    ids = tok.encode(prompt).ids
    full = tok.decode(reference(ids, 40), skip_special_tokens=True)
    k = next(i for i in range(1, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    stop = full[k:k + 2]
    expected = full[: full.find(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\x00\x01"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_is_seeded(srv, client, tok, reference):
    from gemma4_mtp_jax.model.sampling import SamplingParams

    ids = tok.encode("abc").ids
    kw = dict(model=MODEL, prompt="abc", max_tokens=16, temperature=0.9, top_p=0.95,
              extra_body={"return_token_ids": True, "top_k": 50})
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    assert _extra(a.choices[0], "token_ids") == _extra(b.choices[0], "token_ids")
    speculative = srv.server.settings.num_speculative_tokens > 0
    assert _extra(a.choices[0], "token_ids") == reference(ids, 16, SamplingParams(0.9, 50, 0.95, 7), speculative)


# ------------------------------------------------------------------------------------- n, logprobs, penalties
def test_n_choices_are_seeded_and_distinct(srv, client, tok, reference):
    """n = 3 sampled: each choice is the run of its own seed (choice 0 the request's, the others derived from it),
    so a seeded request is reproducible and its choices differ; usage counts every choice, the prompt once."""
    from gemma4_mtp_jax.model.sampling import SamplingParams
    from gemma4_mtp_jax.server.app import choice_seed

    ids = tok.encode("abc").ids
    kw = dict(model=MODEL, prompt="abc", max_tokens=12, temperature=0.9, n=3, seed=5,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    got = [_extra(c, "token_ids") for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and got == [_extra(c, "token_ids") for c in b.choices]
    assert len({tuple(t) for t in got}) == 3
    assert a.usage.prompt_tokens == len(ids) and a.usage.completion_tokens == 36
    speculative = srv.server.settings.num_speculative_tokens > 0
    for i in range(3):
        sampling = SamplingParams(0.9, seed=choice_seed(5, i))
        assert got[i] == reference(ids, 12, sampling, speculative)[:12], f"choice {i}"
    wait_idle(srv.host, srv.port)


def test_greedy_n_choices_are_identical(client, tok, reference):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=10,
                                       temperature=0, n=2, extra_body={"return_token_ids": True})
    ids = _extra(r, "prompt_token_ids")
    assert [c.index for c in r.choices] == [0, 1]
    assert _extra(r.choices[0], "token_ids") == _extra(r.choices[1], "token_ids") == reference(ids, 10)
    assert r.choices[0].message.content == r.choices[1].message.content


def test_streamed_choices_interleave_with_usage(srv, client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.8, seed=3, n=2,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, finish = ["", ""], [None, None]
    for c in chunks[:-1]:  # (how the choices interleave depends on the engine's steps and the client's pace)
        assert len(c.choices) == 1
        ch = c.choices[0]
        texts[ch.index] += ch.text
        finish[ch.index] = ch.finish_reason or finish[ch.index]
    assert texts == [c.text for c in whole.choices] and finish == ["length", "length"]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 32 == whole.usage.completion_tokens
    wait_idle(srv.host, srv.port)


def test_logprobs_are_the_targets_and_go_with_the_tokens(client):
    """Greedy: the chosen token is the likeliest of its top ones, with the same logprob; the top ones are sorted and
    their probabilities sum to at most 1; one entry per token (no EOS here: ignore_eos). Streamed: the same."""
    import math

    kw = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, logprobs=5,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8 == r.usage.completion_tokens
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and max(top.values()) == chosen == top[token]
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob and [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True)
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-5


def test_structured_output_holds_with_speculation(client, srv, monkeypatch):
    """Grammars through the speculative engine's masked rounds (--structured-outputs, on by default): a choice ends
    as one of the choices, a regex's output matches it, streamed and not; a JSON schema's output parses and
    validates whenever the model ended it; greedy output under a grammar is the plain engine's under the same
    grammar token for token (the verify masks every position as a decode step would); a schema that cannot compile
    is a 400 naming the field; a grammar that fails in a masked round fails its request alone."""
    import json
    import re

    import jsonschema
    import openai

    from gemma4_mtp_jax.engine import Engine, EngineConfig
    from gemma4_mtp_jax.engine.grammar import GrammarError, GrammarSpec, RoundMasks
    from gemma4_mtp_jax.model.sampling import SamplingParams

    def ask(body, **kw):
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, extra_body=body, **kw)
        return r.choices[0]

    for seed in range(3):
        c = ask({"structured_outputs": {"choice": ["red", "green", "blue"]}}, temperature=1.0, seed=seed)
        assert c.text in ("red", "green", "blue") and c.finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[a-c]{5}"}, "return_token_ids": True})
    c = r.choices[0]
    assert re.fullmatch("[a-c]{5}", c.text), c.text
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=40, temperature=0, stream=True,
        extra_body={"structured_outputs": {"regex": "[a-c]{5}"}}) if ch.choices)
    assert streamed == c.text
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    js = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                        max_tokens=100, temperature=0.7, seed=4,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "t", "schema": schema}})
    if js.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(js.choices[0].message.content), schema)
    # The same grammar, greedy, on a plain engine over the server's target
    engine = srv.server.engine.engine
    assert engine.k > 0 and engine.config.structured_outputs
    plain = Engine(engine.target, EngineConfig(max_num_seqs=2, max_model_len=128, prefill_chunk=64, page_size=16))
    grammar = srv.server.grammars.compile(GrammarSpec("regex", "[a-c]{5}"))
    req = plain.add_request(_extra(r, "prompt_token_ids"), 40, SamplingParams(), grammar=grammar.matcher())
    plain.run()
    assert req.output == _extra(c, "token_ids")
    # A grammar that cannot go on in a masked round fails its request alone: the batch's other row goes on
    # (here on a speculative engine of the server's pair whose first round reports the first row's matcher failed).
    spec = Engine(engine.target, EngineConfig(max_num_seqs=2, max_model_len=128, prefill_chunk=64, page_size=16,
                                              num_speculative_tokens=2, structured_outputs=True,
                                              compile_at_start=False), assistant=engine.assistant)
    real_fill = RoundMasks.fill

    def first_fails(self, matchers, drafts, out):
        errors = real_fill(self, matchers, drafts, out)
        monkeypatch.setattr(RoundMasks, "fill", real_fill)
        return errors + [(0, GrammarError("made to fail"))]

    monkeypatch.setattr(RoundMasks, "fill", first_fails)
    broken, kept = (spec.add_request(_extra(r, "prompt_token_ids"), 40, SamplingParams(), grammar=grammar.matcher())
                    for _ in range(2))
    spec.run()
    assert broken.finish_reason == "error" and "made to fail" in broken.error and broken.output[:1] == req.output[:1]
    assert kept.output == req.output
    spec.close()
    with pytest.raises(openai.BadRequestError) as e:
        ask({"structured_outputs": {"regex": "(unclosed"}})
    assert e.value.body["param"] == "structured_outputs"


def test_echo_with_logprobs_scores_the_prompt(client):
    """Completions' echo with logprobs (--enable-prompt-logprobs): the prompt's tokens come first, the first with a
    null logprob, each later one with its logprob among its top alternatives; then the output's."""
    r = client.completions.create(model=MODEL, prompt="The cat sat on the mat", max_tokens=3, temperature=0,
                                  logprobs=2, echo=True, extra_body={"ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3 and c.text.startswith("The cat sat on the mat")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for token, chosen, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert chosen <= 0 and top[token] == chosen and len(top) <= 3
    assert lp.text_offset == sorted(lp.text_offset)


def test_penalties_and_logit_shaping_reach_the_engine(client, tok):
    """A penalized request is served; min_tokens holds the EOS back, a banned word stays out, a +100 bias makes
    greedy pick that token, allowed_token_ids confine the draw."""
    def one_token(text):
        [t] = tok.encode(text, add_special_tokens=False).ids
        return t

    x, y, q = one_token("x"), one_token("y"), one_token("q")

    def token_ids(**kw):
        extra = {"return_token_ids": True, **kw.pop("extra", {})}
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, extra_body=extra, **kw)
        return _extra(r.choices[0], "token_ids")

    ids = token_ids(temperature=0.8, seed=1, presence_penalty=1.5, frequency_penalty=-0.5,
                    extra={"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 8, "bad_words": ["q"]})
    assert len(ids) == 8 and q not in ids
    assert token_ids(temperature=0, logit_bias={str(x): 100}) == [x] * 8
    assert set(token_ids(temperature=0.8, seed=2, extra={"allowed_token_ids": [x, y]})) <= {x, y}


# ------------------------------------------------------------------------------------------------------ concurrency
def test_32_concurrent_streams_equal_sequential_runs(srv, client, monkeypatch):
    prompts = [f"Request {i}: {'xyz' * (i % 5)} tell me" for i in range(32)]
    params = [dict(temperature=0) if i % 2 == 0 else dict(temperature=0.8, seed=100 + i) for i in range(32)]
    n_tokens = [8 + (i % 4) * 6 for i in range(32)]

    sequential = []
    for p, kw, n in zip(prompts, params, n_tokens):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=n, extra_body={"return_token_ids": True}, **kw)
        sequential.append((_extra(r.choices[0], "token_ids"), r.choices[0].text))

    async def one(aclient, p, kw, n):
        ids, text, chunks = [], [], 0
        stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=n, stream=True,
                                                  extra_body={"return_token_ids": True}, **kw)
        async for c in stream:
            for ch in c.choices:
                ids += _extra(ch, "token_ids") or []
                text.append(ch.text)
                chunks += 1
        return ids, "".join(text), chunks

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, p, kw, n) for p, kw, n in zip(prompts, params, n_tokens)))
        finally:
            await aclient.close()

    engine, real_step, batch_sizes = srv.engine, srv.engine.step, []
    # Until the larger batch buckets' programs are compiled (in the background) the engine runs at most the
    # smallest bucket; on a busy machine that can outlast the sequential runs above.
    assert engine.programs.wait(300), "the background compiling did not finish"

    def step():
        batch_sizes.append(len(engine.scheduler.running))
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    t0 = time.time()
    concurrent = asyncio.run(run_all())
    monkeypatch.undo()
    print(f"\n[test_server] 32 concurrent streams in {time.time() - t0:.2f}s")
    for i, ((ids, text, chunks), (seq_ids, seq_text)) in enumerate(zip(concurrent, sequential)):
        assert ids == seq_ids, f"request {i}"
        assert text == seq_text, f"request {i}"
        assert chunks >= 1
    assert max(batch_sizes) == srv.engine.config.max_num_seqs  # they really were batched (and queued)
    h = wait_idle(srv.host, srv.port)
    assert h["status"] == "ok"


def test_single_token_and_default_max_tokens(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason in ("length", "stop")
    # Without max_tokens, generated in full (ignore_eos): completions get OpenAI's 16, or what the context has left
    # when that is less; chat what the context has left.
    full = {"ignore_eos": True}
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=0, extra_body=full)
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt=[2] + [70] * (MAX_LEN - 6), temperature=0, extra_body=full)
    assert r.usage.prompt_tokens == MAX_LEN - 5 and r.usage.completion_tokens == 5
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                       extra_body=full)
    assert r.usage.prompt_tokens < MAX_LEN and r.usage.total_tokens == MAX_LEN
    assert r.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------------- bad requests
_GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
C, CH = "/v1/completions", "/v1/chat/completions"

BAD_REQUESTS = [
    # (id, method, path, body, expected status, expected "param" (or None: not checked))
    ("malformed-json", "POST", C, b'{"prompt": "Hello", ', 400, None),
    ("not-utf8", "POST", C, b'\xff\xfe{"prompt": 1}', 400, None),
    ("empty-body", "POST", C, b"", 400, None),
    ("json-array", "POST", C, b"[1, 2]", 400, None),
    ("nan-literal", "POST", C, b'{"prompt": "Hi", "temperature": NaN}', 400, None),
    ("missing-prompt", "POST", C, {"model": MODEL}, 400, "prompt"),
    ("prompt-number", "POST", C, {**_GOOD, "prompt": 5}, 400, "prompt"),
    ("prompt-empty", "POST", C, {**_GOOD, "prompt": ""}, 400, "prompt"),
    ("prompt-empty-ids", "POST", C, {**_GOOD, "prompt": []}, 400, "prompt"),
    ("prompt-mixed-list", "POST", C, {**_GOOD, "prompt": [1, "a"]}, 400, "prompt"),
    ("prompt-token-out-of-vocab", "POST", C, {**_GOOD, "prompt": [2, 100000]}, 400, "prompt"),
    ("prompt-negative-token", "POST", C, {**_GOOD, "prompt": [2, -1]}, 400, "prompt"),
    ("two-prompts", "POST", C, {**_GOOD, "prompt": ["a", "b"]}, 400, "prompt"),
    ("prompt-too-long", "POST", C, {**_GOOD, "prompt": "x" * 400}, 400, "prompt"),
    ("prompt-plus-max-tokens-too-long", "POST", C, {**_GOOD, "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("max-tokens-string", "POST", C, {**_GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    ("max-tokens-zero", "POST", C, {**_GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", "POST", C, {**_GOOD, "max_tokens": -3}, 400, "max_tokens"),
    ("max-tokens-bool", "POST", C, {**_GOOD, "max_tokens": True}, 400, "max_tokens"),
    ("max-tokens-fraction", "POST", C, {**_GOOD, "max_tokens": 2.5}, 400, "max_tokens"),
    ("temperature-negative", "POST", C, {**_GOOD, "temperature": -0.5}, 400, "temperature"),
    ("temperature-string", "POST", C, {**_GOOD, "temperature": "hot"}, 400, "temperature"),
    ("top-p-zero", "POST", C, {**_GOOD, "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", "POST", C, {**_GOOD, "top_p": 1.5}, 400, "top_p"),
    ("top-k-below-minus-one", "POST", C, {**_GOOD, "top_k": -2}, 400, "top_k"),
    ("seed-string", "POST", C, {**_GOOD, "seed": "x"}, 400, "seed"),
    ("stop-number", "POST", C, {**_GOOD, "stop": 5}, 400, "stop"),
    ("stop-empty-string", "POST", C, {**_GOOD, "stop": [""]}, 400, "stop"),
    ("stop-too-many", "POST", C, {**_GOOD, "stop": [str(i) for i in range(40)]}, 400, "stop"),
    ("stream-not-bool", "POST", C, {**_GOOD, "stream": "yes"}, 400, "stream"),
    ("stream-options-without-stream", "POST", C, {**_GOOD, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("n-17", "POST", C, {**_GOOD, "n": 17}, 400, "n"),
    ("best-of-below-n", "POST", C, {**_GOOD, "n": 3, "best_of": 2}, 400, "best_of"),
    ("best-of-streamed", "POST", C, {**_GOOD, "best_of": 2, "stream": True}, 400, "best_of"),
    ("logprobs-21", "POST", C, {**_GOOD, "logprobs": 21}, 400, "logprobs"),
    ("echo-with-logprobs-streamed", "POST", C, {**_GOOD, "echo": True, "logprobs": 1, "stream": True}, 400, "echo"),
    ("suffix", "POST", C, {**_GOOD, "suffix": "end"}, 400, "suffix"),
    ("presence-penalty-3", "POST", C, {**_GOOD, "presence_penalty": 3}, 400, "presence_penalty"),
    ("repetition-penalty-0", "POST", C, {**_GOOD, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit-bias-out-of-vocab", "POST", C, {**_GOOD, "logit_bias": {"100000": 10}}, 400, "logit_bias"),
    ("logit-bias-101", "POST", C, {**_GOOD, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("min-tokens-above-max", "POST", C, {**_GOOD, "min_tokens": 5}, 400, "min_tokens"),
    ("allowed-token-ids-out-of-vocab", "POST", C, {**_GOOD, "allowed_token_ids": [100000]}, 400,
     "allowed_token_ids"),
    ("bad-words-several-tokens", "POST", C, {**_GOOD, "bad_words": ["hello"]}, 400, "bad_words"),
    ("stop-token-ids-out-of-vocab", "POST", C, {**_GOOD, "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ("unknown-parameter", "POST", C, {**_GOOD, "temprature": 0.5}, 400, "temprature"),
    ("unknown-model", "POST", C, {**_GOOD, "model": "gpt-9"}, 404, "model"),
    ("model-not-string", "POST", C, {**_GOOD, "model": 3}, 400, "model"),
    ("chat-missing-messages", "POST", CH, {"model": MODEL}, 400, "messages"),
    ("chat-messages-empty", "POST", CH, {**_CHAT, "messages": []}, 400, "messages"),
    ("chat-messages-not-list", "POST", CH, {**_CHAT, "messages": "hi"}, 400, "messages"),
    ("chat-message-not-object", "POST", CH, {**_CHAT, "messages": ["hi"]}, 400, "messages"),
    ("chat-bad-role", "POST", CH, {**_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("chat-missing-content", "POST", CH, {**_CHAT, "messages": [{"role": "user"}]}, 400, "messages"),
    ("chat-content-number", "POST", CH, {**_CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("chat-image-part", "POST", CH, {**_CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages"),
    ("chat-tool-role", "POST", CH, {**_CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ("chat-tool-name", "POST", CH, {**_CHAT, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400,
     "tools"),
    ("chat-tool-choice-required", "POST", CH, {**_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                                               "tool_choice": "required"}, 400, "tool_choice"),
    ("chat-template-kwargs", "POST", CH, {**_CHAT, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs"),
    ("chat-logprobs-number", "POST", CH, {**_CHAT, "logprobs": 2}, 400, "logprobs"),
    ("chat-top-logprobs-without-logprobs", "POST", CH, {**_CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat-n-0", "POST", CH, {**_CHAT, "n": 0}, 400, "n"),
    ("chat-best-of", "POST", CH, {**_CHAT, "best_of": 2}, 400, "best_of"),
    ("chat-response-format-xml", "POST", CH, {**_CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("chat-json-schema-and-forced-tool", "POST", CH,
     {**_CHAT, "response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, 400, "tool_choice"),
    ("ignore-eos-with-grammar", "POST", C, {**_GOOD, "ignore_eos": True, "structured_outputs": {"choice": ["a"]}},
     400, "ignore_eos"),
    ("chat-too-long", "POST", CH, {**_CHAT, "messages": [{"role": "user", "content": "y" * 300}]}, 400, "messages"),
    ("chat-max-tokens-too-long", "POST", CH, {**_CHAT, "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("chat-conflicting-max", "POST", CH, {**_CHAT, "max_tokens": 3, "max_completion_tokens": 5}, 400,
     "max_completion_tokens"),
    ("unknown-route", "POST", "/v1/embeddings", _GOOD, 404, None),
    ("wrong-method", "GET", C, None, 405, None),
    ("body-too-large", "POST", C, b"{" + b" " * (9 * 2**20) + b"}", 413, None),
    ("chat-too-many-messages", "POST", CH, {**_CHAT, "messages": [{"role": "user", "content": "x"}] * (
        MAX_MESSAGES + 1)}, 400, "messages"),
    # values the engine cannot hold, strings the tokenizer cannot take, ill-typed ignored fields
    ("top-k-above-int32", "POST", C, {**_GOOD, "top_k": 2**31}, 400, "top_k"),
    ("chat-top-k-above-int32", "POST", CH, {**_CHAT, "top_k": 2**31}, 400, "top_k"),
    ("max-tokens-above-int32", "POST", C, {**_GOOD, "max_tokens": 2**31}, 400, "max_tokens"),
    ("max-completion-tokens-huge-float", "POST", CH, {**_CHAT, "max_completion_tokens": 1e300}, 400,
     "max_completion_tokens"),
    ("temperature-above-float32", "POST", C, {**_GOOD, "temperature": 1e39}, 400, "temperature"),
    ("top-p-infinite", "POST", C, b'{"prompt": "Hi", "top_p": 1e999}', 400, "top_p"),
    ("seed-above-uint64", "POST", C, {**_GOOD, "seed": 2**64}, 400, "seed"),
    ("n-huge", "POST", C, {**_GOOD, "n": 2**64}, 400, "n"),
    ("prompt-token-id-huge", "POST", C, {**_GOOD, "prompt": [2, 2**40]}, 400, "prompt"),
    ("prompt-lone-surrogate", "POST", C, {**_GOOD, "prompt": "a\ud800b"}, 400, "prompt"),
    ("prompt-ids-list-lone-surrogate", "POST", C, {**_GOOD, "prompt": ["\udfff"]}, 400, "prompt"),
    ("chat-content-lone-surrogate", "POST", CH, {**_CHAT, "messages": [{"role": "user", "content": "x\ud800"}]},
     400, "messages"),
    ("chat-text-part-lone-surrogate", "POST", CH, {**_CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udc00"}]}]}, 400, "messages"),
    ("chat-role-lone-surrogate", "POST", CH, {**_CHAT, "messages": [{"role": "\ud800", "content": "x"}]}, 400,
     "messages"),
    ("chat-name-lone-surrogate", "POST", CH, {**_CHAT, "messages": [{"role": "user", "content": "x",
                                                                     "name": "\ud800"}]}, 400, "messages"),
    ("model-lone-surrogate", "POST", C, {"prompt": "hi", "model": "\ud800"}, 400, "model"),
    ("stop-lone-surrogate", "POST", C, {**_GOOD, "stop": ["ok", "\ud800"]}, 400, "stop"),
    ("user-lone-surrogate", "POST", C, {**_GOOD, "user": "\ud800"}, 400, "user"),
    ("metadata-key-lone-surrogate", "POST", CH, {**_CHAT, "metadata": {"\ud800": "x"}}, 400, "metadata"),
    ("field-name-lone-surrogate", "POST", C, {**_GOOD, "\ud800": 1}, 400, None),
    ("user-not-string", "POST", C, {**_GOOD, "user": 5}, 400, "user"),
    ("metadata-not-strings", "POST", CH, {**_CHAT, "metadata": {"a": 1}}, 400, "metadata"),
    ("chat-name-not-string", "POST", CH, {**_CHAT, "messages": [{"role": "user", "content": "x", "name": 1}]}, 400,
     "messages"),
    ("chat-role-object", "POST", CH, {**_CHAT, "messages": [{"role": {}, "content": "x"}]}, 400, "messages"),
    ("stream-options-usage-not-bool", "POST", C, {**_GOOD, "stream": True, "stream_options": {
        "include_usage": 1}}, 400, "stream_options"),
]


@pytest.mark.parametrize("name,method,path,body,status,param", BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS])
def test_bad_request(srv, name, method, path, body, status, param):
    got, headers, raw = request(srv.host, srv.port, method, path, body)
    assert got == status, raw[:300]
    assert headers["content-type"].startswith("application/json")
    err = json.loads(raw)["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    if status == 413:  # the server's flag
        assert f"limit of {MAX_REQUEST_BYTES} bytes" in err["message"], err


def test_server_fine_after_bad_requests(srv, client):
    for _, method, path, body, _, _ in BAD_REQUESTS[:20]:
        request(srv.host, srv.port, method, path, body)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4 or r.choices[0].finish_reason == "stop"
    h = wait_idle(srv.host, srv.port)
    assert h["status"] == "ok" and h["last_error"] is None


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=17)
    assert ei.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------------------------------- disconnects
def _open_stream(srv, body) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection((srv.host, srv.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def _wait_for(pred, timeout=20.0, what="condition"):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_disconnect_mid_stream_frees_pages(srv, slow_engine):
    before = metric_samples(srv.host, srv.port)
    sock = _open_stream(srv, {"prompt": "Hello", "max_tokens": 100, "temperature": 0, "stream": True})
    buf = b""
    while b"data: " not in buf.split(b"\r\n\r\n", 1)[-1]:  # headers, then at least one event
        buf += sock.recv(65536)
    assert buf.startswith(b"HTTP/1.1 200")
    # /health reads counters the engine thread publishes after each step: poll rather than race it
    _wait_for(lambda: (lambda h: h["running"] == 1 and any(h["kv_pages_in_use"].values()))(health(srv.host, srv.port)),
              what="the streaming request running with pages")
    sock.close()
    wait_idle(srv.host, srv.port)
    after = metric_samples(srv.host, srv.port)
    name = "gemma4_request_finished_total"
    assert sample(after, name, finish_reason="cancelled") == sample(before, name, finish_reason="cancelled") + 1
    # the request was cut short: far fewer than 100 tokens were generated
    gen = "gemma4_generation_tokens_total"
    assert sample(after, gen) - sample(before, gen) < 100


def test_disconnect_while_waiting_for_non_streamed_answer(srv, slow_engine, monkeypatch):
    """Six non-streamed requests (4 running, 2 queued) whose clients go away before their answers: each is cancelled
    in the engine after far fewer than its 100 tokens, counted as a 499 and as cancelled, and every slot and KV page
    comes back."""
    engine, added = srv.engine, []
    assert engine.programs.wait(300), "the background compiling did not finish"  # until then: 2 run at most
    real_add = engine.add_request

    def add_request(*args, **kwargs):
        added.append(real_add(*args, **kwargs))
        return added[-1]

    monkeypatch.setattr(engine, "add_request", add_request)
    slow_engine["delay"] = 0.1  # 100 tokens take >= 20 steps (2 s) even if every draft is accepted
    before = metric_samples(srv.host, srv.port)
    socks = [_open_stream(srv, {"prompt": f"Hello {i}", "max_tokens": 100, "temperature": 0}) for i in range(6)]
    _wait_for(lambda: (lambda h: h["in_flight"] == 6 and h["running"] == 4)(health(srv.host, srv.port)),
              what="6 requests in flight, 4 of them running")
    for s in socks:
        s.close()
    h = wait_idle(srv.host, srv.port)
    assert h["status"] == "ok" and not engine.scheduler.running and not engine.scheduler.waiting
    assert len(added) == 6 and all(r.finish_reason == "cancelled" for r in added), [r.finish_reason for r in added]
    generated = [len(r.output) for r in added]
    assert max(generated) < 50, generated
    after = metric_samples(srv.host, srv.port)

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("gemma4_request_finished_total", finish_reason="cancelled") == 6
    assert delta("gemma4_requests_total", endpoint="completions", status="499") == 6
    assert delta("gemma4_generation_tokens_total") <= sum(generated)


# ------------------------------------------------------------------------------------------------------- overload
def test_overload_429_with_retry_after(srv, slow_engine, monkeypatch):
    monkeypatch.setattr(srv.server.engine, "max_queue_len", 2)  # capacity: 4 running + 2 waiting
    results = [None] * 14

    def worker(i):
        body = {"prompt": f"overload {i}", "max_tokens": 10, "temperature": 0}
        results[i] = request(srv.host, srv.port, "POST", "/v1/completions", body, timeout=120)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    statuses = [r[0] for r in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 6, statuses
    for status, headers, body in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            assert json.loads(body)["error"]["code"] == "server_overloaded"
        else:
            r = json.loads(body)
            assert r["usage"]["completion_tokens"] == 10 or r["choices"][0]["finish_reason"] == "stop"
    wait_idle(srv.host, srv.port)


# --------------------------------------------------------------------------------------------------- engine errors
def test_engine_step_error_fails_requests_not_the_server(srv, client, monkeypatch):
    engine = srv.engine
    real = engine.step

    def flaky():
        # The first step after this request's prefill fails. Not "the second call": an earlier test's last step may
        # still be in flight (async scheduling) and take a call of its own, before this request was added.
        if engine.scheduler.running:
            raise RuntimeError("injected failure")
        return real()

    monkeypatch.setattr(engine, "step", flaky)
    status, _, body = request(srv.host, srv.port, "POST", "/v1/completions",
                              {"prompt": "Hello", "max_tokens": 10, "temperature": 0})
    assert status == 500 and json.loads(body)["error"]["type"] == "server_error"
    monkeypatch.undo()
    wait_idle(srv.host, srv.port)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    status, _, body = request(srv.host, srv.port, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


# ---------------------------------------------------------------------------------------------------------- metrics
def test_metrics_count_what_was_served(srv, client):
    wait_idle(srv.host, srv.port)
    before = metric_samples(srv.host, srv.port)
    usages = []
    for p in ["count me", "and me too"]:
        usages.append(client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).usage)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "me"}],
                                                 max_tokens=7, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)
    request(srv.host, srv.port, "POST", "/v1/completions", {"prompt": "x", "n": 17})
    wait_idle(srv.host, srv.port)
    after = metric_samples(srv.host, srv.port)

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("gemma4_requests_total", endpoint="completions", status="200") == 2
    assert delta("gemma4_requests_total", endpoint="chat.completions", status="200") == 1
    assert delta("gemma4_requests_total", endpoint="completions", status="400") == 1
    assert delta("gemma4_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("gemma4_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    finished = sum(delta("gemma4_request_finished_total", finish_reason=r) for r in ("stop", "length"))
    assert finished == 3
    assert delta("gemma4_time_to_first_token_seconds_count") == 3
    # one observation per token after the first step's (fewer if a slow reader got several steps at once)
    assert 0 < delta("gemma4_inter_token_latency_seconds_count") <= sum(u.completion_tokens - 1 for u in usages)
    assert delta("gemma4_e2e_request_latency_seconds_count") == 3
    assert delta("gemma4_engine_steps_total") > 0
    for g in srv.engine.pages_in_use():
        assert sample(after, "gemma4_kv_pages_in_use", group=g) == 0
        assert sample(after, "gemma4_kv_pages_total", group=g) > 0
    assert sample(after, "gemma4_num_requests_waiting") == 0
    assert sample(after, "gemma4_num_requests_running") == 0
    k = srv.server.settings.num_speculative_tokens
    assert sample(after, "gemma4_num_speculative_tokens") == k
    drafted = delta("gemma4_spec_decode_draft_tokens_total")
    accepted = delta("gemma4_spec_decode_accepted_tokens_total")
    rounds = delta("gemma4_spec_decode_accepted_tokens_per_round_count")
    if k:  # every decode step after the prefill is one round of k drafts per sequence
        assert drafted > 0 and drafted == k * rounds and 0 <= accepted <= drafted
        assert delta("gemma4_spec_decode_accepted_tokens_per_round_sum") == accepted
        per_position = [delta("gemma4_spec_decode_accepted_tokens_per_position_total", position=str(i))
                        for i in range(k)]
        assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    else:
        assert drafted == accepted == rounds == 0


# ------------------------------------------------------------------------------------------ no request hurts another
def _stream_tokens(srv, body, out: list) -> None:
    """A streamed completion (return_token_ids) over a raw connection; appends (status, token ids, events)."""
    from test_server_support import sse_events

    status, _, raw = request(srv.host, srv.port, "POST", "/v1/completions",
                             {**body, "stream": True, "return_token_ids": True}, timeout=120)
    events = sse_events(raw) if status == 200 else [json.loads(raw)]
    ids = [t for e in events if isinstance(e, dict) for c in e.get("choices", []) for t in c.get("token_ids", [])]
    out.append((status, ids, events))


def test_overflow_and_surrogate_requests_get_400s_and_hurt_no_stream_in_flight(srv, slow_engine, tok, reference):
    """Three requests that once gave 500s (int32 overflow of top_k, a lone surrogate in the prompt, one in `model`)
    get 400s naming the field, are counted in the metrics, and a stream running meanwhile finishes unchanged."""
    prompt = "Once upon a time"
    expected = reference(tok.encode(prompt).ids, 40)
    slow_engine["delay"] = 0.1  # >= 8 steps of 0.1 s: the stream outlasts the bad requests
    before = metric_samples(srv.host, srv.port)
    out: list = []
    t = threading.Thread(target=_stream_tokens, args=(srv, {"prompt": prompt, "max_tokens": 40, "temperature": 0},
                                                       out))
    t.start()
    _wait_for(lambda: health(srv.host, srv.port)["running"] == 1, what="the stream running")
    bad = [(C, b'{"prompt": "hi", "top_k": 2147483648, "max_tokens": 2}', "top_k"),
           (CH, b'{"messages": [{"role": "user", "content": "hi"}], "top_k": 2147483648, "max_tokens": 2}', "top_k"),
           (C, b'{"prompt": "a\\ud800b"}', "prompt"),
           (CH, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
           (C, b'{"prompt": "hi", "model": "\\ud800"}', "model")]
    for path, body, param in bad:
        status, headers, raw = request(srv.host, srv.port, "POST", path, body)
        assert status == 400 and headers["content-type"] == "application/json", raw
        assert json.loads(raw)["error"]["param"] == param
        assert headers.get("connection") != "close"  # answered, not dropped
    assert t.is_alive()
    t.join(120)
    status, ids, events = out[0]
    assert status == 200 and ids == expected and events[-1] == "[DONE]"
    h = wait_idle(srv.host, srv.port)
    assert h["status"] == "ok" and h["last_error"] is None
    after = metric_samples(srv.host, srv.port)
    req = "gemma4_requests_total"
    assert sample(after, req, endpoint="completions", status="400") - sample(before, req, endpoint="completions",
                                                                             status="400") == 3
    assert sample(after, req, endpoint="chat.completions", status="400") - sample(
        before, req, endpoint="chat.completions", status="400") == 2


@pytest.mark.parametrize("path,body,param", [
    (C, {**_GOOD, "prompt": "please REFUSE this"}, "prompt"),
    (CH, {**_CHAT, "messages": [{"role": "user", "content": "REFUSE"}]}, "messages"),
])
def test_text_the_tokenizer_refuses_is_400(srv, monkeypatch, path, body, param):
    """Whatever else a tokenizer may one day refuse (beyond lone surrogates, caught earlier), it is the client's
    text: a 400 naming the field, not a 500."""
    real = srv.server.tokenizer.tokenizer

    class Refusing:
        def encode(self, text, **kw):
            if "REFUSE" in text:
                raise TypeError("TextInputSequence must be str")
            return real.encode(text, **kw)

    monkeypatch.setattr(srv.server.tokenizer, "tokenizer", Refusing())
    status, _, raw = request(srv.host, srv.port, "POST", path, body)
    assert status == 400 and json.loads(raw)["error"]["param"] == param, raw


def test_every_response_is_counted(srv):
    """Health, metrics, unknown routes, wrong methods, malformed bodies, ambiguous framing: each response once."""
    before = metric_samples(srv.host, srv.port)
    request(srv.host, srv.port, "GET", "/health")
    request(srv.host, srv.port, "GET", "/nope")
    request(srv.host, srv.port, "GET", "/v1/completions")
    request(srv.host, srv.port, "POST", "/v1/completions", b"{")
    request(srv.host, srv.port, "POST", "/v1/completions", {"prompt": "x"},
            headers={"Transfer-Encoding": "chunked", "Content-Length": "5"})
    after = metric_samples(srv.host, srv.port)

    def delta(endpoint, status):
        return (sample(after, "gemma4_requests_total", endpoint=endpoint, status=status)
                - sample(before, "gemma4_requests_total", endpoint=endpoint, status=status))

    assert delta("health", "200") == 1
    assert delta("metrics", "200") == 1  # the `before` scrape
    assert delta("other", "404") == 1
    assert delta("completions", "405") == 1
    assert delta("completions", "400") == 2


def _victim_fault(victim_ids, after_tokens):
    """raise for the request whose prompt is `victim_ids`, once it has `after_tokens` tokens (mid-run)"""
    def hit(req) -> bool:
        return req.prompt == victim_ids and len(req.output) >= after_tokens

    return hit


class _ExplodingOutput(list):
    """A request's output that cannot take new tokens."""

    def __iadd__(self, tokens):
        raise RuntimeError("injected: taking its tokens failed")


@pytest.mark.parametrize("where", ["engine-row", "engine-take", "engine-thread-deliver", "server-detokenize"])
@pytest.mark.parametrize("stream", [False, True])
def test_fault_in_one_request_fails_it_alone(srv, slow_engine, tok, monkeypatch, where, stream):
    """A fault in one request of a running (speculative) batch, while building its row of the step, while taking
    its new tokens, while the engine thread hands them to its stream (a fault there once killed the thread), or while
    detokenizing them in the server: that request alone gets an error; the others' tokens equal an undisturbed run,
    every KV page comes back, /health stays ok and the server keeps serving."""
    import gemma4_mtp_jax.server.generation as app_module

    prompts = [f"Fault {i}: tell me" for i in range(4)]
    victim = 2
    victim_ids = tok.encode(prompts[victim]).ids
    bodies = [{"prompt": p, "max_tokens": 16, "temperature": 0 if i % 2 else 0.8, "seed": i}
              for i, p in enumerate(prompts)]

    def run_all():
        results = [None] * len(bodies)

        def one(i):
            if stream:
                out = []
                _stream_tokens(srv, bodies[i], out)
                results[i] = out[0]
            else:
                status, _, raw = request(srv.host, srv.port, "POST", "/v1/completions",
                                         {**bodies[i], "return_token_ids": True}, timeout=120)
                body = json.loads(raw)
                results[i] = (status, body["choices"][0]["token_ids"] if status == 200 else None, body)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return results

    undisturbed = run_all()
    assert all(r[0] == 200 for r in undisturbed)
    wait_idle(srv.host, srv.port)

    engine = srv.engine
    hit = _victim_fault(victim_ids, 3)
    if where == "engine-row":
        real_row = engine.runner.row

        def row(req):
            if hit(req):
                raise OverflowError("injected: a value that does not fit its row")
            return real_row(req)

        monkeypatch.setattr(engine.runner, "row", row)
    elif where == "engine-take":
        real_take = engine._take

        def take(req, result, now, k=None):
            if hit(req):  # the fault strikes inside `_take`, where the engine records a step's tokens
                req.output = _ExplodingOutput(req.output)
            return real_take(req, result, now, k)

        monkeypatch.setattr(engine, "_take", take)
    elif where == "engine-thread-deliver":
        aengine = srv.server.engine
        real_count = aengine._count_speculation

        def count_speculation(ev):
            if hit(ev.request):
                raise RuntimeError("injected: metrics bookkeeping failed")
            return real_count(ev)

        monkeypatch.setattr(aengine, "_count_speculation", count_speculation)
    else:
        class FaultyText(app_module.TextStream):
            def __init__(self, tokenizer, prompt_ids=(), stop=(), *rest):
                super().__init__(tokenizer, prompt_ids, stop, *rest)
                self.victim = list(prompt_ids) == victim_ids

            def push(self, tokens, skip_text=()):
                if self.victim and self.num_tokens >= 3:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
                return super().push(tokens, skip_text)

        monkeypatch.setattr(app_module, "TextStream", FaultyText)
    before = metric_samples(srv.host, srv.port)
    disturbed = run_all()
    monkeypatch.undo()

    for i, (status, ids, body) in enumerate(disturbed):
        if i == victim:
            if stream:  # the stream had started: the error is its last event before [DONE]
                assert status == 200 and body[-1] == "[DONE]" and body[-2]["error"]["type"] == "server_error", body
            else:
                assert status == 500 and body["error"]["type"] == "server_error", body
        else:
            assert (status, ids) == undisturbed[i][:2], f"request {i}"
    h = wait_idle(srv.host, srv.port)
    assert h["status"] == "ok" and h["last_error"] is None
    after = metric_samples(srv.host, srv.port)
    fin = "gemma4_request_finished_total"
    assert sample(after, fin, finish_reason="error") - sample(before, fin, finish_reason="error") == 1
    assert [r[:2] for r in run_all()] == [r[:2] for r in undisturbed]  # and it keeps serving, identically


# ---------------------------------------------------------------------------------------------------- slow clients
def _read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection (or `limit` seconds pass); (data, seconds)."""
    t0 = time.monotonic()
    sock.settimeout(limit)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        raise AssertionError(f"the server held the connection open for {limit}s; got {data[:200]!r}") from None
    except ConnectionResetError:
        pass
    return data, time.monotonic() - t0


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl"],
                         ids=["silent", "partial-headers"])
def test_half_open_request_head_is_closed_with_408(srv, sent):
    before = metric_samples(srv.host, srv.port)
    with socket.create_connection((srv.host, srv.port)) as sock:
        sock.sendall(sent)
        data, took = _read_until_closed(sock, HEADER_TIMEOUT + 10)
    assert HEADER_TIMEOUT - 0.5 <= took <= HEADER_TIMEOUT + 5, took
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), data
    assert json.loads(body)["error"]["code"] == "request_timeout"
    after = metric_samples(srv.host, srv.port)
    key = dict(endpoint="other", status="408")
    assert sample(after, "gemma4_requests_total", **key) - sample(before, "gemma4_requests_total", **key) == 1


def test_half_open_next_request_on_kept_alive_connection_is_closed(srv):
    """After a whole request and its answer, the next request's head is held to the same deadline."""
    with socket.create_connection((srv.host, srv.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first or not first.rstrip().endswith(b"}"):
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        data, took = _read_until_closed(sock, HEADER_TIMEOUT + 10)
    assert took <= HEADER_TIMEOUT + 5 and data.startswith(b"HTTP/1.1 408"), (took, data[:100])


def test_half_open_request_body_is_closed(srv):
    """Headers promise 100 bytes, 10 come: the connection is closed at the body deadline, the handler that was
    reading it gives up (counted as 499: the client went away), and nothing was submitted to the engine."""
    before = metric_samples(srv.host, srv.port)
    with socket.create_connection((srv.host, srv.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"prompt":')
        data, took = _read_until_closed(sock, BODY_TIMEOUT + 10)
    assert BODY_TIMEOUT - 0.5 <= took <= BODY_TIMEOUT + 5 and data == b"", (took, data)
    after = _wait_for(lambda: (lambda m: m if sample(m, "gemma4_requests_total", endpoint="completions",
                                                       status="499") > 0 else None)(metric_samples(srv.host,
                                                                                                     srv.port)),
                      what="the 499 counted")
    key = dict(endpoint="completions", status="499")
    assert sample(after, "gemma4_requests_total", **key) - sample(before, "gemma4_requests_total", **key) == 1
    assert sample(after, "gemma4_prompt_tokens_total") == sample(before, "gemma4_prompt_tokens_total")


def test_content_length_with_transfer_encoding_is_400(srv):
    """Both framings at once (the request-smuggling shape): 400 and the connection is closed, so whatever the
    client meant as the body is never read as a next request."""
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((srv.host, srv.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled)
        data, _ = _read_until_closed(sock, 20)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head.lower(), data
    assert json.loads(body)["error"]["code"] == "ambiguous_framing"
    assert data.count(b"HTTP/1.1 ") == 1  # the smuggled request got no answer


def test_malformed_http_gets_a_json_400(srv):
    with socket.create_connection((srv.host, srv.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
        data, _ = _read_until_closed(sock, 20)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"application/json" in head, data
    assert json.loads(body)["error"]["code"] == "invalid_http"


# ------------------------------------------------------------------------------------------------------------ fuzz
def test_fuzz_every_route_never_5xx(srv):
    """Generated requests at every route (random JSON shapes, wrong types, huge / negative / fractional / NaN
    numbers, lone surrogates, nested junk, raw bytes, and mutations of valid bodies): never a 5xx, never a hang (each
    request has 30 s), every error is JSON in the OpenAI format, and the server is idle and ok afterwards."""
    from hypothesis import HealthCheck, given, settings

    seen = {"generated": 0, "2xx": 0, "4xx": 0}

    @settings(max_examples=600, deadline=None, derandomize=True, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(fuzz_requests())
    def one(case):
        ((method, path), payload), headers = case
        body = payload if method in ("POST", "PUT", "PATCH") else None
        status, h, raw = request(srv.host, srv.port, method, path, body, headers=headers, timeout=30)
        assert status < 500, (status, raw[:300])
        if status >= 400:
            err = json.loads(raw)["error"]
            assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
            seen["4xx"] += 1
        else:
            if h["content-type"].startswith("application/json"):
                json.loads(raw)
            seen["2xx"] += 1
            seen["generated"] += path.startswith(("/v1/completions", "/v1/chat/completions"))

    t0 = time.time()
    one()
    print(f"\n[test_server] fuzz: {seen} in {time.time() - t0:.1f}s")
    assert seen["generated"] >= 100 and seen["4xx"] >= 100, seen  # both answered and refused requests were explored
    h = wait_idle(srv.host, srv.port)
    assert h["status"] == "ok" and h["last_error"] is None


def test_the_first_programs_compile_while_the_weights_load(paths, tmp_path, monkeypatch):
    """With an executable cache, the server compiles its first programs from the checkpoints' shapes while it loads
    the weights: here loading the target waits until one of them is in the cache (so a server that compiled only
    after loading would time out), and the engine then takes every first program from there, lowering none."""
    from gemma4_mtp_jax import api
    from gemma4_mtp_jax.server.cli import create_server

    tdir, adir, _ = paths
    cache = tmp_path / "executables"
    real_load = api.load_target

    def load_once_one_is_compiled(*args, **kwargs):
        t0 = time.time()
        while not list(cache.glob("*.jaxexec")):
            assert time.time() - t0 < 300, "no program was compiled while the target waited to load"
            time.sleep(0.05)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(api, "load_target", load_once_one_is_compiled)
    restore = jax_cache_settings()
    argv = ["--ckpt", str(tdir), "--assistant", str(adir), "--compilation-cache-dir", "none",
            "--executable-cache-dir", str(cache), "--max-num-seqs", "1", "--max-model-len", "64",
            "--prefill-chunk", "16", "--page-size", "16", "--no-compile-in-background", "--speculative-k", "fixed"]
    try:
        server, _ = create_server(argv)
        engine = server.engine.engine
        # prefill, the speculative round's three variants, and structured output's draft, verify forward and accept
        assert sorted(engine.programs.restored) == sorted(engine.compile_times) and len(engine.compile_times) == 7
    finally:
        restore()
