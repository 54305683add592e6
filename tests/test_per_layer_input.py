"""The per-layer-input kernel (compiled on the GPU, interpret mode elsewhere) against its plain-XLA reference, the
reference against the decoder layer's own math, the plan that decides where the kernel runs, and a tiny E2B-like
target with the kernel in its layers."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemma4_mtp_jax
from gemma4_mtp_jax.kernels import per_layer_input as pli
from gemma4_mtp_jax.kernels import split_k as sk
from testenv import INTERPRET

L = 5  # layers in the test stacks


def _arrays(seed, dtype, *shapes, scale=1.0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=s) * scale, dtype) for s in shapes]


def _args(seed, dtype, lead, H, P):
    """x [*lead, H], gate [P, H], a stack [L, *lead, P] whose layers differ, projection [H, P]."""
    x, stack = _arrays(seed, dtype, lead + (H,), (L,) + lead + (P,))
    gate_w, proj_w = _arrays(seed + 1, dtype, (P, H), (H, P), scale=H ** -0.5)
    # GELU's interesting range: gates of order 1 (x [H] of unit entries against weights of H^-1/2).
    return x, gate_w, stack, proj_w


def _tol(dtype):
    # float32: sums in another order (a few ulp); bf16: a gate rounded apart where XLA and the kernel sum its
    # contraction in another order moves its GELU and product by a bf16 ulp.
    return dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)


def test_reference_is_the_decoder_layers_math():
    """The reference is what the layer computed before: the gate split-K (`splits_for`), split_k's `gelu_gate`,
    the projection split in S parts; partial s the product over chunk s of P."""
    x, gate_w, stack, proj_w = _args(0, jnp.float32, (3, 1), 96, 64)
    index = jnp.int32(2)
    got = pli.per_layer_input_reference(x, gate_w, stack, index, proj_w, splits=4)
    assert isinstance(got, sk.SplitSum) and got.partials.shape == (4, 3, 1, 96) and got.dtype == jnp.float32
    g = sk.gelu_gate(sk.split_matmul(x, gate_w, 2), stack, index)
    np.testing.assert_allclose(np.asarray(sk.total(got)), np.asarray(sk.total(sk.split_matmul(g, proj_w, 4))),
                               rtol=1e-5, atol=1e-5)
    want_g = np.asarray(jax.nn.gelu(x @ gate_w.T, approximate=True) * stack[2])
    np.testing.assert_allclose(np.asarray(got.partials[1]), want_g[..., 16:32] @ np.asarray(proj_w[:, 16:32]).T,
                               rtol=1e-5, atol=1e-5)
    one = pli.per_layer_input_reference(x, gate_w, stack, index, proj_w, splits=1)  # still a float32 partial
    assert one.partials.shape == (1, 3, 1, 96) and one.partials.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(one.partials[0]), np.asarray(sk.total(got)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lead,H,P,chunk,block_h,index", [
    ((1, 1), 96, 64, 16, 32, 0),  # H = 3 x 32, as E2B's 1536 = 3 x 512
    ((2, 1), 96, 64, 32, 32, 4),
    ((17, 1), 128, 64, 16, 64, 3),  # a second row block, one row of it live
    ((16, 5), 96, 64, 32, 32, 1),  # the B = 16 verify's 80 rows
    ((2, 1), 1536, 256, 32, 512, 2),  # E2B at decode, the planned tiling
])
def test_kernel_matches_reference(dtype, lead, H, P, chunk, block_h, index):
    x, gate_w, stack, proj_w = _args(7, dtype, lead, H, P)
    S = P // chunk
    want = pli.per_layer_input_reference(x, gate_w, stack, jnp.int32(index), proj_w, splits=S)
    got = pli.per_layer_input(x, gate_w, stack, jnp.int32(index), proj_w, chunk=chunk, block_h=block_h,
                              interpret=INTERPRET)
    assert isinstance(got, sk.SplitSum) and got.dtype == jnp.dtype(dtype)
    assert got.partials.shape == want.partials.shape == (S, *lead, H) and got.partials.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got.partials), np.asarray(want.partials), **_tol(dtype))
    if dtype == jnp.bfloat16:  # the rounding steps are the reference's: all but a few partials agree far closer
        d = np.abs(np.asarray(got.partials) - np.asarray(want.partials))
        assert np.mean(d > 1e-3 * (np.abs(np.asarray(want.partials)) + 1e-2)) < 0.1
    # What the residual kernel makes of the partials agrees too.
    np.testing.assert_allclose(np.asarray(sk.total(got), np.float32), np.asarray(sk.total(want), np.float32),
                               **_tol(dtype))


def test_the_index_picks_the_layers_input():
    """Each layer's result is its own slice's: the stack's layers differ, and the index is a traced scalar (one
    program serves every layer of a kind)."""
    x, gate_w, stack, proj_w = _args(11, jnp.float32, (3, 1), 96, 64)
    run = jax.jit(lambda *a: pli.per_layer_input(*a, chunk=16, block_h=32, interpret=INTERPRET).partials)
    outs = []
    for i in range(L):
        got = run(x, gate_w, stack, jnp.int32(i), proj_w)
        alone = pli.per_layer_input_reference(x, gate_w, stack[i:i + 1], jnp.int32(0), proj_w, splits=4).partials
        np.testing.assert_allclose(np.asarray(got), np.asarray(alone), rtol=1e-5, atol=1e-5)
        outs.append(np.asarray(got))
    assert all(np.max(np.abs(a - b)) > 1e-3 for a, b in zip(outs, outs[1:]))


def test_kernel_differentiates_through_the_reference():
    x, gate_w, stack, proj_w = _args(3, jnp.float32, (2, 1), 96, 64)
    index = jnp.int32(1)

    def loss(fn, x, gate_w, stack, proj_w):
        return jnp.sum(jnp.sin(sk.total(fn(x, gate_w, stack, index, proj_w))))

    kernel = functools.partial(pli.per_layer_input, chunk=16, block_h=32, interpret=INTERPRET)
    reference = functools.partial(pli.per_layer_input_reference, splits=4)
    got = jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2, 3))(x, gate_w, stack, proj_w)
    want = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2, 3))(x, gate_w, stack, proj_w)
    for g, w in zip(got, want):
        assert float(jnp.max(jnp.abs(w))) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_plan(monkeypatch):
    monkeypatch.setattr(pli, "on_gpu", lambda: False)
    assert pli.plan(2, 1536, 256, jnp.bfloat16) is None
    monkeypatch.setattr(pli, "on_gpu", lambda: True)
    e2b = pli.Tiling(pli.CHUNK, pli.BLOCK_H, pli.NUM_WARPS)  # E2B: 16 chunks x 6 column blocks
    assert pli.plan(2, 1536, 256, jnp.bfloat16) == e2b  # E2B: 8 chunks x 3 column blocks
    assert pli.plan(16, 2560, 256, jnp.bfloat16) == e2b  # E4B
    assert pli.plan(pli.PLAN_MAX_ROWS + 1, 1536, 256, jnp.bfloat16) is None  # a verify's rows: XLA's GEMMs
    assert pli.plan(2, 1536, 256, jnp.float32) is None  # float32 keeps XLA's exact path
    assert pli.plan(2, 96, 16, jnp.bfloat16) == pli.Tiling(16, 32, pli.NUM_WARPS)  # blocks shrink to the widths
    assert pli.plan(2, 1544, 256, jnp.bfloat16) is None  # 1544 = 8 x 193: no power-of-two block >= 16
    assert pli.plan(2, 1536, 24, jnp.bfloat16) is None  # P = 8 x 3


def test_bad_shapes_are_named():
    x, gate_w, stack, proj_w = _args(5, jnp.float32, (2, 1), 96, 64)
    i = jnp.int32(0)
    call = functools.partial(pli.per_layer_input, interpret=True)
    with pytest.raises(ValueError, match="gate_w"):
        call(x, gate_w.T, stack, i, proj_w)
    with pytest.raises(ValueError, match="proj_w"):
        call(x, gate_w, stack, i, proj_w.T)
    with pytest.raises(ValueError, match="stack"):
        call(x, gate_w, stack[:, :1], i, proj_w)
    with pytest.raises(ValueError, match="stack"):
        call(x, gate_w, stack[0], i, proj_w)
    with pytest.raises(ValueError, match="index"):
        call(x, gate_w, stack, jnp.zeros((1,), jnp.int32), proj_w)
    with pytest.raises(ValueError, match="index"):
        call(x, gate_w, stack, jnp.float32(0), proj_w)
    with pytest.raises(ValueError, match="chunk=24"):
        call(x, gate_w, stack, i, proj_w, chunk=24)
    with pytest.raises(ValueError, match="block_h=64"):
        call(x, gate_w, stack, i, proj_w, chunk=16, block_h=64)  # 96 = 3 x 32
    big = _args(5, jnp.float32, (pli.MAX_ROWS + 1, 1), 96, 64)
    with pytest.raises(ValueError, match=f"{pli.MAX_ROWS + 1} rows of x"):
        call(big[0], big[1], big[2], i, big[3], chunk=16, block_h=32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_target_with_the_kernel_gives_the_same_logits(dtype, monkeypatch):
    """The bundled demo target (E2B's layout: per-layer inputs of 16, H = 256, 10 layers) over 2 x 5 tokens, with
    every layer's per-layer-input path through the kernel and without. float32 has no plan: a tiling is forced
    there, of 4 column blocks; bfloat16 takes the plan, as on the GPU."""
    target = gemma4_mtp_jax.load_target(Path(gemma4_mtp_jax.__file__).parent / "demo_pair" / "target", dtype)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 8192, size=(2, 5)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), tokens.shape)

    def logits():  # traced afresh: a cached program would not see the patches
        fn = jax.jit(lambda p, t, pos: target.module.apply({"params": p}, t, pos)[0])
        return np.asarray(fn(target.params, tokens, positions), np.float32)

    want = logits()
    calls = []

    def kernel(*args, **kw):
        calls.append(kw)
        return real(*args, **{**kw, "interpret": INTERPRET})

    real = pli.per_layer_input
    monkeypatch.setattr(pli, "per_layer_input", kernel)
    if dtype == "float32":
        monkeypatch.setattr(pli, "plan", lambda rows, H, P, dtype: pli.Tiling(16, 64, 4))
    else:
        monkeypatch.setattr(pli, "on_gpu", lambda: True)
    got = logits()
    assert len(calls) == target.config.num_layers
    assert all(kw["chunk"] == 16 for kw in calls)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == "float32" else dict(rtol=0, atol=0.25)
    np.testing.assert_allclose(got, want, **tol)
    if dtype == "bfloat16":  # a bf16 ulp apart here and there; the distributions agree
        assert float(np.mean(np.abs(got - want))) < 0.02
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
