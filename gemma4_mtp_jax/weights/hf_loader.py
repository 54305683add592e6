"""Hugging Face safetensors -> parameter trees, one tensor at a time.

The parameter tree of each Flax model mirrors the checkpoint's names (`layers.3.self_attn.q_proj.weight` is
`params["layers_3"]["self_attn"]["q_proj"]["weight"]`), so the expected tensors and shapes come from the
model itself (`jax.eval_shape` of its init) and loading is a name mapping plus checks. Each tensor is read,
checked, cast (or quantized) and moved to the device before the next is read: host memory holds one tensor at a
time.

fp8 checkpoints (compressed-tensors' layout): a float8_e4m3fn `<module>.weight` comes with its `<module>.weight_scale`
(per output channel [out, 1], or per tensor); activation scales and zero points beside it (`input_scale`,
`weight_zero_point`, ...) are not read, since only the weights are quantized. Whatever the checkpoint holds, each
leaf becomes what the model expects (weights/quantize.py, `as_param`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from gemma4_mtp_jax.model.config import AssistantConfig, TextConfig
from gemma4_mtp_jax.model.media_config import MediaConfig
from gemma4_mtp_jax.weights.quantize import FP8, as_param, checkpoint_scale, is_scale, scale_path
from gemma4_mtp_jax.weights.safetensors_io import CheckpointError, SafetensorsCheckpoint

# Multimodal checkpoints carry what the text model never reads: Gemma4ForConditionalGeneration its vision and audio
# towers and their embedders; the unified 12B (Gemma4UnifiedForConditionalGeneration, encoder-free) its embedders
# alone, stored under transformers' checkpoint names (`model.vision_embedder.patch_*` / `pos_*` and
# `model.embed_vision.embedding_projection`, which transformers renames into `embed_vision.` when it loads them).
# `load_encoder_params` reads them (every one of them: an encoder tensor the config does not explain is an error).
MULTIMODAL_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
                       "model.vision_embedder.")
_KV_PROJ = ("k_proj", "v_proj", "k_norm", "v_norm")


def flax_to_hf_name(path: str) -> str:
    return re.sub(r"(^|\.)layers_(\d+)\.", r"\1layers.\2.", path)


def flatten_shapes(abstract_params: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """{'layers_0.self_attn.q_proj.weight': ShapeDtypeStruct, ...} of an abstract (eval_shape) param tree."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        out[".".join(str(k.key) for k in path)] = leaf
    return out


def unflatten(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


# compressed-tensors' tensors beside a quantized `<module>.weight` that weight-only fp8 does not read.
_NOT_READ = ("input_scale", "input_zero_point", "weight_zero_point", "input_global_scale")


def _quantization_tensor_of(name: str) -> str | None:
    """The weight a checkpoint's quantization tensor belongs to (`m.weight_scale`, `m.input_scale`, ... -> `m.weight`;
    `experts.down_proj_scale` -> `experts.down_proj`), None for any other name."""
    module, _, last = name.rpartition(".")
    if last in _NOT_READ:
        return f"{module}.weight"
    return name[: -len("_scale")] if name.endswith("_scale") else None


def _is_float(array: np.ndarray) -> bool:
    return np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16" or np.dtype(array.dtype) == FP8


def _cast(array: np.ndarray, want: jax.ShapeDtypeStruct, dtype: jnp.dtype,
          on_host: bool = False) -> jax.Array | np.ndarray:
    """The (checked) tensor in the parameter's dtype: on the default device, or with `on_host` a host array (the
    engine then puts each tensor straight onto its own devices and shards)."""
    if jnp.issubdtype(want.dtype, jnp.integer):
        dtype = jnp.int32
    return np.asarray(array, np.dtype(dtype)) if on_host else jnp.asarray(array, dtype)


def _scale_of(ckpt: SafetensorsCheckpoint | FusedExperts, name: str, array: np.ndarray,
              present: set[str]) -> np.ndarray | None:
    """The float32 [..., out] scale of the checkpoint's fp8 tensor `name`; None for a float tensor."""
    sname = scale_path(name)
    if np.dtype(array.dtype) != FP8:
        if sname in present:
            raise CheckpointError(f"tensor '{sname}' is a scale, but '{name}' is not float8_e4m3fn ({array.dtype})")
        return None
    if sname not in present:
        raise CheckpointError(f"{ckpt.directory}: missing tensor '{sname}', the scale of the float8_e4m3fn tensor "
                              f"'{name}'")
    return checkpoint_scale(ckpt.read(sname), array.shape, sname, name)


def _check(name: str, array: np.ndarray, want: jax.ShapeDtypeStruct) -> None:
    if tuple(array.shape) != tuple(want.shape):
        raise CheckpointError(f"tensor '{name}' has shape {tuple(array.shape)}, the config implies {tuple(want.shape)}")
    if jnp.issubdtype(want.dtype, jnp.integer):
        if not np.issubdtype(array.dtype, np.integer):
            raise CheckpointError(f"tensor '{name}' should hold integers, found {array.dtype}")
    elif not _is_float(array):
        raise CheckpointError(f"tensor '{name}' should be floating point, found {array.dtype}")


def read_tensors(
    ckpt: SafetensorsCheckpoint | FusedExperts,
    expected: dict[str, jax.ShapeDtypeStruct],
    to_checkpoint_name: Callable[[str], str],
    ignorable: Callable[[str], bool],
    dtype: jnp.dtype,
    desc: str,
    on_host: bool = False,
) -> dict[str, jax.Array]:
    """Read every expected tensor (keyed by param path) from `ckpt`; anything else in the file is an error
    unless `ignorable`. Missing tensors and wrong shapes are errors naming the tensor. Expected scales (an fp8
    model's, `weights.quantize`) come from the checkpoint's fp8 weights or from quantizing its float ones; an fp8
    weight the model keeps unquantized is dequantized to `dtype`."""
    by_ckpt_name = {to_checkpoint_name(p): p for p in expected if not is_scale(p)}
    names = ckpt.names()
    present = set(names)

    def known(n: str) -> bool:  # expected, or the quantization tensors of an expected (or ignorable) fp8 weight
        if n in by_ckpt_name or ignorable(n):
            return True
        w = _quantization_tensor_of(n)
        return w is not None and w in present and (w in by_ckpt_name or ignorable(w))

    unexpected = [n for n in names if not known(n)]
    if unexpected:
        raise CheckpointError(f"{ckpt.directory}: unexpected tensor '{unexpected[0]}'" + (
            f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    missing = [n for n in by_ckpt_name if n not in present]
    if missing:
        raise CheckpointError(f"{ckpt.directory}: missing tensor '{missing[0]}'" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    out = {}
    total = sum(ckpt.nbytes(n) for n in by_ckpt_name)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False, disable=total < (64 << 20)) as bar:
        for name, path in by_ckpt_name.items():
            array, spath = ckpt.read(name), scale_path(path)
            _check(name, array, expected[path])
            scale = _scale_of(ckpt, name, array, present)
            if scale is None and spath not in expected:
                out[path] = _cast(array, expected[path], dtype, on_host)
            else:
                out[path], s = as_param(array, scale, quantized=spath in expected, dtype=dtype, on_host=on_host)
                if s is not None:
                    out[spath] = s
            bar.update(ckpt.nbytes(name))
    return out


_PER_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.(\w+)$")


class FusedExperts:
    """A checkpoint whose MoE experts are stored one module per expert (`<layer>.experts.<e>.{gate,up,down}_proj.
    weight`, fp8 with their `weight_scale` or not; how compressed-tensors writes experts it quantized as `Linear`s),
    read through the fused names the model has: `experts.gate_up_proj` [E, 2 Im, H] (each expert's gate rows, then
    its up rows) and `experts.down_proj` [E, H, Im], fp8 ones with `<name>_scale` [E, rows] float32. Every other
    tensor reads as stored; a checkpoint without per-expert tensors reads exactly as itself."""

    def __init__(self, ckpt: SafetensorsCheckpoint):
        self.ckpt, self.directory = ckpt, ckpt.directory
        self._fused: dict[str, tuple[str, int]] = {}  # fused name -> (experts module, E)
        self._hidden: set[str] = set()  # per-expert tensors read through the fused names, or not read at all
        experts: dict[str, set[int]] = {}
        for n in ckpt.names():
            m = _PER_EXPERT.match(n)
            if m and m.group(4) in ("weight", "weight_scale") + _NOT_READ:
                experts.setdefault(m.group(1), set()).add(int(m.group(2)))
                self._hidden.add(n)
        for module, ids in experts.items():
            if ids != set(range(len(ids))):
                raise CheckpointError(f"{self.directory}: '{module}' holds experts {sorted(ids)}, not 0..E-1")
            missing = [w for e in sorted(ids) for p in ("gate_proj", "up_proj", "down_proj")
                       if (w := f"{module}.{e}.{p}.weight") not in ckpt]
            if missing:
                raise CheckpointError(f"{self.directory}: missing tensor '{missing[0]}'")
            for fused in ("gate_up_proj", "down_proj"):
                self._fused[f"{module}.{fused}"] = (module, len(ids))
        fp8 = {f for f, (module, _) in self._fused.items()
               if ckpt.numpy_dtype(f"{module}.0.{_parts(f)[0]}.weight") == FP8}
        self._names = sorted((set(ckpt.names()) - self._hidden) | set(self._fused) | {scale_path(f) for f in fp8})

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def nbytes(self, name: str) -> int:
        if name in self._fused:
            module, E = self._fused[name]
            return sum(self.ckpt.nbytes(f"{module}.{e}.{p}.weight") for e in range(E) for p in _parts(name))
        return 0 if name.removesuffix("_scale") in self._fused else self.ckpt.nbytes(name)

    def read(self, name: str) -> np.ndarray:
        fused = name.removesuffix("_scale")
        if fused not in self._fused:
            return self.ckpt.read(name)
        module, E = self._fused[fused]
        parts = [[self._part(f"{module}.{e}.{p}", name != fused) for p in _parts(fused)] for e in range(E)]
        dtypes = {a.dtype for expert in parts for a in expert}
        if len(dtypes) > 1:
            raise CheckpointError(f"{self.directory}: the experts of '{module}' mix dtypes {sorted(map(str, dtypes))}")
        return np.stack([np.concatenate(expert, axis=0) for expert in parts])

    def _part(self, module: str, scale: bool) -> np.ndarray:
        """One expert's projection `module` ([out, in]), or its scale as float32 [out]."""
        weight, sname = f"{module}.weight", f"{module}.weight_scale"
        if not scale:
            return self.ckpt.read(weight)
        if sname not in self.ckpt:
            raise CheckpointError(f"{self.directory}: missing tensor '{sname}', the scale of the float8_e4m3fn "
                                  f"tensor '{weight}'")
        return checkpoint_scale(self.ckpt.read(sname), self.ckpt.shape(weight), sname, weight)


def _parts(fused: str) -> tuple[str, ...]:
    """The per-expert projections a fused expert tensor stacks, in its row order."""
    return ("gate_proj", "up_proj") if fused.endswith("gate_up_proj") else ("down_proj",)


def _target_prefix(ckpt: SafetensorsCheckpoint) -> str:
    names = ckpt.names()
    if any(n.startswith("model.language_model.") for n in names):
        return "model.language_model."
    return "model."


def load_target_params(directory: str, cfg: TextConfig, abstract_params: Any, dtype: jnp.dtype,
                       on_host: bool = False) -> dict:
    with SafetensorsCheckpoint(directory) as file:
        ckpt = FusedExperts(file)
        prefix = _target_prefix(ckpt)
        reuse = {i for i, lc in enumerate(cfg.layers) if lc.kv_mode == "reuse"}

        def ignorable(name: str) -> bool:
            if name.startswith(MULTIMODAL_PREFIXES) or name == "lm_head.weight":  # lm_head is tied
                return True
            # KV-shared layers own no K/V; released E2B/E4B checkpoints still carry stale k/v tensors for them.
            m = re.match(re.escape(prefix) + r"layers\.(\d+)\.self_attn\.(\w+)\.weight$", name)
            return bool(m) and int(m.group(1)) in reuse and m.group(2) in _KV_PROJ

        flat = read_tensors(ckpt, flatten_shapes(abstract_params), lambda p: prefix + flax_to_hf_name(p),
                            ignorable, dtype, f"target {directory}", on_host)
    return unflatten(flat)


def encoder_checkpoint_name(path: str) -> str:
    """The checkpoint name of an encoder parameter path (`vision_tower.encoder.layers_0.mlp.up_proj.linear.weight`
    -> `model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight`)."""
    return "model." + flax_to_hf_name(path)


def has_encoder_tensors(directory: str) -> bool:
    """Whether the checkpoint holds any media encoder tensor (a multimodal config's text-only extraction holds
    none, and is served as text)."""
    with SafetensorsCheckpoint(directory) as ckpt:
        return any(n.startswith(MULTIMODAL_PREFIXES) for n in ckpt.names())


def load_encoder_params(directory: str, cfg: MediaConfig, abstract_params: Any, dtype: jnp.dtype,
                        on_host: bool = False) -> dict:
    """The media encoders' parameters (`model.Gemma4Encoders`) of a multimodal checkpoint; the text weights are
    left to `load_target_params`. Never quantized: the towers are a small part of any checkpoint, and an fp8
    tower weight is dequantized to `dtype`."""
    del cfg  # the shapes say everything; kept for the loaders' common signature
    with SafetensorsCheckpoint(directory) as ckpt:
        flat = read_tensors(ckpt, flatten_shapes(abstract_params), encoder_checkpoint_name,
                            lambda n: not n.startswith(MULTIMODAL_PREFIXES), dtype, f"encoders {directory}", on_host)
    return unflatten(flat)


_ORDERED = "masked_embedding.ordered_embedding"


def assistant_checkpoint_name(path: str) -> str:
    """The checkpoint name of an assistant parameter path (`layers_0.mlp.up_proj.weight` ->
    `model.layers.0.mlp.up_proj.weight`; the projections and the centroid head sit outside `model.`)."""
    hf = flax_to_hf_name(path)
    return hf if path.split(".")[0] in ("pre_projection", "post_projection", "masked_embedding") else "model." + hf


def load_assistant_params(directory: str, cfg: AssistantConfig, abstract_params: Any, dtype: jnp.dtype,
                          on_host: bool = False) -> dict:
    expected = flatten_shapes(abstract_params)
    if cfg.use_ordered_embeddings:
        # The checkpoint holds the canonical-order head `model.embed_tokens.weight`; we keep it permuted instead.
        expected["embed_tokens.weight"] = expected.pop(_ORDERED)

    with SafetensorsCheckpoint(directory) as ckpt:
        flat = read_tensors(ckpt, expected, assistant_checkpoint_name, lambda n: n == "lm_head.weight", dtype,
                            f"assistant {directory}", on_host)
    if cfg.use_ordered_embeddings:
        flat[_ORDERED] = permute_head_rows(flat.pop("embed_tokens.weight"), flat["masked_embedding.token_ordering"])
    return unflatten(flat)


def permute_head_rows(table: jax.Array, token_ordering: jax.Array) -> jax.Array:
    """Rows of the head in cluster order (cluster c = rows c*V/C..(c+1)*V/C-1), checked to be a permutation."""
    V = table.shape[0]
    order = np.asarray(token_ordering)
    if not np.array_equal(np.sort(order), np.arange(V)):
        raise CheckpointError(f"masked_embedding.token_ordering is not a permutation of 0..{V - 1}")
    if isinstance(table, np.ndarray):
        return table[order]
    return jnp.take(table, token_ordering, axis=0)
