"""Tiny random Gemma 4 target/assistant checkpoint pairs built with transformers' own classes, and reference outputs
extracted from transformers (CPU, float32) for the parity tests.

Families (all float32, vocab 512, sliding window 8, deterministic):
  * "e2b":  per-layer embeddings (PLE), KV-shared tail layers, double-wide MLP on them; centroid-head assistant
            (use_ordered_embeddings=True) whose generation_config carries `suppress_tokens`.
  * "a26b": MoE block beside the dense MLP, attention_k_eq_v with fewer full-layer KV heads; dense-head assistant.
  * "b31b": dense (no MoE, no PLE), attention_k_eq_v, 6 heads / 3 KV heads sliding, 1 KV head full, 7 layers whose last
            layer is forced to full by the config; dense-head assistant.
  * "u12b": the unified architecture of the 12B (`gemma4_unified`): dense, attention_k_eq_v with one full-layer KV
            head, the default 5:1 layer pattern; saved as the released 12B is, a Gemma4UnifiedForConditionalGeneration
            (text weights under `model.language_model.`, the encoder-free vision / audio embedders beside them);
            dense-head `gemma4_unified_assistant`. Its target is the multimodal model (encoder-free embedders).
Extra layouts (built by `build_all`):
  * e2b "target_multimodal": a Gemma4ForConditionalGeneration (text weights under `model.language_model.`) with
    tiny random vision and audio towers, rewritten into the released style: `text_config` with
    `global_head_dim`/`num_global_key_value_heads` (no `per_layer_config`) and stale k_proj/v_proj/k_norm tensors
    for the KV-shared layers (a loader must skip them).
  * b31b "target_multimodal": the same with a vision tower only (its text model attends bidirectionally within an
    image, "vision").
  * a26b "target_sharded": `model.safetensors.index.json` + 2 shards.
  * u12b "target_text": the same weights saved by Gemma4UnifiedForCausalLM (`gemma4_unified_text`, names `model.`).

`write_compressed_tensors_fp8` copies a checkpoint into compressed-tensors' FP8-dynamic layout (fp8 Linear weights
with their scales), the layout of the fp8 Gemma 4 checkpoints users download.

Usage as a script: `python tests/hf_tiny.py OUT_DIR` builds everything under OUT_DIR and prints the paths.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

VOCAB = 512
SLIDING_WINDOW = 8
NUM_ASSISTANT_TOKENS = 4
FAMILIES = ("e2b", "a26b", "b31b", "u12b")
# token ids the e2b assistant's generation_config suppresses (transformers itself ignores them while drafting)
E2B_SUPPRESS_TOKENS = [3, 4, 5, 300]
# residual-branch scale of the target in `align_for_acceptance_`; chosen so that greedy assisted decoding mixes rounds
# with 0, partial and full acceptance (see `acceptance_report`)
ALIGN_ALPHA = {"e2b": 0.5, "a26b": 1.0, "b31b": 0.3, "u12b": 0.3}
SEEDS = {"e2b": 1234, "a26b": 2345, "b31b": 3456, "u12b": 4567}
UNIFIED = ("u12b",)  # families of the unified architecture (transformers' Gemma4Unified* classes)

_S, _F = "sliding_attention", "full_attention"
# Media token ids of the tiny multimodal targets: inside the vocabulary (the released ids lie beyond it), as the
# begin / end-of-image and -audio tokens are embedded like any text token
MEDIA_TOKEN_IDS = dict(image_token_id=500, audio_token_id=501, boi_token_id=502, eoi_token_id=503, video_token_id=504,
                       boa_token_id=505, eoa_token_index=506)


# ----------------------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------------------
def _unified_configs():
    """(Gemma4UnifiedConfig of the multimodal target, Gemma4UnifiedAssistantConfig) of "u12b": the 12B's features
    (dense, k_eq_v, 1 full-layer KV head, [S x 5, F] layers, softcap 30) at tiny sizes; embedders of tiny inputs
    (2x2 patches pooled 2x2: 48 pixel values a soft token; 8 audio samples a token)."""
    from transformers import (Gemma4UnifiedAssistantConfig, Gemma4UnifiedAudioConfig, Gemma4UnifiedConfig,
                              Gemma4UnifiedTextConfig, Gemma4UnifiedVisionConfig)

    common = dict(vocab_size=VOCAB, sliding_window=SLIDING_WINDOW, eos_token_id=None)
    text = Gemma4UnifiedTextConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,  # layer_types left to the config: [S, S, S, S, S, F], the 12B's pattern
        num_attention_heads=4,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        head_dim=8,
        global_head_dim=16,
        final_logit_softcapping=30.0,
        **common,
    )
    vision = Gemma4UnifiedVisionConfig(patch_size=2, pooling_kernel_size=2, mm_embed_dim=16, mm_posemb_size=8,
                                       output_proj_dims=16)
    target = Gemma4UnifiedConfig(text_config=text, vision_config=vision,
                                 audio_config=Gemma4UnifiedAudioConfig(audio_embed_dim=8), **MEDIA_TOKEN_IDS)
    draft_text = Gemma4UnifiedTextConfig(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=4,
        layer_types=[_S, _S, _S, _F],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        head_dim=8,
        global_head_dim=16,
        **common,
    )
    assistant = Gemma4UnifiedAssistantConfig(
        text_config=draft_text, backbone_hidden_size=32, use_ordered_embeddings=False, eos_token_id=None
    )
    return target, assistant


def make_configs(family: str):
    """(target config, assistant config) for one family: Gemma4TextConfig and Gemma4AssistantConfig, or for the
    unified families Gemma4UnifiedConfig (multimodal) and Gemma4UnifiedAssistantConfig."""
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    common = dict(vocab_size=VOCAB, sliding_window=SLIDING_WINDOW, eos_token_id=None)
    if family in UNIFIED:
        return _unified_configs()
    if family == "e2b":
        target = Gemma4TextConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            layer_types=[_S, _S, _S, _F, _S, _S, _S, _F],
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            global_head_dim=32,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=VOCAB,
            num_kv_shared_layers=3,  # layers 5,6,7 reuse the K/V of layer 4 (sliding) / 3 (full)
            use_double_wide_mlp=True,
            final_logit_softcapping=30.0,
            **common,
        )
        draft_text = Gemma4TextConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            layer_types=[_S, _S, _S, _F],
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            global_head_dim=32,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=0,
            **common,
        )
        assistant = Gemma4AssistantConfig(
            text_config=draft_text,
            backbone_hidden_size=64,
            use_ordered_embeddings=True,
            num_centroids=16,  # 512 / 16 = 32 tokens per centroid
            centroid_intermediate_top_k=4,  # 128 candidate tokens per step
            eos_token_id=None,
        )
    elif family == "a26b":
        target = Gemma4TextConfig(
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=6,
            layer_types=[_S, _S, _F, _S, _S, _F],
            num_attention_heads=4,
            num_key_value_heads=2,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            head_dim=16,
            global_head_dim=32,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=24,
            use_bidirectional_attention="vision",
            final_logit_softcapping=30.0,
            **common,
        )
        draft_text = Gemma4TextConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            layer_types=[_S, _S, _S, _F],
            num_attention_heads=4,
            num_key_value_heads=2,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            head_dim=16,
            global_head_dim=32,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=0,
            **common,
        )
        assistant = Gemma4AssistantConfig(
            text_config=draft_text, backbone_hidden_size=48, use_ordered_embeddings=False, eos_token_id=None
        )
    elif family == "b31b":
        import transformers

        # the last layer is given as sliding on purpose: the config forces it to full (and logs a warning)
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            target = Gemma4TextConfig(
                hidden_size=40,
                intermediate_size=80,
                num_hidden_layers=7,
                layer_types=[_S, _S, _F, _S, _S, _S, _S],
                num_attention_heads=6,
                num_key_value_heads=3,
                num_global_key_value_heads=1,
                attention_k_eq_v=True,
                head_dim=8,
                global_head_dim=24,  # proportional RoPE: int(0.25 * 24 // 2) = 3 rotated frequency pairs
                hidden_size_per_layer_input=0,
                vocab_size_per_layer_input=0,
                use_bidirectional_attention="vision",
                final_logit_softcapping=30.0,
                **common,
            )
        finally:
            transformers.logging.set_verbosity(verbosity)
        draft_text = Gemma4TextConfig(
            hidden_size=24,
            intermediate_size=48,
            num_hidden_layers=4,
            layer_types=[_S, _S, _S, _F],
            num_attention_heads=6,
            num_key_value_heads=3,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            head_dim=8,
            global_head_dim=24,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=0,
            **common,
        )
        assistant = Gemma4AssistantConfig(
            text_config=draft_text, backbone_hidden_size=40, use_ordered_embeddings=False, eos_token_id=None
        )
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return target, assistant


# ----------------------------------------------------------------------------------------------------------------------
# Random weights
# ----------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def randomize_(model, seed: int, std: float = 0.2):
    """Random weights large enough to make attention / MoE / softcap non-trivial (as ref_tiny.py)."""
    g = torch.Generator().manual_seed(seed)
    for _, p in model.named_parameters():
        if p.ndim == 1:  # norms / scales around 1 (Gemma 4 RMSNorm multiplies by w, not 1+w)
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(std * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.5 + torch.rand(b.shape, generator=g))
        if name.endswith("token_ordering"):
            b.copy_(torch.randperm(b.numel(), generator=g))


@torch.no_grad()
def align_for_acceptance_(target, assistant, alpha_t: float, alpha_a: float = 0.35, seed: int = 99):
    """Random models never agree, so every draft would be rejected. Make both lean towards "repeat the current token":
    shrink every residual branch (post-norm weights) and give the assistant an LM head / pre_projection aligned with
    the target's embedding (as ref_tiny.py). Everything else stays random."""
    g = torch.Generator().manual_seed(seed)
    for m, a in ((target, alpha_t), (assistant, alpha_a)):
        for n, p in m.named_parameters():
            if n.endswith(
                ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight",
                 "post_per_layer_input_norm.weight")
            ):
                p.mul_(a)
    E = target.get_input_embeddings().weight  # [V, Hb]
    Hb, Ha = E.shape[1], assistant.config.get_text_config().hidden_size
    M = torch.linalg.qr(torch.randn(Hb, Ha, generator=g))[0].T  # [Ha, Hb], orthonormal rows
    pre = assistant.pre_projection.weight  # [Ha, 2*Hb]: first half multiplies the token embedding
    pre[:, :Hb] = M
    pre[:, Hb:] *= 0.25
    Wa = E @ M.T  # [V, Ha]
    assistant.model.embed_tokens.weight.copy_(Wa / Wa.norm(dim=-1, keepdim=True).mean())  # == lm_head (tied)
    assistant.model.norm.weight.fill_(1.0)
    if assistant.masked_embedding is not None:  # centroids = mean of member-token LM-head rows (k-means-like)
        me = assistant.masked_embedding
        clusters = me.token_ordering.view(me.num_centroids, -1)
        me.centroids.weight.copy_(assistant.model.embed_tokens.weight[clusters].mean(1))


def make_models(family: str, align: bool = True, std: float = 0.2):
    """Fresh (target, assistant) torch models with the family's deterministic random weights; `align=False` skips
    the acceptance alignment (the target then generates varied text instead of mostly repeating tokens)."""
    from transformers import (Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4UnifiedAssistantForCausalLM,
                              Gemma4UnifiedForConditionalGeneration)

    tcfg, acfg = make_configs(family)
    if family in UNIFIED:  # the released 12B is the multimodal model; its text weights are what we serve
        target = Gemma4UnifiedForConditionalGeneration(tcfg).eval()
        assistant = Gemma4UnifiedAssistantForCausalLM(acfg).eval()
    else:
        target = Gemma4ForCausalLM(tcfg).eval()
        assistant = Gemma4AssistantForCausalLM(acfg).eval()
    seed = SEEDS[family]
    randomize_(target, seed, std=std)
    randomize_(assistant, seed + 1, std=std)
    if align:
        align_for_acceptance_(target, assistant, alpha_t=ALIGN_ALPHA[family], seed=seed + 2)
    return target, assistant


# ----------------------------------------------------------------------------------------------------------------------
# Building checkpoints
# ----------------------------------------------------------------------------------------------------------------------
def _quiet_save(model, out_dir: Path, **kw):
    # save_pretrained draws a tqdm bar per call; keep test logs clean
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out_dir), **kw)
    finally:
        if was:
            hf_logging.enable_progress_bar()


def build_pair(family: str, out_dir: Path) -> dict:
    """Build and save one (target, assistant) pair under out_dir/{target,assistant}. Returns their paths."""
    out_dir = Path(out_dir)
    target, assistant = make_models(family)
    tdir, adir = out_dir / "target", out_dir / "assistant"
    _quiet_save(target, tdir)
    assistant.generation_config.num_assistant_tokens = NUM_ASSISTANT_TOKENS  # required by transformers
    if family == "e2b":
        assistant.generation_config.suppress_tokens = list(E2B_SUPPRESS_TOKENS)
    _quiet_save(assistant, adir)
    return {"target": tdir, "assistant": adir}


def build_plain_target(family: str, out_dir: Path) -> Path:
    """The family's target without the acceptance alignment and with smaller weights (std 0.1, at which greedy text
    stays varied; at 0.2 the MoE family collapses onto one repeated token), for generation tests."""
    target, _ = make_models(family, align=False, std=0.1)
    _quiet_save(target, Path(out_dir))
    return Path(out_dir)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
_LINEAR = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|experts\.\d+\.(gate|up|down)_proj"
                     r"|per_layer_(model_projection|input_gate|projection))\.weight$")


def write_compressed_tensors_fp8(src, dst, strategy: str = "channel", scale_dtype: str = "float32",
                                 unfused_experts: bool = False) -> dict:
    """A copy of the float checkpoint `src` in the layout of compressed-tensors' "FP8 dynamic" checkpoints
    (RedHatAI's Gemma 4 FP8-dynamic), written here with safetensors: every `Linear` target's `<module>.weight`
    float8_e4m3fn [out, in] beside its `<module>.weight_scale` (strategy "channel": [out, 1]; "tensor": [1]) in
    `scale_dtype`, the router in the `ignore` list, the MoE experts (3-D parameters, no `Linear`) left as they are,
    or with `unfused_experts` stored as one `Linear` per expert and quantized (`experts.<e>.{gate,up,down}_proj`);
    config.json's `quantization_config` as compressed-tensors writes it. Returns {weight name: (fp8, scale)}."""
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors, written = load_torch(str(f)), {}
    if unfused_experts:
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            w, module = tensors.pop(name), name.rsplit(".", 1)[0]
            for e in range(w.shape[0]):
                if name.endswith("gate_up_proj"):
                    gate, up = w[e].chunk(2, dim=0)
                    tensors[f"{module}.{e}.gate_proj.weight"] = gate.contiguous()
                    tensors[f"{module}.{e}.up_proj.weight"] = up.contiguous()
                else:
                    tensors[f"{module}.{e}.down_proj.weight"] = w[e].contiguous()
    for name in [n for n in tensors if _LINEAR.search(n)]:
        w = tensors[name].float()
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
        scale = (amax / FP8_MAX).to(getattr(torch, scale_dtype))
        q = (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale"] = q, scale
        written[name] = (q.view(torch.uint8).numpy(), scale.float().numpy())
    save_torch(tensors, str(f))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
                        "group_size": None, "block_structure": None, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True, "observer": None},
            "output_activations": None}},
        "ignore": ["lm_head", "re:.*router.*"], "kv_cache_scheme": None, "global_compression_ratio": None}
    (dst / "config.json").write_text(json.dumps(cfg))
    return written


def _released_style_text_config(tcfg) -> dict:
    """The text config as released checkpoints carry it (saved by transformers 5.7.0.dev0): `global_head_dim` and
    `num_global_key_value_heads` instead of 5.24's derived `per_layer_config`."""
    d = tcfg.to_dict()
    plc = d.pop("per_layer_config", None) or {}
    full = [v for v in plc.values()] if isinstance(plc, dict) else []
    d["global_head_dim"] = full[0]["head_dim"] if full else d["head_dim"]
    d["num_global_key_value_heads"] = (
        full[0].get("num_key_value_heads") if (full and d.get("attention_k_eq_v")) else None
    )
    d.pop("transformers_version", None)
    d.pop("architectures", None)
    d["model_type"] = "gemma4_text"
    return d


MULTIMODAL = ("e2b", "b31b")  # families built also as a Gemma4ForConditionalGeneration (`target_multimodal`)
AUDIO_MEL_BINS = 16  # the tiny audio tower's input width (its first subsampling conv has as many channels)


def make_media_configs(family: str) -> tuple:
    """(Gemma4VisionConfig, Gemma4AudioConfig or None) of a tiny tower pair: 2x2-pixel patches pooled 2x2 (a soft
    token per 4x4 pixels), clipped linears and standardization on (as the released E2B); audio (E2B only, as the
    released models) over 16 mel bins, chunks of 4 frames with 4 frames of left context."""
    from transformers import Gemma4AudioConfig, Gemma4VisionConfig

    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, patch_size=2, pooling_kernel_size=2,
                                position_embedding_size=16, use_clipped_linears=True, standardize=True)
    audio = None
    if family == "e2b":
        audio = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  subsampling_conv_channels=[AUDIO_MEL_BINS, 4], attention_chunk_size=4,
                                  attention_context_left=5, attention_context_right=0, output_proj_dims=24)
    return vision, audio


@torch.no_grad()
def randomize_towers_(model, seed: int):
    """Random tower weights (as `randomize_`), finite clip bounds that bite now and then (transformers' defaults
    are +-inf) and a standardization away from the identity."""
    g = torch.Generator().manual_seed(seed)
    for name in ("vision_tower", "audio_tower", "embed_vision", "embed_audio"):
        module = getattr(model.model, name, None)
        if module is None:
            continue
        for _, p in module.named_parameters():
            p.copy_((1.0 + 0.3 * torch.randn(p.shape, generator=g)) if p.ndim == 1 else
                    0.2 * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():
            bound = 0.8 + 0.8 * torch.rand((), generator=g)
            if name.endswith(("input_min", "output_min")):
                b.fill_(-bound)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(bound)
            elif name == "std_bias":
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
            elif name == "std_scale":
                b.copy_(0.5 + torch.rand(b.shape, generator=g))


def make_multimodal_target(family: str):
    """The family's target (the same text weights as `make_models`') inside a Gemma4ForConditionalGeneration with
    tiny random towers."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text, _ = make_models(family)
    vision, audio = make_media_configs(family)
    cfg = Gemma4Config(text_config=text.config, vision_config=vision, audio_config=audio, **MEDIA_TOKEN_IDS)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    model.model.language_model.load_state_dict(text.model.state_dict(), strict=True)
    randomize_towers_(model, SEEDS[family] + 11)
    model.tie_weights()
    return model


def build_multimodal_target(family: str, out_dir: Path) -> Path:
    """Save the family's multimodal target as transformers does (Gemma4ForConditionalGeneration: text weights under
    `model.language_model.`, the towers and their embedders beside them). E2B is then rewritten into the released
    checkpoints' style: a `text_config` with `global_head_dim` / `num_global_key_value_heads` and no
    `per_layer_config`, and stale k_proj / v_proj / k_norm tensors for the KV-shared layers, which a loader must
    skip (transformers does)."""
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir)
    model = make_multimodal_target(family)
    _quiet_save(model, out_dir)
    if family != "e2b":
        return out_dir
    tcfg = model.config.text_config
    f = out_dir / "model.safetensors"
    tensors = load_file(str(f))
    g = torch.Generator().manual_seed(SEEDS[family] + 7)
    L, n_shared = tcfg.num_hidden_layers, tcfg.num_kv_shared_layers
    for i in range(L - n_shared, L):
        lc = tcfg.per_layer_config[i]
        D, nkv = lc.head_dim, lc.num_key_value_heads
        p = f"model.language_model.layers.{i}.self_attn."
        tensors[p + "k_proj.weight"] = 0.2 * torch.randn(nkv * D, tcfg.hidden_size, generator=g)
        tensors[p + "v_proj.weight"] = 0.2 * torch.randn(nkv * D, tcfg.hidden_size, generator=g)
        tensors[p + "k_norm.weight"] = 1.0 + 0.3 * torch.randn(D, generator=g)
    save_file(tensors, str(f), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["text_config"] = _released_style_text_config(tcfg)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def build_sharded_target(family: str, out_dir: Path) -> Path:
    """Save the family's target as `model.safetensors.index.json` + 2 shards."""
    target, _ = make_models(family)
    total = sum(t.numel() * t.element_size() for k, t in target.state_dict().items() if k != "lm_head.weight")
    _quiet_save(target, Path(out_dir), max_shard_size=int(total * 0.6))
    shards = sorted(p.name for p in Path(out_dir).glob("model-*.safetensors"))
    assert len(shards) == 2 and (Path(out_dir) / "model.safetensors.index.json").exists(), shards
    return Path(out_dir)


def build_unified_text_target(family: str, out_dir: Path) -> Path:
    """The unified family's target weights saved by Gemma4UnifiedForCausalLM (config `gemma4_unified_text`, text
    weights under `model.`, no embedders): the text-only layout of the same model."""
    from transformers import Gemma4UnifiedForCausalLM

    multimodal, _ = make_models(family)
    text = Gemma4UnifiedForCausalLM(multimodal.config.get_text_config()).eval()
    prefix = "model.language_model."
    state = {"model." + k[len(prefix):]: v for k, v in multimodal.state_dict().items() if k.startswith(prefix)}
    missing, unexpected = text.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    text.tie_weights()
    _quiet_save(text, Path(out_dir))
    return Path(out_dir)


def build_all(root: Path) -> dict:
    """Build every family under root/<family>/. Returns {family: {"target", "assistant"[, extra layouts]}}."""
    root = Path(root)
    out = {}
    for fam in FAMILIES:
        out[fam] = build_pair(fam, root / fam)
        out[fam]["target_plain"] = build_plain_target(fam, root / fam / "target_plain")
    for fam in MULTIMODAL:
        out[fam]["target_multimodal"] = build_multimodal_target(fam, root / fam / "target_multimodal")
    out["a26b"]["target_sharded"] = build_sharded_target("a26b", root / "a26b" / "target_sharded")
    out["u12b"]["target_text"] = build_unified_text_target("u12b", root / "u12b" / "target_text")
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Reference extraction (transformers, CPU, float32); models are loaded once per process
# ----------------------------------------------------------------------------------------------------------------------
def _quiet_load(cls, path: str):
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return cls.from_pretrained(str(path), dtype=torch.float32).eval()
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _model_type(directory) -> str:
    return json.loads((Path(directory) / "config.json").read_text())["model_type"]


@functools.lru_cache(maxsize=None)
def load_hf_target(target_dir: str):
    """transformers' model of the checkpoint's own class (the unified multimodal one for a `gemma4_unified` target,
    which is how the released 12B runs text)."""
    import transformers

    cls = {"gemma4_unified": "Gemma4UnifiedForConditionalGeneration", "gemma4_unified_text": "Gemma4UnifiedForCausalLM"}
    return _quiet_load(getattr(transformers, cls.get(_model_type(target_dir), "Gemma4ForCausalLM")), target_dir)


@functools.lru_cache(maxsize=None)
def load_hf_assistant(assistant_dir: str):
    import transformers

    unified = _model_type(assistant_dir) == "gemma4_unified_assistant"
    return _quiet_load(getattr(transformers, "Gemma4UnifiedAssistantForCausalLM" if unified
                               else "Gemma4AssistantForCausalLM"), assistant_dir)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def _kv_to_btnd(kv) -> tuple:
    k, v = kv  # HF: [B, nKV, T, D]
    return _np(k.transpose(1, 2)), _np(v.transpose(1, 2))


@torch.inference_mode()
def _hf_target_raw(target_dir, token_ids):
    model = load_hf_target(str(target_dir))
    ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.long)
    return model(ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)


def hf_target_outputs(target_dir, token_ids: np.ndarray) -> dict:
    """logits [B,T,V], hidden [B,T,H] (= hidden_states[-1], post-final-norm), store_kv {type: (k, v)} as [B,T,nKV,D]."""
    out = _hf_target_raw(target_dir, token_ids)
    return {
        "logits": _np(out.logits),
        "hidden": _np(out.hidden_states[-1]),
        "store_kv": {t: _kv_to_btnd(out.shared_kv_states[t]) for t in ("sliding_attention", "full_attention")},
    }


@torch.inference_mode()
def hf_draft_steps(target_dir, assistant_dir, token_ids: np.ndarray, num_steps: int = NUM_ASSISTANT_TOKENS) -> list:
    """Draft `num_steps` tokens after the prompt token_ids [1, T] exactly as transformers' generator does.

    Target on the prompt -> bonus = argmax(last logits); step 1 gets (bonus, hidden_states[-1][:, -1]); step s>1 gets
    (argmax of step s-1's logits, step s-1's `last_hidden_state` = post_projection output). All steps: position T,
    the same target K/V (positions 0..T-1). Returns per step a dict with the inputs `token` (int), `h` [Hb], `position`
    (int) and the outputs `logits` [V], `h_next` [Hb], `draft` (= argmax(logits), int).
    """
    ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.long)
    assert ids.ndim == 2 and ids.shape[0] == 1, "hf_draft_steps takes one sequence [1, T]"
    T = ids.shape[1]
    target = load_hf_target(str(target_dir))
    assistant = load_hf_assistant(str(assistant_dir))
    out = _hf_target_raw(target_dir, ids.numpy())
    kv = out.shared_kv_states
    tok = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1] bonus token
    h = out.hidden_states[-1][:, -1:]  # [1, 1, Hb]
    position_ids = torch.tensor([[T]], dtype=torch.long)
    attention_mask = torch.ones(1, T + 1, dtype=torch.long)  # what generate() passes (ids incl. the bonus token)
    embed = target.get_input_embeddings()
    steps = []
    for _ in range(num_steps):
        a = assistant(
            inputs_embeds=torch.cat([embed(tok), h], -1),
            attention_mask=attention_mask,
            position_ids=position_ids,
            shared_kv_states=kv,
            use_cache=False,
        )
        logits = a.logits[0, 0]
        steps.append(
            {
                "token": int(tok[0, 0]),
                "h": _np(h[0, 0]),
                "position": T,
                "logits": _np(logits),
                "h_next": _np(a.last_hidden_state[0, 0]),
                "draft": int(logits.argmax()),
            }
        )
        tok = a.logits.argmax(-1)  # [1, 1]
        h = a.last_hidden_state  # [1, 1, Hb]
    return steps


@torch.inference_mode()
def acceptance_report(family: str, root: Path | None = None, prompts: int = 3, max_new_tokens: int = 40) -> list:
    """Dev helper: accepted drafts per round of transformers' greedy assisted decoding on a few random prompts (to
    check that the alignment gives a mix of 0 / partial / full acceptance)."""
    from transformers.generation import candidate_generator as cg_mod

    if root is None:
        target, assistant = make_models(family)
        assistant.generation_config.num_assistant_tokens = NUM_ASSISTANT_TOKENS
    else:
        target, assistant = load_hf_target(str(root / "target")), load_hf_assistant(str(root / "assistant"))
    rec = []
    orig = cg_mod.SinglePositionMultiTokenCandidateGenerator.get_candidates

    def spy(self, input_ids, **kw):
        cand, logits = orig(self, input_ids, **kw)
        if logits is not None:
            rec.append(cand[0, input_ids.shape[1]:].tolist())
        return cand, logits

    results = []
    cg_mod.SinglePositionMultiTokenCandidateGenerator.get_candidates = spy
    try:
        g = torch.Generator().manual_seed(7)
        for _ in range(prompts):
            prompt = torch.randint(3, VOCAB, (1, 13), generator=g)
            rec.clear()
            plain = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False)
            assisted = target.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False,
                                       assistant_model=assistant)
            assert torch.equal(plain, assisted)
            gen = plain[0, prompt.shape[1]:].tolist()
            # accepted per round: recompute from drafts vs. the emitted tokens
            pos, acc = 1, []
            for d in rec:
                n = 0
                while n < len(d) and pos + n < len(gen) and d[n] == gen[pos + n]:
                    n += 1
                acc.append(n)
                pos += n + 1
            results.append(acc)
    finally:
        cg_mod.SinglePositionMultiTokenCandidateGenerator.get_candidates = orig
    return results


if __name__ == "__main__":
    import time

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "out/hf_tiny")
    t0 = time.time()
    paths = build_all(root)
    print(f"built in {time.time() - t0:.2f}s")
    for fam, p in paths.items():
        for k, v in p.items():
            print(f"{fam:5s} {k:18s} {v}  {sorted(os.listdir(v))}")


# ----------------------------------------------------------------------------------------------------------------------
# Helpers for the parity tests
# ----------------------------------------------------------------------------------------------------------------------
def import_gemma4_mtp_jax():
    """The package under test (imported here so that this module stays importable without JAX)."""
    import gemma4_mtp_jax

    return gemma4_mtp_jax


# ----------------------------------------------------------------------------------------------------------------------
# Comparison helper
# ----------------------------------------------------------------------------------------------------------------------
def assert_close(name: str, got, want, atol: float = 1e-4):
    """Max-abs comparison with a message that says where the worst element is."""
    got = np.asarray(got, dtype=np.float32)
    want = np.asarray(want, dtype=np.float32)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != reference {want.shape}"
    assert np.all(np.isfinite(got)), f"{name}: non-finite values at {np.argwhere(~np.isfinite(got))[:5].tolist()}"
    diff = np.abs(got - want)
    worst = float(diff.max()) if diff.size else 0.0
    if os.environ.get("HF_TINY_LOG_CLOSE"):  # print every comparison's margin (run pytest with -s)
        print(f"[assert_close] {worst:.2e} / {atol:.0e}  {name}")
    if not worst <= atol:
        idx = np.unravel_index(int(diff.argmax()), diff.shape)
        n_bad = int((diff > atol).sum())
        raise AssertionError(
            f"{name}: max|got-ref| = {worst:.3e} > {atol:.0e} at index {tuple(int(i) for i in idx)} "
            f"(got {got[idx]:.6g}, ref {want[idx]:.6g}); {n_bad}/{diff.size} elements over tolerance; "
            f"max|ref| = {float(np.abs(want).max()):.3g}"
        )
    return worst
