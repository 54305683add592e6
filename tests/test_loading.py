"""Config parsing (both serialised forms, derived geometry, refusals) and loader errors on bad checkpoints."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_tiny

from gemma4_mtp_jax.model.config import (
    FULL,
    SLIDING,
    ConfigError,
    check_pair,
    parse_assistant_config,
    parse_target_config,
)

_S, _F = SLIDING, FULL
BASE = dict(model_type="gemma4_text", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
            layer_types=[_S, _S, _S, _F, _S, _S, _S, _F], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            sliding_window=8, hidden_size_per_layer_input=0)


def _cfg(**kw):
    d = dict(BASE)
    d.update(kw)
    return d


def test_released_and_per_layer_config_forms_agree():
    released = parse_target_config(_cfg(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True))
    new = parse_target_config(_cfg(attention_k_eq_v=True,
                                   per_layer_config={"3": {"head_dim": 32, "num_key_value_heads": 1},
                                                     "7": {"head_dim": 32, "num_key_value_heads": 1}}))
    assert released.layers == new.layers
    full = [(lc.head_dim, lc.num_kv_heads, lc.k_eq_v) for lc in released.layers if lc.layer_type == _F]
    assert full == [(32, 1, True)] * 2
    wrapped = parse_target_config({"model_type": "gemma4", "text_config": _cfg(global_head_dim=32)})
    assert wrapped.layers[3].head_dim == 32


def test_global_kv_heads_apply_only_with_k_eq_v():
    cfg = parse_target_config(_cfg(global_head_dim=32, num_global_key_value_heads=1))  # no attention_k_eq_v
    assert all(lc.num_kv_heads == 2 for lc in cfg.layers)


def test_derived_geometry_last_layer_forced_full_and_kv_sharing():
    cfg = parse_target_config(_cfg(layer_types=[_S, _S, _S, _F, _S, _S, _S, _S], num_kv_shared_layers=3,
                                   use_double_wide_mlp=True))
    assert cfg.layer_types[-1] == _F  # forced, as transformers does
    assert [lc.kv_mode for lc in cfg.layers] == [None, None, None, "store", "store", "reuse", "reuse", "reuse"]
    assert cfg.store_layers == {_F: 3, _S: 4}
    assert [lc.kv_source for lc in cfg.layers[5:]] == [4, 4, 3]
    assert [lc.intermediate_size for lc in cfg.layers] == [128] * 5 + [256] * 3  # double-wide on reuse layers


def test_default_layer_types_and_store_layers():
    cfg = parse_target_config({k: v for k, v in _cfg(num_hidden_layers=12, num_kv_shared_layers=4).items()
                               if k != "layer_types"})
    assert cfg.layer_types == tuple(_S if (i + 1) % 6 else _F for i in range(12))
    assert cfg.store_layers == {_S: 7, _F: 5}
    assert cfg.layers[8].kv_source == 7 and cfg.layers[11].kv_source == 5
    assert cfg.layers[8].intermediate_size == 128  # double-wide only when asked


@pytest.mark.parametrize("change,field", [
    (dict(model_type="llama"), "model_type"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(hidden_activation="relu"), "hidden_activation"),
    (dict(num_kv_shared_layers=9), "num_kv_shared_layers"),
    (dict(num_kv_shared_layers=7), "num_kv_shared_layers"),  # leaves no full-attention producer
    (dict(layer_types=[_S] * 7), "layer_types"),
    (dict(layer_types=[_S] * 7 + ["local"]), "layer_types"),
    (dict(num_attention_heads=3), "num_attention_heads"),
    (dict(per_layer_config={"1": {"head_dim": 32}}), "per_layer_config"),
    (dict(per_layer_config={"40": {"head_dim": 32}}), "per_layer_config"),
    (dict(enable_moe_block=True), "num_experts"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(rope_parameters={_S: {"rope_type": "yarn", "rope_theta": 1.0}}), "rope_type"),
])
def test_bad_configs_are_refused_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        parse_target_config(_cfg(**change), "x/config.json")


def _assistant(**kw):
    d = dict(model_type="gemma4_assistant", backbone_hidden_size=64, use_ordered_embeddings=True, num_centroids=16,
             centroid_intermediate_top_k=4,
             text_config=dict(model_type="gemma4_text", vocab_size=512, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=4, layer_types=[_S, _S, _S, _F], num_attention_heads=2,
                              num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
                              hidden_size_per_layer_input=0))
    d.update(kw)
    return d


def test_assistant_config_and_pair_checks():
    a = parse_assistant_config(_assistant())
    assert all(lc.kv_mode == "reuse" for lc in a.text.layers)  # num_kv_shared_layers 0 -> all layers
    check_pair(parse_target_config(_cfg(global_head_dim=32)), a)
    with pytest.raises(ConfigError, match="backbone_hidden_size"):
        check_pair(parse_target_config(_cfg(global_head_dim=32, hidden_size=48)), a)
    with pytest.raises(ConfigError, match="full_attention"):
        check_pair(parse_target_config(_cfg(global_head_dim=64)), a)
    with pytest.raises(ConfigError, match="num_centroids"):
        parse_assistant_config(_assistant(num_centroids=15))
    with pytest.raises(ConfigError, match="model_type"):
        parse_assistant_config(_cfg())
    bad = _assistant()
    bad["text_config"] = dict(bad["text_config"], enable_moe_block=True, num_experts=4, top_k_experts=2,
                              moe_intermediate_size=8)
    with pytest.raises(ConfigError, match="enable_moe_block"):
        parse_assistant_config(bad)


# The released 12B's text config (google/gemma-4-12B-it, `gemma4_unified`) at its own sizes, the fields it carries
# that the unified architecture has no use for included (per-layer-input and MoE fields, off).
UNIFIED_12B = dict(model_type="gemma4_unified_text", vocab_size=262144, hidden_size=3840, intermediate_size=15360,
                   num_hidden_layers=48, layer_types=([_S] * 5 + [_F]) * 8, num_attention_heads=16,
                   num_key_value_heads=8, num_global_key_value_heads=1, attention_k_eq_v=True, head_dim=256,
                   global_head_dim=512, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                   vocab_size_per_layer_input=262144, enable_moe_block=False, num_experts=None,
                   num_kv_shared_layers=0, use_double_wide_mlp=False)


def test_unified_configs_parse_with_their_own_defaults_and_pair_only_with_each_other():
    """`gemma4_unified` (the 12B) wraps a `gemma4_unified_text` model: no PLE, no MoE (a config turning either on is
    refused), transformers' unified defaults (sliding window 1024 where the field is absent), a wrapper holding
    its own architecture's text model only; its `gemma4_unified_assistant` drafts for it and not for a Gemma 4
    target of the same geometry, nor a Gemma 4 assistant for it."""
    text = {k: v for k, v in UNIFIED_12B.items() if k != "sliding_window"}
    cfg = parse_target_config({"model_type": "gemma4_unified", "text_config": text})
    assert cfg.model_type == "gemma4_unified_text" and cfg.sliding_window == 1024
    assert cfg.hidden_size_per_layer_input == 0 and not cfg.enable_moe_block and cfg.num_experts == 0
    assert cfg.store_layers == {_S: 46, _F: 47}
    assert {(lc.layer_type, lc.head_dim, lc.num_kv_heads, lc.k_eq_v) for lc in cfg.layers} == {
        (_S, 256, 8, False), (_F, 512, 1, True)}
    assert parse_target_config(dict(UNIFIED_12B, sliding_window=1024)).layers == cfg.layers
    assert parse_target_config(_cfg()).sliding_window == 8 and parse_target_config(
        {k: v for k, v in _cfg().items() if k != "sliding_window"}).sliding_window == 512  # Gemma 4's default
    for change, field in ((dict(hidden_size_per_layer_input=256), "hidden_size_per_layer_input"),
                          (dict(enable_moe_block=True, num_experts=4), "enable_moe_block")):
        with pytest.raises(ConfigError, match=field):
            parse_target_config(dict(UNIFIED_12B, **change))
    with pytest.raises(ConfigError, match="gemma4_unified_text"):
        parse_target_config({"model_type": "gemma4_unified", "text_config": _cfg()})  # a gemma4_text inside
    with pytest.raises(ConfigError, match="gemma4_text"):
        parse_target_config({"model_type": "gemma4", "text_config": UNIFIED_12B})

    draft_text = dict(model_type="gemma4_unified_text", vocab_size=262144, hidden_size=1024, intermediate_size=8192,
                      num_hidden_layers=4, layer_types=[_S, _S, _S, _F], num_attention_heads=16,
                      num_key_value_heads=8, num_global_key_value_heads=1, attention_k_eq_v=True, head_dim=256,
                      global_head_dim=512, sliding_window=1024)
    unified_assistant = dict(model_type="gemma4_unified_assistant", backbone_hidden_size=3840,
                             use_ordered_embeddings=False, text_config=draft_text)
    a = parse_assistant_config(unified_assistant)
    assert a.text.model_type == "gemma4_unified_text" and all(lc.kv_mode == "reuse" for lc in a.text.layers)
    check_pair(cfg, a)
    no_type = dict(unified_assistant, text_config={k: v for k, v in draft_text.items() if k != "model_type"})
    assert parse_assistant_config(no_type).text == a.text  # transformers' default sub-config is the unified one
    same_geometry = parse_target_config(dict(UNIFIED_12B, model_type="gemma4_text", sliding_window=1024))
    with pytest.raises(ConfigError, match="gemma4_unified_assistant"):
        check_pair(same_geometry, a)
    gemma4_assistant = parse_assistant_config(dict(unified_assistant, model_type="gemma4_assistant",
                                                   text_config=dict(draft_text, model_type="gemma4_text")))
    with pytest.raises(ConfigError, match="gemma4_assistant"):
        check_pair(cfg, gemma4_assistant)
    with pytest.raises(ConfigError, match="gemma4_unified_text"):
        parse_assistant_config(dict(unified_assistant, text_config=dict(draft_text, model_type="gemma4_text")))


def test_converter_knows_the_model_types_the_loaders_do():
    """checkpoints_convert spells the model types out (its --help imports no JAX): the loaders' lists."""
    import checkpoints_convert
    from gemma4_mtp_jax.model import config

    assert set(checkpoints_convert.TARGET_MODEL_TYPES) == set(config.TARGET_MODEL_TYPES)
    assert set(checkpoints_convert.ASSISTANT_MODEL_TYPES) == set(config.ASSISTANT_MODEL_TYPES)


# -------------------------------------------------------------------------------------------------- bad checkpoints
def _copy_with(src, dst, edit, torch: bool = False):
    """A copy of checkpoint `src` at `dst` with `edit` applied to its tensors: numpy arrays, or torch tensors (for
    a checkpoint holding fp8 tensors: safetensors' numpy API has no float8)."""
    if torch:
        from safetensors.torch import load_file as load, save_file as save
    else:
        load, save = load_file, save_file
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load(str(f))
    edit(tensors)
    save(tensors, str(f))
    return dst


def test_missing_unexpected_and_misshapen_tensors_are_named(tiny_ckpts, tmp_path):
    from gemma4_mtp_jax import CheckpointError, load_assistant, load_target

    src = tiny_ckpts["b31b"]["target"]
    name = "model.layers.2.mlp.up_proj.weight"
    d = _copy_with(src, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_target(d, "float32")

    d = _copy_with(src, tmp_path / "extra",
                   lambda t: t.update({"model.layers.2.mlp.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.2.mlp.extra.weight'"):
        load_target(d, "float32")

    d = _copy_with(src, tmp_path / "shape", lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape"):
        load_target(d, "float32")

    asrc = tiny_ckpts["e2b"]["assistant"]
    d = _copy_with(asrc, tmp_path / "ordering",
                   lambda t: t.update({"masked_embedding.token_ordering":
                                       np.zeros_like(t["masked_embedding.token_ordering"])}))
    with pytest.raises(CheckpointError, match="token_ordering is not a permutation"):
        load_assistant(d, "float32")


def test_wrong_model_type_and_bad_json(tiny_ckpts, tmp_path):
    from gemma4_mtp_jax import load_assistant, load_target

    d = tmp_path / "t"
    shutil.copytree(tiny_ckpts["e2b"]["target"], d)
    with pytest.raises(ConfigError, match="gemma4_assistant"):
        load_assistant(d, "float32")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_target(d, "float32")
    cfg = json.loads((tiny_ckpts["e2b"]["target"] / "config.json").read_text())
    cfg["model_type"] = "gemma3_text"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="gemma3_text"):
        load_target(d, "float32")
    with pytest.raises(ConfigError, match="no such checkpoint"):
        load_target(tmp_path / "nope", "float32")


def test_load_format_dummy_reads_only_config_json(tiny_ckpts, tmp_path):
    """`load_format="dummy"` (the server's --load-format dummy): a directory holding only config.json gives random
    weights of exactly the checkpoint's shapes and dtypes, for target and assistant; an unknown format is refused."""
    import jax

    from gemma4_mtp_jax.api import load_assistant, load_target
    from gemma4_mtp_jax.weights.quantize import quantize_abstract

    for kind, load in (("target", load_target), ("assistant", load_assistant)):
        src = tiny_ckpts["e2b"][kind]
        d = tmp_path / kind
        d.mkdir()
        shutil.copy(src / "config.json", d / "config.json")
        real, dummy = load(src, "float32"), load(d, "float32", load_format="dummy")
        shapes = lambda m: jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), m.params)  # noqa: E731
        assert shapes(dummy) == shapes(real)
        assert dummy.config == real.config
        assert all(np.any(np.asarray(a) != 0) for a in jax.tree_util.tree_leaves(dummy.params))
        # fp8 (the benchmarks' quantized random weights): the fp8 model's shapes, values spread over fp8's range,
        # scales making the weights they stand for ~N(0, 0.02) like the unquantized ones
        fp8 = load(d, "float32", load_format="dummy", quantization="fp8")
        assert shapes(fp8) == jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), quantize_abstract(real.params))
        q, scale = (np.asarray(a, np.float32) for a in (fp8.params["layers_0"]["self_attn"]["q_proj"]["weight"],
                                                        fp8.params["layers_0"]["self_attn"]["q_proj"]["weight_scale"]))
        assert 50 < np.abs(q).max() <= 448 and 0.015 < np.std(q * scale[:, None]) < 0.025
    with pytest.raises(ValueError, match="load_format"):
        load_target(tiny_ckpts["e2b"]["target"], load_format="random")


def test_on_host_loading_keeps_host_arrays_and_equal_values(tiny_ckpts):
    """on_host=True (a multi-device engine's loading): the same values as a normal load, as host arrays, so the
    engine puts each tensor straight onto its shards; the engine still runs from them. Quantized at load, the
    same fp8 values and scales bit for bit."""
    import jax

    from gemma4_mtp_jax.api import load_assistant, load_target

    for kind, load, quantization in (("target", load_target, None), ("assistant", load_assistant, None),
                                     ("target", load_target, "fp8")):  # fp8: quantized by numpy, and by XLA
        dev, host = (load(tiny_ckpts["e2b"][kind], "float32", on_host=on_host, quantization=quantization)
                     for on_host in (False, True))
        for a, b in zip(jax.tree_util.tree_leaves(dev.params), jax.tree_util.tree_leaves(host.params)):
            assert isinstance(b, np.ndarray) and b.dtype == a.dtype
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), b.view(np.uint8))


# -------------------------------------------------------------------------------------------------- fp8 checkpoints
def _flat(params) -> dict:
    import jax

    return {".".join(str(k.key) for k in p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.mark.parametrize("unfused_experts", [False, True], ids=["fused-experts", "per-expert"])
def test_compressed_tensors_fp8_checkpoint_loads_as_written(tiny_ckpts, tmp_path, unfused_experts):
    """A compressed-tensors FP8-dynamic checkpoint (per-channel float32 scales) of the MoE family loads fp8 with no
    flag: each Linear's fp8 weight and scale as written, the router, embeddings and norms as stored, the fused
    experts quantized at load (or, stored one fp8 Linear per expert, stacked as written); that is exactly the float
    checkpoint quantized at load (`quantization="fp8"`), whose quantizer rounds as compressed-tensors' does.
    `quantization="none"` dequantizes it."""
    import jax

    from gemma4_mtp_jax.api import load_target
    from gemma4_mtp_jax.weights.quantize import FP8, quantize_params

    src = tiny_ckpts["a26b"]["target"]
    written = hf_tiny.write_compressed_tensors_fp8(src, tmp_path / "ct", unfused_experts=unfused_experts)
    fp8 = _flat(load_target(tmp_path / "ct", "float32").params)
    at_load = _flat(load_target(src, "float32", quantization="fp8").params)
    plain_target = load_target(src, "float32")
    plain = _flat(plain_target.params)
    assert sorted(fp8) == sorted(at_load) == sorted(_flat(quantize_params(plain_target.params)))
    # the same rule and rounding as the loader's, on host copies: a GPU's float32 division may round an ulp away
    in_memory = _flat(quantize_params(jax.tree_util.tree_map(np.asarray, plain_target.params)))
    for k, want in at_load.items():
        assert fp8[k].dtype == want.dtype and np.array_equal(fp8[k].view(np.uint8), want.view(np.uint8)), k
        assert in_memory[k].dtype == want.dtype and np.array_equal(in_memory[k].view(np.uint8), want.view(np.uint8))
    paths = {re.sub(r"^model\.layers\.(\d+)\.", r"layers_\1.", name): w for name, w in written.items()
             if ".experts." not in name}
    for path, (q, scale) in paths.items():
        assert np.array_equal(fp8[path].view(np.uint8), q), path
        np.testing.assert_array_equal(fp8[path + "_scale"], scale[:, 0])
    experts = {k for k in plain if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert experts and {k for k, v in fp8.items() if v.dtype == FP8} == set(paths) | experts
    if unfused_experts:  # expert 1's up_proj rows, as written, are the second half of its gate_up_proj rows
        q, scale = written["model.layers.0.experts.1.up_proj.weight"]
        assert np.array_equal(fp8["layers_0.experts.gate_up_proj"][1, q.shape[0]:].view(np.uint8), q)
        np.testing.assert_array_equal(fp8["layers_0.experts.gate_up_proj_scale"][1, q.shape[0]:], scale[:, 0])
    np.testing.assert_array_equal(fp8["layers_0.router.proj.weight"], plain["layers_0.router.proj.weight"])

    dequantized = _flat(load_target(tmp_path / "ct", "float32", quantization="none").params)
    assert sorted(dequantized) == sorted(plain)
    for k, v in dequantized.items():  # the checkpoint's fp8 weights times their scales; its float tensors as they are
        assert v.dtype == np.float32, k
        stored_fp8 = k in paths or (unfused_experts and k in experts)
        want = fp8[k].astype(np.float32) * fp8[k + "_scale"][..., None] if stored_fp8 else plain[k]
        np.testing.assert_array_equal(v, want, err_msg=k)


def test_fp8_checkpoint_errors_name_the_tensor(tiny_ckpts, tmp_path):
    """Per-tensor bfloat16 scales ([1]) load; a missing or mis-shaped scale, a scale beside a float weight, and
    quantization configs this package does not read are one-line errors naming the tensor or the field."""
    import jax

    from gemma4_mtp_jax import CheckpointError
    from gemma4_mtp_jax.api import load_target, target_shapes

    ct = tmp_path / "ct"
    written = hf_tiny.write_compressed_tensors_fp8(tiny_ckpts["b31b"]["target"], ct, strategy="tensor",
                                                   scale_dtype="bfloat16")
    got = _flat(load_target(ct, "float32").params)
    q, scale = written["model.layers.2.mlp.up_proj.weight"]
    np.testing.assert_array_equal(got["layers_2.mlp.up_proj.weight_scale"], np.full(q.shape[:1], scale[0]))
    shapes = _flat(jax.tree_util.tree_map(lambda a: np.zeros((), a.dtype), target_shapes(ct, "float32").params))
    assert {k: v.dtype for k, v in shapes.items()} == {k: v.dtype for k, v in got.items()}

    name = "model.layers.2.mlp.up_proj.weight"
    d = _copy_with(ct, tmp_path / "missing", lambda t: t.pop(name + "_scale"), torch=True)
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}_scale'"):
        load_target(d, "float32")
    d = _copy_with(ct, tmp_path / "shape", lambda t: t.update({name + "_scale": t[name + "_scale"].repeat(3)}),
                   torch=True)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}_scale' has shape \(3,\)"):
        load_target(d, "float32")
    d = _copy_with(ct, tmp_path / "nan", lambda t: t.update({name + "_scale": t[name + "_scale"] * np.nan}),
                   torch=True)
    with pytest.raises(CheckpointError, match=f"'{name}_scale'.*non-finite"):
        load_target(d, "float32")
    d = _copy_with(ct, tmp_path / "stray", lambda t: t.update({name: t[name].float()}), torch=True)
    with pytest.raises(CheckpointError, match=f"'{name}_scale' is a scale, but '{name}' is not float8"):
        load_target(d, "float32")
    cfg = json.loads((ct / "config.json").read_text())
    for edit, field in [(lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block"), "strategy"),
                        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), "4-bit"),
                        (lambda q: q.update(quant_method="gptq"), "quant_method 'gptq'"),
                        (lambda q: q.update(format="pack-quantized"), "format 'pack-quantized'")]:
        bad = json.loads(json.dumps(cfg))
        edit(bad["quantization_config"])
        (ct / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"quantization_config.*{field}"):
            load_target(ct, "float32")
    with pytest.raises(ValueError, match="quantization must be"):
        load_target(ct, "float32", quantization="int8")




def test_fp8_needs_a_gpu_of_compute_capability_8_9():
    """fp8 on a GPU without fp8 support is an error naming the device; CPUs and Ada / Hopper GPUs pass."""
    from types import SimpleNamespace

    from gemma4_mtp_jax.kernels.device_budget import check_fp8_support

    gpu = lambda cc, i=0: SimpleNamespace(platform="gpu", compute_capability=cc, id=i,  # noqa: E731
                                          device_kind="NVIDIA A100-SXM4-80GB" if cc == "8.0" else "NVIDIA H100")
    check_fp8_support([SimpleNamespace(platform="cpu", id=0), gpu("8.9"), gpu("9.0"), gpu("12.0")])
    with pytest.raises(ValueError, match=r"device 3 \(NVIDIA A100-SXM4-80GB\) has compute capability 8\.0") as e:
        check_fp8_support([gpu("9.0"), gpu("8.0", 3)])
    assert "\n" not in str(e.value) and "8.9" in str(e.value)
    with pytest.raises(ValueError, match="an fp8 KV cache need"):  # the engine's check of its cache
        check_fp8_support([gpu("7.5")], "an fp8 KV cache")
