"""A Q-only target layer's q projection split along its contraction, its partial sums added by the paged-attention
kernel as it loads the query rows (kv_state `_query_parts`, the kernel's query prep): on the tiny E2B target (CPU,
float32, kernels in interpret mode), whose layers 5-7 read the K/V of layers 4 and 3."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import hf_tiny
from testenv import INTERPRET

PROMPT = 11  # longer than the sliding window (8): the ring wraps before the decode and verify steps
K = 3  # a verify step's drafts: K + 1 query tokens


def _tables(layout, batch: int) -> dict:
    """Distinct pages per sequence and group (page 0, the null page, left out)."""
    tables = {}
    for g, width in layout.pages_per_seq:
        tables[g] = jnp.asarray(1 + np.arange(batch * width).reshape(batch, width), jnp.int32)
    return tables


@pytest.mark.parametrize("T", [1, K + 1], ids=["decode", "verify"])
def test_paged_forward_with_split_q_equals_plain(tiny_ckpts, monkeypatch, T):
    """After a prefill, a decode (or verify) forward whose Q-only layers hand the kernel their q projection in 2
    parts gives the plain forward's hidden states (the dense forward over the whole sequence, and the paged
    forward through XLA, whose q stays whole)."""
    g = hf_tiny.import_gemma4_mtp_jax()
    from gemma4_mtp_jax.forward import forward_paged
    from gemma4_mtp_jax.kernels import attention_inputs as ai
    from gemma4_mtp_jax.kernels import paged_attention as pa
    from gemma4_mtp_jax.kernels import split_k as sk
    from gemma4_mtp_jax.kv_state import init_pages, make_layout

    # A target of its own: layer programs are traced once per config object, and these must see the patches.
    target = g.load_target(str(tiny_ckpts["e2b"]["target"]), dtype="float32")
    cfg = target.config
    # The tiny q_proj's contraction (64) splits in 2 once a part may be 32 long (the other projections split too,
    # in every forward compared here).
    monkeypatch.setattr(sk, "MIN_SPLIT_K", 32)
    seen = []

    def kernel(q, *args, **kw):
        seen.append(q.partials.shape[0] if isinstance(q, sk.SplitSum) else 1)
        return pa_kernel(q, *args, interpret=INTERPRET, **kw)

    pa_kernel = pa.paged_attention
    monkeypatch.setattr(pa, "paged_attention", kernel)
    monkeypatch.setattr(ai, "attention_inputs", functools.partial(ai.attention_inputs, interpret=INTERPRET))

    B = 2
    layout = make_layout(cfg, page_size=4, max_model_len=32, num_pages={"sliding_attention": 64,
                                                                        "full_attention": 64},
                         num_speculative_tokens=K, prefill_chunk=PROMPT)
    tables = _tables(layout, B)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(3, hf_tiny.VOCAB, size=(B, PROMPT + T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(PROMPT + T, dtype=jnp.int32), (B, PROMPT + T))

    _, plain, _ = target.module.apply({"params": target.params}, tokens, positions, logits=False)
    hidden = {}
    for impl in ("xla", "pallas"):
        pages = init_pages(cfg, layout, jnp.float32)
        _, pages = forward_paged(target, layout, target.params, pages, tokens[:, :PROMPT], positions[:, :PROMPT],
                                 tables, attention_impl="xla")
        seen.clear()
        hidden[impl], _ = forward_paged(target, layout, target.params, pages, tokens[:, PROMPT:],
                                        positions[:, PROMPT:], tables, attention_impl=impl)
    # traced once per kind of layer: q in 2 parts from the two kinds of Q-only layer (sliding, full), whole q from
    # the owning ones
    assert seen.count(2) == 2 and 1 in seen and set(seen) == {1, 2}, seen
    want = np.asarray(plain[:, PROMPT:])
    np.testing.assert_allclose(np.asarray(hidden["pallas"]), np.asarray(hidden["xla"]), atol=5e-5, rtol=5e-5)
    np.testing.assert_allclose(np.asarray(hidden["pallas"]), want, atol=5e-5, rtol=5e-5)
