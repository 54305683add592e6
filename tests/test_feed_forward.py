"""The feed-forward block kernel (compiled on the GPU, interpret mode elsewhere) against its plain-XLA reference,
the reference against the decoder layer's own math, and the plan that decides where the kernel runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_mtp_jax.kernels import feed_forward as ff
from gemma4_mtp_jax.kernels import split_k as sk
from gemma4_mtp_jax.kernels.attention_inputs import rms_norm
from testenv import INTERPRET

EPS = 1e-6


def _arrays(seed, dtype, *shapes, scale=1.0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=s) * scale, dtype) for s in shapes]


def _block_args(seed, dtype, lead, H, I, a_parts=None):
    a_shape = lead + (H,) if a_parts is None else (a_parts,) + lead + (H,)
    a = _arrays(seed, dtype if a_parts is None else jnp.float32, a_shape)[0]
    res = _arrays(seed + 1, dtype, lead + (H,))[0]
    wpa, wpf = [1.0 + 0.1 * w for w in _arrays(seed + 2, dtype, (H,), (H,))]
    gate, up, down = _arrays(seed + 3, dtype, (I, H), (I, H), (H, I), scale=H ** -0.5)
    y = a if a_parts is None else sk.SplitSum(a, jnp.dtype(dtype))
    return y, res, wpa, wpf, gate, up, down


def _tol(dtype):
    # float32: sums in another order (a few ulp); bf16: a rounding step where XLA and Triton round apart (gate and
    # up feed GELU, so one bf16 ulp of a gate moves its product by about that much).
    return dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)


def test_reference_is_the_decoder_layers_math():
    y, res, wpa, wpf, gate, up, down = _block_args(0, jnp.bfloat16, (3, 1), 64, 128)
    x, f = ff.feed_forward_block_reference(y, res, wpa, wpf, gate, up, down, eps=EPS, splits=4)
    want_x = res + rms_norm(y, EPS, wpa)
    m = rms_norm(want_x, EPS, wpf)
    g = jnp.einsum("...h,ih->...i", m, gate)
    u = jnp.einsum("...h,ih->...i", m, up)
    h = jax.nn.gelu(g, approximate=True) * u
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(want_x, np.float32))
    assert isinstance(f, sk.SplitSum) and f.partials.shape == (4, 3, 1, 64)
    np.testing.assert_allclose(np.asarray(sk.total(f), np.float32),
                               np.asarray(jnp.einsum("...i,hi->...h", h, down), np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead,H,I,splits,a_parts", [
    ((2, 1), 256, 2048, 32, None),  # the E2B assistant's draft step at B = 2
    ((16, 1), 256, 2048, 32, None),  # B = 16
    ((1, 1), 64, 256, 2, 4),  # o_proj's output as split-K partials (a target layer)
    ((2, 5), 128, 512, 4, None),  # a verify's 10 rows
])
def test_kernel_matches_reference(dtype, lead, H, I, splits, a_parts):
    if dtype == jnp.float32:  # 4-byte tiles: a quarter of the columns a program, to fit its shared memory on the GPU
        splits = min(4 * splits, I // 16)
    args = _block_args(7, dtype, lead, H, I, a_parts)
    want_x, want_f = ff.feed_forward_block_reference(*args, eps=EPS, splits=splits)
    x, f = ff.feed_forward_block(*args, eps=EPS, splits=splits, interpret=INTERPRET)
    assert x.shape == want_x.shape and x.dtype == want_x.dtype
    assert isinstance(f, sk.SplitSum) and f.partials.shape == (splits, *lead, H) and f.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(want_x, np.float32), **_tol(dtype))
    np.testing.assert_allclose(np.asarray(f.partials), np.asarray(want_f.partials), **_tol(dtype))
    # What the layer's last kernel makes of the partials agrees too.
    np.testing.assert_allclose(np.asarray(sk.total(f), np.float32), np.asarray(sk.total(want_f), np.float32),
                               **_tol(dtype))


def test_kernel_differentiates_through_the_reference():
    args = _block_args(3, jnp.float32, (2, 1), 64, 256)

    def loss(fn, *a):
        x, f = fn(*a)
        return jnp.sum(x * x) + jnp.sum(sk.total(f) ** 2)

    kernel = lambda *a: ff.feed_forward_block(*a, eps=EPS, splits=4, interpret=INTERPRET)  # noqa: E731
    reference = lambda *a: ff.feed_forward_block_reference(*a, eps=EPS, splits=4)  # noqa: E731
    got = jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 4, 6))(*args)
    want = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 4, 6))(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_plan(monkeypatch):
    # The E2B assistant: 32 programs of 64 columns, on the GPU only.
    monkeypatch.setattr(ff, "kernels_chosen", lambda: False)
    assert ff.plan_block(2, 256, 2048, jnp.bfloat16) is None
    monkeypatch.setattr(ff, "kernels_chosen", lambda: True)
    assert ff.plan_block(2, 256, 2048, jnp.bfloat16) == 32
    assert ff.plan_block(16, 256, 2048, jnp.bfloat16) == 32
    assert ff.plan_block(17, 256, 2048, jnp.bfloat16) is None  # past MAX_ROWS
    assert ff.plan_block(2, 256, 2048, jnp.float32) is None  # float32 keeps XLA's exact path
    assert ff.plan_block(2, 256, 2048, jnp.bfloat16, quantized=True) is None  # fp8 weights keep XLA's matmuls
    assert ff.plan_block(2, 1536, 6144, jnp.bfloat16) is None  # E2B's target: 54 MiB of weights
    assert ff.plan_block(2, 96, 256, jnp.bfloat16) is None  # H not a power of two
    assert ff.plan_block(2, 64, 48, jnp.bfloat16) == 3  # 16-column chunks


def test_bad_shapes_are_named():
    y, res, wpa, wpf, gate, up, down = _block_args(5, jnp.float32, (2, 1), 64, 256)
    with pytest.raises(ValueError, match="disagree"):
        ff.feed_forward_block(y, res, wpa, wpf, gate, up, down.T, eps=EPS, splits=4, interpret=True)
    with pytest.raises(ValueError, match="no kernel"):
        ff.feed_forward_block(y, res, wpa, wpf, gate, up, down, eps=EPS, splits=3, interpret=True)
    big = _block_args(5, jnp.float32, (17, 1), 64, 256)
    with pytest.raises(ValueError, match="17 rows"):
        ff.feed_forward_block(*big, eps=EPS, splits=4, interpret=True)
