"""Server pieces without the engine: incremental detokenization, stop strings, chat templates, request parsing."""

from __future__ import annotations

import json
import random

import pytest

from gemma4_mtp_jax.server.chat import ChatTemplate, TextTokenizer
from gemma4_mtp_jax.server.detokenize import IncrementalDetokenizer, StopStringMatcher, TextStream
from gemma4_mtp_jax.server.errors import APIError
from gemma4_mtp_jax.server.protocol import parse_chat, parse_completion, parse_json
from test_server_support import EDGE_NUMBERS, NUMERIC_FIELDS, fuzz_requests, session_paths


@pytest.fixture(scope="module")
def demo_tok(tmp_path_factory) -> TextTokenizer:
    return TextTokenizer(session_paths(tmp_path_factory)[0])


BYTE0 = 6  # demo tokenizer: id = byte + 6


def _byte_ids(data: bytes) -> list[int]:
    return [BYTE0 + b for b in data]


# ---------------------------------------------------------------------------------------------------- detokenizer
@pytest.mark.parametrize("seed", range(6))
def test_incremental_detokenizer_equals_full_decode(demo_tok, seed):
    rng = random.Random(seed)
    words = ["hello", " wörld", " 日本語", " 🎉🎉", " Καλημέρα", "\n", " x"]
    text = "".join(rng.choice(words) for _ in range(30))
    ids = _byte_ids(text.encode())
    if seed % 2:  # plus garbage: lone continuation bytes, truncated sequences, unused ids, specials
        for _ in range(15):
            ids.insert(rng.randrange(len(ids)), rng.choice([BYTE0 + 0x80, BYTE0 + 0xE6, BYTE0 + 0xF0, 300, 1, 2]))
    prompt = demo_tok.encode("prompt ")
    d = IncrementalDetokenizer(demo_tok, prompt)
    pieces = [d.push(t) for t in ids] + [d.flush()]
    full = demo_tok.decode(ids)
    assert "".join(pieces) == full
    if seed % 2 == 0:
        assert full == text
        assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_detokenizer_holds_incomplete_character(demo_tok):
    d = IncrementalDetokenizer(demo_tok)
    ids = _byte_ids("€".encode())  # 3 bytes
    assert d.push(ids[0]) == "" and d.push(ids[1]) == ""
    assert d.push(ids[2]) == "€"
    d.push(_byte_ids(b"\xe2")[0])
    assert d.flush() == "\ufffd"  # a truncated character at the very end shows as U+FFFD


# ---------------------------------------------------------------------------------------------------- stop strings
def _run(stops, pieces):
    m = StopStringMatcher(stops)
    out, stopped = [], False
    for p in pieces:
        text, stopped = m.push(p)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return out, stopped


def test_stop_string_split_across_pieces():
    out, stopped = _run(["STOP"], ["abc S", "T", "OP and more"])
    assert stopped and "".join(out) == "abc "
    assert out == ["abc ", "", ""]  # "S", "ST" held back until decided


def test_held_back_prefix_released_when_not_a_stop():
    out, stopped = _run(["STOP"], ["abc ST", "ing"])
    assert not stopped and out == ["abc ", "STing", ""]


def test_earliest_stop_wins_and_nothing_past_it():
    out, stopped = _run(["bc", "abcd", "d"], ["xab", "cd"])
    assert stopped and "".join(out) == "x"  # "abcd" starts first
    out, stopped = _run(["c", "ab"], ["zabc"])
    assert stopped and "".join(out) == "z"


def test_stop_text_flushed_at_end():
    out, stopped = _run(["</s>"], ["hi <", "/"])
    assert not stopped and "".join(out) == "hi </"


@pytest.mark.parametrize("seed", range(4))
def test_text_stream_random_splits(demo_tok, seed):
    rng = random.Random(seed)
    text = "Il était une fois — 日本語 🎉 the end. Après: FIN. more text"
    ids = _byte_ids(text.encode())
    stops = ["FIN", "日本語 🎉"] if seed % 2 else ["FIN"]
    expected = text[: min(text.find(s) for s in stops)]
    ts = TextStream(demo_tok, [], stops)
    out, i = [], 0
    while i < len(ids) and not ts.stopped:
        n = rng.randint(1, 5)  # several tokens per step, like speculative decoding
        out.append(ts.push(ids[i:i + n]))
        i += n
    out.append(ts.finish())
    assert ts.stopped and "".join(out) == expected
    assert ts.num_tokens <= len(ids)


def test_text_stream_skips_eos_text(demo_tok):
    ts = TextStream(demo_tok, [], [])
    assert ts.push(_byte_ids(b"ok") + [1], skip_text=[1]) == "ok"
    assert ts.finish() == "" and ts.num_tokens == 3


# ---------------------------------------------------------------------------------------------------- chat template
def test_chat_template_renders_like_hf(demo_tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"}]
    text = demo_tok.render_chat(msgs)
    assert text == ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>assistant\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = demo_tok.encode(text)
    assert ids[:2] == [2, 4] and ids.count(2) == 1  # BOS once: the template's, not the tokenizer's too
    assert demo_tok.encode("plain")[0] == 2  # plain text gets the tokenizer's BOS


def test_chat_template_errors_are_400():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
                     "{{ messages[0]['content'] }}", {"bos_token": "<bos>"})
    assert t.render([{"role": "user", "content": "x"}]) == "x"
    with pytest.raises(APIError) as ei:
        t.render([{"role": "system", "content": "x"}])
    assert ei.value.status == 400 and "first must be user" in ei.value.message
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(APIError):
        sandboxed.render([{"role": "user", "content": "x"}])


def test_chat_template_from_jinja_file(tmp_path, demo_tok):
    src = demo_tok.chat_template  # noqa: F841 (the demo's comes from tokenizer_config.json)
    (tmp_path / "tokenizer.json").write_text(demo_tok.tokenizer.to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<bos>"},
                                                                "chat_template": "unused"}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}[{{ m.content }}]"
                                                  "{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    tt = TextTokenizer(tmp_path)
    assert tt.render_chat([{"role": "user", "content": "a"}]) == "<bos>[a]>"


# ---------------------------------------------------------------------------------------------------- parsing
def test_kv_cache_memory_sizes():
    import argparse

    from gemma4_mtp_jax.server.cli import build_parser, parse_size

    assert parse_size("8GiB") == 8 * 2**30 and parse_size("512MB") == 512 * 10**6 and parse_size("1.5 gib") == 3 * 2**29
    assert parse_size("4096") == 4096
    for bad in ("", "GiB", "-1GiB", "0", "5XB", "1.2.3MB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
    assert build_parser().parse_args(["--kv-cache-memory", "2GiB"]).kv_cache_memory == 2 * 2**30
    assert build_parser().parse_args([]).kv_cache_memory is None
    assert build_parser().parse_args([]).load_format == "auto"
    assert build_parser().parse_args(["--load-format", "dummy"]).load_format == "dummy"
    assert build_parser().parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert build_parser().parse_args([]).enable_prefix_caching is True
    assert build_parser().parse_args([]).pack_params is False
    assert build_parser().parse_args(["--pack-params"]).pack_params is True
    assert build_parser().parse_args([]).executable_cache_dir is None
    assert build_parser().parse_args(["--executable-cache-dir", "/x"]).executable_cache_dir == "/x"


def test_the_executable_cache_is_on_unless_turned_off(monkeypatch, tmp_path):
    """The server keeps its compiled programs under the user's cache directory unless given another or 'none'."""
    from gemma4_mtp_jax.server.cli import _executable_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    assert _executable_cache_dir(None) == str(tmp_path / ".cache" / "gemma4_mtp_jax" / "executables")
    assert _executable_cache_dir("/x") == "/x"
    assert _executable_cache_dir("none") is None and _executable_cache_dir("None") is None


def test_a_replica_that_fails_to_start_stops_the_others(monkeypatch, tmp_path_factory):
    """--data-parallel-size: when a later replica cannot be built, the ones built before stop their background
    compiles before the error reaches main (a thread left running would outlive the interpreter's shutdown)."""
    import jax

    import gemma4_mtp_jax.engine as engine_mod
    from gemma4_mtp_jax.server.cli import create_server

    built = []

    class OneReplicaFits:  # stands in for Engine: the first replica is built, the second runs out of memory
        def __init__(self, *args, **kwargs):
            if built:
                raise engine_mod.DeviceMemoryError("replica 1 does not fit")
            self.closed = False
            built.append(self)

        def close(self):
            self.closed = True

    cpu = jax.devices()[0]
    monkeypatch.setattr(engine_mod, "Engine", OneReplicaFits)
    monkeypatch.setattr(jax, "devices", lambda *a: [cpu, cpu])
    tdir, adir, cache = session_paths(tmp_path_factory)
    with pytest.raises(engine_mod.DeviceMemoryError, match="replica 1"):
        create_server(["--ckpt", str(tdir), "--assistant", str(adir), "--compilation-cache-dir", str(cache),
                       "--executable-cache-dir", "none", "--data-parallel-size", "2"])
    assert len(built) == 1 and built[0].closed


def test_parse_defaults_and_extensions():
    p = parse_completion({"prompt": ["hi"], "n": 1, "logprobs": None, "top_k": -1, "seed": -1, "stop": "x",
                          "user": "u", "stream": True, "stream_options": {"include_usage": True}})
    assert p.prompt == "hi" and p.top_k == 0 and p.seed == 2**32 - 1 and p.stop == ["x"]
    assert p.stream and p.include_usage and p.max_tokens is None
    c = parse_chat({"messages": [{"role": "developer", "content": "be nice"}, {"role": "user", "content": "hi",
                                                                              "name": "bob"}],
                    "max_completion_tokens": 5, "tool_choice": "none", "tools": [], "logprobs": False})
    assert c.messages[0] == {"role": "system", "content": "be nice"} and c.max_tokens == 5


@pytest.mark.parametrize("raw", [b"", b"   ", b"{", b"[]", b'"x"', b"\xff", b'{"a": Infinity}', b"[" * 100000])
def test_parse_json_rejects(raw):
    with pytest.raises(APIError) as ei:
        parse_json(raw)
    assert ei.value.status == 400


# ---------------------------------------------------------------------------------------- the server on a fake engine
class FakeEngine:
    """Stands in for Engine (same surface the server uses): every step yields 3 tokens per running request, as a
    speculative step with 2 of 3 drafts accepted would; one page per request."""

    def __init__(self, max_num_seqs=2, tokens=b"speculative!"):
        from types import SimpleNamespace

        from gemma4_mtp_jax.engine import Request

        self._Request = Request
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.eos_ids = frozenset([1])
        self.waiting, self.running = [], []
        self.tokens = [BYTE0 + b for b in tokens]
        self.allocators = {"full_attention": SimpleNamespace(capacity=8)}
        self.programs, self.untuned = [3, 3], 0  # (compiled, total) and programs not yet tuned
        self.num_preemptions = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.served = []  # every request added
        self.k = 3

    @property
    def has_work(self):
        return bool(self.waiting or self.running)

    def pages_total(self):
        return {"full_attention": 8}

    def pages_in_use(self):
        return {"full_attention": len(self.running)}

    def kv_cache_bytes(self):
        return 9 * 4096

    def programs_ready(self):
        return tuple(self.programs)

    def programs_untuned(self):
        return self.untuned

    def close(self):
        self.closed = True

    def add_request(self, prompt, max_new_tokens, sampling=None, stop_ids=None, request_id=None):
        self.stop_ids_asked = stop_ids
        req = self._Request(request_id, list(prompt), max_new_tokens, sampling,
                            self.eos_ids if stop_ids is None else stop_ids)
        self.waiting.append(req)
        self.served.append(req)
        return req

    def cancel(self, req):
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        req.status, req.finish_reason = "finished", "cancelled"

    def step(self):
        import time

        from gemma4_mtp_jax.engine import StepEvent

        time.sleep(0.02)  # a step takes time: the client reads each step's tokens before the next step's

        while self.waiting and len(self.running) < self.config.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        events = []
        for req in list(self.running):
            n = len(req.output)
            new = [self.tokens[(n + i) % len(self.tokens)] for i in range(3)][: req.max_new_tokens - n]
            req.output += new
            req.num_speculative_tokens = 3
            req.accepted_per_round.append(2)
            if len(req.output) >= req.max_new_tokens:
                req.status, req.finish_reason = "finished", "length"
                self.running.remove(req)
            events.append(StepEvent(req, new, req.finished, accepted=2))
        return events


fake_server_engine: list = []  # the fake_server fixture's engine


@pytest.fixture(scope="module")
def fake_server(demo_tok):
    import threading

    import uvicorn

    from gemma4_mtp_jax.server.app import OpenAIServer, ServerSettings
    from gemma4_mtp_jax.server.async_engine import AsyncEngine
    from gemma4_mtp_jax.server.cli import bind_socket
    from gemma4_mtp_jax.server.metrics import Metrics
    from test_server_support import wait_healthy

    metrics = Metrics("fake")
    engine = FakeEngine()
    fake_server_engine[:] = [engine]
    server = OpenAIServer(AsyncEngine(engine, max_queue_len=4, metrics=metrics), demo_tok,
                          ServerSettings("fake", max_model_len=64, vocab_size=512, num_speculative_tokens=3), metrics,
                          engine.eos_ids)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", lifespan="on"))
    t = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    wait_healthy("127.0.0.1", port, 30)
    yield port
    uv.should_exit = True
    t.join(30)


def test_ignore_eos_reaches_the_engine(fake_server):
    """`ignore_eos` (vLLM's extension, for benchmarks): the request's stop ids are empty, not the model's EOS ids;
    without it the engine gets None (its default: the EOS ids). A non-boolean value is a 400 naming the field."""
    from test_server_support import request

    engine = fake_server_engine[0]
    for flag, want in ((True, frozenset()), (False, None)):
        status, _, raw = request("127.0.0.1", fake_server, "POST", "/v1/completions",
                                 {"prompt": "x", "max_tokens": 3, "ignore_eos": flag})
        assert status == 200 and engine.stop_ids_asked == want, raw
    status, _, raw = request("127.0.0.1", fake_server, "POST", "/v1/completions",
                             {"prompt": "x", "max_tokens": 3, "ignore_eos": "yes"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "ignore_eos"


def test_fake_engine_multi_token_chunks_and_speculative_metrics(fake_server):
    from test_server_support import metric_samples, request, sample, sse_events, wait_idle

    port = fake_server
    before = metric_samples("127.0.0.1", port)
    status, _, raw = request("127.0.0.1", port, "POST", "/v1/completions",
                             {"prompt": "x", "max_tokens": 10, "stream": True, "return_token_ids": True})
    assert status == 200
    events = sse_events(raw)
    chunks = [e for e in events if e != "[DONE]" and e["choices"] and e["choices"][0].get("token_ids")]
    sizes = [len(c["choices"][0]["token_ids"]) for c in chunks]
    # one chunk per step: [3, 3, 3, 1] (steps merge into one chunk only when the client lags behind)
    assert sum(sizes) == 10 and all(n % 3 == 0 for n in sizes[:-1]) and sizes[-1] % 3 == 1, sizes
    assert "".join(c["choices"][0]["text"] for c in chunks) == "speculativ"
    status, _, raw = request("127.0.0.1", port, "POST", "/v1/completions",
                             {"prompt": "x", "max_tokens": 12, "stop": "ive"})
    body = json.loads(raw)
    assert body["choices"][0]["text"] == "speculat" and body["choices"][0]["finish_reason"] == "stop"
    wait_idle("127.0.0.1", port)
    after = metric_samples("127.0.0.1", port)

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert body["usage"]["completion_tokens"] == 11  # up to the end of the stop string
    assert delta("gemma4_spec_decode_draft_tokens_total") == 3 * (4 + 4)  # 4 rounds per request
    assert delta("gemma4_spec_decode_accepted_tokens_total") == 2 * 8
    assert delta("gemma4_spec_decode_accepted_tokens_per_position_total", position="0") == 8
    assert delta("gemma4_spec_decode_accepted_tokens_per_position_total", position="2") == 0
    assert delta("gemma4_spec_decode_accepted_tokens_per_round_count") == 8
    assert delta("gemma4_spec_decode_accepted_tokens_per_round_sum") == 16
    assert sample(after, "gemma4_num_speculative_tokens") == 3
    assert delta("gemma4_request_finished_total", finish_reason="stop") == 1


def test_fuzz_parsers_refuse_only_with_api_errors():
    """For every generated body, the parsers either refuse with a 4xx APIError, or return parameters the engine and
    the tokenizer can take (int32 counts, float32-finite temperature, UTF-8-encodable strings)."""
    from hypothesis import given, settings

    from gemma4_mtp_jax.sampling import INT32_MAX, SamplingParams

    @settings(max_examples=1500, deadline=None, derandomize=True, database=None)
    @given(fuzz_requests())
    def one(case):
        ((_, _), payload), _ = case
        for parse in (parse_completion, parse_chat):  # each body as either kind
            try:
                p = parse(parse_json(payload))
            except APIError as e:
                assert 400 <= e.status < 500 and e.message and json.dumps(e.body())
                continue
            texts = [p.prompt] if isinstance(p.prompt, str) else [m["content"] for m in p.messages or []]
            for s in texts + p.stop + [p.model or ""]:
                s.encode("utf-8")
            assert p.max_tokens is None or 1 <= p.max_tokens <= INT32_MAX
            SamplingParams(p.temperature or 0.0, p.top_k or 0, 1.0 if p.top_p is None else p.top_p, p.seed).row()

    one()


@pytest.mark.parametrize("field", NUMERIC_FIELDS)
def test_every_numeric_field_at_every_edge(field):
    """Each numeric field at each edge of the number types, on a valid completion and chat body: a 400 naming the
    field, or parameters the engine holds (what passed int32 / float32 checks here once overflowed in a step)."""
    from gemma4_mtp_jax.sampling import INT32_MAX, SamplingParams

    for value in EDGE_NUMBERS:
        for parse, base in ((parse_completion, {"prompt": "hi"}), (parse_chat, {"messages": [{"role": "user",
                                                                                              "content": "hi"}]})):
            raw = json.dumps({**base, field: value}).encode()
            try:
                p = parse(parse_json(raw))
            except APIError as e:
                assert e.status == 400 and e.param in (field, None), (field, value, e.body())
                assert e.param == field or "JSON" in e.message, (field, value, e.body())  # NaN: not JSON at all
                continue
            assert p.max_tokens is None or 1 <= p.max_tokens <= INT32_MAX, (field, value)
            SamplingParams(p.temperature or 0.0, p.top_k or 0, 1.0 if p.top_p is None else p.top_p, p.seed).row()


def test_data_parallel_replicas_share_the_load_and_sum_their_state(demo_tok):
    """Replicas (--data-parallel-size): concurrent requests spread over the engines (the least loaded first),
    each answered in full; /health and the gauges report the sum over the replicas; a cancel reaches the
    replica that holds the request. /health's programs_final is true only once every replica has compiled every
    program and none is untuned."""
    import asyncio
    import threading
    import time

    import uvicorn

    from gemma4_mtp_jax.sampling import SamplingParams
    from gemma4_mtp_jax.server.app import OpenAIServer, ServerSettings
    from gemma4_mtp_jax.server.async_engine import AsyncEngine, Replicas
    from gemma4_mtp_jax.server.cli import bind_socket
    from gemma4_mtp_jax.server.metrics import Metrics
    from test_server_support import health, metric_samples, request, sample, wait_healthy, wait_idle

    metrics = Metrics("fake")
    engines = [FakeEngine(max_num_seqs=2), FakeEngine(max_num_seqs=2)]
    engines[0].programs, engines[1].untuned = [2, 3], 1  # one program still compiling, one not yet tuned
    front = Replicas([AsyncEngine(e, max_queue_len=4, metrics=metrics) for e in engines], metrics)
    server = OpenAIServer(front, demo_tok, ServerSettings("fake", max_model_len=64, vocab_size=512,
                                                          num_speculative_tokens=3), metrics, engines[0].eos_ids)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", lifespan="on"))
    t = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        wait_healthy("127.0.0.1", port, 30)
        h = health("127.0.0.1", port)
        assert h["kv_pages_total"] == {"full_attention": 16} and h["kv_cache_bytes"] == 2 * 9 * 4096
        assert (h["programs_compiled"], h["programs_total"], h["programs_untuned"]) == (5, 6, 1)
        assert h["programs_final"] is False

        def health_when(pred):  # the engine threads publish what /health reads when idle, every IDLE_POLL_S
            deadline = time.time() + 10
            while not pred(h := health("127.0.0.1", port)) and time.time() < deadline:
                time.sleep(0.05)
            return h

        def counted(compiled, untuned):  # /health once both replicas have published this state
            h = health_when(lambda h: (h["programs_compiled"], h["programs_untuned"]) == (compiled, untuned))
            assert (h["programs_compiled"], h["programs_untuned"]) == (compiled, untuned), h
            return h["programs_final"]

        engines[1].untuned = 0
        assert counted(5, 0) is False  # none untuned, one program still compiling
        engines[0].programs, engines[1].untuned = [3, 3], 1
        assert counted(6, 1) is False  # every program compiled, one untuned
        engines[1].untuned = 0
        assert counted(6, 0) is True
        answers = [None] * 4

        def ask(i):
            answers[i] = request("127.0.0.1", port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 12})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert [a[0] for a in answers] == [200] * 4
        assert all(json.loads(a[2])["usage"]["completion_tokens"] == 12 for a in answers)
        served = [len(e.served) for e in engines]
        assert served == [2, 2], f"requests per replica: {served}"
        idle = wait_idle("127.0.0.1", port)
        assert idle["in_flight"] == 0 and idle["running"] == 0
        assert sample(metric_samples("127.0.0.1", port), "gemma4_kv_pages_total", group="full_attention") == 16

        async def submit_then_cancel():
            stream = await front.submit([BYTE0 + 1], 50, SamplingParams())
            front.cancel(stream)
            return stream

        stream = asyncio.run(submit_then_cancel())
        assert stream.owner is front.replicas[0]
        deadline = time.time() + 10
        while not (stream.request is not None and stream.request.finished) and time.time() < deadline:
            time.sleep(0.02)
        assert stream.request.finish_reason == "cancelled"
    finally:
        uv.should_exit = True
        t.join(30)
