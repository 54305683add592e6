"""The server's command line: every flag, its default and its checks (`python -m gemma4_mtp_jax.serve --help`)."""

from __future__ import annotations

import argparse

DEFAULT_MAX_MODEL_LEN_CAP = 8192
API_KEY_ENV = "GEMMA4_MTP_JAX_API_KEY"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default; JAX alone would allow 0.75

# The command lines' --speculative-k (serve, generate).
SPECULATIVE_K_CHOICES = ("auto", "fixed")
SPECULATIVE_K_HELP = ("auto: each step's drafts per round chosen among 0, 1, 2, 4, ... up to K from the acceptance "
                      "measured per draft position and each round size's measured step time, so that speculation "
                      "never costs more than it gives (k = 0 where drafts are not accepted); fixed: K drafts every "
                      "round. Default: auto, or fixed when --num-speculative-tokens is given")


def adaptive(speculative_k: str | None, num_speculative_tokens: int | None) -> bool:
    """--speculative-k as EngineConfig.adaptive_speculation: auto unless a fixed K was asked for."""
    return (speculative_k or ("fixed" if num_speculative_tokens is not None else "auto")) == "auto"


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
                   help="draft tokens per speculative round: with --speculative-k fixed, every round's; with auto, "
                        "the most a round drafts (default: the assistant's num_assistant_tokens, or 4)")
    m.add_argument("--speculative-k", choices=SPECULATIVE_K_CHOICES, default=None, help=SPECULATIVE_K_HELP)
    m.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="parameter dtype; auto: the checkpoint's")
    m.add_argument("--quantization", choices=["none", "fp8"], default=None,
                   help="target weights: fp8 (float8_e4m3fn with per-output-channel scales, weight-only: the matmuls "
                        "read fp8 and compute in --dtype; embeddings, norms and the router stay in --dtype), quantized "
                        "at load from a float checkpoint; none: an fp8 checkpoint dequantized to --dtype. Default: "
                        "the checkpoint's own (fp8 for a compressed-tensors FP8 checkpoint or one converted with "
                        "--quantize fp8). fp8 needs a GPU of compute capability 8.9 or newer")
    m.add_argument("--quantization-assistant", choices=["none", "fp8"], default=None,
                   help="the assistant's weights, as --quantization (default: the checkpoint's own, unquantized for "
                        "the released assistants)")
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
    # engine.config.CACHE_DTYPES, written out: this module imports nothing of the engine (`--help` stays quick)
    e.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16", "float32", "fp8"], default="auto",
                   help="dtype of the KV cache's pages; auto: the parameters' dtype. fp8 (float8 e4m3fn) holds half "
                        "a bfloat16 cache's bytes, so twice the tokens, each layer's K and V scaled by a static power "
                        "of two derived from its weights (no calibration); it needs a GPU of compute capability "
                        ">= 8.9 (Ada, Hopper or newer)")
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
    e.add_argument("--structured-outputs", action=argparse.BooleanOptionalAction, default=True,
                   help="with an assistant, speculate for requests with a grammar (response_format json_schema / "
                        "json_object, structured_outputs, a forced tool_choice): two more programs per batch bucket, "
                        "the drafts alone and their verify under the grammar's masks; --no-structured-outputs: such "
                        "requests are served without drafts (default: on)")
    e.add_argument("--enable-prompt-logprobs", action="store_true",
                   help="answer completions' echo with logprobs (each prompt token's logprob, as evaluation "
                        "harnesses score text): one more program per prefill bucket (default: off; such a request "
                        "gets 400)")
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
    s.add_argument("--allow-media-fetch", action="store_true",
                   help="chat image_url parts may be http(s) URLs, which the server fetches (within "
                        "--media-fetch-timeout-seconds and --media-fetch-max-size); without it only data: URLs")
    s.add_argument("--media-fetch-timeout-seconds", type=float, default=10.0,
                   help="with --allow-media-fetch: the time limit of a fetch, from connecting to the last byte")
    s.add_argument("--media-fetch-max-size", type=parse_size, default=20 * 2**20, metavar="SIZE",
                   help="with --allow-media-fetch: the largest image fetched (default: 20MiB)")
    s.add_argument("--max-image-tokens", type=int, default=280, metavar="N",
                   help="soft tokens per image (the image processor's budget: 70, 140, 280, 560 or 1120 for the "
                        "released models; default 280)")
    s.add_argument("--max-messages", type=int, default=None, metavar="N",
                   help="messages a chat request may hold; more get 400 (default: 4096)")
    s.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="connections served at once, as uvicorn's --limit-concurrency: a request on a connection "
                        "beyond them gets 503 and the connection is closed. Default: 1024, or twice the requests the "
                        "server holds (--max-num-seqs x --data-parallel-size + --max-queue-len) when that is more")
    # chat_output.PARSER_CHOICES, written out (`--help` stays quick)
    s.add_argument("--tool-call-parser", choices=["auto", "gemma4", "none"], default="auto",
                   help="how chat outputs become tool_calls for requests with tools: gemma4 (Gemma 4's "
                        "<|tool_call>call:NAME{...}<tool_call|>); auto: gemma4 when the tokenizer has those special "
                        "tokens; none: the output stays content (default: auto)")
    s.add_argument("--reasoning-parser", choices=["auto", "gemma4", "none"], default="auto",
                   help="how chat outputs' thinking becomes reasoning_content: gemma4 (Gemma 4's "
                        "<|channel>thought ...<channel|>); auto: gemma4 when the tokenizer has those special tokens; "
                        "none: the thinking stays in content (default: auto)")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info", help="log verbosity")
    s.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    g = add_multihost_arguments(ap)
    g.add_argument("--peer-timeout-seconds", type=float, default=10.0, metavar="S",
                   help="serve across processes: a process whose heartbeat stops for this long counts as dead; "
                        "every process logs which, process 0 ends its requests with an error, and all exit with "
                        "status 1 (docs/SERVING.md, \"Several hosts\")")
    return ap


def add_multihost_arguments(ap: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The flags that join a job of several processes (engine/distributed.py), as serve and generate take them;
    returns their group."""
    g = ap.add_argument_group("multi-host (jax.distributed)")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's address; every process runs the same command (default: "
                        "$JAX_COORDINATOR_ADDRESS; unset: one process)")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the job ($JAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=None, help="this process's index ($JAX_PROCESS_ID)")
    return g


def check_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.max_num_batched_tokens is not None and a.max_num_batched_tokens < 1:
        ap.error("--max-num-batched-tokens must be >= 1")
    for name in ("max_num_seqs", "page_size", "prefill_chunk"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.tensor_parallel_size < 1 or a.data_parallel_size < 1:
        ap.error("--tensor-parallel-size and --data-parallel-size must be >= 1")
    if not a.peer_timeout_seconds > 0:
        ap.error("--peer-timeout-seconds must be > 0")
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


def max_connections(args: argparse.Namespace) -> int:
    """--max-connections, or its default: room for every request the server holds (running and queued) twice over,
    for the keep-alive connections of clients' pools, probes and refused requests; at least 1024."""
    if args.max_connections is not None:
        return args.max_connections
    return max(1024, 2 * (args.max_num_seqs * args.data_parallel_size + args.max_queue_len))
