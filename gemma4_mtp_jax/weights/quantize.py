"""fp8 weights: which parameters are quantized, how, and how a checkpoint's tensors become them.

Weight-only float8_e4m3fn with one float32 scale per output channel: w[..., o, i] ~ weight[..., o, i] * scale[..., o].
A quantized projection keeps its `weight` (float8_e4m3fn, the same [out, in] layout) and gains a sibling parameter
`weight_scale` (float32 [out]); the MoE experts' `gate_up_proj` [E, 2Im, H] and `down_proj` [E, H, Im] gain
`gate_up_proj_scale` [E, 2Im] and `down_proj_scale` [E, H]. The names follow compressed-tensors' (`<module>.weight`
and `<module>.weight_scale`, whose per-channel scale is [out, 1]), so a checkpoint's scale sits where ours does.

The modules find a scale by its presence (model/layers.py), so `init` and the abstract shapes stay unquantized and
quantization is a transform of the parameter tree, leaf by leaf (`quantize_abstract`, `quantize_params`). One rule,
`is_quantized`, says which leaves: every projection a matmul reads (attention, MLP, the per-layer-input
projections, the assistant's pre/post projections) and the MoE experts. Embeddings (the tied LM head with them), the
centroid head, norms, scalars and the router stay in the model's dtype.

What a checkpoint holds need not match: `as_param` turns each of its weights into the model's leaf, reading an fp8
weight as stored, quantizing a float one at load (e.g. the MoE experts, which compressed-tensors' `Linear` targets
skip) and dequantizing an fp8 one where the model keeps the leaf unquantized.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from gemma4_mtp_jax.weights.safetensors_io import CheckpointError

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448: past it the cast gives NaN (no infinity)
SCALE_SUFFIX = "_scale"
QUANTIZATIONS = ("none", "fp8")
# Our converter's mark in a converted checkpoint's config.json (`quantization_config`).
OWN_METHOD = "gemma4_mtp_jax"

# The quantized leaves, by dotted parameter path (`layers_3.mlp.up_proj.weight`).
_QUANTIZED = re.compile(
    r"(^|\.)((q|k|v|o|gate|up|down)_proj|per_layer_(model_projection|input_gate|projection)|(pre|post)_projection)"
    r"\.weight$"
    r"|(^|\.)experts\.(gate_up_proj|down_proj)$")


class QuantizationError(ValueError):
    """A checkpoint's quantization (config.json's `quantization_config`) this package does not read."""


def is_quantized(path: str) -> bool:
    """Whether the parameter at dotted `path` is stored as fp8 in a quantized model."""
    return bool(_QUANTIZED.search(path))


def scale_path(path: str) -> str:
    """The path (or checkpoint name) of the scale of the weight at `path`: `...weight` -> `...weight_scale`."""
    return path + SCALE_SUFFIX


def is_scale(path: str) -> bool:
    """Whether `path` is the scale of a quantized leaf."""
    return path.endswith(SCALE_SUFFIX) and is_quantized(path[: -len(SCALE_SUFFIX)])


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None (the checkpoint's own), "
                         f"got {quantization!r}")


# ----------------------------------------------------------------------------------------------------------
# The arithmetic
# ----------------------------------------------------------------------------------------------------------


def _quantize_np(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    w = w.astype(np.float32)  # exact for bfloat16 / float16 weights
    scale = np.max(np.abs(w), axis=axis) / np.float32(FP8_MAX)
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)  # an all-zero row: 0 / 1, no 0 / 0
    q = np.clip(w / np.expand_dims(scale, axis), -FP8_MAX, FP8_MAX)  # the division may round past 448
    return q.astype(FP8), scale


@functools.partial(jax.jit, static_argnums=1)
def _quantize_jax(w: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """`_quantize_np` in XLA. XLA turns a division by a broadcast (or a constant) into a product with the rounded
    reciprocal, one ulp from the division numpy (and compressed-tensors' quantizer) compute: each divisor is
    materialized behind an optimization barrier, so the divisions stay divisions."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=axis)
    scale = amax / jax.lax.optimization_barrier(jnp.full_like(amax, FP8_MAX))
    scale = jnp.where(scale > 0, scale, 1.0)
    divisor = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.expand_dims(scale, axis), w.shape))
    return jnp.clip(w / divisor, -FP8_MAX, FP8_MAX).astype(FP8), scale


def _host_backend() -> jax.Device | None:
    """JAX's CPU device, None where the process runs without the CPU backend (JAX_PLATFORMS=cuda)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def quantize_fp8(w: Any, axis: int = -1) -> tuple[Any, Any]:
    """(q float8_e4m3fn, scale float32) with w ~ q * scale: one scale per slice along `axis` (the contraction, so
    one per output channel), amax / 448, with float32 divisions rounded correctly and round-to-nearest-even to fp8,
    as compressed-tensors' quantizer rounds. A numpy array is quantized on the host, numpy in and out: by XLA on the
    CPU (all cores; numpy's own arithmetic where JAX has no CPU backend). Anything else is quantized by XLA on its
    device, where a GPU's float32 division may round an ulp away: the loaders quantize checkpoints on the host."""
    if isinstance(w, np.ndarray):
        cpu = _host_backend()
        if cpu is None:
            return _quantize_np(w, axis)
        q, scale = _quantize_jax(jax.device_put(w, cpu), axis)
        return np.asarray(q), np.asarray(scale)
    return _quantize_jax(jnp.asarray(w), axis)


def dequantize(q: Any, scale: Any, dtype: Any) -> Any:
    """q * scale[..., None] in float32, rounded once to `dtype` (numpy in, numpy out)."""
    xp = np if isinstance(q, np.ndarray) else jnp
    return (q.astype(np.float32) * xp.asarray(scale, np.float32)[..., None]).astype(dtype)


# ----------------------------------------------------------------------------------------------------------
# Parameter trees
# ----------------------------------------------------------------------------------------------------------


def _map_quantized(tree: dict, leaf_fn, prefix: str = "") -> dict:
    """A copy of a nested dict with each quantized leaf replaced by leaf_fn(leaf) = (weight, scale) and its scale
    added beside it."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out[key] = _map_quantized(value, leaf_fn, path + ".")
        elif is_quantized(path):
            out[key], out[key + SCALE_SUFFIX] = leaf_fn(value)
        else:
            out[key] = value
    return out


def quantize_abstract(abstract: Any) -> dict:
    """The shapes of the quantized model from the unquantized one's (jax.ShapeDtypeStruct leaves)."""
    return _map_quantized(dict(abstract), lambda a: (jax.ShapeDtypeStruct(a.shape, FP8),
                                                     jax.ShapeDtypeStruct(a.shape[:-1], jnp.float32)))


def quantize_params(params: Any) -> dict:
    """The quantized model's parameters from an unquantized tree (each quantized leaf on its own device, or on the
    host for numpy leaves); the other leaves are the same arrays."""
    return _map_quantized(dict(params), quantize_fp8)


def is_quantized_tree(params: Any) -> bool:
    """Whether a parameter tree holds fp8 leaves."""
    return any(jnp.dtype(leaf.dtype) == FP8 for leaf in jax.tree_util.tree_leaves(params))


# ----------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------


def as_param(weight: Any, scale: Any | None, *, quantized: bool, dtype: Any, on_host: bool) -> tuple[Any, Any]:
    """(the model's leaf, its scale or None) from a checkpoint's `weight` (numpy; float, or float8_e4m3fn with its
    float32 `scale` [..., out]): fp8 read as stored where the model quantizes the leaf, a float weight quantized
    here, an fp8 one dequantized to `dtype` where the model keeps it; on the default device, or with `on_host` as
    host arrays."""
    fp8 = np.dtype(weight.dtype) == FP8
    if quantized and not fp8:
        weight, scale = quantize_fp8(np.asarray(weight))  # on the host: the same fp8 values on every device
        fp8 = True
    if not on_host:
        weight = jnp.asarray(weight)
        scale = None if scale is None else jnp.asarray(scale)
    if quantized:
        return weight, scale
    return (dequantize(weight, scale, dtype) if fp8 else weight.astype(np.dtype(dtype))), None


def checkpoint_scale(scale: np.ndarray, weight_shape: tuple[int, ...], name: str, weight_name: str) -> np.ndarray:
    """A checkpoint's scale of the fp8 tensor `weight_name` as float32 [..., out]: per output channel ([..., out] or
    compressed-tensors' [..., out, 1]) or per tensor (one element). Anything else (block-wise scales) is an error
    naming the tensor, never a wrong answer."""
    out = tuple(weight_shape[:-1])
    if not (np.issubdtype(scale.dtype, np.floating) or scale.dtype.name == "bfloat16"):
        raise CheckpointError(f"tensor '{name}' (the scale of '{weight_name}') should be floating point, found "
                              f"{scale.dtype}")
    if tuple(scale.shape) in (out, out + (1,)):
        s = scale.reshape(out)
    elif scale.size == 1:
        s = np.broadcast_to(scale.reshape(()), out)
    else:
        raise CheckpointError(f"tensor '{name}' has shape {tuple(scale.shape)}: a scale of '{weight_name}' "
                              f"{tuple(weight_shape)} is per output channel {out} or {out + (1,)}, or per tensor "
                              f"(one element); block-wise scales are not supported")
    s = np.ascontiguousarray(s, np.float32)
    if not np.all(np.isfinite(s)):
        raise CheckpointError(f"tensor '{name}' (the scale of '{weight_name}') holds non-finite values")
    return s


def checkpoint_quantization(cfg_json: dict, where: str) -> str | None:
    """"fp8" when config.json's `quantization_config` declares weights this package reads as fp8 (compressed-tensors'
    float-quantized 8-bit float weights per channel or per tensor, as RedHatAI's "FP8-dynamic" checkpoints; or our
    converter's mark), None without one. Anything else is a QuantizationError naming the field."""
    qc = cfg_json.get("quantization_config")
    if qc is None:
        return None
    field = f"{where}: quantization_config"
    if not isinstance(qc, dict):
        raise QuantizationError(f"{field} is not an object")
    method = qc.get("quant_method")
    if method == OWN_METHOD:
        if qc.get("weights") != "fp8":
            raise QuantizationError(f"{field}.weights {qc.get('weights')!r}: this package writes 'fp8'")
        return "fp8"
    if method != "compressed-tensors":
        raise QuantizationError(f"{field}.quant_method {method!r} is not supported: fp8 checkpoints are read in "
                                f"compressed-tensors' float-quantized format or as converted by checkpoints_convert")
    if qc.get("format") not in ("float-quantized", "naive-quantized"):
        raise QuantizationError(f"{field}.format {qc.get('format')!r} is not supported (float-quantized fp8 weights "
                                f"are)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError(f"{field}.config_groups is missing or empty")
    for gname, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        at = f"{field}.config_groups.{gname}.weights"
        if not isinstance(w, dict):
            raise QuantizationError(f"{at} is missing: only weight quantization is read")
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise QuantizationError(f"{at}: {w.get('num_bits')}-bit {w.get('type')!r} weights are not supported "
                                    f"(8-bit float are)")
        if w.get("strategy") not in ("channel", "tensor"):
            raise QuantizationError(f"{at}.strategy {w.get('strategy')!r} is not supported (per 'channel' or per "
                                    f"'tensor' scales are)")
        if w.get("symmetric") is False or w.get("dynamic"):
            raise QuantizationError(f"{at}: asymmetric or dynamic weight quantization is not supported")
    return "fp8"


def resolve(requested: str | None, stored: str | None) -> str | None:
    """The model's quantization: the checkpoint's own (`stored`) unless `requested`: "fp8" quantizes a float
    checkpoint at load, "none" dequantizes an fp8 one to the model's dtype."""
    check_quantization(requested)
    if requested is None:
        return stored
    return None if requested == "none" else requested


def own_quantization_config() -> dict:
    """The `quantization_config` our converter writes into a quantized checkpoint's config.json."""
    return {"quant_method": OWN_METHOD, "weights": "fp8",
            "format": "float8_e4m3fn weights, float32 per-output-channel <name>_scale beside each"}
