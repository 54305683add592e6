"""gemma4_mtp_jax: Gemma 4 serving in JAX with MTP speculative decoding.

The public names resolve on first use (PEP 562), so that importing one part of the package (the engine, a kernel)
does not import the loaders and checkpoint readers behind `load_target` (docs/DESIGN.md, "Layers").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gemma4_mtp_jax.xla_env import set_gpu_runtime_flags

set_gpu_runtime_flags()  # before JAX starts its GPU client (xla_env.py says why)

_PUBLIC = {
    "Assistant": "gemma4_mtp_jax.model.runtime",
    "AssistantConfig": "gemma4_mtp_jax.model.config",
    "CheckpointError": "gemma4_mtp_jax.weights.safetensors_io",
    "ConfigError": "gemma4_mtp_jax.model.config",
    "DraftOutput": "gemma4_mtp_jax.api",
    "Encoders": "gemma4_mtp_jax.model.runtime",
    "Target": "gemma4_mtp_jax.model.runtime",
    "TargetOutput": "gemma4_mtp_jax.api",
    "TextConfig": "gemma4_mtp_jax.model.config",
    "draft_step": "gemma4_mtp_jax.api",
    "load_assistant": "gemma4_mtp_jax.api",
    "load_target": "gemma4_mtp_jax.api",
    "multimodal_forward": "gemma4_mtp_jax.api",
    "target_forward": "gemma4_mtp_jax.api",
}

__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ below imports on demand
    from gemma4_mtp_jax.api import (DraftOutput, TargetOutput, draft_step, load_assistant, load_target,
                                    multimodal_forward, target_forward)
    from gemma4_mtp_jax.model.config import AssistantConfig, ConfigError, TextConfig
    from gemma4_mtp_jax.model.runtime import Assistant, Encoders, Target
    from gemma4_mtp_jax.weights.safetensors_io import CheckpointError


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'gemma4_mtp_jax' has no attribute '{name}'")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
