"""`python -m gemma4_mtp_jax.serve` as users run it: a subprocess on a free port. Start-up logs, --help, the API key,
and SIGTERM: keep listening but refuse new generation requests (503, /health "draining"), finish in-flight requests
within the grace period (or cancel them when it runs out), then stop listening and exit 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_server_support import MODEL, ServerProcess, request, server_argv, session_paths, stream_completion

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return session_paths(tmp_path_factory)


def test_help_lists_every_flag():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "gemma4_mtp_jax.serve", "--help"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for flag in ["--ckpt", "--assistant", "--num-speculative-tokens", "--host", "--port", "--max-num-seqs",
                 "--max-model-len", "--dtype", "--api-key", "--max-queue-len", "--shutdown-grace-seconds",
                 "--header-timeout-seconds", "--body-timeout-seconds", "--max-request-size", "--max-messages",
                 "--max-connections"]:
        assert flag in r.stdout
    assert "127.0.0.1" in r.stdout and "demo" in r.stdout


def test_sigterm_finishes_in_flight_requests_and_exits_0(paths):
    tdir, adir, cache = paths
    key = "sekret-key"
    srv = ServerProcess(server_argv(tdir, adir, cache, "--api-key", key, "--shutdown-grace-seconds", "60"))
    try:
        log = srv.log
        # start-up shows progress and timings
        assert re.search(r"loading target .*: done in [\d.]+s", log), log
        assert len(re.findall(r"compiled \S+ in [\d.]+s", log)) >= 3, log  # one line per program
        assert re.search(r"compiling the smallest buckets. programs: done in [\d.]+s", log), log
        assert "speculative decoding: on, 4 draft tokens per round" in log
        print(f"\n[test_server_process] started in {srv.start_s:.1f}s")

        # API key: required on /v1, not on /health
        status, _, body = request("127.0.0.1", srv.port, "GET", "/v1/models")
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        auth = {"Authorization": f"Bearer {key}"}
        status, _, body = request("127.0.0.1", srv.port, "GET", "/v1/models", headers=auth)
        assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
        status, _, _ = request("127.0.0.1", srv.port, "POST", "/v1/completions", {"prompt": "x"},
                               headers={"Authorization": "Bearer wrong"})
        assert status == 401

        # 24 long streams on 4 slots; SIGTERM as soon as tokens flow. Requests in flight at that moment must all
        # complete; later ones are refused (503 while draining, or no connection once the socket is closed).
        # Meanwhile the server still answers: /health 503 "draining", a new generation request 503.
        n = 24
        out, first = [], threading.Event()
        threads = [threading.Thread(target=stream_completion, args=(srv.port, {"prompt": f"story {i}", "max_tokens": 100,
                                                                     "temperature": 0, "stream": True}, auth, out,
                                                           first)) for i in range(n)]
        for t in threads:
            t.start()
        assert first.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        while "received SIGTERM" not in srv.log and time.time() - t0 < 30:
            time.sleep(0.01)
        status, _, body = request("127.0.0.1", srv.port, "GET", "/health")
        assert status == 503 and json.loads(body)["status"] == "draining", body
        status, _, body = request("127.0.0.1", srv.port, "POST", "/v1/completions", {"prompt": "late"}, headers=auth)
        assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down", body
        assert any(t.is_alive() for t in threads)  # all that happened while streams were still running
        for t in threads:
            t.join(120)
        assert srv.proc.wait(60) == 0, srv.log
        assert len(out) == n
        completed = 0
        for status, events in out:
            if status == 200:
                assert events[-1] == "[DONE]"
                assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop"), events[-2]
                completed += 1
            elif status == 503:
                assert events["error"]["code"] == "shutting_down"
            else:
                assert status == "exception" and ("Refused" in events or "Reset" in events), events
        m = re.search(r"received SIGTERM: not accepting new requests; (\d+) in-flight", srv.log)
        assert m and int(m.group(1)) > 0, srv.log  # the signal did arrive while requests were in flight
        assert completed >= int(m.group(1))
        print(f"[test_server_process] SIGTERM with {m.group(1)} requests in flight; {completed}/{n} completed")
        # and nothing listens any more
        with pytest.raises(OSError):
            request("127.0.0.1", srv.port, "GET", "/health", timeout=2)
    finally:
        srv.kill()


def test_sigterm_grace_over_cancels_and_exits_0(paths):
    tdir, adir, cache = paths
    srv = ServerProcess(server_argv(tdir, adir, cache, "--shutdown-grace-seconds", "0"))
    try:
        out, first = [], threading.Event()
        threads = [threading.Thread(target=stream_completion, args=(srv.port, {"prompt": f"tale {i}", "max_tokens": 120,
                                                                     "temperature": 0, "stream": True}, {}, out,
                                                           first)) for i in range(8)]
        for t in threads:
            t.start()
        assert first.wait(60)
        t0 = time.time()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log
        print(f"\n[test_server_process] exited {time.time() - t0:.2f}s after SIGTERM (grace 0)")
        for t in threads:
            t.join(30)
        assert len(out) == 8
        aborted = 0
        for status, events in out:
            if status == "exception":  # connection closed by the exiting server before the response started
                continue
            assert status == 200 and events[-1] == "[DONE]", events
            if "error" in events[-2]:
                assert events[-2]["error"]["code"] == "abort"
                aborted += 1
        assert aborted >= 1, out
        assert "aborting" in srv.log
    finally:
        srv.kill()
