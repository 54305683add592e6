"""Writing trained models as Hugging Face checkpoint directories: model.safetensors with the released tensor names
(what our loaders, `checkpoints_convert` and transformers read), config.json and generation_config.json (for an
assistant, `num_assistant_tokens` = the k it was trained for)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from gemma4_mtp_jax.weights.hf_loader import assistant_checkpoint_name, flatten_shapes, flax_to_hf_name

_NUMPY = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def dtype_name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def checkpoint_tensors(params: dict, dtype: Any, centroids: np.ndarray | None = None,
                       ordering: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Dense-head training parameters (+ the fitted centroid head) -> {checkpoint name: array}. The head is
    stored canonically ordered as `model.embed_tokens.weight`, as in the released centroid-head checkpoints."""
    np_dtype = _NUMPY[dtype_name(dtype)]
    out = {assistant_checkpoint_name(path): np.asarray(leaf, np.float32).astype(np_dtype)
           for path, leaf in flatten_shapes(params).items()}
    if centroids is not None:
        out["masked_embedding.centroids.weight"] = np.asarray(centroids, np.float32).astype(np_dtype)
        out["masked_embedding.token_ordering"] = np.asarray(ordering, np.int64)
    return out


def target_checkpoint_tensors(params: dict, dtype: Any) -> dict[str, np.ndarray]:
    """Target parameters -> {checkpoint name: array} as a Gemma4ForCausalLM checkpoint names them."""
    np_dtype = _NUMPY[dtype_name(dtype)]
    return {"model." + flax_to_hf_name(path): np.asarray(leaf, np.float32).astype(np_dtype)
            for path, leaf in flatten_shapes(params).items()}


def write_checkpoint(directory: Path, config: dict, generation_config: dict, tensors: dict[str, np.ndarray]) -> None:
    """config.json, generation_config.json and model.safetensors, each through a temporary name, so a crash never
    leaves a half-written file."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "config.json": lambda p: p.write_text(json.dumps(config, indent=2)),
        "generation_config.json": lambda p: p.write_text(json.dumps(generation_config, indent=2)),
        "model.safetensors": lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
    }
    for name, write in files.items():
        tmp = directory / f".{name}.tmp"
        write(tmp)
        os.replace(tmp, directory / name)


def write_assistant(directory: Path, config_json: dict, generation_config: dict, tensors: dict[str, np.ndarray],
                    dtype: Any) -> None:
    config = {**config_json, "dtype": dtype_name(dtype)}
    config.setdefault("architectures", ["Gemma4AssistantForCausalLM"])
    write_checkpoint(directory, config, generation_config, tensors)


def generation_config(base: dict, k: int) -> dict:
    """The assistant's generation_config.json: `base` (an initial assistant's, else the target's token ids) with
    num_assistant_tokens = k (transformers' drafting loop reads only this field for the number of drafts)."""
    keep = {key: v for key, v in base.items() if key != "transformers_version"}
    return {**keep, "num_assistant_tokens": k}
