"""Writing a trained assistant as a Hugging Face checkpoint directory: model.safetensors with the released tensor
names (what `load_assistant`, `checkpoints_convert` and transformers' `Gemma4AssistantForCausalLM` read),
config.json and generation_config.json (`num_assistant_tokens` = the k it was trained for)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from gemma4_mtp_jax.weights.hf_loader import assistant_checkpoint_name, flatten_shapes

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


def write_assistant(directory: Path, config_json: dict, generation_config: dict, tensors: dict[str, np.ndarray],
                    dtype: Any) -> None:
    """Write the three files (each through a temporary name, so a crash never leaves a half-written file)."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {**config_json, "dtype": dtype_name(dtype)}
    config.setdefault("architectures", ["Gemma4AssistantForCausalLM"])
    files = {
        "config.json": lambda p: p.write_text(json.dumps(config, indent=2)),
        "generation_config.json": lambda p: p.write_text(json.dumps(generation_config, indent=2)),
        "model.safetensors": lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
    }
    for name, write in files.items():
        tmp = directory / f".{name}.tmp"
        write(tmp)
        os.replace(tmp, directory / name)


def generation_config(base: dict, k: int) -> dict:
    """The assistant's generation_config.json: `base` (an initial assistant's, else the target's token ids) with
    num_assistant_tokens = k (transformers' drafting loop reads only this field for the number of drafts)."""
    keep = {key: v for key, v in base.items() if key != "transformers_version"}
    return {**keep, "num_assistant_tokens": k}
