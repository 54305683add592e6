"""Assistant (MTP drafter) parity with transformers 5.24 (CPU, float32, max-abs 1e-4) on the tiny random checkpoints.

The reference is transformers' own drafting loop (hf_tiny.hf_draft_steps): after a prompt of T tokens the query sits
at position T (the bonus token's, convention 1), full layers see target keys 0..T-1, sliding layers the last W+1 of
them (convention 2; identical to transformers right after a prefill). Step 1 is fed (bonus token, target hidden at
T-1); steps 2..4 are fed (previous draft, previous post_projection output) - here exactly the inputs transformers got.
For the centroid head (e2b) the whole logits vector is compared, including the fill value min(selected)-1 of the
non-selected tokens (see FILL_PER_ROW).
"""

from __future__ import annotations

import numpy as np
import pytest

import hf_tiny
from hf_tiny import assert_close, import_gemma4_mtp_jax
from test_parity_target import FAMILIES, LAYER_TYPES, LENGTHS, prompt_tokens

ATOL = 1e-4
NUM_STEPS = hf_tiny.NUM_ASSISTANT_TOKENS

_HF_STEPS = {}


def hf_steps(tiny_ckpts, family: str, tokens: np.ndarray) -> list:
    """hf_draft_steps for each row of tokens (one sequence at a time, as transformers drafts); memoized."""
    key = (family, tokens.tobytes(), tokens.shape)
    if key not in _HF_STEPS:
        p = tiny_ckpts[family]
        _HF_STEPS[key] = [
            hf_tiny.hf_draft_steps(p["target"], p["assistant"], tokens[b : b + 1], NUM_STEPS)
            for b in range(tokens.shape[0])
        ]
    return _HF_STEPS[key]


def _models(tiny_ckpts, jax_models, family):
    p = tiny_ckpts[family]
    return jax_models.assistant(p["assistant"], "float32"), jax_models.target(p["target"], "float32")


def _hf_kv(tiny_ckpts, family, tokens):
    """transformers' store-layer K/V for tokens [B,T], as the JAX API takes it: {type: (k, v)} [B,T,nKV,D]."""
    import jax.numpy as jnp

    ref = hf_tiny.hf_target_outputs(tiny_ckpts[family]["target"], tokens)
    return {t: tuple(jnp.asarray(a) for a in ref["store_kv"][t]) for t in LAYER_TYPES}


# Fill value of the centroid head's non-selected tokens. transformers' Gemma4AssistantMaskedEmbedder uses
# min(selected logits over the WHOLE batch it is given) - 1; its generator only ever drafts one sequence, so per
# sequence that is min(own selected) - 1. The JAX API follows the module literally for the batch it is given (the
# reference below rebuilds that from the per-sequence runs). Set True to pin per-sequence fills instead.
FILL_PER_ROW = True


def _reference_logits(rows_ref) -> list:
    """transformers' logits per row, with the non-selected fill value the centroid head gives for this batch."""
    out = [s["logits"].copy() for s in rows_ref]
    if FILL_PER_ROW:
        return out
    sel = [lg > lg.min() for lg in out]  # the fill min(selected)-1 lies strictly below every selected logit
    fill = np.float32(min(float(lg[m].min()) for lg, m in zip(out, sel)) - 1.0)
    for lg, m in zip(out, sel):
        lg[~m] = fill
    return out


def _check_step(name, d, rows_ref, centroid: bool):
    """Compare a batched JAX draft result with the per-row transformers steps."""
    logits = np.asarray(d.logits)
    h_next = np.asarray(d.h_next)
    assert logits.ndim == 2 and h_next.ndim == 2, (logits.shape, h_next.shape)
    want = _reference_logits(rows_ref) if centroid else [s["logits"] for s in rows_ref]
    for b, s in enumerate(rows_ref):
        if centroid:
            # say whether a failure is in the selected (scored) tokens or in the fill value of the others
            sel = s["logits"] > s["logits"].min()
            assert_close(f"{name} row {b} logits of the selected tokens", logits[b][sel], want[b][sel], ATOL)
            assert_close(f"{name} row {b} logits of the non-selected tokens (fill)", logits[b][~sel],
                         want[b][~sel], ATOL)
        assert_close(f"{name} row {b} logits", logits[b], want[b], ATOL)
        assert_close(f"{name} row {b} h_next (post_projection)", h_next[b], s["h_next"], ATOL)
        assert int(logits[b].argmax()) == s["draft"], (
            f"{name} row {b}: argmax {int(logits[b].argmax())} != transformers' draft {s['draft']}")


def _is_centroid(tiny_ckpts, family) -> bool:
    import json

    cfg = json.loads((tiny_ckpts[family]["assistant"] / "config.json").read_text())
    return bool(cfg.get("use_ordered_embeddings"))


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_first_draft_step_end_to_end(tiny_ckpts, jax_models, family, T):
    """JAX target forward -> bonus = argmax, h = hidden[:, -1], kv = store_kv -> one JAX draft step == transformers."""
    g = import_gemma4_mtp_jax()
    import jax.numpy as jnp

    tokens = prompt_tokens(family, T)
    ref = hf_steps(tiny_ckpts, family, tokens)
    assistant, target = _models(tiny_ckpts, jax_models, family)
    out = g.target_forward(target, jnp.asarray(tokens, dtype=jnp.int32))
    bonus = jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32)
    assert np.asarray(bonus).tolist() == [r[0]["token"] for r in ref], "bonus token differs from transformers"
    d = g.draft_step(assistant, target, bonus, out.hidden[:, -1], kv=out.store_kv,
                     kv_lengths=jnp.full((tokens.shape[0],), T, dtype=jnp.int32))
    _check_step(f"{family} T={T} step 1 (end to end)", d, [r[0] for r in ref], _is_centroid(tiny_ckpts, family))


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_draft_steps_fed_transformers_inputs(tiny_ckpts, jax_models, family, T):
    """Steps 1..4, each fed exactly the (token, h) transformers got and transformers' K/V."""
    g = import_gemma4_mtp_jax()
    import jax.numpy as jnp

    tokens = prompt_tokens(family, T)
    ref = hf_steps(tiny_ckpts, family, tokens)
    assistant, target = _models(tiny_ckpts, jax_models, family)
    kv = _hf_kv(tiny_ckpts, family, tokens)
    kv_lengths = jnp.full((tokens.shape[0],), T, dtype=jnp.int32)
    centroid = _is_centroid(tiny_ckpts, family)
    for s in range(NUM_STEPS):
        rows = [r[s] for r in ref]
        tok = jnp.asarray([x["token"] for x in rows], dtype=jnp.int32)
        h = jnp.asarray(np.stack([x["h"] for x in rows]))
        d = g.draft_step(assistant, target, tok, h, kv=kv, kv_lengths=kv_lengths)
        _check_step(f"{family} T={T} step {s + 1}", d, rows, centroid)


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_steps_ragged_kv_lengths(tiny_ckpts, jax_models, family):
    """Two sequences of different lengths (13 and 21) in one batch: the K/V buffer is [2, 21, nKV, D] and row 0's
    entries 13..20 hold garbage that must stay invisible (kv_lengths = [13, 21], query positions 13 and 21)."""
    g = import_gemma4_mtp_jax()
    import jax.numpy as jnp

    short, long_ = prompt_tokens(family, 13)[:1], prompt_tokens(family, 21)[1:]
    ref = [hf_steps(tiny_ckpts, family, prompt_tokens(family, 13))[0],
           hf_steps(tiny_ckpts, family, prompt_tokens(family, 21))[1]]
    kv_s, kv_l = _hf_kv(tiny_ckpts, family, short), _hf_kv(tiny_ckpts, family, long_)
    rng = np.random.default_rng(5)
    kv = {}
    for t in LAYER_TYPES:
        pair = []
        for j in (0, 1):
            a_s, a_l = np.asarray(kv_s[t][j]), np.asarray(kv_l[t][j])
            garbage = 50.0 * rng.standard_normal((1, 21 - 13) + a_s.shape[2:]).astype(np.float32)
            pair.append(jnp.asarray(np.concatenate([np.concatenate([a_s, garbage], 1), a_l], 0)))
        kv[t] = tuple(pair)
    assistant, target = _models(tiny_ckpts, jax_models, family)
    kv_lengths = jnp.asarray([13, 21], dtype=jnp.int32)
    centroid = _is_centroid(tiny_ckpts, family)
    for s in range(NUM_STEPS):
        rows = [r[s] for r in ref]
        tok = jnp.asarray([x["token"] for x in rows], dtype=jnp.int32)
        h = jnp.asarray(np.stack([x["h"] for x in rows]))
        d = g.draft_step(assistant, target, tok, h, kv=kv, kv_lengths=kv_lengths)
        _check_step(f"{family} ragged kv_lengths [13, 21] step {s + 1}", d, rows, centroid)
