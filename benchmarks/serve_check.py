"""The README's main command, checked end to end: start `python -m gemma4_mtp_jax.serve` with its default flags,
time it until /health answers, ask /v1/chat/completions (plain, the same again, then streamed: the streamed reply
must equal the repeated one; /v1/completions with token ids where the checkpoint has no chat), send SIGTERM and
expect exit 0.
Twice: with an empty persistent compilation cache and executable cache (cold) and again with the caches the first
start filled (warm). Flags after `--` win over these (e.g. `-- --executable-cache-dir none`: the compilation cache
alone).

    python benchmarks/serve_check.py [--runs cold warm] [-- extra serve flags]

Prints one line per start (ready seconds, answers, exit code) and exits 1 if any check failed. Server logs and
JSON go to $OUT when it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The request each check sends (greedy). A checkpoint without a tokenizer or chat template (random weights,
# --load-format dummy) answers chat with 400; it gets IDS instead (17 ids below any vocabulary's size), and the
# replies compared are token ids.
CHAT = {"messages": [{"role": "user", "content": "Hello! Who are you?"}], "max_tokens": 24, "temperature": 0}
IDS = {"prompt": [2, *range(10, 26)], "max_tokens": 24, "temperature": 0, "return_token_ids": True}


def _ask(base: str, body: dict, stream: bool) -> dict:
    """POST `body` (CHAT to /v1/chat/completions, IDS to /v1/completions): status, seconds, the reply (text, or
    with IDS token ids; None unless 200), usage, and when streamed the SSE events and whether [DONE] ended them."""
    chat = "messages" in body
    t0 = time.perf_counter()
    status, raw = _post(base + ("/v1/chat/completions" if chat else "/v1/completions"), {**body, "stream": stream})
    out = {"status": status, "seconds": round(time.perf_counter() - t0, 3), "reply": None, "usage": None,
           "events": 0, "done": False}
    if status != 200:
        return out
    if not stream:
        reply = json.loads(raw)
        choice = reply["choices"][0]
        out.update(reply=choice["message"]["content"] if chat else choice.get("token_ids"), usage=reply.get("usage"))
        return out
    events = [ln[6:] for ln in raw.decode("utf-8", "replace").splitlines() if ln.startswith("data: ")]
    chunks = [c for e in events if e != "[DONE]" for c in json.loads(e).get("choices") or []]
    if chat:
        out["reply"] = "".join(c["delta"].get("content") or "" for c in chunks)
    else:
        out["reply"] = [t for c in chunks for t in c.get("token_ids") or []]
    out.update(events=len(events), done=bool(events) and events[-1] == "[DONE]")
    return out


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; `exit_code` is how it ended (it is stopped)."""

    def __init__(self, message: str, exit_code: int | str | None):
        super().__init__(message)
        self.exit_code = exit_code


def start_server(flags: list[str], port: int, log_path: str, ready_timeout: float,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, float]:
    """Start `python -m gemma4_mtp_jax.serve --port PORT *flags` (output to `log_path`) and wait until /health
    answers 200. Returns (process, seconds until ready). Raises ServerStartError if it exits first or is not ready
    within `ready_timeout` (then it has been stopped)."""
    cmd = [sys.executable, "-m", "gemma4_mtp_jax.serve", "--port", str(port), *flags]
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    while True:
        if proc.poll() is not None:
            raise ServerStartError(f"server exited with {proc.returncode} before it was ready (log: {log_path})",
                                   proc.returncode)
        if time.perf_counter() - t0 > ready_timeout:
            code, _ = stop_server(proc)
            raise ServerStartError(f"not ready after {ready_timeout:.0f}s (log: {log_path})", code)
        try:
            status, _ = _get(base + "/health", timeout=2)
            if status == 200:
                return proc, time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.2)


def wait_compiled(proc: subprocess.Popen, port: int, timeout: float) -> bool:
    """Wait until the server's /health counts every program compiled (it serves before, with the smallest buckets,
    while the others compile in the background). False if it exits or the time runs out first."""
    t0 = time.perf_counter()
    while proc.poll() is None and time.perf_counter() - t0 < timeout:
        try:
            status, body = _get(f"http://127.0.0.1:{port}/health", timeout=2)
            h = json.loads(body) if status == 200 else {}
            if h.get("programs_compiled", 0) >= h.get("programs_total", 1):
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    return False


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[int | str, float]:
    """SIGTERM (the server drains, then exits 0); returns (exit code or "killed after Ns", seconds it took)."""
    if proc.poll() is not None:
        return proc.returncode, 0.0
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        code: int | str = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = f"killed after {timeout:.0f}s"
    return code, time.perf_counter() - t0


def check_once(label: str, cache_dir: str, extra: list[str], out_dir: str | None, ready_timeout: float,
               until_compiled: bool = False) -> dict:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = os.path.join(out_dir or tempfile.gettempdir(), f"serve_{label}.log")
    flags = ["--compilation-cache-dir", os.path.join(cache_dir, "jax"),
             "--executable-cache-dir", os.path.join(cache_dir, "executables"), *extra]
    rec: dict = {"run": label, "cmd": " ".join(["-m", "gemma4_mtp_jax.serve", "--port", str(port), *flags])}
    try:
        proc, ready_s = start_server(flags, port, log_path, ready_timeout)
    except ServerStartError as e:
        rec.update(ok=False, error=str(e), exit_code=e.exit_code)
        return rec
    rec["ready_s"] = round(ready_s, 2)
    launched = time.perf_counter() - ready_s
    try:
        first = _ask(base, CHAT, stream=False)
        if first["status"] == 400:  # no tokenizer or chat template (e.g. random weights): a token-id prompt
            rec["prompt"] = "token ids"
            first = _ask(base, IDS, stream=False)
        body = CHAT if rec.get("prompt") is None else IDS
        # The same request again, then streamed: both find the first one's prompt pages in the prefix cache and
        # prefill only the rest, so they take the same programs and must agree token for token. The first reply
        # may differ from them where bf16 logits tie (a whole-prompt prefill against a one-token one).
        repeat, streamed = _ask(base, body, stream=False), _ask(base, body, stream=True)
        rec.update(status=first["status"], seconds=first["seconds"], reply=first["reply"], usage=first["usage"],
                   repeat_status=repeat["status"], repeat_reply=repeat["reply"],
                   repeat_equals_first=repeat["reply"] == first["reply"], stream_status=streamed["status"],
                   stream_events=streamed["events"], stream_done=streamed["done"],
                   stream_reply=streamed["reply"],  # kept whole: when two replies differ, where they part says why
                   stream_equals_repeat=streamed["reply"] == repeat["reply"])
        if until_compiled:  # seconds from launch until every bucket's programs were ready
            rec["all_compiled_s"] = (round(time.perf_counter() - launched, 2)
                                     if wait_compiled(proc, port, ready_timeout) else None)
    finally:
        code, shutdown_s = stop_server(proc)
        rec["exit_code"], rec["shutdown_s"] = code, round(shutdown_s, 2)
    rec["ok"] = bool(rec.get("status") == 200 and rec.get("reply") is not None
                     and rec.get("repeat_status") == 200 and rec.get("stream_status") == 200
                     and rec.get("stream_done") and rec.get("stream_equals_repeat") and rec.get("exit_code") == 0)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--until-compiled", action="store_true",
                    help="after the requests, also wait until every program is compiled (all_compiled_s) before "
                         "stopping the server; by default it is stopped at once, while the rest may still compile")
    ap.add_argument("extra", nargs="*", help="flags passed to the server after --")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT")
    cache_dir = tempfile.mkdtemp(prefix="gemma4_serve_cache_")  # empty: the first start is cold
    results = []
    for label in args.runs:
        rec = check_once(label, cache_dir, args.extra, out_dir, args.ready_timeout, args.until_compiled)
        results.append(rec)
        print(json.dumps(rec), flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "serve_check.json"), "w") as f:
            json.dump(results, f, indent=2)
    print(f"\n{'run':6} {'ready s':>8} {'plain':>5} {'stream':>7} {'exit':>5}  reply")
    for r in results:
        print(f"{r['run']:6} {r.get('ready_s', '-')!s:>8} {r.get('status', '-')!s:>5} "
              f"{r.get('stream_status', '-')!s:>7} {r.get('exit_code', '-')!s:>5}  {r.get('reply') or r.get('error')!r}")
    ok = all(r["ok"] for r in results)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
