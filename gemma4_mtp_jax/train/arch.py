"""The architecture of an assistant to train: its config.json (a default derived from the target, or given), its
initial parameters, and the dense-head form it is trained in.

Centroid-head assistants (E2B/E4B style) are trained with the dense tied head over the full vocabulary: the
training parameters hold the head canonically ordered as `embed_tokens.weight`, exactly like a dense assistant.
The clusters (`token_ordering`) and centroids are fitted after training (train/centroids.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gemma4_mtp_jax.api import abstract_assistant_params
from gemma4_mtp_jax.model.config import (
    FAMILIES,
    FULL,
    SLIDING,
    AssistantConfig,
    ConfigError,
    TextConfig,
    check_pair,
    parse_assistant_config,
)
from gemma4_mtp_jax.model.runtime import Assistant
from gemma4_mtp_jax.weights.hf_loader import flatten_shapes, unflatten

_ORDERED = "masked_embedding"


def default_assistant_config(target_json: dict, target: TextConfig) -> dict:
    """An assistant config.json for `target`, following the released assistants (reference §6):

    4 Q-only layers [S, S, S, F] reading the target's store layers (so K/V geometry, window and RoPE are the
    target's); hidden 256 with half the target's heads for PLE targets (E2B/E4B), else hidden 1024 with the target's
    heads (26B-A4B, 31B), never more than half the target's hidden size; FFN 8x hidden; the centroid head for PLE
    targets (V/128 clusters, top 32, scaled down for small vocabularies). The assistant is of the target's own
    architecture: `gemma4_unified_assistant` for the unified 12B (as the released one), else `gemma4_assistant`.
    """
    wrapper, assistant_type = FAMILIES[target.model_type]
    text_json = (target_json.get("text_config", target_json) if target_json.get("model_type") == wrapper
                 else target_json)
    ple = target.hidden_size_per_layer_input > 0
    hidden = min(256 if ple else 1024, max(8, target.hidden_size // 2))
    kv_s, d_s = target.kv_geometry(SLIDING)
    kv_f, d_f = target.kv_geometry(FULL)
    heads = target.num_heads // 2 if ple else target.num_heads
    if heads == 0 or heads % kv_s or heads % kv_f:
        heads = target.num_heads
    V = target.vocab_size
    centroids = min(2048, max(1, V // 32))
    ordered = ple and V % centroids == 0 and centroids > 1
    text = {
        "model_type": target.model_type,
        "vocab_size": V,
        "hidden_size": hidden,
        "intermediate_size": 8 * hidden,
        "num_hidden_layers": 4,
        "layer_types": [SLIDING, SLIDING, SLIDING, FULL],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_s,
        "head_dim": d_s,
        # the full layer's geometry in the form transformers >= 5.15 writes (layer 3 is the full layer)
        "per_layer_config": {"3": {"head_dim": d_f, "num_key_value_heads": kv_f}},
        "attention_k_eq_v": target.attention_k_eq_v,
        "sliding_window": target.sliding_window,
        "rms_norm_eps": target.rms_norm_eps,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": text_json.get("max_position_embeddings", 131072),
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "num_kv_shared_layers": 4,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "pad_token_id": target.pad_token_id,
        "bos_token_id": target.bos_token_id,
        "eos_token_id": list(target.eos_token_ids) or None,
    }
    if text_json.get("rope_parameters"):
        text["rope_parameters"] = copy.deepcopy(text_json["rope_parameters"])
    return {
        "architectures": ["Gemma4UnifiedAssistantForCausalLM" if target.model_type != "gemma4_text"
                          else "Gemma4AssistantForCausalLM"],
        "model_type": assistant_type,
        "backbone_hidden_size": target.hidden_size,
        "use_ordered_embeddings": ordered,
        "num_centroids": centroids,
        "centroid_intermediate_top_k": max(1, min(32, centroids // 4)),
        "tie_word_embeddings": True,
        "eos_token_id": list(target.eos_token_ids) or None,
        "text_config": text,
    }


def merge_config(base: dict, overrides: dict) -> dict:
    """`overrides` over `base`, key by key (nested objects merged, `null` deletes a key)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict) and key != "per_layer_config":
            out[key] = merge_config(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_config_overrides(arg: str, flag: str = "--assistant-config") -> dict:
    """A JSON object given inline or as a file path."""
    text = arg
    if not arg.lstrip().startswith("{"):
        p = Path(arg).expanduser()
        if not p.is_file():
            raise ConfigError(f"{flag} {arg}: neither a JSON object nor an existing file")
        text = p.read_text()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} {arg}: invalid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} {arg}: expected a JSON object")
    return value


def parse_for_target(config_json: dict, target: TextConfig, where: str) -> AssistantConfig:
    """Parse an assistant config.json and check that it can read `target`'s K/V; errors name `where`."""
    cfg = parse_assistant_config(config_json, where)
    try:
        check_pair(target, cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return cfg


def dense(cfg: AssistantConfig) -> AssistantConfig:
    """The config the assistant trains under: the same model with the dense tied head."""
    return dataclasses.replace(cfg, use_ordered_embeddings=False)


def init_params(cfg: AssistantConfig, seed: int) -> dict:
    """Fresh dense-head training parameters (float32): projections ~ N(0, 1/fan_in) (unit-scale outputs for
    unit-scale inputs), the tied head ~ N(0, 1/Ha) (unit-scale logits from the unit-RMS normed hidden), norm
    weights and layer scalars 1."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, leaf in sorted(flatten_shapes(abstract_assistant_params(dense(cfg), jnp.float32)).items()):
        if len(leaf.shape) == 1:
            arr = np.ones(leaf.shape)
        else:
            fan_in = leaf.shape[-1]  # [out, in] projections and the [V, Ha] head alike
            arr = rng.standard_normal(leaf.shape) / np.sqrt(fan_in)
        out[name] = jnp.asarray(arr, jnp.float32)
    return unflatten(out)


def dense_params(assistant: Assistant) -> tuple[dict, np.ndarray | None]:
    """A loaded assistant's parameters as float32 dense-head training parameters, and its token_ordering (centroid
    head: the head rows go back to canonical order) or None."""
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), dict(assistant.params))
    if not assistant.config.use_ordered_embeddings:
        return params, None
    me = params.pop(_ORDERED)
    ordering = np.asarray(assistant.params[_ORDERED]["token_ordering"])
    table = jnp.zeros_like(me["ordered_embedding"]).at[ordering].set(me["ordered_embedding"])
    params["embed_tokens"] = {"weight": table}
    return params, ordering


def canonical_head(params: dict) -> np.ndarray:
    """The dense head [V, Ha] (canonical token order) of training parameters, as float32 numpy."""
    return np.asarray(params["embed_tokens"]["weight"], np.float32)
