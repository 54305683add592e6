"""Helpers for the server tests (this module holds no tests): the demo pair and JAX cache of the session, raw HTTP
on loopback, SSE parsing, Prometheus samples, an in-process server on a free port."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]

# Small engine for the CPU tests: batch buckets 1, 2, 4; prefill buckets 16, 32, 64.
# Test servers leave out structured output's masked rounds (two programs per batch bucket to compile); the module
# that tests them turns them on.
# A fixed k: the round sizes chosen per step (the server's default) would compile 4 times the speculative programs;
# the engine's tests cover them.
ENGINE_ARGS = ["--max-num-seqs", "4", "--max-model-len", "128", "--prefill-chunk", "64", "--page-size", "16",
               "--no-structured-outputs", "--speculative-k", "fixed"]
MODEL = "gemma4-demo"


def session_paths(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(target dir, assistant dir, JAX compilation cache dir), shared by every server test module of the session."""
    from gemma4_mtp_jax.weights.demo import build_random_pair

    base = tmp_path_factory.getbasetemp()
    tdir, adir = build_random_pair(base / "server_demo")
    cache = base / "server_jax_cache"
    cache.mkdir(exist_ok=True)
    return tdir, adir, cache


def server_argv(tdir: Path, adir: Path, cache: Path, *extra: str) -> list[str]:
    return ["--ckpt", str(tdir), "--assistant", str(adir), "--served-model-name", MODEL,
            "--compilation-cache-dir", str(cache), "--executable-cache-dir", "none", "--no-access-log", *ENGINE_ARGS,
            *extra]


_JAX_CACHE_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


def jax_cache_settings() -> Callable[[], None]:
    """Snapshot JAX's persistent-cache settings (create_server turns the cache on); the returned function puts them
    back and drops the cache JAX opened, which it keeps until reset whatever the settings say."""
    import jax

    saved = {k: getattr(jax.config, k) for k in _JAX_CACHE_SETTINGS}

    def restore() -> None:
        from jax._src import compilation_cache

        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()

    return restore


class InProcessServer:
    """`create_server` + uvicorn in a background thread, bound to a free loopback port."""

    def __init__(self, argv: list[str]):
        from gemma4_mtp_jax.server.cli import bind_socket, create_server, make_uvicorn_server

        self._restore_jax_cache = jax_cache_settings()
        self.server, self.args = create_server(argv)
        sock = bind_socket("127.0.0.1", 0)
        self.host, self.port = sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.uvicorn = make_uvicorn_server(self.server, self.args)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_healthy(self.host, self.port, 60)

    @property
    def engine(self):
        return self.server.engine.engine

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(60)
        self._restore_jax_cache()


def wait_healthy(host: str, port: int, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            status, _, _ = request(host, port, "GET", "/health", timeout=2)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"server on port {port} not healthy after {timeout}s")


def request(host: str, port: int, method: str, path: str, body: Any = None, headers: dict | None = None,
            timeout: float = 60) -> tuple[int, dict, bytes]:
    """One HTTP request on a fresh connection; body: bytes (sent as is) or an object (sent as JSON)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        h = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def sse_events(raw: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body: parsed JSON objects, and the string "[DONE]"."""
    out = []
    for block in raw.decode().split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def health(host: str, port: int) -> dict:
    status, _, body = request(host, port, "GET", "/health", timeout=10)
    return json.loads(body)


def wait_idle(host: str, port: int, timeout: float = 20) -> dict:
    """Poll /health until nothing is in flight and every KV page is free; returns the last health body."""
    t0 = time.time()
    h = health(host, port)
    while time.time() - t0 < timeout:
        if h["in_flight"] == 0 and h["running"] == 0 and h["waiting"] == 0 and not any(h["kv_pages_in_use"].values()):
            return h
        time.sleep(0.05)
        h = health(host, port)
    raise AssertionError(f"server not idle after {timeout}s: {h}")


def metric_samples(host: str, port: int) -> dict[tuple[str, frozenset], float]:
    """/metrics parsed with prometheus_client's parser: {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, body = request(host, port, "GET", "/metrics", timeout=10)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


# The edges of int32 / uint32 / int64 / uint64 / float32 / float64, and NaN / infinities (which JSON cannot spell:
# json.dumps sends them as NaN / Infinity literals).
EDGE_NUMBERS = [0, 1, -1, 2, 2**31 - 1, 2**31, -2**31 - 1, 2**32, 2**63, -2**63 - 1, 2**64, 10**30, 0.5, -0.0, 1e-40,
                1e-5, 1e39, 3.4e38, 1e308, 2.5, float("nan"), float("inf"), -float("inf")]
NUMERIC_FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "n", "best_of",
                  "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                  "min_tokens"]


def fuzz_requests():
    """A hypothesis strategy of requests ((method, path), body bytes), headers) at every route of the server: valid
    generation requests with extreme values, mutations of valid bodies (fields replaced by random JSON: wrong types,
    huge / negative / fractional / NaN numbers, lone surrogates, nested junk), and junk bodies at random routes."""
    from hypothesis import strategies as st

    surrogates = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"])
    text = st.one_of(st.text(max_size=12),
                     st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), surrogates, st.text(max_size=4)))
    numbers = st.one_of(
        st.sampled_from(EDGE_NUMBERS),
        st.integers(-3, 40),
        st.integers(),
        st.floats(),  # NaN and infinities included: sent as NaN / Infinity literals, which JSON does not have
    )
    scalars = st.one_of(st.none(), st.booleans(), numbers, text)
    fields = st.sampled_from(["prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature",
                              "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "logprobs",
                              "top_logprobs", "echo", "best_of", "suffix", "user", "metadata", "service_tier",
                              "return_token_ids", "tools", "tool_choice", "response_format", "logit_bias",
                              "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                              "allowed_token_ids", "bad_words", "stop_token_ids", "role", "content", "name", "type",
                              "text", "include_usage", "parallel_tool_calls", "chat_template_kwargs",
                              "tool_calls", "tool_call_id", "function", "arguments"])
    json_values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                             st.dictionaries(fields | text, c, max_size=4)),
                               max_leaves=8)
    messages = st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool"]) | json_values,
         "content": text | json_values}, optional={"name": text | json_values}), max_size=3)
    valid_completion = st.fixed_dictionaries({"prompt": st.sampled_from(["Hi", "abc def", "é🎉"]),
                                              "max_tokens": st.integers(1, 3), "temperature": st.sampled_from([0, 1])})
    valid_chat = st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "Hi"}]),
                                        "max_tokens": st.integers(1, 3)})
    mutations = st.one_of(st.dictionaries(fields, numbers | scalars | json_values | messages, min_size=1, max_size=3),
                          st.dictionaries(text, json_values, min_size=1, max_size=2))
    # valid but extreme: what the engine must hold (int32 top_k, uint64 seeds, float32 edges, stop strings...)
    valid_extras = st.fixed_dictionaries({}, optional={
        "top_k": st.integers(-1, 2**31 - 1) | st.sampled_from([2**31 - 1, 262144, 1]),
        "seed": st.integers(-2**63, 2**64 - 1),
        "temperature": st.floats(0, 3.4e38) | st.sampled_from([1e-30, 1e-5, 2.0, 3.4e38]),
        "top_p": st.floats(1e-300, 1.0, exclude_min=False) | st.just(1.0),
        "stop": st.lists(st.text(min_size=1, max_size=5), max_size=3),
        "stream": st.booleans(), "return_token_ids": st.booleans(), "n": st.integers(1, 2), "user": st.text(max_size=8),
        "presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0, 2, exclude_min=True),
        "min_p": st.floats(0, 1), "logit_bias": st.dictionaries(st.integers(0, 511).map(str), st.floats(-100, 100),
                                                                max_size=3),
        "model": st.just(MODEL),
    })

    def mutate(base, changes, drop):
        body = {**base, **changes}
        for k in drop:
            if k != "max_tokens":  # chat's default is the whole context: keep the fuzz quick
                body.pop(k, None)
        return body

    def encode(body, raw_junk=None):
        if raw_junk is not None:
            return raw_junk
        return json.dumps(body).encode()  # ensure_ascii: surrogates travel as \ud800 escapes, NaN as NaN

    headers = st.fixed_dictionaries({}, optional={"Content-Type": st.sampled_from(["text/plain", "application/json;"
                                                                                    " charset=latin-1", "x/y"]),
                                                  "Authorization": st.sampled_from(["Bearer x", "Basic ???", ""])})
    C, CH = ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")

    def generation(kind_body):  # (route, payload) with a body of the route's kind
        return st.one_of(st.tuples(st.just(C), st.builds(encode, kind_body(valid_completion))),
                         st.tuples(st.just(CH), st.builds(encode, kind_body(valid_chat))))

    valid = generation(lambda base: st.builds(lambda b, e: {**b, **e}, base, valid_extras))
    mutated = generation(lambda base: st.builds(mutate, base, mutations, st.lists(fields, max_size=2)))
    junk_routes = st.tuples(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
                            st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                             "/metrics", "/v1/models/x", "/", "/v1/embeddings", "/health?x=%ff"]))
    junk_bodies = st.one_of(st.builds(lambda m, n: {"messages": m, "max_tokens": n}, messages,
                                      st.integers(1, 3) | numbers), json_values)
    junk = st.tuples(junk_routes, st.builds(encode, junk_bodies, st.none() | st.binary(max_size=40)))
    return st.tuples(st.one_of(valid, mutated, junk), headers)


def free_port() -> int:
    """A TCP port free on loopback now (for a process that must be told its port, as a job's coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m gemma4_mtp_jax.serve --port 0 ARGV` in a subprocess on the CPU, its output collected. With `ready`
    (a regex) it returns once a line matches (SERVING: listening, `port` then its port, and healthy); None: at once,
    `wait_for` later."""

    SERVING = r"serving '.*' on http://127\.0\.0\.1:(\d+)"

    def __init__(self, argv: list[str], timeout: float = 120, ready: str | None = SERVING):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get(
            "PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
        self.t0 = time.time()
        self.proc = subprocess.Popen([sys.executable, "-m", "gemma4_mtp_jax.serve", "--port", "0", *argv], cwd=REPO,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.port = None
        if ready is not None:
            self.wait_for(ready, timeout)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        """The first line that matches `pattern`, waited for; for SERVING, `port` is set and the server healthy."""
        t0 = time.time()
        while True:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    if pattern == self.SERVING:
                        self.port = int(m.group(1))
                        self.start_s = time.time() - self.t0
                        wait_healthy("127.0.0.1", self.port, 30)
                    return m
            if self.proc.poll() is not None or time.time() - t0 > timeout:
                self.kill()
                raise AssertionError(f"no line matched {pattern!r}:\n" + self.log)
            time.sleep(0.05)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def stream_completion(port: int, body: dict, headers: dict, out: list, first_event: threading.Event):
    """A streaming completion over a raw connection; appends (status, events) to out (or ("exception", repr)),
    sets `first_event` once an event came (or it ended)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", **headers})
        r = conn.getresponse()
        raw = b""
        while True:
            chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
            if not chunk:
                break
            raw += chunk
            if b"data: " in raw:
                first_event.set()
        out.append((r.status, sse_events(raw) if r.status == 200 else json.loads(raw)))
    except Exception as e:  # noqa: BLE001 - reported by the test
        out.append(("exception", repr(e)))
    finally:
        first_event.set()
        conn.close()
