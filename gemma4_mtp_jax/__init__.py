"""gemma4_mtp_jax: Gemma 4 serving in JAX with MTP speculative decoding."""

from gemma4_mtp_jax.api import (
    Assistant,
    DraftOutput,
    Target,
    TargetOutput,
    draft_step,
    load_assistant,
    load_target,
    target_forward,
)
from gemma4_mtp_jax.config import AssistantConfig, ConfigError, TextConfig
from gemma4_mtp_jax.weights.safetensors_io import CheckpointError

__all__ = [
    "Assistant",
    "AssistantConfig",
    "CheckpointError",
    "ConfigError",
    "DraftOutput",
    "Target",
    "TargetOutput",
    "TextConfig",
    "draft_step",
    "load_assistant",
    "load_target",
    "target_forward",
]
