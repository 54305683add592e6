"""Target forward parity with transformers 5.24 (CPU, float32, max-abs 1e-4) on the tiny random checkpoints of
hf_tiny.py: logits, post-final-norm hidden and the "store" layers' K/V, for prompts longer than the sliding window;
plus a bfloat16 smoke test, the multimodal / sharded checkpoint layouts, and fp8 weights' accuracy."""

from __future__ import annotations

import numpy as np
import pytest

import hf_tiny
from hf_tiny import assert_close, import_gemma4_mtp_jax

ATOL = 1e-4
FAMILIES = hf_tiny.FAMILIES
LENGTHS = (13, 21)  # both longer than the sliding window (8)
LAYER_TYPES = ("sliding_attention", "full_attention")


def prompt_tokens(family: str, T: int, batch: int = 2) -> np.ndarray:
    """Deterministic random prompts, a different sequence per row."""
    rng = np.random.default_rng(1000 * FAMILIES.index(family) + T)
    return rng.integers(0, hf_tiny.VOCAB, size=(batch, T)).astype(np.int32)


_RESULTS = {}


def _parity_run(tiny_ckpts, jax_models, family: str, T: int):
    """(HF reference outputs, JAX outputs as numpy) for the family's target on prompt_tokens(family, T); memoized."""
    key = (family, T)
    if key not in _RESULTS:
        g = import_gemma4_mtp_jax()
        import jax.numpy as jnp

        tokens = prompt_tokens(family, T)
        ref = hf_tiny.hf_target_outputs(tiny_ckpts[family]["target"], tokens)
        target = jax_models.target(tiny_ckpts[family]["target"], "float32")
        out = g.target_forward(target, jnp.asarray(tokens, dtype=jnp.int32))
        got = {
            "logits": np.asarray(out.logits),
            "hidden": np.asarray(out.hidden),
            "store_kv": {t: tuple(np.asarray(a) for a in out.store_kv[t]) for t in LAYER_TYPES},
        }
        _RESULTS[key] = (ref, got)
    return _RESULTS[key]


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_target_logits_and_hidden(tiny_ckpts, jax_models, family, T):
    ref, got = _parity_run(tiny_ckpts, jax_models, family, T)
    assert got["logits"].dtype == np.float32, got["logits"].dtype
    assert_close(f"{family} T={T} logits", got["logits"], ref["logits"], ATOL)
    assert_close(f"{family} T={T} hidden (post-final-norm)", got["hidden"], ref["hidden"], ATOL)
    np.testing.assert_array_equal(got["logits"].argmax(-1), ref["logits"].argmax(-1))


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_target_store_kv(tiny_ckpts, jax_models, family, T):
    ref, got = _parity_run(tiny_ckpts, jax_models, family, T)
    for t in LAYER_TYPES:
        for j, name in enumerate(("k", "v")):
            assert_close(f"{family} T={T} store_kv[{t}].{name} [B,T,nKV,D]", got["store_kv"][t][j],
                         ref["store_kv"][t][j], ATOL)


def test_target_bfloat16_smoke(tiny_ckpts, jax_models):
    """bfloat16 weights/activations: finite logits, and the argmax mostly agrees with float32 (loose smoke test)."""
    g = import_gemma4_mtp_jax()
    import jax.numpy as jnp

    for family in FAMILIES:
        tokens = jnp.asarray(prompt_tokens(family, 21), dtype=jnp.int32)
        f32 = np.asarray(g.target_forward(jax_models.target(tiny_ckpts[family]["target"], "float32"), tokens).logits)
        out = g.target_forward(jax_models.target(tiny_ckpts[family]["target"], "bfloat16"), tokens)
        bf16 = np.asarray(jnp.asarray(out.logits, dtype=jnp.float32))
        assert bf16.shape == f32.shape
        assert np.all(np.isfinite(bf16)), f"{family}: non-finite bfloat16 logits"
        agree = float((bf16.argmax(-1) == f32.argmax(-1)).mean())
        assert agree >= 0.75, f"{family}: bfloat16 argmax agrees with float32 on only {agree:.0%} of positions"


@pytest.mark.parametrize("family,variant", [("e2b", "target_multimodal"), ("a26b", "target_sharded"),
                                            ("u12b", "target_text")])
def test_checkpoint_layouts_same_logits(tiny_ckpts, jax_models, family, variant):
    """Multimodal layout (text under model.language_model., towers and stale KV-shared k/v tensors to skip,
    released-style text_config), a sharded checkpoint, and the unified 12B's text-only layout (Gemma4UnifiedForCausalLM:
    `gemma4_unified_text`, text under model.; its plain checkpoint is the multimodal one) give the plain checkpoint's
    logits."""
    g = import_gemma4_mtp_jax()
    import jax.numpy as jnp

    tokens = jnp.asarray(prompt_tokens(family, 13), dtype=jnp.int32)
    plain = g.target_forward(jax_models.target(tiny_ckpts[family]["target"], "float32"), tokens)
    other = g.target_forward(jax_models.target(tiny_ckpts[family][variant], "float32"), tokens)
    # same weights, same program: the results should be identical; 1e-6 only allows for a different XLA fusion
    assert_close(f"{family} {variant} logits vs plain checkpoint", other.logits, plain.logits, 1e-6)
    assert_close(f"{family} {variant} hidden vs plain checkpoint", other.hidden, plain.hidden, 1e-6)


# Measured on these prompts (T = 21, 42 positions; CPU, float32 compute): mean KL (nats) of the fp8-weight model's
# next-token law from the float checkpoint's, and top-1 agreement. bfloat16 weights and activations give KL
# 0.003-0.011 and 88-98% agreement; fp8 weights with bf16 activations 0.044-0.125 and 50-83%. The tiny random
# models' laws are nearly flat (the top token holds 6-12% on average of 512), so fp8's weight error (~2.4%: 3
# mantissa bits, per-channel amax scaling) flips many near-ties. The bounds catch a mis-scaled quantizer (scales
# 4x too small: KL 1.26, top-1 5%); the dequantized-weights comparison catches a matmul that reads the wrong scale.
FP8_MEASURED = {"e2b": (0.086, 0.786), "a26b": (0.125, 0.571), "b31b": (0.086, 0.500), "u12b": (0.044, 0.786)}
FP8_MAX_KL, FP8_MIN_TOP1 = 0.25, 0.4
FP8_DEQUANTIZED_ATOL = 1e-4  # fp8 x scale on the output vs on each weight: float32 rounding apart


def _dequantized(params, prefix=""):
    """The unquantized tree of the weights an fp8 tree stands for (each fp8 weight times its scale, float32)."""
    from gemma4_mtp_jax.weights.quantize import dequantize, is_quantized, is_scale

    out = {}
    for k, v in params.items():
        path = prefix + k
        if isinstance(v, dict):
            out[k] = _dequantized(v, path + ".")
        elif not is_scale(path):
            out[k] = dequantize(v, params[k + "_scale"], np.float32) if is_quantized(path) else v
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_weights_accuracy(tiny_ckpts, jax_models, family):
    """fp8 weights (quantized at load; float32 activations): the logits are those of the unquantized model run on
    the weights the fp8 ones stand for (fp8 x scale), to float32 rounding, so every quantized matmul reads its
    scale; and they stay within FP8_MAX_KL / FP8_MIN_TOP1 of the float checkpoint's (measured: FP8_MEASURED)."""
    from testenv import kl_and_top1

    g = import_gemma4_mtp_jax()
    import jax.numpy as jnp

    ref, got = _parity_run(tiny_ckpts, jax_models, family, 21)
    tokens = jnp.asarray(prompt_tokens(family, 21), dtype=jnp.int32)
    fp8 = g.load_target(tiny_ckpts[family]["target"], "float32", quantization="fp8")
    logits = np.asarray(g.target_forward(fp8, tokens).logits)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    plain = jax_models.target(tiny_ckpts[family]["target"], "float32")  # its compiled forward, dequantized weights
    dequantized = np.asarray(plain._forward(_dequantized(fp8.params), tokens, positions)[0])
    assert_close(f"{family} fp8 logits vs its dequantized weights", logits, dequantized, FP8_DEQUANTIZED_ATOL)
    kl, top1 = kl_and_top1(got["logits"], logits)
    print(f"{family}: fp8 weights vs float32: mean KL {kl:.4f} nats, top-1 agreement {top1:.3f}")
    assert kl <= FP8_MAX_KL and top1 >= FP8_MIN_TOP1, (
        f"{family}: KL {kl:.4f}, top-1 {top1:.3f} (measured: {FP8_MEASURED[family]})")
