"""The gate|up kernel (compiled on the GPU, interpret mode elsewhere) against its plain-XLA reference, the reference
against the MLP's math, the plan that decides where the kernel runs, and a tiny target with the kernel on."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_mtp_jax.kernels import feed_forward as ff
from gemma4_mtp_jax.kernels import gate_up as gu
from testenv import INTERPRET


def _args(seed, dtype, lead, H, I):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=lead + (H,)), dtype)
    # Gate and up of different scales: a kernel that reads one for the other is off by far more than rounding.
    gate = jnp.asarray(rng.normal(size=(I, H)) * H ** -0.5, dtype)
    up = jnp.asarray(rng.normal(size=(I, H)) * 2 * H ** -0.5 + 0.1, dtype)
    return x, gate, up


def _tol(dtype):
    # float32: sums in another order (a few ulp); bf16: a product rounded to bf16 on one side and not the other (a
    # gate one ulp apart moves its GELU, and the product, by about an ulp).
    return dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)


def _close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **_tol(dtype))


def test_reference_is_the_mlps_math():
    x, gate, up = _args(0, jnp.bfloat16, (3, 2), 64, 128)
    down = _args(1, jnp.bfloat16, (), 128, 64)[1]
    h = jax.nn.gelu(jnp.einsum("...h,ih->...i", x, gate), approximate=True) * jnp.einsum("...h,ih->...i", x, up)
    np.testing.assert_array_equal(np.asarray(gu.gate_up_reference(x, gate, up), np.float32),
                                  np.asarray(h, np.float32))
    np.testing.assert_array_equal(np.asarray(ff.mlp(x, gate, up, down), np.float32),
                                  np.asarray(jnp.einsum("...i,hi->...h", h, down), np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (2, 1), (17,), (16, 5), (128,)], ids=lambda v: "x".join(map(str, v)))
@pytest.mark.parametrize("H,I,block_n,block_k", [
    (96, 64, 16, 32),  # H = 3 x 32, not a power of two (E2B's 1536 = 3 x 512): three steps of H
    (128, 128, 32, 64),  # two steps, four column blocks
    (64, 64, 64, 64),  # one program, one step
])
def test_kernel_matches_reference(dtype, lead, H, I, block_n, block_k):
    x, gate, up = _args(7, dtype, lead, H, I)
    got = gu.gate_up(x, gate, up, tiling=gu.Tiling(block_n, block_k, 4, 2), interpret=INTERPRET)
    _close(got, gu.gate_up_reference(x, gate, up), dtype)


def test_kernel_through_mlp():
    """`mlp` with a tiling: the kernel's h, then down_proj split as asked."""
    x, gate, up = _args(3, jnp.float32, (5,), 64, 64)
    down = _args(4, jnp.float32, (), 64, 64)[1]
    kernel = functools.partial(gu.gate_up, interpret=INTERPRET)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ff, "gate_up", kernel)
        got = ff.mlp(x, gate, up, down, 2, gu.Tiling(16, 32))
    want = ff.mlp(x, gate, up, down, 2)
    np.testing.assert_allclose(np.asarray(got.partials), np.asarray(want.partials), rtol=2e-5, atol=2e-5)


def test_kernel_differentiates_through_the_reference():
    x, gate, up = _args(5, jnp.float32, (2, 3), 64, 32)

    def loss(fn, *a):
        return jnp.sum(fn(*a) ** 2)

    kernel = lambda *a: gu.gate_up(*a, tiling=gu.Tiling(16, 32), interpret=INTERPRET)  # noqa: E731
    got = jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2))(x, gate, up)
    want = jax.grad(lambda *a: loss(gu.gate_up_reference, *a), argnums=(0, 1, 2))(x, gate, up)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_bad_shapes_are_named():
    x, gate, up = _args(6, jnp.float32, (2,), 64, 32)
    t = gu.Tiling(16, 32)
    with pytest.raises(ValueError, match="gate must be"):
        gu.gate_up(x, gate.T, up, tiling=t, interpret=True)
    with pytest.raises(ValueError, match="up "):
        gu.gate_up(x, gate, up[:16], tiling=t, interpret=True)
    with pytest.raises(ValueError, match=r"x \(129, 64\) has 129 rows"):
        gu.gate_up(jnp.zeros((129, 64)), gate, up, tiling=t, interpret=True)
    with pytest.raises(ValueError, match="block_n=24"):
        gu.gate_up(x, gate, up, tiling=gu.Tiling(24, 32), interpret=True)
    with pytest.raises(ValueError, match="block_n=64"):  # past I
        gu.gate_up(x, gate, up, tiling=gu.Tiling(64, 32), interpret=True)
    with pytest.raises(ValueError, match="block_k=128"):
        gu.gate_up(x, gate, up, tiling=gu.Tiling(16, 128), interpret=True)
    with pytest.raises(ValueError, match="num_stages=0"):
        gu.gate_up(x, gate, up, tiling=gu.Tiling(16, 32, 4, 0), interpret=True)


def test_plan(monkeypatch):
    bf16 = jnp.bfloat16
    monkeypatch.setattr(gu, "on_gpu", lambda: False)
    assert gu.plan(2, 1536, 6144, bf16) is None
    monkeypatch.setattr(gu, "on_gpu", lambda: True)
    e2b = gu.plan(2, 1536, 6144, bf16)  # E2B: H = 3 x 512, steps of the default block_k
    assert e2b == gu.Tiling(gu.BLOCK_N, gu.BLOCK_K, gu.NUM_WARPS, gu.NUM_STAGES) and 1536 % e2b.block_k == 0
    assert gu.plan(80, 1536, 12288, bf16) == e2b  # a verify's rows, a double-wide layer
    assert gu.plan(128, 2560, 10240, bf16) is not None  # E4B: 105 MB of gate + up
    assert gu.plan(4, 2816, 2112, bf16).block_k == 256  # 26B-A4B's dense MLP: H = 11 x 256
    assert gu.plan(4, 1024, 8192, bf16) is not None  # the 31B drafter
    assert gu.plan(129, 1536, 6144, bf16) is None  # past MAX_ROWS: prefill keeps XLA's GEMM
    assert gu.plan(2, 1536, 6144, jnp.float32) is None  # float32 keeps XLA's exact path
    assert gu.plan(2, 5376, 21504, bf16) is None  # 31B's target MLP: 441 MiB of gate + up
    assert gu.plan(2, 1536, 6152, bf16) is None  # I = 8 x 769: no 16-column block
    assert gu.plan(2, 1544, 6144, bf16) is None  # H = 8 x 193: no 16-wide step
    for rows in (1, 16, 17, 80, 128):  # what the stages hold fits the shared memory
        t = gu.plan(rows, 1536, 12288, bf16)
        assert gu._shared_bytes(rows, t, 2) <= gu.default_budget().smem_per_block, (rows, t)


def test_tiny_target_same_logits_with_the_kernel(tiny_ckpts, jax_models, monkeypatch):
    """The e2b tiny target (H 64, I 128 and 256 in its double-wide layers) with every MLP through the kernel
    (interpret mode off the GPU; float32, so the plan is forced; two steps of H) gives the logits it gives without."""
    import hf_tiny

    target = jax_models.target(tiny_ckpts["e2b"]["target"], "float32")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, hf_tiny.VOCAB, size=(2, 13)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), tokens.shape)

    def logits():  # a fresh trace each time (target._forward would keep the first)
        return jax.jit(lambda p, t, pos: target.module.apply({"params": p}, t, pos)[0])(target.params, tokens,
                                                                                          positions)

    want = logits()
    from gemma4_mtp_jax.model import decoder

    calls = []

    def kernel(*a, **kw):
        calls.append(kw["tiling"])
        return gu.gate_up(*a, **kw, interpret=INTERPRET)

    monkeypatch.setattr(decoder, "plan_gate_up", lambda rows, H, I, dtype: gu.Tiling(16, 32, 4, 2))
    monkeypatch.setattr(ff, "gate_up", kernel)
    got = logits()
    assert len(calls) == target.config.num_layers, calls
    # float32 sums in another order through 8 layers: the parity tests' 1e-4 (logits of a few units)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
