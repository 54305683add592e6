"""The OpenAI-compatible server over real HTTP on loopback: one in-process server (demo pair, small buckets) for the
module, driven by the official `openai` client and by raw HTTP.

Covers: completions and chat, streaming and not, greedy output equal to `generate`; 32 concurrent streams equal to
sequential runs with every KV page free afterwards; stop strings; a table of bad requests; client disconnects
(pages freed); overload (429 + Retry-After, nothing accepted is lost); an engine step that raises; metrics.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from test_server_support import (
    MODEL,
    InProcessServer,
    metric_samples,
    request,
    sample,
    server_argv,
    session_paths,
    wait_idle,
)

openai = pytest.importorskip("openai")

MAX_LEN = 128


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return session_paths(tmp_path_factory)


@pytest.fixture(scope="module")
def srv(paths):
    tdir, adir, cache = paths
    t0 = time.time()
    s = InProcessServer(server_argv(tdir, adir, cache))
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
    from gemma4_mtp_jax.sampling import SamplingParams

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
    samples = metric_samples(srv.host, srv.port)
    assert sample(samples, "gemma4_model_info", model=MODEL) == 1.0


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
    from gemma4_mtp_jax.sampling import SamplingParams

    ids = tok.encode("abc").ids
    kw = dict(model=MODEL, prompt="abc", max_tokens=16, temperature=0.9, top_p=0.95,
              extra_body={"return_token_ids": True, "top_k": 50})
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    assert _extra(a.choices[0], "token_ids") == _extra(b.choices[0], "token_ids")
    speculative = srv.server.settings.num_speculative_tokens > 0
    assert _extra(a.choices[0], "token_ids") == reference(ids, 16, SamplingParams(0.9, 50, 0.95, 7), speculative)


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

    def step():
        batch_sizes.append(len(engine.running))
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
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=0)  # OpenAI's default: 16
    assert r.usage.completion_tokens <= 16
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0)
    assert r.usage.total_tokens <= MAX_LEN  # chat's default: whatever fits in the context


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
    ("n-2", "POST", C, {**_GOOD, "n": 2}, 400, "n"),
    ("best-of-3", "POST", C, {**_GOOD, "best_of": 3}, 400, "best_of"),
    ("logprobs", "POST", C, {**_GOOD, "logprobs": 2}, 400, "logprobs"),
    ("echo", "POST", C, {**_GOOD, "echo": True}, 400, "echo"),
    ("suffix", "POST", C, {**_GOOD, "suffix": "end"}, 400, "suffix"),
    ("presence-penalty", "POST", C, {**_GOOD, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("logit-bias", "POST", C, {**_GOOD, "logit_bias": {"5": 10}}, 400, "logit_bias"),
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
    ("chat-tools", "POST", CH, {**_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("chat-logprobs", "POST", CH, {**_CHAT, "logprobs": True}, 400, "logprobs"),
    ("chat-top-logprobs", "POST", CH, {**_CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat-n-3", "POST", CH, {**_CHAT, "n": 3}, 400, "n"),
    ("chat-json-mode", "POST", CH, {**_CHAT, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("chat-too-long", "POST", CH, {**_CHAT, "messages": [{"role": "user", "content": "y" * 300}]}, 400, "messages"),
    ("chat-max-tokens-too-long", "POST", CH, {**_CHAT, "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("chat-conflicting-max", "POST", CH, {**_CHAT, "max_tokens": 3, "max_completion_tokens": 5}, 400,
     "max_completion_tokens"),
    ("unknown-route", "POST", "/v1/embeddings", _GOOD, 404, None),
    ("wrong-method", "GET", C, None, 405, None),
    ("body-too-large", "POST", C, b"{" + b" " * (17 * 2**20) + b"}", 413, None),
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


def test_server_fine_after_bad_requests(srv, client):
    for _, method, path, body, _, _ in BAD_REQUESTS[:20]:
        request(srv.host, srv.port, method, path, body)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4 or r.choices[0].finish_reason == "stop"
    h = wait_idle(srv.host, srv.port)
    assert h["status"] == "ok" and h["last_error"] is None


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2)
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
    from test_server_support import health

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


def test_disconnect_while_waiting_for_non_streamed_answer(srv, slow_engine):
    from test_server_support import health

    socks = [_open_stream(srv, {"prompt": f"Hello {i}", "max_tokens": 100, "temperature": 0}) for i in range(6)]
    # 4 run, 2 wait in the queue; everyone disconnects before the answer
    _wait_for(lambda: health(srv.host, srv.port)["in_flight"] == 6, what="6 requests in flight")
    for s in socks:
        s.close()
    wait_idle(srv.host, srv.port)


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
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
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
    request(srv.host, srv.port, "POST", "/v1/completions", {"prompt": "x", "n": 5})
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
