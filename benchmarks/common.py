"""Shared pieces of the GPU benchmarks: real Gemma 4 shapes, random weights made on the device, the measured
HBM copy bandwidth, and a timer (warm-up, then the median over repeats)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.steps.device_state import ProcessingRows, StepInputs, StepRows
from gemma4_mtp_jax.model.kv_state import KVLayout, make_layout
from gemma4_mtp_jax.model.sampling import SamplingBatch, SamplingParams, mask_words
from gemma4_mtp_jax.programs.compiled import CompiledSteps, compile_lowered
from gemma4_mtp_jax.weights.dummy import random_params  # noqa: F401 -- the benchmarks' random weights

_S, _F = "sliding_attention", "full_attention"

# Text configs of the released checkpoints (gemma4_architecture.md §6; the 12B's from google/gemma-4-12B-it's
# config.json, a `gemma4_unified` checkpoint), as HF config.json dicts.
TARGETS: dict[str, dict] = {
    "e2b": dict(model_type="gemma4_text", vocab_size=262144, hidden_size=1536, intermediate_size=6144,
                num_hidden_layers=35, layer_types=([_S] * 4 + [_F]) * 7, num_attention_heads=8,
                num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
                hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, num_kv_shared_layers=20,
                use_double_wide_mlp=True, final_logit_softcapping=30.0),
    "e4b": dict(model_type="gemma4_text", vocab_size=262144, hidden_size=2560, intermediate_size=10240,
                num_hidden_layers=42, layer_types=([_S] * 5 + [_F]) * 7, num_attention_heads=8,
                num_key_value_heads=2, head_dim=256, global_head_dim=512, sliding_window=512,
                hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, num_kv_shared_layers=18,
                final_logit_softcapping=30.0),
    "26b": dict(model_type="gemma4_text", vocab_size=262144, hidden_size=2816, intermediate_size=2112,
                num_hidden_layers=30, layer_types=([_S] * 5 + [_F]) * 5, num_attention_heads=16,
                num_key_value_heads=8, num_global_key_value_heads=2, attention_k_eq_v=True, head_dim=256,
                global_head_dim=512, sliding_window=1024, hidden_size_per_layer_input=0, enable_moe_block=True,
                num_experts=128, top_k_experts=8, moe_intermediate_size=704, final_logit_softcapping=30.0),
    "31b": dict(model_type="gemma4_text", vocab_size=262144, hidden_size=5376, intermediate_size=21504,
                num_hidden_layers=60, layer_types=([_S] * 5 + [_F]) * 10, num_attention_heads=32,
                num_key_value_heads=16, num_global_key_value_heads=4, attention_k_eq_v=True, head_dim=256,
                global_head_dim=512, sliding_window=1024, hidden_size_per_layer_input=0,
                final_logit_softcapping=30.0),
    "12b": dict(model_type="gemma4_unified_text", vocab_size=262144, hidden_size=3840, intermediate_size=15360,
                num_hidden_layers=48, layer_types=([_S] * 5 + [_F]) * 8, num_attention_heads=16,
                num_key_value_heads=8, num_global_key_value_heads=1, attention_k_eq_v=True, head_dim=256,
                global_head_dim=512, sliding_window=1024, final_logit_softcapping=30.0),
}


def _assistant(backbone: str, hidden: int, inter: int, heads: int, kv: int, gkv: int | None, k_eq_v: bool,
               window: int, centroids: bool) -> dict:
    """The released assistant of `backbone`, of its target's architecture (the 12B's: gemma4_unified_assistant)."""
    text_type = TARGETS[backbone]["model_type"]
    text = dict(model_type=text_type, vocab_size=262144, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=4, layer_types=[_S, _S, _S, _F], num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=256, global_head_dim=512, attention_k_eq_v=k_eq_v,
                sliding_window=window, num_kv_shared_layers=4, final_logit_softcapping=None)
    if text_type == "gemma4_text":  # the unified text config has no per-layer-input fields
        text.update(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    if gkv is not None:
        text["num_global_key_value_heads"] = gkv
    assistant_type = "gemma4_unified_assistant" if text_type == "gemma4_unified_text" else "gemma4_assistant"
    return dict(model_type=assistant_type, backbone_hidden_size=TARGETS[backbone]["hidden_size"],
                use_ordered_embeddings=centroids, num_centroids=2048, centroid_intermediate_top_k=32,
                text_config=text)


ASSISTANTS: dict[str, dict] = {
    "e2b": _assistant("e2b", 256, 2048, 4, 1, None, False, 512, True),
    "e4b": _assistant("e4b", 256, 2048, 4, 2, None, False, 512, True),
    "26b": _assistant("26b", 1024, 8192, 16, 8, 2, True, 1024, False),
    "31b": _assistant("31b", 1024, 8192, 32, 16, 4, True, 1024, False),
    # google/gemma-4-12B-it-assistant: a dense head, 423 M parameters
    "12b": _assistant("12b", 1024, 8192, 16, 8, 1, True, 1024, False),
}


# Mean acceptance length L (tokens a round emits: accepted drafts + the bonus) per model family and k, greedy, each
# with its source, for projecting a speedup (L x t_decode / t_spec) from step times: random weights accept nothing,
# so a projection borrows L from a measurement of the real pair or a peer's published figure, and never another
# family's (a small target and its assistant agree at other rates than a large one and its own). A family or k
# missing here gets no projection: only the L at which speculation breaks even (t_spec / t_decode).
_31B_RATES = (0.92, 0.78, 0.67, 0.57)  # vLLM, 31B-it and its assistant, per draft position at k = 4
ACCEPTANCE_LENGTHS: dict[str, dict[int, tuple[float, str]]] = {
    "31b": {k: (round(1 + sum(_31B_RATES[:k]), 2),
                "stated: vLLM's per-position acceptance of 31B-it with its assistant at k = 4, 0.92 / 0.78 / 0.67 / "
                "0.57 (a community report, github.com/noonghunna/club-3090/issues/274)"
                + ("" if k == 4 else f"; the first {k} positions")) for k in range(1, 5)},
    "e4b": {2: (2.28, "stated: vLLM's CI test_gemma4_mtp_acceptance_lengths, E4B-it with its assistant, k = 2, "
                      "T = 0, MT-Bench (HumanEval 2.68, GSM8K 2.67)")},
    "demo": {4: (2.94, "measured: benchmarks/acceptance.py --corpus CORPUS --ks 4 --prompts-per-source 32 "
                       "--max-new-tokens 128, the shipped pair (its retrained assistant) in bf16, greedy, held-out "
                       "corpus prompts")},
}


def acceptance_length(model: str, k: int) -> tuple[float, str] | tuple[None, str]:
    """(L, its source) of `model` at k drafts per round (ACCEPTANCE_LENGTHS), or (None, why not)."""
    known = ACCEPTANCE_LENGTHS.get(model, {})
    if k in known:
        return known[k]
    return None, (f"none known for {model} at k = {k}" + (f" (known at k = {sorted(known)})" if known else ""))


def write_random_checkpoint(model: str, root: str) -> tuple[str, str]:
    """config.json of `model`'s target and assistant (TARGETS / ASSISTANTS) under `root`, for a server started with
    --load-format dummy (random weights at the real shapes). Returns (target dir, assistant dir)."""
    dirs = []
    for kind, cfg in (("target", TARGETS[model]), ("assistant", ASSISTANTS[model])):
        d = os.path.join(root, f"{model}_{kind}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**cfg, "dtype": "bfloat16"}, f, indent=1)
        dirs.append(d)
    return dirs[0], dirs[1]


def layout_for(cfg, sequences: int, **geometry) -> KVLayout:
    """A KV layout (`make_layout` geometry) whose pools hold `sequences` sequences of max_model_len each."""
    probe = make_layout(cfg, num_pages={g: 1 << 30 for g in ("sliding_attention", "full_attention")}, **geometry)
    return make_layout(cfg, num_pages={g: sequences * probe.table_width(g) + 1 for g, _ in probe.pages_per_seq},
                       **geometry)


def copy_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written) through a jitted elementwise op."""
    n = int(gib * (1 << 30) / 2)
    x = jax.random.normal(jax.random.PRNGKey(0), (n,), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda a: a * jnp.bfloat16(1.0001))
    t = median_time(f, (x,), repeats=repeats)
    return 2 * x.nbytes / t


def gemv_bandwidth(gib: float = 2.0, repeats: int = 20) -> float:
    """Bytes/s of a bf16 matrix-vector product over a `gib` GiB matrix: a decode step's own read pattern (weights
    streamed once, a few rows of activations), through XLA's own kernel. A step that mostly reads can beat the copy
    roofline (31B's decode did on the H200: docs/PERFORMANCE.md); this is the bar it should be held to."""
    cols = 4096
    rows = int(gib * (1 << 30) / 2 / cols)
    w = jax.random.normal(jax.random.PRNGKey(0), (rows, cols), jnp.float32).astype(jnp.bfloat16)
    x = jnp.ones((cols, 2), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    t = median_time(f, (w, x), repeats=repeats)
    return w.nbytes / t


def lower_program(program: tuple) -> jax.stages.Lowered:
    """A CompiledSteps program ((jitted, abstract args), e.g. `decode_program(B, sampled)`) lowered."""
    jitted, args = program
    return jitted.lower(*args)


def fresh_inputs(tokens: np.ndarray, lengths: np.ndarray, tables: dict[str, np.ndarray], num_slots: int,
                 sampling: SamplingParams | None = None, processed: tuple[int, int] | None = None) -> np.ndarray:
    """A decode or speculative step's packed host inputs (CompiledSteps.inputs) whose rows all bring their token and
    length from the host, never reading what the previous call left in the slots: repeated calls time the same step
    (no sequence grows or stops). Greedy rows unless `sampling` (every row then samples so), no stop ids; tables:
    KV group -> [B, width] page ids. `processed` (vocab size, grammar-masked positions): a processed program's
    inputs, every row also a processing row of `sampling`'s (`SamplingParams.processing_row`, as the engine's
    Runner.step_inputs builds it; its prompt the whole context) with all-allow grammar masks at that many positions
    (1 for the processed decode and speculative programs, k+1 for a masked round's accept)."""
    B = len(tokens)
    rows = StepRows.stack([dict(slot=min(r, num_slots), fresh=True, token=t, length=n, remaining=1 << 20,
                                stop_ids=-1, speculate=True) for r, (t, n) in enumerate(zip(tokens, lengths))], B)
    processing = None
    if processed is not None:
        vocab_size, masked = processed
        params = sampling or SamplingParams()
        processing = ProcessingRows.stack([params.processing_row(int(n)) for n in lengths], B,
                                          (0, masked, mask_words(vocab_size)))
    sampling = SamplingBatch.from_params([sampling] * B if sampling else [], B)
    return CompiledSteps.inputs(StepInputs(rows, tables, sampling, processing))


def compile_concurrently(lowerings: dict[Any, Callable[[], jax.stages.Lowered]],
                         threads: int | None = None) -> dict[Any, tuple[Any, float]]:
    """{key: (compiled, seconds)}: each program lowered in turn (tracing holds the GIL) and compiled in a thread as
    soon as it is lowered (XLA releases the GIL), with the options the engine compiles with, so a benchmark's many
    programs compile in about the time of its slowest few. Seconds: lowering plus compilation, wall time in its
    thread (other compilations run beside it)."""
    def compile_one(lowered, t_lower):
        t0 = time.perf_counter()
        return compile_lowered(lowered), t_lower + time.perf_counter() - t0

    with concurrent.futures.ThreadPoolExecutor(threads or min(len(lowerings), os.cpu_count() or 1) or 1) as pool:
        futures = {}
        for key, lower in lowerings.items():
            t0 = time.perf_counter()
            lowered = lower()
            futures[key] = pool.submit(compile_one, lowered, time.perf_counter() - t0)
        return {key: fut.result() for key, fut in futures.items()}


def median_time(fn: Callable, args: tuple, repeats: int = 20, warmup: int = 3) -> float:
    """Seconds per call: median over `repeats` timed calls after `warmup` calls, each synchronised."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pipelined_time(call: Callable, n: int = 20) -> float:
    """Seconds per call of `n` calls of call() dispatched back to back and waited for once (median of 3 such
    chains), as the engine's async scheduling runs its steps: the device's own time per call, with a call's
    launch and input copies hidden behind the one before. call() returns something to wait for."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def add_format_args(ap) -> None:
    """--quantization and --kv-cache-dtype, each a list: the weight formats and K/V cache dtypes to time in turn
    (the server's flags of the same names; `weights.dummy.random_params` makes the random fp8 weights)."""
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "fp8"],
                    help="target weight formats, each timed in turn (default: none, the checkpoint dtype's)")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "bfloat16", "float32", "fp8"],
                    help="K/V cache dtypes, each timed in turn (default: auto, the activations' dtype)")


def add_pack_params_arg(ap) -> None:
    """--pack-params: the step programs take the target's leaves stacked into a few arrays (EngineConfig.pack_params)."""
    ap.add_argument("--pack-params", action="store_true", help="programs take the target's leaves stacked as rows "
                    "of a few arrays (EngineConfig.pack_params)")


# GPUs whose programs compile here without the GPU: their target description, beside this file.
COMPILE_ONLY_TARGETS = {"h200": "h200.txtpb"}


def compile_only_device(name: str) -> jax.Device:
    """A compile-only device of the GPU `name` (COMPILE_ONLY_TARGETS), to compile that GPU's programs on a machine
    without one. Under `jax.default_device(device)` the package picks the kernels and tilings it would run there
    (kernels/device_budget.py: `target_device`) and XLA compiles for that GPU, Triton's compilation of the Pallas
    kernels included; no program can run. Needs JAX's CUDA plugin of the installed jax (in a venv of its own:
    `pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"`), not a driver. XLA cannot
    autotune without the device, so its GEMMs get its heuristics' tilings."""
    from jax.experimental import topologies

    if name not in COMPILE_ONLY_TARGETS:
        raise ValueError(f"compile_only_device: no target description for {name!r}; known: "
                         f"{sorted(COMPILE_ONLY_TARGETS)}")
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), COMPILE_ONLY_TARGETS[name])) as f:
        config = f.read()
    try:
        topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=config)
    except Exception as e:  # no CUDA plugin: JAX names the platform it cannot find
        raise RuntimeError(f"compile_only_device({name!r}) needs JAX's CUDA plugin (pip install "
                           f"\"jax[cuda12]=={jax.__version__}\"): {e}") from e
    return topology.devices[0]


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_USE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
                        r"|Used (\d+) registers")


def ptxas_report(dump_dir: str) -> dict[str, dict]:
    """Registers and spills of every GPU kernel whose PTX XLA dumped into `dump_dir` (`compile({"xla_dump_to":
    dir})`), by entry name, from `ptxas -v` for the PTX's own target: what a kernel costs in registers is known
    before it runs, so a change that makes one spill shows here, without a GPU. Takes the ptxas of JAX's CUDA
    plugin (nvidia-cuda-nvcc, the one XLA compiles with), else one on PATH. A file ptxas rejects is reported under
    its own name with the error."""
    try:
        import nvidia.cuda_nvcc  # the CUDA plugin's compiler package

        ptxas = os.path.join(list(nvidia.cuda_nvcc.__path__)[0], "bin", "ptxas")
    except ImportError:
        ptxas = shutil.which("ptxas")
    if ptxas is None or not os.path.exists(ptxas):
        raise RuntimeError("ptxas_report needs ptxas: pip install nvidia-cuda-nvcc-cu12, or put it on PATH")
    out: dict[str, dict] = {}
    for name in sorted(os.listdir(dump_dir)):
        if not name.endswith(".ptx"):
            continue
        path = os.path.join(dump_dir, name)
        with open(path) as f:
            ptx = f.read()
        if ".entry" not in ptx:  # XLA writes an empty file for a module part that has no kernel
            continue
        target = re.search(r"^\.target\s+(\w+)", ptx, re.M)
        proc = subprocess.run([ptxas, f"-arch={target.group(1) if target else 'sm_90a'}", "-v", path, "-o",
                               os.devnull], capture_output=True, text=True)
        if proc.returncode:
            out[name] = {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
            continue
        entry = None
        for line in proc.stderr.splitlines():
            m = _PTXAS_ENTRY.search(line)
            if m:
                entry = out.setdefault(m.group(1), {})
                continue
            for u in _PTXAS_USE.finditer(line):
                if entry is None:
                    continue
                if u.group(4):
                    entry["registers"] = int(u.group(4))
                else:
                    entry["stack"], entry["spill_stores"], entry["spill_loads"] = map(int, u.group(1, 2, 3))
    return out


def environment() -> dict:
    info = {"jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    # GIT_COMMIT first: a device call's copy of the tree need not carry the checkout's HEAD
    info["commit"] = os.environ.get("GIT_COMMIT", "")
    if not info["commit"]:
        try:
            info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            check=False).stdout.strip() or "unknown"
        except OSError:
            info["commit"] = "unknown"
    return info


def write_json(name: str, data: Any) -> None:
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, name), "w") as f:
            json.dump(data, f, indent=2, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
