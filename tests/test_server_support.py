"""Helpers for the server tests (this module holds no tests): the demo pair and JAX cache of the session, raw HTTP
on loopback, SSE parsing, Prometheus samples, an in-process server on a free port."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

# Small engine for the CPU tests: batch buckets 1, 2, 4; prefill buckets 16, 32, 64.
ENGINE_ARGS = ["--max-num-seqs", "4", "--max-model-len", "128", "--prefill-chunk", "64", "--page-size", "16"]
MODEL = "gemma4-demo"


def session_paths(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(target dir, assistant dir, JAX compilation cache dir), shared by every server test module of the session."""
    from gemma4_mtp_jax.demo import build_demo

    base = tmp_path_factory.getbasetemp()
    tdir, adir = build_demo(base / "server_demo")
    cache = base / "server_jax_cache"
    cache.mkdir(exist_ok=True)
    return tdir, adir, cache


def server_argv(tdir: Path, adir: Path, cache: Path, *extra: str) -> list[str]:
    return ["--ckpt", str(tdir), "--assistant", str(adir), "--served-model-name", MODEL,
            "--compilation-cache-dir", str(cache), "--no-access-log", *ENGINE_ARGS, *extra]


class InProcessServer:
    """`create_server` + uvicorn in a background thread, bound to a free loopback port."""

    def __init__(self, argv: list[str]):
        import jax

        from gemma4_mtp_jax.server.cli import bind_socket, create_server, make_uvicorn_server

        # create_server turns the persistent compilation cache on; put the settings back afterwards
        self._jax_config = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                                "jax_persistent_cache_min_compile_time_secs")}
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
        import jax

        self.uvicorn.should_exit = True
        self.thread.join(60)
        for k, v in self._jax_config.items():
            jax.config.update(k, v)


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
