"""The small public API research scripts and tests use: load models, run the target, run a draft step.

The loader façade: it reads checkpoints into the runtime's `Target` / `Assistant` (defined in `runtime.py`, below the
engine, and re-exported here), so that nothing on the serving path imports the checkpoint readers."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.kernels.dense_attention import image_runs
from gemma4_mtp_jax.kernels.device_budget import check_fp8_support
from gemma4_mtp_jax.model.config import (
    AssistantConfig,
    ConfigError,
    TextConfig,
    check_pair,
    parse_assistant_config,
    parse_target_config,
    read_config_json,
)
from gemma4_mtp_jax.model.assistant import Gemma4Assistant
from gemma4_mtp_jax.model.attention import DenseKV, DraftKV
from gemma4_mtp_jax.model.encoders import Gemma4Encoders, example_inputs
from gemma4_mtp_jax.model.media_config import MediaConfig, parse_media_config
from gemma4_mtp_jax.model.multimodal import check_counts, merge_soft_tokens, text_tokens, vision_tokens
from gemma4_mtp_jax.model.target import Gemma4Target
from gemma4_mtp_jax.model.runtime import Assistant, Encoders, Target
from gemma4_mtp_jax.weights import hf_loader, orbax_io, quantize
from gemma4_mtp_jax.weights.dummy import random_params
from gemma4_mtp_jax.weights.resolve import resolve_checkpoint

__all__ = [
    "Assistant",
    "DraftOutput",
    "Encoders",
    "Target",
    "TargetOutput",
    "abstract_assistant_params",
    "abstract_target_params",
    "draft_step",
    "load_assistant",
    "load_target",
    "multimodal_forward",
    "target_forward",
]

Array = jax.Array
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
LOAD_FORMATS = ("auto", "dummy")


@dataclasses.dataclass
class TargetOutput:
    logits: Array  # [B, T, V], softcapped
    hidden: Array  # [B, T, H], after the final norm (what the assistant's first step reads)
    store_kv: dict[str, tuple[Array, Array]]  # layer type -> (K, V) [B, T, nKV, D] of the store layers


@dataclasses.dataclass
class DraftOutput:
    logits: Array  # [B, V]
    h_next: Array  # [B, Hb], the post_projection output fed to the next draft step
    hidden: Array  # [B, Ha], the normed draft hidden the logits come from


def _dtype(dtype: str | Any | None, d: Path, cfg_json: dict) -> Any:
    if dtype is None:
        if orbax_io.is_orbax_checkpoint(d):
            dtype = orbax_io.read_metadata(d).get("dtype", "bfloat16")
        else:
            dtype = cfg_json.get("dtype") or cfg_json.get("torch_dtype") or "bfloat16"
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype '{dtype}' is not supported (choose from {sorted(_DTYPES)})")
        return _DTYPES[dtype]
    return jnp.dtype(dtype).type


def _generation_config(d: Path) -> dict:
    p = d / "generation_config.json"
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: invalid JSON ({e})") from None


# The key of a converted target's media encoders in its Orbax tree, beside the text model's parameters (whose top-level
# names are `embed_tokens`, `layers_{i}`, `norm` and the per-layer embeddings').
ENCODERS_KEY = "encoders"


def _restore_orbax(d: Path, kind: str, abstract: Any, dtype: Any,
                   encoders_abstract: Any = None) -> tuple[dict, dict | None]:
    """The converted checkpoint's parameters as the model expects them (`abstract`): leaf by leaf onto the default
    device, fp8 leaves as stored, quantized or dequantized where the checkpoint and the model differ; and its
    media encoders' (None where it has none, or `encoders_abstract` is None)."""
    meta = orbax_io.read_metadata(d)
    if meta.get("kind") != kind:
        raise ConfigError(f"{d}: Orbax checkpoint holds a '{meta.get('kind')}', expected a '{kind}'")
    params, _ = orbax_io.restore_params(d)
    encoders = params.pop(ENCODERS_KEY, None)
    if encoders is not None and encoders_abstract is not None:
        encoders = _as_model_params(d, encoders, encoders_abstract, dtype)
    return _as_model_params(d, params, abstract, dtype), (encoders if encoders_abstract is not None else None)


def _as_model_params(d: Path, params: dict, abstract: Any, dtype: Any) -> dict:
    """Restored host arrays -> the parameter tree `abstract` describes, checked name by name and shape by shape."""
    want = hf_loader.flatten_shapes(abstract)
    got = hf_loader.flatten_shapes(params)
    weights = lambda names: {n for n in names if not quantize.is_scale(n)}  # noqa: E731
    if weights(want) != weights(got):
        diff = sorted(weights(want) ^ weights(got))
        raise ConfigError(f"{d}: Orbax parameters do not match config.json (first difference: '{diff[0]}')")
    out = {}
    for name in sorted(weights(got)):
        leaf, spath = got.pop(name), quantize.scale_path(name)
        if tuple(leaf.shape) != tuple(want[name].shape):
            raise ConfigError(f"{d}: parameter '{name}' has shape {tuple(leaf.shape)}, "
                              f"config implies {want[name].shape}")
        if jnp.issubdtype(want[name].dtype, jnp.integer):
            out[name] = jnp.asarray(leaf, jnp.int32)
            continue
        scale = got.pop(spath, None)
        if (np.dtype(leaf.dtype) == quantize.FP8) != (scale is not None):
            raise ConfigError(f"{d}: parameter '{name}' is {leaf.dtype} " + (
                f"with a scale '{spath}'" if scale is not None else f"without its scale '{spath}'"))
        if scale is not None and tuple(scale.shape) != tuple(leaf.shape[:-1]):
            raise ConfigError(f"{d}: parameter '{spath}' has shape {tuple(scale.shape)}, its weight "
                              f"{tuple(leaf.shape)} implies {tuple(leaf.shape[:-1])}")
        out[name], s = quantize.as_param(leaf, scale, quantized=spath in want, dtype=dtype, on_host=False)
        if s is not None:
            out[spath] = s
    return hf_loader.unflatten(out)


def abstract_target_params(cfg: TextConfig, dtype: Any) -> dict:
    """Shapes and dtypes of every target parameter (no memory allocated)."""
    module = Gemma4Target(cfg, dtype)
    one = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), one, one))["params"]


def abstract_encoder_params(cfg: MediaConfig, dtype: Any) -> dict:
    """Shapes and dtypes of every media encoder parameter (no memory allocated)."""
    module = Gemma4Encoders(cfg, dtype)
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), **example_inputs(cfg)))["params"]


def abstract_assistant_params(cfg: AssistantConfig, dtype: Any) -> dict:
    """Shapes and dtypes of every assistant parameter (no memory allocated)."""
    module = Gemma4Assistant(cfg, dtype)
    H = cfg.backbone_hidden_size
    kv = {i: (jnp.zeros((1, 1, *cfg.text.kv_geometry(t)), dtype),) * 2 for i, t in enumerate(cfg.text.layer_types)}
    return jax.eval_shape(
        lambda: module.init(
            jax.random.PRNGKey(0),
            jnp.zeros((1, H), dtype),
            jnp.zeros((1, H), dtype),
            DraftKV(kv, jnp.ones((1,), jnp.int32)),
            method=lambda m, e, h, kv: m.logits(m(e, h, kv)[0]),
        )
    )["params"]


def _check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")


def _checkpoint_shapes(path_or_id: str | os.PathLike, dtype: str | Any | None, load_format: str,
                       kind: str, quantization: str | None) -> tuple[Path, Any, Any, dict]:
    """(directory, config, dtype, parameter shapes) of a target or assistant checkpoint: its JSON files alone. The
    shapes are the fp8 model's (weights.quantize) when `quantization` is "fp8", or None and config.json declares
    fp8 weights."""
    _check_load_format(load_format)
    quantize.check_quantization(quantization)
    d = resolve_checkpoint(path_or_id) if load_format == "auto" else Path(path_or_id)
    cfg_json = read_config_json(d)
    dt = _dtype(dtype, d, cfg_json)
    where = str(d / "config.json")
    if kind == "target":
        cfg = parse_target_config(cfg_json, where)
        abstract = abstract_target_params(cfg, dt)
    else:
        cfg = parse_assistant_config(cfg_json, where)
        abstract = abstract_assistant_params(cfg, dt)
    if quantize.resolve(quantization, quantize.checkpoint_quantization(cfg_json, where)) == "fp8":
        abstract = quantize.quantize_abstract(abstract)
    return d, cfg, dt, abstract


def target_shapes(path_or_id: str | os.PathLike, dtype: str | Any | None = None,
                  load_format: str = "auto", quantization: str | None = None) -> Target:
    """The Target that `load_target` gives for these arguments, its parameters shapes alone (jax.ShapeDtypeStruct):
    only the JSON files are read. An engine compiles for it while the weights load (`engine.compile_ahead`)."""
    d, cfg, dt, abstract = _checkpoint_shapes(path_or_id, dtype, load_format, "target", quantization)
    return Target(cfg, abstract, dt, d, _generation_config(d))


def assistant_shapes(path_or_id: str | os.PathLike, dtype: str | Any | None = None,
                     load_format: str = "auto", quantization: str | None = None) -> Assistant:
    """`target_shapes` for an assistant (`load_assistant`)."""
    d, cfg, dt, abstract = _checkpoint_shapes(path_or_id, dtype, load_format, "assistant", quantization)
    return Assistant(cfg, abstract, dt, d, _generation_config(d))


def _load_params(kind: str, d: Path, cfg: Any, abstract: Any, dt: Any, load_format: str, on_host: bool) -> dict:
    if quantize.is_quantized_tree(abstract) and not on_host:
        check_fp8_support(jax.devices()[:1])  # the weights go to the default device now (on_host: the engine's)
    if load_format == "dummy":
        return random_params(abstract, seed=0 if kind == "target" else 1)
    if orbax_io.is_orbax_checkpoint(d):
        return _restore_orbax(d, kind, abstract, dt)[0]
    load = hf_loader.load_target_params if kind == "target" else hf_loader.load_assistant_params
    return load(str(d), cfg, abstract, dt, on_host)


def load_target(path_or_id: str | os.PathLike, dtype: str | Any | None = None, load_format: str = "auto",
                on_host: bool = False, quantization: str | None = None) -> Target:
    """Load a Gemma 4 target from a HF directory (`gemma4` or `gemma4_text`; the unified 12B's `gemma4_unified` or
    `gemma4_unified_text`: the text weights of a multimodal checkpoint), a converted Orbax directory, or a hub id.

    dtype: "float32" | "bfloat16" | None (None: the checkpoint's own dtype). load_format "dummy": only config.json
    is read, the weights are random (timing real shapes without the checkpoint). on_host: keep the safetensors
    weights in host memory, so that an engine over several devices puts each tensor straight onto its shards
    instead of through a full copy on one device.

    quantization: None (the checkpoint's own: fp8 for a checkpoint whose config.json declares fp8 weights, as
    compressed-tensors' FP8-dynamic ones or our converter's), "fp8" (weight-only fp8, a float checkpoint quantized
    at load, tensor by tensor) or "none" (an fp8 checkpoint dequantized to `dtype`). See weights/quantize.py.
    """
    d, cfg, dt, abstract = _checkpoint_shapes(path_or_id, dtype, load_format, "target", quantization)
    media = parse_media_config(read_config_json(d), str(d / "config.json"))
    media_abstract = None if media is None else abstract_encoder_params(media, dt)
    if load_format == "auto" and orbax_io.is_orbax_checkpoint(d):  # one restore for both trees
        params, encoders = _restore_orbax(d, "target", abstract, dt, media_abstract)
    else:
        params = _load_params("target", d, cfg, abstract, dt, load_format, on_host)
        encoders = None if media is None else _load_encoders(d, media, media_abstract, dt, load_format, on_host)
    return Target(cfg, params, dt, d, _generation_config(d),
                  None if encoders is None else Encoders(media, encoders, dt))


def _load_encoders(d: Path, media: MediaConfig, abstract: Any, dtype: Any, load_format: str,
                   on_host: bool) -> dict | None:
    """The media encoders' parameters of a safetensors checkpoint whose config.json declares some, when it holds
    their tensors (a multimodal config over text weights alone is served as text), or random ones (dummy)."""
    if load_format == "dummy":
        return random_params(abstract, seed=2)
    if not hf_loader.has_encoder_tensors(str(d)):
        return None
    return hf_loader.load_encoder_params(str(d), media, abstract, dtype, on_host)


def load_assistant(path_or_id: str | os.PathLike, dtype: str | Any | None = None,
                   load_format: str = "auto", on_host: bool = False, quantization: str | None = None) -> Assistant:
    """Load a Gemma 4 assistant (`gemma4_assistant`, `gemma4_unified_assistant`) from a HF directory, a converted
    Orbax directory, or a hub id
    (load_format, on_host and quantization as `load_target`'s)."""
    d, cfg, dt, abstract = _checkpoint_shapes(path_or_id, dtype, load_format, "assistant", quantization)
    params = _load_params("assistant", d, cfg, abstract, dt, load_format, on_host)
    return Assistant(cfg, params, dt, d, _generation_config(d))


def target_forward(target: Target, tokens: Any, positions: Any = None) -> TargetOutput:
    """Full-sequence forward. tokens: int [B, T]; positions: int [B, T] (default 0..T-1)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, length], got shape {tokens.shape}")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, hidden, kv = target._forward(target.params, tokens, jnp.asarray(positions, jnp.int32))
    store = {t: kv.layers[i] for t, i in target.config.store_layers.items()}
    return TargetOutput(logits, hidden, store)


def draft_step(
    assistant: Assistant,
    target: Target,
    tokens: Any,
    hidden: Any,
    kv: dict[str, tuple[Any, Any]],
    kv_lengths: Any,
) -> DraftOutput:
    """One assistant step for a batch of sequences.

    tokens [B]: the newest token (the bonus token in round 1, then the previous draft); hidden [B, Hb]: the
    target's post-norm hidden at P-1 (step 1) or the previous step's `h_next`; kv: layer type -> (K, V)
    [B, S, nKV, D] of the target's store layers, key j at position j; kv_lengths [B]: P, the committed tokens.
    The query sits at position P; full layers see keys 0..P-1, sliding layers P-1-W..P-1.
    """
    check_pair(target.config, assistant.config)
    tokens = jnp.asarray(tokens, jnp.int32)
    embedding = target._embed(target.params, tokens)
    by_layer = {i: tuple(jnp.asarray(a, assistant.dtype) for a in kv[t])
                for i, t in enumerate(assistant.config.text.layer_types)}
    lengths = jnp.asarray(kv_lengths, jnp.int32)
    logits, h_next, hn = assistant._step(assistant.params, embedding, jnp.asarray(hidden), by_layer, lengths)
    return DraftOutput(logits, h_next, hn)


def multimodal_forward(target: Target, tokens: Any, *, pixels: Any = None, pixel_positions: Any = None,
                       audio_features: Any = None, audio_mask: Any = None, positions: Any = None) -> TargetOutput:
    """Full-sequence forward over a prompt with media (the non-paged reference path), as transformers'
    `...ForConditionalGeneration` runs it: the encoders' soft tokens replace the prompt's placeholders, and an
    image's soft tokens attend to each other where the model says so (`TextConfig.image_attention`).

    tokens [B, T] with the placeholders already expanded (`media.placeholders.expand_placeholders`); pixels
    [n, N, 3 p^2] and pixel_positions [n, N, 2] (`media.image_processing`), one row per image in prompt order;
    audio_features [m, F, bins] and audio_mask [m, F] (`media.audio_features`), one row per clip."""
    enc = target.encoders
    if enc is None:
        raise ValueError(f"{target.path}: the checkpoint has no media encoders")
    cfg = enc.config
    tokens_np = np.asarray(tokens, np.int32)
    if tokens_np.ndim != 2:
        raise ValueError(f"tokens must be [batch, length], got shape {tokens_np.shape}")
    tokens = jnp.asarray(tokens_np)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    positions = jnp.asarray(positions, jnp.int32)
    ids = text_tokens(tokens, cfg)
    embeds = target._embed(target.params, ids)
    for what, token_id, inputs, encode in (("image", cfg.image_token_id, (pixels, pixel_positions), enc._image),
                                           ("audio", cfg.audio_token_id, (audio_features, audio_mask), enc._audio)):
        if inputs[0] is None:
            check_counts(tokens_np, token_id, np.zeros(0, bool), what)
            continue
        soft, valid = encode(enc.params, *(jnp.asarray(a) for a in inputs))
        check_counts(tokens_np, token_id, np.asarray(valid), what)
        embeds = merge_soft_tokens(embeds, tokens, token_id, soft, valid)
    kv = DenseKV(positions, runs=image_runs(vision_tokens(tokens, cfg), positions),
                 image_attention=target.config.image_attention)
    logits, hidden, kv = target._forward_embeds(target.params, ids, positions, embeds, kv)
    store = {t: kv.layers[i] for t, i in target.config.store_layers.items()}
    return TargetOutput(logits, hidden, store)
