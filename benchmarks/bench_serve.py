"""Serving benchmark in the manner of `vllm bench serve`: the HTTP server under load, with and without speculation.

The same workload is sent to `python -m gemma4_mtp_jax.serve` twice: with the MTP assistant (mode "spec") and with
`--assistant none` (mode "plain"). Each level is either a concurrency C (a closed loop keeps exactly C streaming
requests in flight) or a request rate R (an open loop: requests arrive as a Poisson process of R per second, `inf`
= all at once), until `--requests-per-level` (or `--rounds-per-level` x C) have finished. The workload:
- `--dataset chat` (default): greedy chat requests from a list of short prompts (built in, or --prompts-json), each
  asking `--max-tokens`; the actual output lengths are reported (EOS ends a reply unless --ignore-eos).
- `--dataset random`: completions with random token-id prompts; prompt and output lengths drawn uniformly from
  [L(1-r), L(1+r)] around `--input-len` / `--output-len` (r = `--range-ratio`), seeded. With `--ignore-eos` (vLLM's
  request extension, which this server has) every request generates exactly its output length: what random weights
  need.
- `--long-prompt-len L`: interference. While each level runs, a request with a random L-token prompt (one token
  out) arrives every `--long-prompt-interval` seconds; the level's inter-chunk gaps are then the running streams'
  while long prompts prefill (the goal: p99 <= 2x p50), and the long prompts' TTFT is reported beside them.
Per (mode, level): output tokens/s, requests/s, TTFT, inter-chunk latency, time per output token, end-to-end latency
(p50/p90/p99), and the server's own speculative counters from /metrics (acceptance rate, mean acceptance length),
then a spec-vs-plain speedup table.

    python benchmarks/bench_serve.py [--ckpt demo] [--assistant DIR] [--assistant-modes spec,plain]
        [--concurrency 1,8,32 | --request-rate 2,8,inf] [--requests-per-level N] [--max-tokens 128]
        [--dataset chat [--prompts-json FILE] | --dataset random --input-len 256 --output-len 128 --range-ratio 0.25
         [--random-prefix-len 2048] [--random-weights e2b]] [--long-prompt-len 4096 --long-prompt-interval 1]
        [--temperature 0.8] [--ignore-eos] [--out results.json] [--port 8011] [--server-arg=--flag ...]

Why the pieces are as they are:
- The client is a small asyncio HTTP/1.1 reader from the standard library (one connection per request), so the
  script runs wherever the server runs, with no HTTP client package, and stamps each SSE event when its bytes arrive.
- Requests ask for `return_token_ids` (this server's extension) and `stream_options.include_usage`: the token ids
  of each chunk give exact first-token times and tokens per chunk (a speculative server sends several tokens in one
  chunk), and the final usage gives the authoritative output length.
- Inter-token latency is reported twice: the gap between chunks (what a reader sees) and, per request, time per
  output token = (last token - first token) / (tokens - 1), which is the number that speculation lowers.
- The server answers once its smallest buckets' programs are compiled and compiles the rest in the background;
  on the GPU those first programs are compiled without XLA's autotuning and replaced by tuned ones last. Until
  then it serves, but slower (on an H100, speculation at c = 1 ran slower than plain in that window, and faster
  once the tuned programs were in). So before any request the script waits until /health reports
  `programs_final` (every program compiled, none untuned: the steady speed), at most --final-timeout seconds,
  with a progress line, and records per server the seconds from launch until ready (listening, /health 200:
  ready_s), until every program was compiled (all_compiled_s) and until programs_final (final_s), and the tuned
  replacements' share (tuned_replacement_s = final_s - all_compiled_s). The servers run with JAX_LOG_COMPILES=1
  and the script counts compilations logged during each timed level (after a warm-up wave at every level), which
  must be zero.
- The speculative counters are differences of /metrics scraped right before and after each timed level, so the
  warm-up and the other levels do not leak into them.

Exits 1 if a server did not start or exit 0, a request failed, or something compiled during a timed level.
(Until 2026-12-01 this script was benchmarks/serve_load.py, closed loop and chat prompts only.)
Server logs go to --log-dir ($OUT or the temp directory).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import re
import shlex
import sys
import tempfile
import time
from typing import AsyncIterator, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import TARGETS, write_random_checkpoint  # noqa: E402
from benchmarks.serve_check import ServerStartError, _get, start_server, stop_server  # noqa: E402

HOST = "127.0.0.1"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MODES = ("spec", "plain")

# Short, varied chat prompts (novels, the Bible, poetry, Python): different prompt lengths and topics, so the
# acceptance rate is not that of one lucky prompt.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "Summarize the plot of Pride and Prejudice in a few sentences.",
    "Who is Captain Ahab, and what does he want?",
    "Why does Jay Gatsby throw such lavish parties?",
    "Describe the opening scene of A Tale of Two Cities.",
    "What happens to Jean Valjean after he steals the bishop's silver?",
    "Explain the role of the narrator in Wuthering Heights.",
    "Tell me about the friendship between Frodo and Sam.",
    "What is the main theme of Crime and Punishment?",
    "Write a short review of Jane Eyre.",
    "How does Don Quixote see the windmills, and why?",
    "Retell the story of Noah's ark briefly.",
    "What does the parable of the prodigal son teach?",
    "Who was King David, according to the Bible?",
    "Summarize the first chapter of Genesis.",
    "What is the Sermon on the Mount about?",
    "Tell the story of Jonah and the whale.",
    "Who were the twelve apostles?",
    "Explain the meaning of Psalm 23.",
    "What happened at the Tower of Babel?",
    "Describe the exodus from Egypt in a paragraph.",
    "Write a short poem about the sea at night.",
    "What is a sonnet, and how is it structured?",
    "Explain the imagery in 'The Road Not Taken'.",
    "Write a haiku about autumn leaves.",
    "Who was Emily Dickinson, and how did she write?",
    "Compose four lines of verse about a quiet village.",
    "What makes Shakespeare's sonnets memorable?",
    "Write a limerick about a cat who loves books.",
    "Describe the rhythm of iambic pentameter.",
    "Write a poem about the first snow of winter.",
    "Write a Python function that reverses a string.",
    "How do I read a text file line by line in Python?",
    "Explain list comprehensions in Python with an example.",
    "Write a Python class for a simple bank account.",
    "What is the difference between a list and a tuple in Python?",
    "Show how to sort a list of dictionaries by a key in Python.",
    "Write a Python generator that yields Fibonacci numbers.",
    "How do I handle exceptions in Python?",
    "Explain what a Python decorator does, with a short example.",
    "Write a Python script that counts word frequencies in a text.",
)


# ----------------------------------------------------------------------------------------------- the HTTP client
class RequestFailed(RuntimeError):
    """A request that got a non-200 answer, an error event in its stream, or a broken stream."""


@dataclasses.dataclass
class RequestResult:
    """One streamed request, with perf_counter() times of its events."""

    index: int
    start: float
    end: float = 0.0
    first_token: float | None = None
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # chunks that carried at least one token
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)
    completion_tokens: int = 0
    finish_time: float | None = None  # the chunk with finish_reason: when the last token (maybe an EOS) arrived
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None


async def _body_pieces(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[tuple[float, bytes]]:
    """The response body as it arrives, as (arrival time, bytes); decodes chunked transfer encoding."""
    while True:
        if not chunked:
            data = await reader.read(65536)
            if not data:
                return
            yield time.perf_counter(), data
            continue
        size_line = await reader.readline()
        if not size_line:
            raise RequestFailed("connection closed inside a chunked body")
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF after the chunk
        yield time.perf_counter(), data


async def _sse_events(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[tuple[float, str]]:
    """`data:` payloads of the SSE stream, each with the arrival time of the bytes that completed it."""
    buf = b""
    async for t, data in _body_pieces(reader, chunked):
        buf += data.replace(b"\r\n", b"\n")
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            lines = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                yield t, b"\n".join(lines).decode("utf-8", "replace")


@dataclasses.dataclass
class Workload:
    """What request i asks: POST `path` with `bodies[i % len(bodies)]` (streaming, greedy, token ids returned)."""

    path: str
    bodies: list[dict]
    description: str

    def request(self, i: int) -> tuple[str, dict]:
        return self.path, self.bodies[i % len(self.bodies)]

    def after(self, n: int) -> Workload:
        """The workload from its request n on: each wave of a server's run starts where the last one stopped, so
        no timed request repeats a warm-up's prompt (and finds it in the prefix cache) while distinct ones last."""
        k = n % len(self.bodies)
        return dataclasses.replace(self, bodies=self.bodies[k:] + self.bodies[:k])


def _streaming(body: dict, ignore_eos: bool) -> dict:
    return {**body, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, **({"ignore_eos": True} if ignore_eos else {})}


def chat_workload(prompts: Sequence[str], max_tokens: int, ignore_eos: bool) -> Workload:
    bodies = [_streaming({"messages": [{"role": "user", "content": p}], "max_tokens": max_tokens}, ignore_eos)
              for p in prompts]
    return Workload(CHAT_PATH, bodies, f"chat: {len(prompts)} prompts, max_tokens {max_tokens}")


def random_workload(n: int, input_len: int, output_len: int, range_ratio: float, token_range: tuple[int, int],
                    ignore_eos: bool, seed: int, prefix_len: int = 0) -> Workload:
    """n completions with random token-id prompts; lengths uniform in [L(1-r), L(1+r)] (at least 1), each after
    the same `prefix_len` random tokens (a shared system prompt: what the prefix cache serves)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(*token_range, size=prefix_len).tolist()

    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=n)

    ins, outs = lengths(input_len), lengths(output_len)
    bodies = [_streaming({"prompt": prefix + rng.integers(*token_range, size=int(a)).tolist(), "max_tokens": int(b)},
                         ignore_eos) for a, b in zip(ins, outs)]
    return Workload(COMPLETIONS_PATH, bodies, f"random: {n} prompts, shared prefix {prefix_len}, input {input_len}, "
                    f"output {output_len}, range ratio {range_ratio}, token ids in [{token_range[0]}, "
                    f"{token_range[1]}), seed {seed}")


async def stream_request(port: int, index: int, path: str, payload: dict, timeout: float) -> RequestResult:
    """One streaming request; never raises for the request's own failure (see `error`), including taking longer
    than `timeout` seconds."""
    body = json.dumps(payload).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    res = RequestResult(index=index, start=time.perf_counter())
    try:
        async with asyncio.timeout(timeout):
            await _exchange(port, head + body, res)
    except TimeoutError:
        res.error = f"no complete answer within {timeout:g}s (--request-timeout)"
    except (OSError, asyncio.IncompleteReadError, ValueError, KeyError, RequestFailed) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter()
    return res


async def _exchange(port: int, request: bytes, res: RequestResult) -> None:
    """Send `request` on a new connection and record its SSE answer into `res`; raises on any failure."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(request)
        await writer.drain()
        status_line = await reader.readline()
        parts = status_line.split(None, 2)
        status = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if status != 200:
            text = b"".join([d async for _, d in _body_pieces(reader, chunked)]).decode("utf-8", "replace")
            raise RequestFailed(f"HTTP {status or status_line!r}: {text[:300]}")
        usage_tokens = None
        done = False
        async for t, data in _sse_events(reader, chunked):
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RequestFailed(f"error event: {json.dumps(obj['error'])[:300]}")
            if obj.get("usage"):
                usage_tokens = int(obj["usage"]["completion_tokens"])
            for choice in obj.get("choices") or ():
                n = len(choice.get("token_ids") or ())
                if n:
                    if res.first_token is None:
                        res.first_token = t
                    res.chunk_times.append(t)
                    res.chunk_tokens.append(n)
                res.text += (choice.get("delta") or {}).get("content") or ""
                if choice.get("finish_reason"):
                    res.finish_reason, res.finish_time = choice["finish_reason"], t
        if not done:
            raise RequestFailed("the stream ended without [DONE]")
        res.completion_tokens = usage_tokens if usage_tokens is not None else sum(res.chunk_tokens)
    finally:
        writer.close()


@dataclasses.dataclass(frozen=True)
class Level:
    """A load level: a concurrency (closed loop) or a request rate per second (Poisson arrivals; inf: at once)."""

    concurrency: int | None = None
    rate: float | None = None

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"rate={self.rate:g}/s"


async def _closed_loop(port: int, workload: Workload, concurrency: int, n_requests: int,
                       timeout: float) -> tuple[list[RequestResult], float]:
    """Keep exactly `concurrency` requests in flight until `n_requests` have finished; request i is the workload's
    request i, so both modes get the same workload. Returns the results and the wall time."""
    results: list[RequestResult] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < n_requests:
            i = next_index
            next_index += 1
            results.append(await stream_request(port, i, *workload.request(i), timeout))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.index), time.perf_counter() - t0


async def _open_loop(port: int, workload: Workload, rate: float, n_requests: int, timeout: float,
                     seed: int) -> tuple[list[RequestResult], float]:
    """Send request i at the i-th arrival of a Poisson process of `rate` per second (seeded: both modes get the same
    arrival times), whatever is still in flight. Returns the results and the wall time."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n_requests) if np.isfinite(rate) else \
        np.zeros(n_requests)
    t0 = time.perf_counter()
    tasks = []
    for i in range(n_requests):
        arrival = t0 + float(gaps[: i + 1].sum())
        if (wait := arrival - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(stream_request(port, i, *workload.request(i), timeout)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


async def _long_prompts(port: int, prompts: Workload | None, interval: float, done: asyncio.Event,
                        timeout: float) -> list[RequestResult]:
    """While the level runs (until `done`), one long-prompt request every `interval` seconds: the interference
    whose effect on the running streams' inter-chunk gaps the level then shows."""
    if prompts is None:
        return []
    tasks, i = [], 0
    while not done.is_set():
        tasks.append(asyncio.create_task(stream_request(port, -1 - i, *prompts.request(i), timeout)))
        i += 1
        try:
            await asyncio.wait_for(done.wait(), interval)
        except asyncio.TimeoutError:
            pass
    return list(await asyncio.gather(*tasks))


def run_level(args: argparse.Namespace, workload: Workload, level: Level, n_requests: int,
              long_prompts: Workload | None = None) -> tuple[list[RequestResult], float, list[RequestResult]]:
    """The level's requests, and the long-prompt requests sent meanwhile (none without `long_prompts`)."""
    async def both():
        done = asyncio.Event()
        interference = asyncio.create_task(_long_prompts(args.port, long_prompts, args.long_prompt_interval, done,
                                                         args.request_timeout))
        if level.concurrency is not None:
            results, wall = await _closed_loop(args.port, workload, level.concurrency, n_requests,
                                               args.request_timeout)
        else:
            results, wall = await _open_loop(args.port, workload, level.rate, n_requests, args.request_timeout,
                                             args.seed)
        done.set()
        return results, wall, await interference

    return asyncio.run(both())


# ------------------------------------------------------------------------------------------------ measurements
def _pcts(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50/p90/p99 (and mean) in milliseconds; None when there is nothing to measure."""
    if not len(values):
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3),
            "mean": round(float(a.mean()), 3)}


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict:
    """Client-side numbers of one timed level (failed requests are counted, not measured)."""
    ok = [r for r in results if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    ttft = [r.first_token - r.start for r in ok if r.first_token is not None]
    gaps = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [((r.finish_time or r.chunk_times[-1]) - r.first_token) / (r.completion_tokens - 1)
            for r in ok if r.first_token is not None and r.completion_tokens > 1]
    chunks = sum(len(r.chunk_times) for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "mean_output_tokens": round(tokens / len(ok), 2) if ok else None,
        "finish_reasons": dict(sorted(collections.Counter(str(r.finish_reason) for r in ok).items())),
        "tokens_per_chunk": round(sum(sum(r.chunk_tokens) for r in ok) / chunks, 3) if chunks else None,
        "ttft_ms": _pcts(ttft),
        "inter_chunk_ms": _pcts(gaps),
        "tpot_ms": _pcts(tpot),
        "e2e_ms": _pcts([r.end - r.start for r in ok]),
    }


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)")


def scrape_metrics(port: int) -> dict[str, float]:
    """The server's /metrics as {series (name plus labels): value}."""
    status, body = _get(f"http://{HOST}:{port}/metrics", timeout=10)
    if status != 200:
        raise RequestFailed(f"/metrics answered {status}")
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out[m.group(1)] = float(m.group(2))
    return out


def spec_counters(before: dict[str, float], after: dict[str, float]) -> dict:
    """The server's counters over one timed level: speculation and the prefix cache (prompt tokens looked up and
    found). Mean acceptance length counts the target's own token of each round: (accepted + rounds) / rounds tokens
    per sequence per round."""
    p = "gemma4_"

    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafted = d(p + "spec_decode_draft_tokens_total")
    accepted = d(p + "spec_decode_accepted_tokens_total")
    rounds = d(p + "spec_decode_accepted_tokens_per_round_count")
    steps = d(p + "engine_steps_total")
    gen = d(p + "generation_tokens_total")
    pos_re = re.compile(re.escape(p + "spec_decode_accepted_tokens_per_position_total") + r'\{position="(\d+)"\}')
    per_pos = {int(m.group(1)): d(k) for k in after if (m := pos_re.fullmatch(k))}
    return {
        "num_speculative_tokens": int(after.get(p + "num_speculative_tokens", 0)),
        "generation_tokens": int(gen),
        "engine_steps": int(steps),
        "drafted": int(drafted),
        "accepted": int(accepted),
        "rounds": int(rounds),
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_acceptance_length": round((accepted + rounds) / rounds, 3) if rounds else None,
        "acceptance_by_position": [round(per_pos[i] / rounds, 4) for i in sorted(per_pos)] if rounds else [],
        "prefix_cache_queries": int(d(p + "prefix_cache_queries_total")),
        "prefix_cache_hits": int(d(p + "prefix_cache_hits_total")),
    }


def count_compiles(log_path: str, offset: int) -> int:
    """JAX compilations (JAX_LOG_COMPILES lines) written to the server log after byte `offset`."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        return sum(1 for line in f if b"Compiling " in line and b"jax" in line)


# ------------------------------------------------------------------------------------------------ the driver
class NotSteady(RuntimeError):
    """The server exited, or did not report programs_final in time."""


def wait_steady(proc, port: int, timeout: float, label: str, progress_every: float = 15.0) -> dict[str, float]:
    """Poll /health from ready until it reports programs_final (every program compiled and none still untuned:
    the server's steady speed), printing a progress line every `progress_every` seconds. Returns the seconds
    after this call began at which every program was compiled ("all_compiled") and at which programs_final came
    ("final"). Raises NotSteady if the server exits, its /health has no programs_final, or `timeout` passes."""
    t0 = time.perf_counter()
    seen: dict[str, float] = {}
    last_print, h = t0, {}
    while True:
        now = time.perf_counter()
        if proc.poll() is not None:
            raise NotSteady(f"the server exited with {proc.returncode} before programs_final: last /health {h}")
        try:
            status, body = _get(f"http://{HOST}:{port}/health", timeout=2)
            h = json.loads(body) if status == 200 else h
        except (OSError, ValueError):
            pass
        if h and "programs_final" not in h:
            raise NotSteady(f"the server's /health has no programs_final: {h}")
        if h and h["programs_compiled"] >= h["programs_total"]:
            seen.setdefault("all_compiled", now - t0)
        if h.get("programs_final"):
            seen.setdefault("all_compiled", now - t0)
            seen["final"] = now - t0
            return seen
        if now - t0 > timeout:
            raise NotSteady(f"no programs_final within {timeout:.0f}s after ready (--final-timeout): last /health "
                            f"{h}")
        if now - last_print >= progress_every:
            last_print = now
            print(f"[{label}] {now - t0:.0f}s after ready, waiting for the steady programs: "
                  f"{h.get('programs_compiled')}/{h.get('programs_total')} compiled, "
                  f"{h.get('programs_untuned')} untuned", flush=True)
        time.sleep(0.2)


def _int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: expected integers >= 1, got {text!r}")
    return values


def _load_prompts(path: str | None) -> list[str]:
    if path is None:
        return list(DEFAULT_PROMPTS)
    try:
        with open(path) as f:
            prompts = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--prompts-json: cannot read {path}: {e}") from None
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, str) and p for p in prompts)):
        raise ValueError(f"--prompts-json: {path} must hold a non-empty JSON list of non-empty strings")
    return prompts


def _rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--request-rate: expected comma-separated numbers or inf, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"--request-rate: expected rates > 0, got {text!r}")
    return values


def sampled(workload: Workload, temperature: float) -> Workload:
    """The workload at `temperature`, each request seeded by its index (so both modes draw with the same seeds)."""
    if temperature <= 0:
        return workload
    bodies = [{**b, "temperature": temperature, "seed": i} for i, b in enumerate(workload.bodies)]
    return dataclasses.replace(workload, bodies=bodies, description=f"{workload.description}, T = {temperature}")


def make_workload(args: argparse.Namespace) -> Workload:
    if args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    return sampled(_make_workload(args), args.temperature)


def _make_workload(args: argparse.Namespace) -> Workload:
    if args.dataset == "chat":
        if args.max_tokens < 1:
            raise ValueError("--max-tokens must be >= 1")
        return chat_workload(_load_prompts(args.prompts_json), args.max_tokens, args.ignore_eos)
    if min(args.input_len, args.output_len, args.num_prompts) < 1 or not 0 <= args.range_ratio < 1:
        raise ValueError("--input-len, --output-len and --num-prompts must be >= 1, --range-ratio in [0, 1)")
    if args.random_prefix_len < 0:
        raise ValueError("--random-prefix-len must be >= 0")
    lo_hi = _int_list("--token-range", args.token_range)
    if len(lo_hi) != 2 or lo_hi[0] >= lo_hi[1]:
        raise ValueError(f"--token-range: expected lo,hi with lo < hi, got {args.token_range!r}")
    return random_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                           (lo_hi[0], lo_hi[1]), args.ignore_eos, args.seed, args.random_prefix_len)


def long_prompt_workload(args: argparse.Namespace) -> Workload | None:
    """--long-prompt-len: random-token prompts of that length, one token out each (None when off)."""
    if not args.long_prompt_len:
        return None
    if args.long_prompt_len < 0 or args.long_prompt_interval <= 0:
        raise ValueError("--long-prompt-len must be >= 0 and --long-prompt-interval > 0")
    lo_hi = _int_list("--token-range", args.token_range)
    # Distinct prompts for a run's waves (each starts where the last stopped): none repeats into the prefix cache.
    return random_workload(64, args.long_prompt_len, 1, 0.0, (lo_hi[0], lo_hi[1]), True, args.seed + 1)


def max_num_seqs(args: argparse.Namespace, levels: list[Level]) -> int:
    """The server's batch: --max-num-seqs, else the largest concurrency (32 when every level is a rate)."""
    biggest = max((lv.concurrency or 0 for lv in levels), default=0)
    return max(args.max_num_seqs or 0, biggest) or 32


def server_flags(args: argparse.Namespace, mode: str, max_num_seqs: int) -> list[str]:
    flags = ["--ckpt", args.ckpt, "--max-num-seqs", str(max_num_seqs), "--no-access-log"]
    if mode == "plain":
        flags += ["--assistant", "none"]
    elif args.assistant is not None:
        flags += ["--assistant", args.assistant]
    for extra in args.server_arg:
        flags += shlex.split(extra)
    return flags


def run_mode(args: argparse.Namespace, mode: str, workload: Workload, levels: list[Level], log_dir: str,
             long_prompts: Workload | None = None) -> tuple[dict, list[dict], list[list[RequestResult]]]:
    """Start the server for `mode`, warm it up, time every level, stop it. Returns (server record, level records,
    each level's request results)."""
    flags = server_flags(args, mode, max_num_seqs(args, levels))
    log_path = os.path.join(log_dir, f"bench_serve_{mode}.log")
    server = {"mode": mode, "flags": flags, "log": log_path}
    env = {**os.environ, "JAX_LOG_COMPILES": "1"}
    print(f"[{mode}] starting: python -m gemma4_mtp_jax.serve --port {args.port} {shlex.join(flags)}", flush=True)
    try:
        proc, ready_s = start_server(flags, args.port, log_path, args.ready_timeout, env=env)
    except ServerStartError as e:
        server.update(error=str(e), exit_code=e.exit_code)
        print(f"[{mode}] {e}", flush=True)
        return server, [], []
    server["ready_s"] = round(ready_s, 2)
    print(f"[{mode}] ready after {ready_s:.1f}s", flush=True)
    # The server answers once the smallest buckets' programs are compiled (untuned on the GPU); the timed part
    # needs every bucket, each in its final form.
    try:
        steady = wait_steady(proc, args.port, args.final_timeout, mode)
    except NotSteady as e:
        code, _ = stop_server(proc)
        server.update(error=str(e), exit_code=code)
        print(f"[{mode}] {e}", flush=True)
        return server, [], []
    server["all_compiled_s"] = round(ready_s + steady["all_compiled"], 2)
    server["final_s"] = round(ready_s + steady["final"], 2)
    server["final_after_ready_s"] = round(steady["final"], 2)
    server["tuned_replacement_s"] = round(steady["final"] - steady["all_compiled"], 2)
    print(f"[{mode}] seconds from launch: ready {server['ready_s']}, every program compiled "
          f"{server['all_compiled_s']}, programs_final {server['final_s']} (the tuned replacements "
          f"{server['tuned_replacement_s']} s)", flush=True)
    records, raw = [], []
    try:
        startup_compiles = count_compiles(log_path, 0)
        server["startup_compiles_logged"] = startup_compiles
        if not startup_compiles:  # this JAX logs them differently: the timed-part check below would see nothing
            print(f"[{mode}] WARNING: no JAX compilation in the start-up log; cannot check the timed part",
                  flush=True)
        offset = os.path.getsize(log_path)
        t0 = time.perf_counter()
        # A full wave at each concurrency (every batch size and prefill shape the level will use); rate levels
        # warm up with a wave as wide as the server's batch.
        sent, long_sent = 0, 0  # requests (and long prompts) so far: each wave starts after them (Workload.after)

        def long_after():
            return None if long_prompts is None else long_prompts.after(long_sent)

        for c in sorted({lv.concurrency or max_num_seqs(args, levels) for lv in levels}):
            warm, _, warm_long = run_level(args, workload.after(sent), Level(concurrency=c), c, long_after())
            sent, long_sent = sent + c, long_sent + len(warm_long)
            failed = [r.error for r in warm if r.error]
            if failed:
                raise RequestFailed(f"warm-up at concurrency {c}: {len(failed)} request(s) failed: {failed[0]}")
        server["warmup_s"] = round(time.perf_counter() - t0, 2)
        server["warmup_compiles"] = count_compiles(log_path, offset)
        for lv in levels:
            in_flight = lv.concurrency or max_num_seqs(args, levels)
            n = args.requests_per_level or max(8, args.rounds_per_level * in_flight)
            before, offset = scrape_metrics(args.port), os.path.getsize(log_path)
            results, wall, interference = run_level(args, workload.after(sent), lv, n, long_after())
            sent, long_sent = sent + n, long_sent + len(interference)
            after = scrape_metrics(args.port)
            rec = {"mode": mode, "level": lv.label, "concurrency": lv.concurrency, "request_rate": lv.rate,
                   **summarize(results, wall), "server": spec_counters(before, after),
                   "compiles_during_timed": count_compiles(log_path, offset) if startup_compiles else None}
            if long_prompts is not None:  # the streams' gaps above are measured while these prefilled
                gaps = rec["inter_chunk_ms"]
                rec["long_prompts"] = {"sent": len(interference),
                                       "failed": sum(r.error is not None for r in interference),
                                       "ttft_ms": _pcts([r.first_token - r.start for r in interference
                                                         if r.error is None and r.first_token is not None]),
                                       "inter_chunk_p99_over_p50": _ratio(gaps["p99"], gaps["p50"])}
                lp = rec["long_prompts"]
                print(f"[{mode}] {lv.label}: {lp['sent']} long prompts meanwhile ({lp['failed']} failed), their TTFT "
                      f"p50 {lp['ttft_ms']['p50']} ms; the streams' inter-chunk p99 / p50 = "
                      f"{lp['inter_chunk_p99_over_p50']}", flush=True)
            records.append(rec)
            raw.append(results)
            s = rec["server"]
            print(f"[{mode}] {lv.label}: {rec['output_tokens']} tokens in {rec['wall_s']:.2f}s = "
                  f"{rec['output_tokens_per_s']} tok/s, TTFT p50 {rec['ttft_ms']['p50']} ms, TPOT p50 "
                  f"{rec['tpot_ms']['p50']} ms, acceptance {s['acceptance_rate']}, failed {rec['failed']}, "
                  f"compiles {rec['compiles_during_timed']}", flush=True)
    except RequestFailed as e:
        server["error"] = str(e)
        print(f"[{mode}] {e}", flush=True)
    finally:
        code, shutdown_s = stop_server(proc)
        server.update(exit_code=code, shutdown_s=round(shutdown_s, 2))
        print(f"[{mode}] stopped: exit code {code} after {shutdown_s:.1f}s", flush=True)
    return server, records, raw


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num and den else None


def speedups(records: list[dict], raw: dict[tuple[str, int], list[RequestResult]]) -> list[dict]:
    """spec vs plain at each level; every ratio is > 1 when speculation helps. same_text: the fraction of requests
    whose greedy output was identical in both modes (speculative decoding is lossless up to numerics)."""
    by = {(r["mode"], r["level"]): r for r in records}
    out = []
    for (mode, level), spec in by.items():
        plain = by.get(("plain", level))
        if mode != "spec" or plain is None:
            continue
        pairs = list(zip(raw[("spec", level)], raw[("plain", level)]))
        same = [a.text == b.text for a, b in pairs if a.error is None and b.error is None]
        out.append({
            "level": level,
            "output_tokens_per_s": _ratio(spec["output_tokens_per_s"], plain["output_tokens_per_s"]),
            "tpot_p50": _ratio(plain["tpot_ms"]["p50"], spec["tpot_ms"]["p50"]),
            "tpot_mean": _ratio(plain["tpot_ms"]["mean"], spec["tpot_ms"]["mean"]),
            "ttft_p50": _ratio(plain["ttft_ms"]["p50"], spec["ttft_ms"]["p50"]),
            "same_text": round(sum(same) / len(same), 3) if same else None,
        })
    return out


def _fmt(v: object) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def _p3(d: dict) -> str:
    """p50/p90/p99 of a _pcts() dict, to 0.1 ms."""
    return "/".join("-" if d[k] is None else f"{d[k]:.1f}" for k in ("p50", "p90", "p99"))


def markdown(servers: list[dict], records: list[dict], ratios: list[dict]) -> str:
    lines = ["Seconds from launch: ready (listening), every program compiled, programs_final (none untuned)", "",
             "| mode | ready s | all compiled s | final s | tuned replacements s | warm-up s | warm-up compiles | "
             "timed compiles | exit code |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in servers:
        timed = [r["compiles_during_timed"] for r in records if r["mode"] == s["mode"]]
        timed_txt = "unchecked" if None in timed else str(sum(timed)) if timed else "-"
        lines.append(f"| {s['mode']} | {_fmt(s.get('ready_s'))} | {_fmt(s.get('all_compiled_s'))} | "
                     f"{_fmt(s.get('final_s'))} | {_fmt(s.get('tuned_replacement_s'))} | {_fmt(s.get('warmup_s'))} | "
                     f"{_fmt(s.get('warmup_compiles'))} | {timed_txt} | {_fmt(s.get('exit_code'))} |")
    lines += ["", "| mode | level | reqs | out tok | mean len | wall s | tok/s | req/s | TTFT ms p50/p90/p99 | "
              "inter-chunk ms p50/p90/p99 | TPOT ms p50/p90/p99 | e2e ms p50/p90/p99 | tok/chunk | accept rate | "
              "mean accept len |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---|---:|---:|---:|"]
    for r in records:
        s = r["server"]
        lines.append(f"| {r['mode']} | {r['level']} | {r['requests'] - r['failed']}/{r['requests']} | "
                     f"{r['output_tokens']} | {_fmt(r['mean_output_tokens'])} | {_fmt(r['wall_s'])} | "
                     f"{_fmt(r['output_tokens_per_s'])} | {_fmt(r['requests_per_s'])} | {_p3(r['ttft_ms'])} | "
                     f"{_p3(r['inter_chunk_ms'])} | {_p3(r['tpot_ms'])} | {_p3(r['e2e_ms'])} | "
                     f"{_fmt(r['tokens_per_chunk'])} | {_fmt(s['acceptance_rate'])} | "
                     f"{_fmt(s['mean_acceptance_length'])} |")
    if ratios:
        lines += ["", "Speedup of spec over plain (> 1: spec is better)", "",
                  "| level | tok/s | TPOT p50 | TPOT mean | TTFT p50 | same text |", "|---|---:|---:|---:|---:|---:|"]
        for q in ratios:
            lines.append(f"| {q['level']} | {_fmt(q['output_tokens_per_s'])} | {_fmt(q['tpot_p50'])} | "
                         f"{_fmt(q['tpot_mean'])} | {_fmt(q['ttft_p50'])} | {_fmt(q['same_text'])} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default="demo", help="target checkpoint, passed to the server's --ckpt (default: demo)")
    ap.add_argument("--assistant", default=None,
                    help="assistant checkpoint for the spec mode (default: the server's default, i.e. the demo "
                         "assistant with --ckpt demo)")
    ap.add_argument("--assistant-modes", default="spec,plain",
                    help="comma-separated modes, run in this order: spec (with the assistant), plain "
                         "(--assistant none) (default: spec,plain)")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", default=None,
                      help="comma-separated in-flight request counts, a closed loop each (default: 1,8,32)")
    load.add_argument("--request-rate", default=None,
                      help="comma-separated request rates per second (Poisson arrivals; inf: all at once)")
    ap.add_argument("--requests-per-level", type=int, default=None,
                    help="requests timed at each level (default: --rounds-per-level x the concurrency, or x the "
                         "server's batch with --request-rate; at least 8)")
    ap.add_argument("--rounds-per-level", type=int, default=2,
                    help="without --requests-per-level: requests timed at each level per request in flight "
                         "(default 2; more for a smaller spread between runs)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the server's --max-num-seqs (default: the largest concurrency, or 32 with --request-rate)")
    ap.add_argument("--dataset", choices=["chat", "random"], default="chat", help="the workload (see above)")
    ap.add_argument("--max-tokens", type=int, default=128, help="chat: max_tokens of every request (default: 128)")
    ap.add_argument("--prompts-json", default=None, help="chat: a JSON list of prompt strings (default: built-in)")
    ap.add_argument("--input-len", type=int, default=256, help="random: mean prompt tokens (default: 256)")
    ap.add_argument("--output-len", type=int, default=128, help="random: mean max_tokens (default: 128)")
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="random: lengths uniform in [L(1-r), L(1+r)] (default: 0, every length L)")
    ap.add_argument("--token-range", default="10,1000", help="random: token ids drawn from [lo, hi) (default: "
                    "10,1000, inside every Gemma 4 vocabulary and the demo's)")
    ap.add_argument("--num-prompts", type=int, default=256, help="random: distinct prompts (default: 256)")
    ap.add_argument("--random-prefix-len", type=int, default=0, metavar="N",
                    help="random: every prompt starts with the same N random tokens (default: 0)")
    ap.add_argument("--random-weights", choices=sorted(TARGETS), default=None, metavar="MODEL",
                    help="serve MODEL's real shapes with random weights (the server's --load-format dummy; "
                         "--dataset random only): " + ", ".join(sorted(TARGETS)))
    ap.add_argument("--long-prompt-len", type=int, default=0, metavar="L",
                    help="interference: while each level runs, a request with a random L-token prompt and one "
                         "output token every --long-prompt-interval seconds; the level's inter-chunk gaps then show "
                         "what the running streams suffer while long prompts prefill (default: 0, off)")
    ap.add_argument("--long-prompt-interval", type=float, default=1.0, metavar="S",
                    help="seconds between long-prompt requests (default: 1)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request, each seeded by its index (default: 0, greedy)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every request generates its max_tokens whatever EOS the model emits (random weights)")
    ap.add_argument("--seed", type=int, default=0, help="random prompts and Poisson arrivals (default: 0)")
    ap.add_argument("--out", default=None, help="results JSON (default: $OUT/bench_serve.json or the temp dir)")
    ap.add_argument("--log-dir", default=None, help="server logs (default: $OUT or the temp dir)")
    ap.add_argument("--port", type=int, default=8011, help="server port, for both modes in turn (default: 8011)")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for a server's /health "
                    "(default: 900)")
    ap.add_argument("--final-timeout", type=float, default=900.0, help="seconds after ready to wait for /health's "
                    "programs_final (every program compiled and tuned) before the first request (default: 900)")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take in all "
                    "(default: 600)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra server flags, shell-split; repeatable; write --server-arg=--flag=value")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.assistant_modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES) or len(set(modes)) != len(modes):
        ap.error(f"--assistant-modes: expected distinct values among {','.join(MODES)}, got {args.assistant_modes!r}")
    try:
        if args.request_rate is not None:
            levels = [Level(rate=r) for r in _rate_list(args.request_rate)]
        else:
            levels = [Level(concurrency=c) for c in _int_list("--concurrency", args.concurrency or "1,8,32")]
        workload = make_workload(args)
        long_prompts = long_prompt_workload(args)
    except ValueError as e:
        ap.error(str(e))
    if args.requests_per_level is not None and args.requests_per_level < 1:
        ap.error("--requests-per-level must be >= 1")
    if args.rounds_per_level < 1:
        ap.error("--rounds-per-level must be >= 1")
    biggest = max((lv.concurrency or 0 for lv in levels), default=0)
    if args.max_num_seqs is not None and args.max_num_seqs < biggest:
        ap.error(f"--max-num-seqs ({args.max_num_seqs}) must be >= the largest --concurrency ({biggest})")
    if not (args.ready_timeout > 0 and args.request_timeout > 0 and args.final_timeout > 0):
        ap.error("--ready-timeout, --final-timeout and --request-timeout must be > 0")
    if not 0 < args.port < 65536:
        ap.error("--port must be in [1, 65535]")
    if args.random_weights:
        if args.dataset != "random":
            ap.error("--random-weights needs --dataset random (random weights come with no tokenizer)")
        args.ckpt, args.assistant = write_random_checkpoint(args.random_weights, tempfile.mkdtemp(prefix="bench_"))
        args.server_arg = [*args.server_arg, "--load-format=dummy"]
    out_dir = os.environ.get("OUT") or tempfile.gettempdir()
    log_dir = args.log_dir or out_dir
    os.makedirs(log_dir, exist_ok=True)
    out_path = args.out or os.path.join(out_dir, "bench_serve.json")

    servers, records, raw = [], [], {}

    def summary() -> tuple[list[str], list[dict]]:
        ratios = speedups(records, raw)
        problems = [f"{s['mode']}: {s['error']}" for s in servers if s.get("error")]
        problems += [f"{s['mode']}: server exit code {s['exit_code']}" for s in servers
                     if s.get("exit_code") != 0 and not s.get("error")]
        problems += [f"{r['mode']} {r['level']}: {r['failed']} request(s) failed ({r['errors'][0]})"
                     for r in records if r["failed"]]
        problems += [f"{r['mode']} {r['level']}: {r['compiles_during_timed']} compilation(s) in the timed part"
                     for r in records if r["compiles_during_timed"]]
        problems += [f"{r['mode']} {r['level']}: {r['long_prompts']['failed']} long-prompt request(s) failed"
                     for r in records if r.get("long_prompts", {}).get("failed")]
        result = {
            "config": {"ckpt": args.ckpt, "assistant": args.assistant, "modes": modes,
                       "levels": [lv.label for lv in levels], "requests_per_level": args.requests_per_level,
                       "workload": workload.description, "ignore_eos": args.ignore_eos,
                       "server_args": args.server_arg,
                       "long_prompts": None if long_prompts is None else
                       f"{long_prompts.description}, one every {args.long_prompt_interval:g} s during each level"},
            "servers": servers,
            "results": records,
            "speedup": ratios,
            "problems": problems,
        }
        # Written after every mode, so that a run cut short (a time limit) keeps the modes it finished.
        with open(out_path, "w") as f:
            json.dump(result, f, indent=2)
        return problems, ratios

    for mode in modes:
        server, recs, results = run_mode(args, mode, workload, levels, log_dir, long_prompts)
        servers.append(server)
        records += recs
        raw.update({(mode, r["level"]): res for r, res in zip(recs, results)})
        problems, ratios = summary()
    print()
    print(markdown(servers, records, ratios))
    print(f"\nresults: {out_path}")
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
