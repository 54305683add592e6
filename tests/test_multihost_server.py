"""`serve` across two processes on localhost (jax.distributed, gloo; one CPU device each, tensor parallel over both):
process 0 serves HTTP and publishes its program calls, process 1 follows. The same greedy replies as one process,
streaming, a client's disconnect, SIGTERM on either process stopping both (exit 0), a killed peer stopping the other
with a clear error within a bounded time, and mismatched flags refused at start with the differing flag named."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import jax
import numpy as np
import pytest

from gemma4_mtp_jax.engine.multihost import decode_call, encode_call
from gemma4_mtp_jax.model.sampling import SamplingBatch, SamplingParams
from gemma4_mtp_jax.steps.device_state import PrefillRows, ProcessingRows, StepInputs
from test_server_support import ServerProcess, free_port, request, stream_completion, wait_idle

# The trained demo pair (real text), the fewest programs: batch bucket 2, prefill bucket 16, rounds of 2 drafts.
ENGINE = ["--ckpt", "demo", "--executable-cache-dir", "none", "--no-access-log", "--max-num-seqs", "2",
          "--max-model-len", "128", "--prefill-chunk", "16", "--page-size", "16", "--no-structured-outputs",
          "--speculative-k", "fixed", "--num-speculative-tokens", "2"]
FOLLOWING = r"process 1 of 2: following process 0's program calls"
PLAIN = ["--assistant", "none"]  # the jobs started for one test alone: decode programs, quicker to compile
PROMPTS = ["Once upon a time", "The little cat", [5, 9, 13, 200, 7], "A"]
PEER_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("multihost_jax_cache"))


def start_job(cache: str, *extra: str, wait: bool = True) -> list[ServerProcess]:
    """Process 0 and process 1 of a two-process server; with `wait`, once 0 serves and 1 follows."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [ServerProcess([*ENGINE, "--compilation-cache-dir", cache, "--tensor-parallel-size", "2",
                            "--coordinator-address", coordinator, "--num-processes", "2", "--process-id", str(i),
                            "--peer-timeout-seconds", str(PEER_TIMEOUT_S), *extra], ready=None) for i in range(2)]
    if wait:
        try:
            procs[0].wait_for(ServerProcess.SERVING, 600)
            procs[1].wait_for(FOLLOWING, 60)
        except BaseException:
            for p in procs:
                p.kill()
            raise
    return procs


def completion(port: int, prompt, max_tokens: int = 24) -> dict:
    status, _, body = request("127.0.0.1", port, "POST", "/v1/completions",
                              {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return json.loads(body)


def replies(port: int) -> list[tuple[str, dict]]:
    """The greedy replies to PROMPTS, two at a time (the batch bucket holds both)."""
    out: list = [None] * len(PROMPTS)

    def one(i):
        r = completion(port, PROMPTS[i])
        out[i] = (r["choices"][0]["text"], r["usage"])

    for pair in (PROMPTS[:2], PROMPTS[2:]):
        threads = [threading.Thread(target=one, args=(PROMPTS.index(p),)) for p in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    return out


def streaming(port: int, max_tokens: int) -> tuple[threading.Thread, list]:
    """A greedy streaming completion in a thread, once its first event came: (the thread, where its (status,
    events) go)."""
    out, first = [], threading.Event()
    t = threading.Thread(target=stream_completion, args=(port, {"prompt": "Once", "max_tokens": max_tokens,
                                                                "temperature": 0, "stream": True}, {}, out, first))
    t.start()
    assert first.wait(60)
    return t, out


def exited(proc: ServerProcess, timeout: float) -> tuple[int, float]:
    """(its exit status, seconds it took from now)."""
    t0 = time.time()
    return proc.proc.wait(timeout), time.time() - t0


@pytest.fixture(scope="module")
def job(cache):
    """A two-process server and, beside it, the same server in one process (the reference replies)."""
    procs = start_job(cache, wait=False)
    one = ServerProcess([*ENGINE, "--compilation-cache-dir", cache], ready=None)
    try:
        procs[0].wait_for(ServerProcess.SERVING, 600)
        procs[1].wait_for(FOLLOWING, 60)
        one.wait_for(ServerProcess.SERVING, 600)
        print(f"\n[test_multihost_server] two processes serving after {procs[0].start_s:.0f}s")
        yield procs, one
    finally:
        for p in [*procs, one]:
            p.kill()


def test_replies_equal_one_process(job):
    procs, one = job
    got = replies(procs[0].port)
    assert got == replies(one.port)
    assert all(text for text, _ in got)
    assert "told the other" not in procs[0].log  # still serving


def test_streaming_equals_the_whole_reply(job):
    procs, one = job
    out, first = [], threading.Event()
    stream_completion(procs[0].port, {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "stream": True}, {},
                      out, first)
    status, events = out[0]
    assert status == 200 and events[-1] == "[DONE]", events
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert len(events) > 3  # several chunks, not one
    assert streamed == completion(one.port, PROMPTS[0])["choices"][0]["text"]


def test_client_disconnect_cancels_and_the_job_goes_on(job):
    procs, one = job
    port = procs[0].port
    body = json.dumps({"prompt": "Tell me a story", "max_tokens": 100, "temperature": 0, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    buf = b""
    while b"data: " not in buf.split(b"\r\n\r\n", 1)[-1]:
        buf += sock.recv(65536)
    sock.close()
    h = wait_idle("127.0.0.1", port)
    assert h["in_flight"] == 0 and h["status"] == "ok", h
    assert completion(port, PROMPTS[1])["choices"][0]["text"] == completion(one.port, PROMPTS[1])["choices"][0]["text"]


def test_sigterm_on_process_1_drains_and_stops_both(job):
    procs, _ = job
    t, out = streaming(procs[0].port, 80)
    procs[1].proc.send_signal(signal.SIGTERM)
    statuses = [exited(p, 60)[0] for p in procs]
    t.join(30)
    assert statuses == [0, 0], procs[0].log[-3000:] + procs[1].log[-3000:]
    status, events = out[0]
    assert status == 200 and events[-2]["choices"][0]["finish_reason"] == "length", events  # drained, not cut
    assert "process 1 received SIGTERM: stopping the job" in procs[0].log
    assert "process 0 stopped the job after" in procs[1].log


def test_sigterm_on_process_0_stops_both(cache):
    procs = start_job(cache, *PLAIN)
    try:
        assert completion(procs[0].port, "A", 4)["choices"][0]["text"]
        procs[0].proc.send_signal(signal.SIGTERM)
        assert [exited(p, 60)[0] for p in procs] == [0, 0], procs[0].log[-3000:] + procs[1].log[-3000:]
        assert "told the other 1 process(es) to stop" in procs[0].log
    finally:
        for p in procs:
            p.kill()


def test_killed_follower_fails_the_requests_and_stops_process_0(cache):
    procs = start_job(cache, *PLAIN)
    try:
        t, out = streaming(procs[0].port, 100)
        procs[1].kill()
        status, seconds = exited(procs[0], PEER_TIMEOUT_S + 30)
        t.join(30)
        print(f"\n[test_multihost_server] process 0 exited {seconds:.1f}s after process 1 was killed")
        assert status == 1, procs[0].log[-3000:]
        assert seconds < PEER_TIMEOUT_S + 15
        assert "process 1 stopped answering: no heartbeat for" in procs[0].log
        status, events = out[0]
        if status == 200:  # the stream ended with an error, not with "length"
            assert any("error" in e for e in events if isinstance(e, dict)), events
    finally:
        for p in procs:
            p.kill()


def test_killed_process_0_stops_the_follower(cache):
    """Process 0 dies during start-up: process 1, which waits in the job's store or a collective, ends at once
    (jax.distributed's own client ends it, or our watch does: a clear word either way), never hangs."""
    procs = start_job(cache, *PLAIN, wait=False)
    try:
        procs[1].wait_for(r"the processes' flags, checkpoints and code agree", 120)
        procs[0].kill()
        status, seconds = exited(procs[1], 60)
        assert status != 0 and seconds < 30
        assert ("lost the job's coordination service on process 0" in procs[1].log
                or "another task died" in procs[1].log), procs[1].log[-3000:]
    finally:
        for p in procs:
            p.kill()


def test_mismatched_flags_are_refused_naming_the_flag(cache):
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [ServerProcess([*ENGINE, "--compilation-cache-dir", cache, "--tensor-parallel-size", "2",
                            "--coordinator-address", coordinator, "--num-processes", "2", "--process-id", str(i),
                            "--max-model-len", str(128 + 64 * i)], ready=None) for i in range(2)]
    try:
        assert [exited(p, 120)[0] for p in procs] == [2, 2]
        for p in procs:
            assert "differ in their configuration: --max-model-len: process" in p.log, p.log[-3000:]
            assert "has 128" in p.log and "has 192" in p.log
    finally:
        for p in procs:
            p.kill()


def test_a_program_call_survives_its_encoding():
    """What process 0 publishes is what a follower runs: every array of a prefill's inputs (rows, tables, sampling,
    processing) and every flag, dtypes included."""
    rows = PrefillRows.stack([dict(slot=1, tokens=np.arange(16), positions=np.arange(16), last_index=15,
                                   stop_ids=np.full(16, -1), remaining=7, next_tokens=np.arange(1, 17))], 1, 16)
    processing = ProcessingRows.stack([SamplingParams(temperature=0.5).processing_row(3)], 1, (4, 1, 4))
    inputs = StepInputs(rows, {"full": np.array([[3, 4, 0]], np.int32)},
                        SamplingBatch.from_params([SamplingParams(temperature=0.5, seed=9)], 1), processing)
    call, got, flags = decode_call(encode_call("prefill", inputs, scored=True, k=None))
    assert (call, flags) == ("prefill", {"scored": True, "k": None})
    for a, b in zip(jax.tree_util.tree_leaves(inputs), jax.tree_util.tree_leaves(got), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert decode_call(encode_call("stop")) == ("stop", None, {})
