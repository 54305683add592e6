"""Gemma 4 configs, read from Hugging Face `config.json`.

Two architectures, each a target (multimodal wrapper or text model) and an assistant:
  * Gemma 4 (E2B, E4B, 26B-A4B, 31B): `gemma4` (multimodal wrapper; the text model sits in `text_config`),
    `gemma4_text`, `gemma4_assistant`;
  * Gemma 4 "unified" (12B, encoder-free multimodal): `gemma4_unified`, `gemma4_unified_text`,
    `gemma4_unified_assistant`. Its text model is Gemma 4's without per-layer embeddings and without the MoE block
    (transformers' `Gemma4UnifiedTextConfig` has neither field), with other defaults (sliding window 1024).
Full-attention layers may override head dim and KV heads in two serialised forms: the released one
(`global_head_dim`, `num_global_key_value_heads`) and the form transformers >= 5.15 writes (`per_layer_config`,
keyed by layer index). Everything the model needs per layer is derived here once, so the model code never
re-derives it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Literal

SLIDING = "sliding_attention"
FULL = "full_attention"
LayerType = Literal["sliding_attention", "full_attention"]
LAYER_TYPES: tuple[str, str] = (SLIDING, FULL)

# model_type of the text model -> (its multimodal wrapper's, its assistant's). The architecture a config names
# decides its defaults and which fields exist; the model code itself is one for both.
GEMMA4_TEXT, UNIFIED_TEXT = "gemma4_text", "gemma4_unified_text"
FAMILIES: dict[str, tuple[str, str]] = {
    GEMMA4_TEXT: ("gemma4", "gemma4_assistant"),
    UNIFIED_TEXT: ("gemma4_unified", "gemma4_unified_assistant"),
}
TARGET_MODEL_TYPES: tuple[str, ...] = tuple(t for text, (wrapper, _) in FAMILIES.items() for t in (wrapper, text))
ASSISTANT_MODEL_TYPES: tuple[str, ...] = tuple(a for _, a in FAMILIES.values())
# transformers' per-architecture defaults of the fields a config.json may leave out
_DEFAULT_SLIDING_WINDOW = {GEMMA4_TEXT: 512, UNIFIED_TEXT: 1024}

_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


class ConfigError(ValueError):
    """An unsupported or inconsistent config; the message names the file and field."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    # Fraction of the frequency pairs that rotate ("proportional" RoPE); 1.0 for the default RoPE.
    partial_rotary_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    layer_type: str
    head_dim: int
    num_kv_heads: int
    # "store": produces K/V that later layers (or the assistant) read; "reuse": owns no K/V and reads
    # `kv_source`'s; None: an ordinary layer.
    kv_mode: str | None
    kv_source: int  # index of the layer whose K/V this layer attends to (itself unless "reuse")
    intermediate_size: int
    k_eq_v: bool  # V is the (un-normed, un-roped) K projection; no v_proj


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The decoder: the target's text model, or the assistant's 4 Q-only layers."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    layers: tuple[LayerConfig, ...]
    rope: dict[str, RopeConfig]
    sliding_window: int
    rms_norm_eps: float
    final_logit_softcapping: float | None
    hidden_size_per_layer_input: int  # PLE dim P; 0 disables PLE
    vocab_size_per_layer_input: int
    num_kv_shared_layers: int
    attention_k_eq_v: bool
    enable_moe_block: bool
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    model_type: str = GEMMA4_TEXT  # the architecture (FAMILIES): gemma4_text or gemma4_unified_text
    # How an image's soft tokens attend to each other (kernels/dense_attention.image_bounds): "causal" (E2B,
    # E4B), "sliding_layers" (use_bidirectional_attention "vision" in Gemma 4: 26B, 31B) or "all_layers" (the same
    # setting in the unified 12B, whose forward widens every layer). Text-only sequences never see a difference.
    image_attention: str = "causal"

    @property
    def store_layers(self) -> dict[str, int]:
        """Layer type -> the last non-KV-shared layer of that type (what KV-shared layers and the assistant read)."""
        return {lc.layer_type: i for i, lc in enumerate(self.layers) if lc.kv_mode == "store"}

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def kv_geometry(self, layer_type: str) -> tuple[int, int]:
        """(num_kv_heads, head_dim) of the K/V that layers of this type attend to."""
        for lc in self.layers:
            if lc.layer_type == layer_type:
                return lc.num_kv_heads, lc.head_dim
        raise KeyError(layer_type)


def owning_layers(cfg: TextConfig) -> list[int]:
    """The layers that own K/V (write their own pages); KV-shared layers read a store layer's."""
    return [i for i, lc in enumerate(cfg.layers) if lc.kv_mode != "reuse"]


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    text: TextConfig
    backbone_hidden_size: int  # the target's hidden size
    use_ordered_embeddings: bool  # centroid-masked head (E2B/E4B assistants)
    num_centroids: int
    centroid_top_k: int
    eos_token_ids: tuple[int, ...]


def _field(d: dict, key: str, where: str, default: Any = dataclasses.MISSING) -> Any:
    if key in d and d[key] is not None:
        return d[key]
    if default is dataclasses.MISSING:
        raise ConfigError(f"{where}: required field '{key}' is missing")
    return default


def _int_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(d: dict, where: str) -> dict[str, RopeConfig]:
    params = d.get("rope_parameters") or _DEFAULT_ROPE
    out = {}
    for t in LAYER_TYPES:
        p = params.get(t, _DEFAULT_ROPE[t])
        kind = p.get("rope_type", "default")
        if kind == "default":
            out[t] = RopeConfig(theta=float(p["rope_theta"]))
        elif kind == "proportional":
            if p.get("factor", 1.0) not in (None, 1.0):
                raise ConfigError(f"{where}: rope_parameters.{t}.factor={p['factor']} is not supported")
            out[t] = RopeConfig(theta=float(p["rope_theta"]),
                                partial_rotary_factor=float(p.get("partial_rotary_factor", 1.0)))
        else:
            raise ConfigError(f"{where}: rope_parameters.{t}.rope_type='{kind}' is not supported")
    return out


def _full_layer_overrides(d: dict, layer_types: tuple[str, ...], where: str) -> dict[int, dict]:
    """Per full layer {head_dim, [num_key_value_heads]} from either serialised form."""
    plc = d.get("per_layer_config")
    if plc:
        out = {}
        for key, val in plc.items():
            if key in LAYER_TYPES:  # keyed by layer type
                for i, t in enumerate(layer_types):
                    if t == key:
                        out[i] = dict(val)
                continue
            try:
                i = int(key)
            except (TypeError, ValueError):
                raise ConfigError(f"{where}: per_layer_config key '{key}' is neither a layer index nor a layer type")
            if not 0 <= i < len(layer_types):
                raise ConfigError(f"{where}: per_layer_config names layer {i}, "
                                  f"but num_hidden_layers={len(layer_types)}")
            out[i] = dict(val)
        return out
    head_dim = d.get("global_head_dim") or 512
    over: dict[str, Any] = {"head_dim": head_dim}
    # transformers applies num_global_key_value_heads only together with attention_k_eq_v.
    if d.get("attention_k_eq_v") and d.get("num_global_key_value_heads") is not None:
        over["num_key_value_heads"] = d["num_global_key_value_heads"]
    return {i: dict(over) for i, t in enumerate(layer_types) if t == FULL}


def parse_text_config(d: dict, where: str = "config.json", *, all_layers_reuse: bool = False) -> TextConfig:
    mt = d.get("model_type", GEMMA4_TEXT)
    if mt not in FAMILIES:
        raise ConfigError(f"{where}: text model_type must be one of {sorted(FAMILIES)}, got '{mt}'")
    unified = mt == UNIFIED_TEXT
    if unified:
        # The unified architecture has no per-layer embeddings and no MoE block: transformers' unified model never
        # reads these fields (released 12B configs still carry them, off). One that turns either on describes
        # weights that model would not have, so refuse it rather than load a different model silently.
        for key, on in (("hidden_size_per_layer_input", bool(d.get("hidden_size_per_layer_input"))),
                        ("enable_moe_block", bool(d.get("enable_moe_block")))):
            if on:
                raise ConfigError(f"{where}: {key}={d[key]!r}: the gemma4_unified architecture has no "
                                  f"{'per-layer embeddings' if key.startswith('hidden') else 'MoE block'}")
    bidirectional = d.get("use_bidirectional_attention", "vision" if unified else None)
    if bidirectional == "all":
        raise ConfigError(f"{where}: use_bidirectional_attention='all' (non-causal text model) is not supported")
    if bidirectional not in (None, "vision"):
        raise ConfigError(f"{where}: use_bidirectional_attention={bidirectional!r} is not one of null, 'vision'")
    act = d.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{where}: hidden_activation='{act}' is not supported (expected 'gelu_pytorch_tanh')")
    if d.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true is not supported")

    L = int(_field(d, "num_hidden_layers", where))
    layer_types = d.get("layer_types")
    if layer_types is None:
        layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(L)]
    layer_types = list(layer_types)
    if len(layer_types) != L:
        raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries, num_hidden_layers={L}")
    for t in layer_types:
        if t not in LAYER_TYPES:
            raise ConfigError(f"{where}: layer_types entry '{t}' is not one of {LAYER_TYPES}")
    layer_types[-1] = FULL  # transformers forces the last layer to full attention
    layer_types = tuple(layer_types)

    H = int(_field(d, "hidden_size", where))
    nH = int(_field(d, "num_attention_heads", where, 8))
    nKV = int(_field(d, "num_key_value_heads", where, 4))
    D = int(_field(d, "head_dim", where, 256))
    inter = int(_field(d, "intermediate_size", where))
    n_shared = int(d.get("num_kv_shared_layers") or 0)
    if all_layers_reuse and n_shared == 0:
        n_shared = L  # the assistant: every layer is Q-only (Gemma4AssistantConfig.__post_init__)
    if not 0 <= n_shared <= L:
        raise ConfigError(f"{where}: num_kv_shared_layers={n_shared} is outside 0..num_hidden_layers={L}")
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    moe = bool(d.get("enable_moe_block", False)) and not unified
    double_wide = bool(d.get("use_double_wide_mlp", False))
    P = 0 if unified else int(d.get("hidden_size_per_layer_input") or 0)
    V = int(_field(d, "vocab_size", where))

    overrides = _full_layer_overrides(d, layer_types, where)
    for i in overrides:
        if layer_types[i] != FULL:
            raise ConfigError(f"{where}: per_layer_config overrides layer {i}, which is not a full_attention layer")

    first_shared = L - n_shared
    if n_shared == L:
        modes: list[str | None] = ["reuse"] * L
        store = {}
    else:
        modes = [None if i < first_shared else "reuse" for i in range(L)]
        store = {}
        for t in set(layer_types):
            prod = [j for j in range(first_shared) if layer_types[j] == t]
            if not prod:
                raise ConfigError(
                    f"{where}: num_kv_shared_layers={n_shared} leaves no non-shared '{t}' layer to produce its K/V"
                )
            store[t] = prod[-1]
            modes[prod[-1]] = "store"

    layers = []
    for i, t in enumerate(layer_types):
        o = overrides.get(i, {})
        hd = int(o.get("head_dim", D))
        kvh = int(o.get("num_key_value_heads", nKV))
        if nH % kvh:
            raise ConfigError(f"{where}: num_attention_heads={nH} is not a multiple of layer {i}'s KV heads ({kvh})")
        layers.append(
            LayerConfig(
                layer_type=t,
                head_dim=hd,
                num_kv_heads=kvh,
                kv_mode=modes[i],
                kv_source=store.get(t, i) if modes[i] == "reuse" else i,
                intermediate_size=inter * (2 if double_wide and modes[i] == "reuse" else 1),
                k_eq_v=k_eq_v and t == FULL,
            )
        )
    # A reusing layer attends with the producer's K/V geometry; a mismatch would be silent garbage.
    for i, lc in enumerate(layers):
        if lc.kv_mode == "reuse" and lc.kv_source != i:
            src = layers[lc.kv_source]
            if (src.head_dim, src.num_kv_heads) != (lc.head_dim, lc.num_kv_heads):
                raise ConfigError(f"{where}: KV-shared layer {i} has a different head_dim/KV heads than its "
                                  f"source {lc.kv_source}")

    if moe:
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            _field(d, key, where)
    if P:
        _field(d, "vocab_size_per_layer_input", where)
    if d.get("tie_word_embeddings", True) is False:
        raise ConfigError(f"{where}: tie_word_embeddings=false is not supported (Gemma 4 ties the LM head)")

    return TextConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=inter,
        num_layers=L,
        num_heads=nH,
        num_kv_heads=nKV,
        head_dim=D,
        layer_types=layer_types,
        layers=tuple(layers),
        rope=_rope(d, where),
        sliding_window=int(_field(d, "sliding_window", where, _DEFAULT_SLIDING_WINDOW[mt])),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        hidden_size_per_layer_input=P,
        vocab_size_per_layer_input=int(d.get("vocab_size_per_layer_input") or 0) if P else 0,
        num_kv_shared_layers=n_shared,
        attention_k_eq_v=k_eq_v,
        enable_moe_block=moe,
        num_experts=0 if unified else int(d.get("num_experts") or 0),
        top_k_experts=0 if unified else int(d.get("top_k_experts") or 0),
        moe_intermediate_size=0 if unified else int(d.get("moe_intermediate_size") or 0),
        pad_token_id=d.get("pad_token_id"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_int_list(d.get("eos_token_id")),
        model_type=mt,
        image_attention="causal" if bidirectional is None else ("all_layers" if unified else "sliding_layers"),
    )


def parse_target_config(d: dict, where: str = "config.json") -> TextConfig:
    mt = d.get("model_type")
    for text, (wrapper, _) in FAMILIES.items():
        if mt == wrapper:
            if "text_config" not in d or not isinstance(d["text_config"], dict):
                raise ConfigError(f"{where}: model_type '{wrapper}' needs a 'text_config' object")
            tc = dict(d["text_config"])
            tc.setdefault("model_type", text)
            if tc["model_type"] != text:  # a wrapper holds its own architecture's text model
                raise ConfigError(f"{where}: text_config.model_type must be '{text}' in a '{wrapper}' config, "
                                  f"got '{tc['model_type']}'")
            return parse_text_config(tc, f"{where}: text_config")
        if mt == text:
            return parse_text_config(d, where)
    raise ConfigError(f"{where}: model_type '{mt}' is not a Gemma 4 target (expected one of "
                      f"{', '.join(repr(t) for t in TARGET_MODEL_TYPES)})")


def parse_assistant_config(d: dict, where: str = "config.json") -> AssistantConfig:
    mt = d.get("model_type")
    texts = {assistant: text for text, (_, assistant) in FAMILIES.items()}
    if mt not in texts:
        raise ConfigError(f"{where}: model_type '{mt}' is not a Gemma 4 assistant (expected one of "
                          f"{', '.join(repr(a) for a in ASSISTANT_MODEL_TYPES)})")
    if not isinstance(d.get("text_config"), dict):
        raise ConfigError(f"{where}: 'text_config' is missing")
    tc = dict(d["text_config"])
    tc.setdefault("model_type", texts[mt])  # transformers' sub-config default for this assistant
    if tc["model_type"] != texts[mt]:
        raise ConfigError(f"{where}: text_config.model_type must be '{texts[mt]}' in a '{mt}' config, "
                          f"got '{tc['model_type']}'")
    text = parse_text_config(tc, f"{where}: text_config", all_layers_reuse=True)
    for field, ok in (
        ("hidden_size_per_layer_input", text.hidden_size_per_layer_input == 0),
        ("enable_moe_block", not text.enable_moe_block),
        ("use_double_wide_mlp", not tc.get("use_double_wide_mlp", False)),
        ("num_kv_shared_layers", text.num_kv_shared_layers == text.num_layers),
    ):
        if not ok:
            raise ConfigError(f"{where}: text_config.{field} is not allowed for an assistant (its layers are Q-only)")
    ordered = bool(d.get("use_ordered_embeddings", False))
    nc = int(d.get("num_centroids") or 2048)
    topk = int(d.get("centroid_intermediate_top_k") or 32)
    if ordered:
        if text.vocab_size % nc:
            raise ConfigError(f"{where}: vocab_size={text.vocab_size} is not divisible by num_centroids={nc}")
        if not 0 < topk <= nc:
            raise ConfigError(f"{where}: centroid_intermediate_top_k={topk} must be in 1..num_centroids={nc}")
    return AssistantConfig(
        text=text,
        backbone_hidden_size=int(_field(d, "backbone_hidden_size", where)),
        use_ordered_embeddings=ordered,
        num_centroids=nc,
        centroid_top_k=topk,
        eos_token_ids=_int_list(d.get("eos_token_id")),
    )


def check_pair(target: TextConfig, assistant: AssistantConfig) -> None:
    """The assistant attends to the target's store-layer K/V: geometry and sizes must agree, and it was trained
    with a target of its own architecture (a unified assistant drafts for the unified 12B only)."""
    if assistant.text.model_type != target.model_type:
        wants = FAMILIES[assistant.text.model_type][0]
        raise ConfigError(f"a '{FAMILIES[assistant.text.model_type][1]}' drafts for a '{wants}' target, "
                          f"not a '{FAMILIES[target.model_type][0]}' one")
    if assistant.backbone_hidden_size != target.hidden_size:
        raise ConfigError(
            f"assistant backbone_hidden_size={assistant.backbone_hidden_size} "
            f"!= target hidden_size={target.hidden_size}"
        )
    if assistant.text.vocab_size != target.vocab_size:
        raise ConfigError(f"assistant vocab_size={assistant.text.vocab_size} != target vocab_size={target.vocab_size}")
    for t in set(assistant.text.layer_types):
        if t not in target.store_layers:
            raise ConfigError(f"assistant has '{t}' layers but the target stores no '{t}' K/V")
        if assistant.text.kv_geometry(t) != target.kv_geometry(t):
            raise ConfigError(
                f"assistant '{t}' layers expect (kv_heads, head_dim)={assistant.text.kv_geometry(t)}, "
                f"the target's store layer has {target.kv_geometry(t)}"
            )


def read_config_json(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None


def embed_scale(hidden_size: int) -> float:
    return math.sqrt(hidden_size)
