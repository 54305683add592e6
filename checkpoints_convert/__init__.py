"""Convert Hugging Face Gemma 4 checkpoints (safetensors) to gemma4_mtp_jax Orbax checkpoints.

Command line: ``python -m checkpoints_convert --hf <dir or hub id> --out <dir> [--dtype ...] [--quantize fp8]
[--force]`` (see ``__main__.py``).  From Python::

    from checkpoints_convert import convert
    summary = convert("path/to/gemma-4-E2B-it", "out/e2b", dtype="bfloat16")

The output directory holds ``params/`` (Orbax), ``gemma4_mtp_jax.json`` (our metadata), the HF
``config.json`` / ``generation_config.json`` and the tokenizer files; ``gemma4_mtp_jax.load_target`` /
``load_assistant`` read it directly.

With ``quantize="fp8"`` (or an fp8 source, e.g. a compressed-tensors FP8 checkpoint) the parameters are stored
quantized (gemma4_mtp_jax/weights/quantize.py: float8_e4m3fn weights, float32 ``<name>_scale`` beside each) and
config.json's ``quantization_config`` says so, so the loaders load it quantized by default.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Callable, Mapping

__all__ = [
    "ConvertError",
    "TARGET_MODEL_TYPES",
    "ASSISTANT_MODEL_TYPES",
    "COPIED_FILES",
    "convert",
    "kind_of_model_type",
    "resolve_source",
]

# The model config's lists (gemma4_mtp_jax/model/config.py), spelled out so that `--help` imports no JAX; a test
# keeps them equal. Gemma 4 and Gemma 4 unified (12B).
TARGET_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")
ASSISTANT_MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
DTYPES = ("bfloat16", "float32")
QUANTIZATIONS = ("none", "fp8")

# Copied verbatim into the output directory when present in the source.
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
)

class ConvertError(ValueError):
    """A user error: bad arguments, missing or unsuitable input, output in the way."""


def kind_of_model_type(model_type: str | None) -> str:
    if model_type in TARGET_MODEL_TYPES:
        return "target"
    if model_type in ASSISTANT_MODEL_TYPES:
        return "assistant"
    expected = ", ".join(TARGET_MODEL_TYPES + ASSISTANT_MODEL_TYPES)
    raise ConvertError(f"config.json model_type {model_type!r} is not a Gemma 4 checkpoint "
                       f"(expected one of: {expected})")


def resolve_source(hf: str, log: Callable[[str], None] = print) -> str:
    """The absolute checkpoint directory `--hf` names, resolved as the loaders resolve it
    (`gemma4_mtp_jax.weights.resolve`): a local directory, or a hub id downloaded first (announced through `log`).
    Every failure is a one-line ConvertError naming --hf."""
    from gemma4_mtp_jax.model.config import ConfigError
    from gemma4_mtp_jax.weights.resolve import hub_id, resolve_checkpoint

    try:
        repo = hub_id(hf)
    except ConfigError as e:
        raise ConvertError(f"--hf {e}") from e
    if repo is not None:
        log(f"[convert] {hf} is not a local directory; fetching it from the Hugging Face hub")
    try:
        return os.path.abspath(resolve_checkpoint(hf))
    except Exception as e:  # the download: network, auth, unknown repo: all user-facing
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConvertError(f"--hf {hf}: no such directory, and downloading it from the hub failed: {msg}") from e


def _read_config(src: str) -> dict:
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{src}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: unreadable: {e}") from e
    if not isinstance(cfg, dict):
        raise ConvertError(f"{path}: not a JSON object")
    return cfg


def _as_nested_dict(params: Any) -> Any:
    """Plain nested dicts from Mapping-like containers (dict, FrozenDict, nnx.State)."""
    to_pure = getattr(params, "to_pure_dict", None)
    if callable(to_pure):
        params = to_pure()
    if isinstance(params, Mapping):
        return {str(k): _as_nested_dict(v) for k, v in params.items()}
    return params


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None:
        return None
    try:
        import numpy as np

        return np.dtype(dtype).name
    except TypeError:
        return None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def convert(
    hf: str,
    out: str,
    *,
    dtype: str | None = None,
    quantize: str | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Convert ``hf`` (local directory or hub id) into an Orbax checkpoint in ``out``.

    ``quantize``: "fp8" stores the weights quantized, "none" an fp8 source dequantized to ``dtype``; None keeps
    the source's own (the loaders' ``quantization``). Returns a summary dict (kind, model_type, quantization,
    num_tensors, num_bytes, seconds, out).  Raises :class:`ConvertError` (or ``CheckpointError``) for user errors.
    """
    t_start = time.perf_counter()
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ConvertError(f"--quantize {quantize}: expected one of {', '.join(QUANTIZATIONS)}")
    src = resolve_source(hf, log)
    out_abs = os.path.abspath(os.path.expanduser(out))
    if out_abs == src:
        raise ConvertError(f"--out {out}: is the source directory itself")
    if os.path.exists(out_abs) and not os.path.isdir(out_abs):
        raise ConvertError(f"--out {out}: exists and is not a directory")
    if os.path.isdir(out_abs) and os.listdir(out_abs) and not force:
        raise ConvertError(f"--out {out}: directory exists and is not empty (pass --force to overwrite)")

    cfg = _read_config(src)
    model_type = cfg.get("model_type")
    kind = kind_of_model_type(model_type)

    # Imported here so `--help` and argument errors stay fast.
    from gemma4_mtp_jax.weights.orbax_io import is_orbax_checkpoint, save_params
    from gemma4_mtp_jax.weights.safetensors_io import SafetensorsCheckpoint

    if is_orbax_checkpoint(src):
        raise ConvertError(f"--hf {hf}: is already a converted gemma4_mtp_jax checkpoint")
    with SafetensorsCheckpoint(src) as st:  # header check only: fails early on missing/corrupt files
        n_src, bytes_src = len(st), st.total_bytes()
    log(
        f"[convert] {kind} ({model_type}) from {src}: {n_src} tensors, {_human(bytes_src)} in "
        f"safetensors; dtype {dtype or 'default'}; quantization {quantize or 'as the source'}"
    )

    import gemma4_mtp_jax
    from gemma4_mtp_jax.weights.quantize import is_quantized_tree, own_quantization_config

    loader = gemma4_mtp_jax.load_target if kind == "target" else gemma4_mtp_jax.load_assistant
    t0 = time.perf_counter()
    kwargs = {} if dtype is None else {"dtype": dtype}
    # host arrays: conversion never needs an accelerator (fp8 ones are quantized by numpy, tensor by tensor)
    model = loader(src, on_host=True, quantization=quantize, **kwargs)
    params = _as_nested_dict(model.params)
    if not isinstance(params, dict):
        raise TypeError(f"loader returned params of type {type(model.params).__name__}, expected a nested dict")
    encoders = getattr(model, "encoders", None)
    if encoders is not None:  # a multimodal target's towers / embedders: one subtree beside the text weights
        from gemma4_mtp_jax.api import ENCODERS_KEY

        params[ENCODERS_KEY] = _as_nested_dict(encoders.params)
    log(f"[convert] loaded in {time.perf_counter() - t0:.1f} s")

    t0 = time.perf_counter()
    log(f"[convert] writing Orbax checkpoint to {out_abs}")
    quantization = "fp8" if is_quantized_tree(params) else None
    metadata: dict[str, Any] = {"kind": kind, "model_type": model_type, "source": hf, "quantization": quantization}
    dtype_name = dtype or _dtype_name(getattr(model, "dtype", None))
    if dtype_name is not None:
        metadata["dtype"] = dtype_name  # read back by the loader as the checkpoint's own dtype
    written = save_params(out_abs, params, metadata=metadata, force=force)
    log(f"[convert] saved in {time.perf_counter() - t0:.1f} s")

    copied = []
    for name in COPIED_FILES:
        p = os.path.join(src, name)
        if not os.path.isfile(p):
            continue
        if name == "config.json" and (quantization is not None or "quantization_config" in cfg):
            # What the parameters are now: our fp8 format, or (dequantized) no quantization at all.
            out_cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
            if quantization is not None:
                out_cfg["quantization_config"] = own_quantization_config()
            with open(os.path.join(out_abs, name), "w", encoding="utf-8") as f:
                json.dump(out_cfg, f, indent=2)
                f.write("\n")
        else:
            shutil.copyfile(p, os.path.join(out_abs, name))
        copied.append(name)
    log(f"[convert] copied {', '.join(copied)}")

    summary = {
        "kind": kind,
        "model_type": model_type,
        "quantization": quantization,
        "dtype": written.get("dtype"),
        "num_tensors": written["num_tensors"],
        "num_bytes": written["num_bytes"],
        "seconds": time.perf_counter() - t_start,
        "out": out_abs,
        "copied": copied,
    }
    log(
        f"[convert] done: {summary['num_tensors']} tensors, {_human(summary['num_bytes'])} "
        f"({summary['dtype']}) in {summary['seconds']:.1f} s -> {out_abs}"
    )
    return summary
