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

log = logging.getLogger("gemma4_mtp_jax.serve")

DEFAULT_MAX_MODEL_LEN_CAP = 8192
API_KEY_ENV = "GEMMA4_MTP_JAX_API_KEY"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default; JAX alone would allow 0.75


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" where the help text doesn't already explain the default."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" in h.lower() or action.default in (None, False, argparse.SUPPRESS):
            return h
        return h + " (default: %(default)s)"


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
               "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """A byte count: a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB, ...), e.g. '8GiB', '512MB'."""
    t = text.strip().upper().replace(" ", "")
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size (a number with an optional unit such as GiB, MB)")
    if unit not in _SIZE_UNITS or not value > 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive size (units: B, KB, MB, GB, KiB, MiB, GiB)")
    return int(value * _SIZE_UNITS[unit])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m gemma4_mtp_jax.serve",
        description="Serve a Gemma 4 checkpoint over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /metrics), with MTP speculative decoding when an "
                    "assistant is given. Loads the model, compiles the smallest buckets' programs, then listens "
                    "while the others compile.",
        formatter_class=_HelpFormatter,
    )
    m = ap.add_argument_group("model")
    m.add_argument("--ckpt", default="demo",
                   help="target checkpoint: a Hugging Face directory, a converted Orbax directory, a hub id, or "
                        "'demo': the small trained demo pair shipped in the package (a 16M-parameter Gemma 4-shaped "
                        "target and its MTP assistant, English text; gemma4_mtp_jax/demo_pair/MODEL_CARD.md)")
    m.add_argument("--assistant", default=None,
                   help="MTP assistant (drafter) checkpoint: directory, Orbax directory or hub id; 'none' to serve "
                        "the target alone. Default: the demo assistant with --ckpt demo, none otherwise")
    m.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="draft tokens per speculative round (default: the assistant's num_assistant_tokens, or 4)")
    m.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="parameter dtype; auto: the checkpoint's")
    m.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: read only config.json (target and assistant) and draw random weights, to time real "
                        "shapes without the checkpoint; its text is gibberish")
    m.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the checkpoint's directory name, "
                        "or 'gemma4-demo')")
    e = ap.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together (largest batch bucket)")
    e.add_argument("--max-model-len", type=int, default=None,
                   help=f"max prompt + generated tokens per request (default: the model's max_position_embeddings, "
                        f"capped at {DEFAULT_MAX_MODEL_LEN_CAP})")
    e.add_argument("--page-size", type=int, default=16, help="KV cache page size in tokens")
    e.add_argument("--kv-cache-memory", type=parse_size, default=None, metavar="SIZE",
                   help="device memory for the KV cache, e.g. 8GiB or 512MiB: every running sequence's sliding-"
                        "window ring (one more with the prefix cache, which keeps a finished prefix's window), the "
                        "rest for full-layer pages taken as sequences grow (the newest are preempted and recomputed "
                        "later when it runs out). Default: enough for --max-num-seqs sequences of --max-model-len")
    e.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="share of each GPU's memory this server may use: weights, KV cache, the programs' "
                        "temporaries (default: $XLA_PYTHON_CLIENT_MEM_FRACTION if set, else "
                        f"{DEFAULT_GPU_MEMORY_UTILIZATION}; JAX's own default is 0.75). Without --kv-cache-memory "
                        "the KV cache takes what is left after the weights and a reserve, up to --max-num-seqs "
                        "sequences of --max-model-len")
    e.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens prefilled per program call "
                                                                   "(largest prefill bucket)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="prompt tokens prefilled per engine step while other sequences decode (default: "
                        "--prefill-chunk): a long prompt delays the running streams by at most N tokens' prefill "
                        "per step")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the K/V of full pages between requests with the same tokens up to that page (a "
                        "chat's earlier turns, a common system prompt); free when unused, since only pages that "
                        "would otherwise sit free stay cached (default: on)")
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="dispatch each engine step before reading the previous one's tokens, so the device never "
                        "waits for the host between steps (default: on)")
    e.add_argument("--compile-in-background", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the smallest batch and prefill buckets' programs, start serving, and compile the "
                        "others in the background; until they are ready, batches and prefill chunks keep to the "
                        "buckets compiled (/health: programs_compiled of programs_total). Serving never waits for a "
                        "compile either way; --no-compile-in-background compiles every program before listening "
                        "(default: on)")
    e.add_argument("--pack-params", action=argparse.BooleanOptionalAction, default=False,
                   help="pass the target's weights to each step stacked as rows of a few arrays instead of one "
                        "array per tensor (each array passed costs the host a few microseconds per step; "
                        "param_pack.py); the weights are then loaded into host memory first (default: off)")
    e.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="devices one engine spans: parameters and KV pages split Megatron-style (N must divide the "
                        "attention heads and the MLP width), one SPMD program per step")
    e.add_argument("--data-parallel-size", type=int, default=1, metavar="M",
                   help="independent engine replicas, each on its own --tensor-parallel-size devices; a request "
                        "goes to the replica with the fewest in flight")
    e.add_argument("--attention-impl", choices=["auto", "pallas", "xla"], default="auto",
                   help="paged attention implementation")
    e.add_argument("--compilation-cache-dir", default=None,
                   help="JAX persistent compilation cache, so restarts skip compiling (default: "
                        "~/.cache/gemma4_mtp_jax/jax_cache, or $JAX_COMPILATION_CACHE_DIR; 'none' disables it)")
    e.add_argument("--executable-cache-dir", default=None, metavar="DIR",
                   help="keep the compiled programs in DIR and load them at the next start without tracing, "
                        "lowering or compiling them (the compilation cache still traces and lowers every program: "
                        "~1 min at 31B); keyed by the package's code, the JAX version, the devices and the engine's "
                        "configuration, at most 4 GiB (the least recently used entries go). Entries are pickles: "
                        "only use a directory you own. Default: ~/.cache/gemma4_mtp_jax/executables; 'none' "
                        "disables it")
    s = ap.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind; use 0.0.0.0 to accept connections from other machines")
    s.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port; the log says which)")
    s.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; unset: no auth)")
    s.add_argument("--max-queue-len", type=int, default=256,
                   help="requests that may wait beyond the --max-num-seqs running ones; past that: 429 with "
                        "Retry-After")
    s.add_argument("--shutdown-grace-seconds", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: refuse new generation requests (503; /health answers 503 'draining'), "
                        "let in-flight requests finish for up to this long, cancel what is left, then stop listening "
                        "and exit 0 (a second signal cancels at once)")
    s.add_argument("--header-timeout-seconds", type=float, default=30.0,
                   help="a request's headers must arrive in full within this long of the connection opening (or of "
                        "their first byte on a kept-alive connection); otherwise 408 and the connection is closed")
    s.add_argument("--body-timeout-seconds", type=float, default=30.0,
                   help="a request's body must arrive in full within this long of its headers; otherwise the "
                        "connection is closed")
    s.add_argument("--max-request-size", type=parse_size, default=None, metavar="SIZE",
                   help="largest request body accepted, e.g. 16MiB or 4MB; a larger one gets 413 (default: 16MiB). "
                        "Bodies over 16 KiB are parsed, rendered and tokenized in worker processes, so a large one "
                        "delays no stream")
    s.add_argument("--max-messages", type=int, default=None, metavar="N",
                   help="messages a chat request may hold; more get 400 (default: 4096)")
    s.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="connections served at once, as uvicorn's --limit-concurrency: a request on a connection "
                        "beyond them gets 503 and the connection is closed. Default: 1024, or twice the requests the "
                        "server holds (--max-num-seqs x --data-parallel-size + --max-queue-len) when that is more")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info", help="log verbosity")
    s.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    return ap


def _check_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.max_num_batched_tokens is not None and a.max_num_batched_tokens < 1:
        ap.error("--max-num-batched-tokens must be >= 1")
    for name in ("max_num_seqs", "page_size", "prefill_chunk"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.tensor_parallel_size < 1 or a.data_parallel_size < 1:
        ap.error("--tensor-parallel-size and --data-parallel-size must be >= 1")
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        ap.error("the server runs in one process (its requests would have to reach every host's engine); for a "
                 "multi-host job use `python -m gemma4_mtp_jax.generate --coordinator-address ...` or the Python API")
    if a.max_model_len is not None and a.max_model_len < 2:
        ap.error("--max-model-len must be >= 2")
    if a.num_speculative_tokens is not None and a.num_speculative_tokens < 1:
        ap.error("--num-speculative-tokens must be >= 1")
    if a.max_queue_len < 0:
        ap.error("--max-queue-len must be >= 0")
    for name in ("max_messages", "max_connections"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.shutdown_grace_seconds < 0:
        ap.error("--shutdown-grace-seconds must be >= 0")
    for name in ("header_timeout_seconds", "body_timeout_seconds"):
        if not getattr(a, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0 <= a.port < 65536:
        ap.error("--port must be in [0, 65535]")
    if a.gpu_memory_utilization is not None and not 0 < a.gpu_memory_utilization <= 1:
        ap.error("--gpu-memory-utilization must be in (0, 1]")


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
                      prefill_chunk=args.prefill_chunk, attention_impl=args.attention_impl,
                      kv_cache_bytes=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens,
                      enable_prefix_caching=args.enable_prefix_caching, async_scheduling=args.async_scheduling,
                      compile_in_background=args.compile_in_background,
                      tensor_parallel_size=args.tensor_parallel_size, pack_params=args.pack_params,
                      executable_cache_dir=_executable_cache_dir(args.executable_cache_dir))
    if speculative:
        cfg_kwargs["num_speculative_tokens"] = args.num_speculative_tokens  # None: the assistant's own
    elif args.num_speculative_tokens:
        log.warning("--num-speculative-tokens has no effect without --assistant")
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

    def __init__(self, ckpt: str, assistant_path: str | None, dtype: str | None, load_format: str, config):
        super().__init__(name="gemma4-compile-ahead")
        self.args = ckpt, assistant_path, dtype, load_format
        self.config = config
        self.stop = threading.Event()
        self.programs: dict = {}

    def run(self) -> None:
        from gemma4_mtp_jax.api import assistant_shapes, target_shapes
        from gemma4_mtp_jax.engine import compile_ahead

        ckpt, assistant_path, dtype, load_format = self.args
        t0 = time.perf_counter()
        try:
            target = target_shapes(ckpt, dtype, load_format)
            assistant = None if assistant_path is None else assistant_shapes(assistant_path, dtype, load_format)
            self.programs = compile_ahead(target, self.config, assistant,
                                          lambda prog, s: log.info("compiled ahead %s in %.2fs", prog, s),
                                          stop=self.stop)
        except Exception as e:  # noqa: BLE001 - the engine compiles them instead
            log.warning("compiling ahead of the weights failed (%s: %s); the engine compiles its programs itself",
                        type(e).__name__, e)
            return
        log.info("compiled %d programs ahead of the weights in %.1fs", len(self.programs), time.perf_counter() - t0)


def create_server(argv: Sequence[str] | None = None, args: argparse.Namespace | None = None):
    """Load, check, compile; returns (OpenAIServer, args). Raises on a bad checkpoint or configuration."""
    import jax

    from gemma4_mtp_jax.api import load_assistant, load_target
    from gemma4_mtp_jax.model.config import check_pair
    from gemma4_mtp_jax.engine import Engine
    from gemma4_mtp_jax.server.app import OpenAIServer, ServerSettings
    from gemma4_mtp_jax.server.async_engine import AsyncEngine, Replicas
    from gemma4_mtp_jax.server.chat import TextTokenizer
    from gemma4_mtp_jax.server.metrics import Metrics

    ap = build_parser()
    if args is None:
        args = ap.parse_args(argv)
    _check_args(ap, args)
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
        ahead = _CompileAhead(ckpt, assistant_path, dtype, args.load_format, config)
        ahead.start()

    try:  # a failure or a signal from here on lets the compile-ahead thread start no further program
        with _Timer(f"loading target {ckpt}"):
            target = load_target(ckpt, dtype, args.load_format, on_host=spread)
        assistant = None
        if assistant_path is not None:
            with _Timer(f"loading assistant {assistant_path}"):
                assistant = load_assistant(assistant_path, dtype, args.load_format, on_host=spread)
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
    if config.executable_cache_dir:
        log.info("executable cache %s: %d of the %d programs compiled so far loaded from it%s",
                 config.executable_cache_dir,
                 sum(len(e.programs.restored) for e in engines), sum(len(e.compile_times) for e in engines),
                 " or compiled ahead of the weights" if ahead is not None else "")
    if engine.k:
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
        **{k: v for k, v in limits.items() if v is not None},  # flags not given: ServerSettings' defaults
    )
    metrics = Metrics(name)
    aengines = [AsyncEngine(e, max_queue_len=args.max_queue_len, metrics=metrics) for e in engines]
    front = aengines[0] if dp == 1 else Replicas(aengines, metrics)
    server = OpenAIServer(front, tokenizer, settings, metrics, eos_ids=engine.eos_ids)
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


def max_connections(args: argparse.Namespace) -> int:
    """--max-connections, or its default: room for every request the server holds (running and queued) twice over,
    for the keep-alive connections of clients' pools, probes and refused requests; at least 1024."""
    if args.max_connections is not None:
        return args.max_connections
    return max(1024, 2 * (args.max_num_seqs * args.data_parallel_size + args.max_queue_len))


DRAIN_OVERRUN_S = 5.0  # past the grace period, stop listening even if the engine has not closed every request


def make_uvicorn_server(server, args: argparse.Namespace):
    import uvicorn

    from gemma4_mtp_jax.server.connection import guarded_h11_protocol

    class _Server(uvicorn.Server):
        """uvicorn, with our shutdown: the first SIGTERM/SIGINT drains while still listening (new generation
        requests get 503, /health says "draining") until nothing is in flight or the grace period is over; then
        uvicorn's own shutdown closes the listener and waits for the last responses. The process exits 0."""

        drain_until: float | None = None

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
            if self.drain_until is not None and not self.should_exit:
                if server.engine.in_flight == 0 or time.monotonic() > self.drain_until + DRAIN_OVERRUN_S:
                    self.should_exit = True
            return await super().on_tick(counter)

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

    def _stop_during_startup(sig, frame):
        log.info("received %s during start-up: exiting", signal.Signals(sig).name)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop_during_startup)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":
        logging.getLogger("jax").setLevel(logging.WARNING)  # e.g. "Unable to initialize backend 'tpu'"
    from gemma4_mtp_jax.model.config import ConfigError
    from gemma4_mtp_jax.engine import DeviceMemoryError
    from gemma4_mtp_jax.weights.safetensors_io import CheckpointError

    try:  # claim the address first (a busy port fails now, not after minutes of compiling); listen when ready
        sock = bind_socket(args.host, args.port, listen=False)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, e)
        return 2
    try:
        server, args = create_server(args=args)
    except (ConfigError, CheckpointError, DeviceMemoryError, OSError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 2
    server.preparer.start()  # a worker process for large request bodies, ready before the first one comes
    sock.listen(2048)
    url = _url(sock)
    log.info("serving '%s' on %s (OpenAI API: %s/v1, health: %s/health, metrics: %s/metrics)%s",
             server.settings.model_name, url, url, url, url, " [API key required]" if server.settings.api_key else "")
    if not server.settings.api_key and not _is_loopback(sock):
        log.warning("listening beyond this machine without --api-key: anyone who can reach %s can use it", url)
    uv = make_uvicorn_server(server, args)
    uv.run(sockets=[sock])
    log.info("stopped")
    return 0
