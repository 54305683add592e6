"""`python -m gemma4_mtp_jax.serve`: load, compile, then serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from gemma4_mtp_jax.server.flags import (API_KEY_ENV, DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_MAX_MODEL_LEN_CAP,
                                         adaptive, build_parser, check_args, max_connections)

log = logging.getLogger("gemma4_mtp_jax.serve")

def _set_memory_fraction(arg: float | None) -> None:
    """--gpu-memory-utilization, before JAX starts: the flag, else the environment's, else the default."""
    from gemma4_mtp_jax.xla_env import MEM_FRACTION_ENV, set_memory_fraction

    if arg is None and os.environ.get(MEM_FRACTION_ENV):
        return
    set_memory_fraction(DEFAULT_GPU_MEMORY_UTILIZATION if arg is None else arg)


def _setup_compilation_cache(arg: str | None) -> None:
    from gemma4_mtp_jax.programs.compiled import enable_compilation_cache

    path = enable_compilation_cache(arg)
    if path:
        log.info("JAX compilation cache: %s", path)


def _executable_cache_dir(arg: str | None) -> str | None:
    """--executable-cache-dir: the directory, None for 'none', the package's default without the flag."""
    from gemma4_mtp_jax.programs.executable_cache import user_cache_dir

    if arg is None:
        return user_cache_dir("executables")
    return None if arg.lower() == "none" else arg


def _max_position_embeddings(path: Path) -> int | None:
    from gemma4_mtp_jax.model.config import read_config_json

    try:
        cfg = read_config_json(path)
    except Exception:
        return None
    v = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    return int(v) if isinstance(v, int) and v > 1 else None


def _prefill_chunk(args: argparse.Namespace, path: Path) -> int:
    """--prefill-chunk, raised to a power of two of at least --max-image-tokens for a target whose image tokens see
    each other: the engine prefills each image within one chunk (engine/media.PromptMedia.whole), so a smaller
    chunk would refuse every image of the default size."""
    from gemma4_mtp_jax.model.config import parse_target_config, read_config_json
    from gemma4_mtp_jax.model.media_config import parse_media_config

    try:
        d = read_config_json(path)
        bidirectional = parse_target_config(d).image_attention != "causal"
        media = parse_media_config(d)
    except Exception:  # the loader reports a bad checkpoint with its own message
        return args.prefill_chunk
    if not bidirectional or media is None or media.vision is None or args.prefill_chunk >= args.max_image_tokens:
        return args.prefill_chunk
    chunk = 1 << (args.max_image_tokens - 1).bit_length()
    log.warning("--prefill-chunk raised from %d to %d: this model's image tokens attend to each other, so an image "
                "(up to --max-image-tokens %d soft tokens) is prefilled within one chunk", args.prefill_chunk, chunk,
                args.max_image_tokens)
    return chunk


class _Timer:
    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        log.info("%s ...", self.what)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            log.info("%s: done in %.1fs", self.what, time.perf_counter() - self.t0)


def _engine_config(args: argparse.Namespace, target_dir: Path, speculative: bool):
    """The EngineConfig of the server's flags for the target checkpoint in `target_dir` (its config.json gives the
    default max_model_len), speculative or not."""
    from gemma4_mtp_jax.engine import EngineConfig

    max_len = args.max_model_len
    if max_len is None:
        mpe = _max_position_embeddings(target_dir)
        max_len = min(mpe or DEFAULT_MAX_MODEL_LEN_CAP, DEFAULT_MAX_MODEL_LEN_CAP)
    cfg_kwargs = dict(max_num_seqs=args.max_num_seqs, max_model_len=max_len, page_size=args.page_size,
                      prefill_chunk=_prefill_chunk(args, target_dir), attention_impl=args.attention_impl,
                      cache_dtype=args.kv_cache_dtype,
                      kv_cache_bytes=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens,
                      enable_prefix_caching=args.enable_prefix_caching, async_scheduling=args.async_scheduling,
                      compile_in_background=args.compile_in_background,
                      tensor_parallel_size=args.tensor_parallel_size, pack_params=args.pack_params,
                      executable_cache_dir=_executable_cache_dir(args.executable_cache_dir),
                      structured_outputs=speculative and args.structured_outputs,
                      prompt_logprobs=args.enable_prompt_logprobs)
    if speculative:
        cfg_kwargs["num_speculative_tokens"] = args.num_speculative_tokens  # None: the assistant's own
        cfg_kwargs["adaptive_speculation"] = adaptive(args.speculative_k, args.num_speculative_tokens)
    elif args.num_speculative_tokens or args.speculative_k:
        log.warning("--num-speculative-tokens and --speculative-k have no effect without --assistant")
    config = EngineConfig(**cfg_kwargs)
    log.info("engine: max_num_seqs=%d max_model_len=%d page_size=%d batch buckets %s, prefill buckets %s",
             config.max_num_seqs, config.max_model_len, config.page_size, config.batch_buckets(),
             config.prefill_buckets())
    return config


class _CompileAhead(threading.Thread):
    """Compiles, from the checkpoints' shapes, the programs the engine compiles first (`engine.compile_ahead`), while
    the server's thread loads the weights; `programs` then holds them for the engine. Whatever goes wrong here is
    logged and costs nothing else: the engine then compiles those programs itself. Not a daemon: an XLA
    compilation in flight is waited for, not cut (see Engine.close); `stop` keeps it from starting others."""

    def __init__(self, ckpt: str, assistant_path: str | None, dtype: str | None, load_format: str,
                 quantization: tuple[str | None, str | None], config):
        super().__init__(name="gemma4-compile-ahead")
        self.args = ckpt, assistant_path, dtype, load_format, quantization
        self.config = config
        self.stop = threading.Event()
        self.programs: dict = {}

    def run(self) -> None:
        from gemma4_mtp_jax.api import assistant_shapes, target_shapes
        from gemma4_mtp_jax.engine import compile_ahead

        ckpt, assistant_path, dtype, load_format, (quantization, quantization_assistant) = self.args
        t0 = time.perf_counter()
        try:
            target = target_shapes(ckpt, dtype, load_format, quantization)
            assistant = None if assistant_path is None else assistant_shapes(assistant_path, dtype, load_format,
                                                                              quantization_assistant)
            self.programs = compile_ahead(target, self.config, assistant,
                                          lambda prog, s: log.info("compiled ahead %s in %.2fs", prog, s),
                                          stop=self.stop)
        except Exception as e:  # noqa: BLE001 - the engine compiles them instead
            log.warning("compiling ahead of the weights failed (%s: %s); the engine compiles its programs itself",
                        type(e).__name__, e)
            return
        log.info("compiled %d programs ahead of the weights in %.1fs", len(self.programs), time.perf_counter() - t0)


def create_server(argv: Sequence[str] | None = None, args: argparse.Namespace | None = None, job=None):
    """Load, check, compile; returns (OpenAIServer, args). Raises on a bad checkpoint or configuration. `job`: this
    process's part of a multi-process server (multihost.Job), whose processes check each other's flags and KV
    pools here."""
    import jax

    from gemma4_mtp_jax.api import load_assistant, load_target
    from gemma4_mtp_jax.model.config import check_pair
    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.engine.media import MediaEncoder
    from gemma4_mtp_jax.server.app import OpenAIServer, ServerSettings
    from gemma4_mtp_jax.server.async_engine import AsyncEngine, Replicas
    from gemma4_mtp_jax.server.chat import TextTokenizer
    from gemma4_mtp_jax.server.chat_output import OutputParsers
    from gemma4_mtp_jax.server.media import MediaLoader, MediaSettings
    from gemma4_mtp_jax.server.metrics import Metrics

    ap = build_parser()
    if args is None:
        args = ap.parse_args(argv)
    check_args(ap, args)
    t_start = time.perf_counter()
    _set_memory_fraction(args.gpu_memory_utilization)
    log.info("JAX %s on %s", jax.__version__, ", ".join(sorted({str(d.platform) for d in jax.devices()})))
    _setup_compilation_cache(args.compilation_cache_dir)

    ckpt, assistant_path, name = args.ckpt, args.assistant, args.served_model_name
    if ckpt == "demo":
        from gemma4_mtp_jax.weights.demo import demo_pair

        tdir, adir = demo_pair()
        log.info("demo target: %s; demo assistant: %s", tdir, adir)
        ckpt = str(tdir)
        if assistant_path is None:
            assistant_path = str(adir)
        name = name or "gemma4-demo"
    if assistant_path is not None and assistant_path.lower() == "none":
        assistant_path = None
    if job is not None:
        from gemma4_mtp_jax.server import multihost

        for change in multihost.serve_settings(args):
            log.info("multi-process server: %s", change)
        job.check_flags(ap, args, ckpt, assistant_path)
        log.info("process %d of %d: the processes' flags, checkpoints and code agree", job.process_id,
                 job.num_processes)
    dtype = None if args.dtype == "auto" else args.dtype
    # Weights go from host memory to each device, or (packed) to the packed arrays, never whole on a device twice.
    spread = args.tensor_parallel_size * args.data_parallel_size > 1 or args.pack_params
    # Local checkpoints: the engine's settings come from their config.json now, and its first programs compile
    # from the parameters' shapes while the weights load (the engine takes them once it is built).
    local = Path(ckpt).expanduser().is_dir() and (assistant_path is None or Path(assistant_path).expanduser().is_dir())
    config = _engine_config(args, Path(ckpt).expanduser(), assistant_path is not None) if local else None
    ahead = None
    if local and config.executable_cache_dir is not None and not spread:
        log.info("compiling the first programs from the checkpoints' shapes while the weights load")
        ahead = _CompileAhead(ckpt, assistant_path, dtype, args.load_format,
                              (args.quantization, args.quantization_assistant), config)
        ahead.start()

    try:  # a failure or a signal from here on lets the compile-ahead thread start no further program
        with _Timer(f"loading target {ckpt}"):
            target = load_target(ckpt, dtype, args.load_format, on_host=spread, quantization=args.quantization)
        assistant = None
        if assistant_path is not None:
            with _Timer(f"loading assistant {assistant_path}"):
                assistant = load_assistant(assistant_path, dtype, args.load_format, on_host=spread,
                                           quantization=args.quantization_assistant)
            check_pair(target.config, assistant.config)
            log.info("assistant matches the target (K/V geometry, vocabulary, hidden size)")
        name = name or Path(str(target.path)).name or str(args.ckpt)

        tokenizer = None
        if (Path(target.path) / "tokenizer.json").is_file():
            with _Timer("loading tokenizer"):
                tokenizer = TextTokenizer(target.path)
            if tokenizer.chat_template is None:
                log.warning("%s has no chat template: /v1/chat/completions will answer 400", target.path)
        else:
            log.warning("%s has no tokenizer.json: prompts must be token ids, chat is unavailable", target.path)
        # Before compiling: a parser asked for by name that the tokenizer cannot serve is a configuration error.
        parsers = OutputParsers.select(tokenizer, args.tool_call_parser, args.reasoning_parser)
        log.info("chat output parsers: tool calls %s, reasoning %s",
                 "gemma4" if parsers.tool_call_ids is not None else "off",
                 "gemma4" if parsers.reasoning_ids is not None else "off")

        if config is None:
            config = _engine_config(args, Path(target.path), assistant is not None)
        if ahead is not None and ahead.is_alive():
            with _Timer("waiting for the programs compiling ahead"):
                ahead.join()
    except BaseException:
        if ahead is not None:
            ahead.stop.set()
        raise
    done = [0]

    def progress(prog: str, seconds: float) -> None:
        done[0] += 1
        log.info("compiled %s in %.2fs (%d)", prog, seconds, done[0])

    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    devices = jax.devices()
    if tp * dp > len(devices):
        raise ValueError(f"--tensor-parallel-size {tp} x --data-parallel-size {dp} needs {tp * dp} devices; "
                         f"{len(devices)} are visible")
    engines = []
    what = "the smallest buckets' programs" if config.compile_in_background else "all programs"
    try:
        for r in range(dp):
            with _Timer(f"compiling {what}{f' (replica {r})' if dp > 1 else ''}"):
                engines.append(Engine(target, config, progress=progress, assistant=assistant,
                                      devices=devices[r * tp:(r + 1) * tp] if dp > 1 else None,
                                      compiled_ahead=ahead.programs if ahead is not None else None))
    except BaseException:
        # A later replica failed (say, out of device memory): the replicas built so far compile in background
        # threads, which must stop before the interpreter does (else they log "cannot schedule new futures").
        for e in engines:
            e.close()
        raise
    engine = engines[0]
    if job is not None:
        job.check_engine(engine)
    if config.executable_cache_dir:
        log.info("executable cache %s: %d of the %d programs compiled so far loaded from it%s",
                 config.executable_cache_dir,
                 sum(len(e.programs.restored) for e in engines), sum(len(e.compile_times) for e in engines),
                 " or compiled ahead of the weights" if ahead is not None else "")
    if engine.k and config.adaptive_speculation:
        log.info("speculative decoding: on, drafts per round chosen each step among %s",
                 ", ".join(map(str, engine.steps.round_sizes)))
    elif engine.k:
        log.info("speculative decoding: on, %d draft tokens per round", engine.k)

    gen = target.generation_config or {}
    limits = {"max_request_bytes": args.max_request_size, "max_messages": args.max_messages}
    settings = ServerSettings(
        model_name=name,
        max_model_len=config.max_model_len,
        vocab_size=target.config.vocab_size,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        aliases=tuple({str(args.ckpt), str(target.path)} - {name}),
        default_temperature=(1.0 if gen.get("temperature") is None else float(gen["temperature"]))
        if gen.get("do_sample", True) else 0.0,
        default_top_k=int(gen.get("top_k") or 0),
        default_top_p=float(gen.get("top_p") or 1.0),
        num_speculative_tokens=engine.k,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        prompt_logprobs=config.prompt_logprobs,
        media_token_ids=None if target.encoders is None else {"image": target.encoders.config.image_token_id,
                                                              "audio": target.encoders.config.audio_token_id},
        **{k: v for k, v in limits.items() if v is not None},  # flags not given: ServerSettings' defaults
    )
    metrics = Metrics(name)
    aengines = [AsyncEngine(e, max_queue_len=args.max_queue_len, metrics=metrics) for e in engines]
    front = aengines[0] if dp == 1 else Replicas(aengines, metrics)
    media = None
    if target.encoders is not None:
        media = MediaLoader(MediaEncoder(target, args.max_image_tokens),
                            MediaSettings(args.allow_media_fetch, args.media_fetch_timeout_seconds,
                                          args.media_fetch_max_size, args.max_image_tokens))
    server = OpenAIServer(front, tokenizer, settings, metrics, eos_ids=engine.eos_ids, media=media)
    compiled, total = (sum(n) for n in zip(*(e.programs.ready() for e in engines)))
    log.info("ready in %.1fs%s", time.perf_counter() - t_start,
             f" (the other {total - compiled} programs compile in the background)" if compiled < total else "")
    return server, args


def bind_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(addr)
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _is_loopback(sock: socket.socket) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(sock.getsockname()[0]).is_loopback
    except ValueError:
        return False


DRAIN_OVERRUN_S = 5.0  # past the grace period, stop listening even if the engine has not closed every request


def make_uvicorn_server(server, args: argparse.Namespace, job=None):
    import uvicorn

    from gemma4_mtp_jax.server.connection import guarded_h11_protocol

    class _Server(uvicorn.Server):
        """uvicorn, with our shutdown: the first SIGTERM/SIGINT drains while still listening (new generation
        requests get 503, /health says "draining") until nothing is in flight or the grace period is over; then
        uvicorn's own shutdown closes the listener and waits for the last responses. The process exits 0.
        In a multi-process server (`job`), a follower's stop request is such a signal, and a failure of the job ends
        every request with an error and stops at once."""

        drain_until: float | None = None
        failed = False

        def handle_exit(self, sig, frame) -> None:
            name = signal.Signals(sig).name
            if self.drain_until is None:
                self.drain_until = time.monotonic() + args.shutdown_grace_seconds
                log.info("received %s: not accepting new requests; %d in-flight request(s) have %.0fs to finish",
                         name, server.engine.in_flight, args.shutdown_grace_seconds)
                server.begin_drain(args.shutdown_grace_seconds)
            elif not self.should_exit:
                log.info("received %s again: cancelling the %d request(s) still in flight", name,
                         server.engine.in_flight)
                self.drain_until = time.monotonic()
                server.begin_drain(0.0)
            elif sig == signal.SIGINT:  # already stopping, and asked a third time: don't wait for connections
                self.force_exit = True

        async def on_tick(self, counter: int) -> bool:
            if job is not None:
                self.watch_job()
            if self.drain_until is not None and not self.should_exit:
                if server.engine.in_flight == 0 or time.monotonic() > self.drain_until + DRAIN_OVERRUN_S:
                    self.should_exit = True
            return await super().on_tick(counter)

        def watch_job(self) -> None:
            watch = job.watch
            if watch.failure is not None and not self.failed:
                self.failed = self.should_exit = True
                log.error("stopping: %s", watch.failure)
                server.engine.fail_all(watch.failure)
            elif watch.stop_request is not None and self.drain_until is None:
                log.info("%s: stopping the job", watch.stop_request)
                self.handle_exit(signal.SIGTERM, None)

    def count(status: int) -> None:
        server.metrics.requests.labels("other", str(status)).inc()

    config = uvicorn.Config(
        server.app,
        http=guarded_h11_protocol(args.header_timeout_seconds, args.body_timeout_seconds, count,
                                  max_connections(args)),
        log_level=args.log_level,
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=args.shutdown_grace_seconds + 10.0,
        timeout_keep_alive=5,
        lifespan="on",
        loop="asyncio",
    )
    return _Server(config)


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    job = None

    def _stop_during_startup(sig, frame):
        log.info("received %s during start-up: exiting", signal.Signals(sig).name)
        if job is not None:  # the other processes stop too, rather than wait for this one in a collective
            job.exit(0, f"process {job.process_id} received {signal.Signals(sig).name} during start-up")
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop_during_startup)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":
        logging.getLogger("jax").setLevel(logging.WARNING)  # e.g. "Unable to initialize backend 'tpu'"
    from gemma4_mtp_jax.server import multihost

    try:
        job = multihost.start(args)
    except ValueError as e:
        log.error("cannot join the multi-process job: %s", e)
        return 2
    if job is None:
        return _serve(args)
    signal.signal(signal.SIGTERM, _stop_during_startup)  # jax.distributed's preemption notifier took it over
    try:
        return _serve(args, job)
    except BaseException as e:  # noqa: BLE001 - never the interpreter's exit: it would wait for the others
        log.exception("process %d failed", job.process_id)
        job.exit(1, f"process {job.process_id} failed: {type(e).__name__}: {e}")


def _serve(args: argparse.Namespace, job=None) -> int:
    """Start-up and serving, once the process has joined its job (`job`, multihost.Job) if any."""
    from gemma4_mtp_jax.model.config import ConfigError
    from gemma4_mtp_jax.engine import DeviceMemoryError
    from gemma4_mtp_jax.engine.multihost import PeerFailure
    from gemma4_mtp_jax.weights.safetensors_io import CheckpointError

    sock = None
    try:  # claim the address first (a busy port fails now, not after minutes of compiling); listen when ready
        if job is None or job.leader:
            sock = bind_socket(args.host, args.port, listen=False)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, e)
        if job is not None:
            job.exit(2, f"process 0 cannot listen on {args.host}:{args.port}: {e}")
        return 2
    try:
        server, args = create_server(args=args, job=job)
    except (ConfigError, CheckpointError, DeviceMemoryError, OSError, ValueError, PeerFailure) as e:
        if job is not None:
            job.exit(2, f"process {job.process_id} cannot start: {e}")
        log.error("cannot start: %s", e)
        return 2
    if job is not None and not job.leader:
        return job.follow(server.engine.engine)
    if job is not None:
        job.lead(server.engine.engine)
    server.preparer.start()  # a worker process for large request bodies, ready before the first one comes
    sock.listen(2048)
    url = _url(sock)
    log.info("serving '%s' on %s (OpenAI API: %s/v1, health: %s/health, metrics: %s/metrics)%s",
             server.settings.model_name, url, url, url, url, " [API key required]" if server.settings.api_key else "")
    if not server.settings.api_key and not _is_loopback(sock):
        log.warning("listening beyond this machine without --api-key: anyone who can reach %s can use it", url)
    uv = make_uvicorn_server(server, args, job)
    uv.run(sockets=[sock])
    log.info("stopped")
    return 0 if job is None else job.finish()
