"""Split-K matmuls and the kernels that add their partials: the Pallas kernels (compiled on the GPU, interpret mode
elsewhere) against the plain-XLA reference, and the reference against the model's own math."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_mtp_jax.kernels import split_k as sk
from gemma4_mtp_jax.kernels.attention_inputs import rms_norm
from gemma4_mtp_jax.kernels.device_budget import HOPPER
from testenv import INTERPRET

EPS = 1e-6


def _arrays(seed, dtype, *shapes, scale=1.0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=s) * scale, dtype) for s in shapes]


def _tol(dtype):
    # float32: sums in another order (a few ulp); bf16: one rounding step where XLA and Triton round apart.
    return dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=1.6e-2, atol=1.6e-2)


def test_split_matmul_sums_to_the_matmul():
    x, w = _arrays(0, jnp.float32, (2, 3, 256), (96, 256))
    y = sk.split_matmul(x, w, 8)
    assert isinstance(y, sk.SplitSum) and y.partials.shape == (8, 2, 3, 96) and y.partials.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(sk.total(y)), want, rtol=1e-5, atol=1e-5)
    # Each partial is its own slice of the contraction.
    np.testing.assert_allclose(np.asarray(y.partials[3]), np.asarray(x[..., 96:128]) @ np.asarray(w[:, 96:128]).T,
                               rtol=1e-5, atol=1e-5)
    plain = sk.split_matmul(x, w, 1)
    assert isinstance(plain, jax.Array)
    np.testing.assert_allclose(np.asarray(plain), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not divide"):
        sk.split_matmul(x, w, 3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fp8_weights_scale_the_output_columns(dtype):
    """With an fp8 weight and its per-output-channel scale: the products summed in float32 over the exactly
    converted fp8 values, each column times its scale, rounded once to x's dtype; split, the scaled partials sum
    to the same (float32 summation order apart). The scale must multiply columns (a transposed or missing scale,
    or a dequantized weight rounded to bf16 first, fails)."""
    from gemma4_mtp_jax.weights.quantize import quantize_fp8

    x, w = _arrays(8, jnp.float32, (2, 3, 256), (96, 256))
    w = w * jnp.linspace(0.1, 3.0, 96)[:, None]  # rows of different magnitudes: distinct scales
    q, s = quantize_fp8(w)
    x = x.astype(dtype)
    exact = (np.asarray(x, np.float64) @ np.asarray(q, np.float64).T) * np.asarray(s, np.float64)
    want = np.asarray(jnp.asarray(exact, jnp.float32).astype(dtype), np.float64)  # the one rounding
    got = sk.split_matmul(x, q, 1, s)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **_tol(dtype))
    if dtype == jnp.bfloat16:  # the one rounding: at most half an ulp of bf16 from the exact value (plus f32 sums)
        np.testing.assert_allclose(np.asarray(got, np.float64), exact, rtol=2 ** -8 + 1e-5, atol=1e-6)
    split = sk.split_matmul(x, q, 8, s)
    assert isinstance(split, sk.SplitSum) and split.partials.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(sk.total(split), np.float64), want, **_tol(dtype))
    # the weights it stands for: within fp8's rounding (3 mantissa bits) of the float weights
    np.testing.assert_allclose(np.asarray(q, np.float32) * np.asarray(s)[:, None], np.asarray(w), rtol=2 ** -4,
                               atol=float(s.max()) * 2 ** -9)
    with pytest.raises(ValueError, match="scale"):
        sk.split_matmul(x, q, 1, s[:-1])


def test_fp8_weights_meet_many_bf16_rows_as_w8a8():
    """bfloat16 activations of W8A8_MIN_ROWS rows or more: each row quantized to fp8 by its amax, the fp8 products
    summed in float32, each output times its row's and its column's scale, rounded once. So each output lies within
    the activations' fp8 rounding (half an ulp: 2^-4 relative, or 2^-10 of the row's scale in fp8's subnormals) of
    the weight-only product, and off it by more than bf16's rounding. One row fewer takes the weight-only path;
    float32 activations always do."""
    from gemma4_mtp_jax.weights.quantize import quantize_fp8

    rows = sk.W8A8_MIN_ROWS
    x, w = _arrays(9, jnp.float32, (rows, 256), (96, 256))
    x = (x * jnp.linspace(0.01, 10.0, rows)[:, None]).astype(jnp.bfloat16)  # rows of different magnitudes
    q, s = quantize_fp8(w * jnp.linspace(0.1, 3.0, 96)[:, None])
    w_q = np.asarray(q, np.float64) * np.asarray(s, np.float64)[:, None]  # the weights the fp8 ones stand for
    x64 = np.asarray(x, np.float64)
    weight_only = x64 @ w_q.T
    row_scale = np.abs(x64).max(axis=1, keepdims=True) / 448
    bound = (2 ** -4 * np.abs(x64) + 2 ** -10 * row_scale) @ np.abs(w_q).T + 2 ** -8 * np.abs(weight_only)
    got = np.asarray(sk.split_matmul(x, q, 1, s), np.float64)
    assert np.all(np.abs(got - weight_only) <= bound), np.max(np.abs(got - weight_only) / bound)
    assert np.abs(got - weight_only).max() > 2 ** -7 * np.abs(weight_only).max(), "W8A8 not taken"
    one_fewer = np.asarray(sk.split_matmul(x[1:], q, 1, s), np.float64)
    np.testing.assert_allclose(one_fewer, weight_only[1:], rtol=2 ** -8 + 1e-5, atol=1e-6)
    in_f32 = np.asarray(sk.split_matmul(x.astype(jnp.float32), q, 1, s), np.float64)
    np.testing.assert_allclose(in_f32, weight_only, rtol=1e-5, atol=1e-5)


def test_reference_is_the_models_math():
    """Given a plain array (no split), the reference is exactly what the decoder layer computed before."""
    y, res, w, w2 = _arrays(1, jnp.bfloat16, (4, 64), (4, 64), (64,), (64,))
    h, n = sk.add_normed_reference(y, res, w, eps=EPS, next_weight=w2)
    want_h = res + rms_norm(y, EPS, w)
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(want_h, np.float32))
    np.testing.assert_array_equal(np.asarray(n, np.float32), np.asarray(rms_norm(want_h, EPS, w2), np.float32))
    assert sk.add_normed_reference(y, res, w, eps=EPS)[1] is None
    scale = jnp.asarray([0.37], jnp.float32)
    h_scaled, _ = sk.add_normed_reference(y, res, w, eps=EPS, scale=scale)
    np.testing.assert_array_equal(np.asarray(h_scaled, np.float32),
                                  np.asarray(want_h * scale.astype(jnp.bfloat16), np.float32))
    mult = _arrays(2, jnp.bfloat16, (3, 4, 64))[0]
    g = sk.gelu_gate_reference(y, mult, jnp.int32(2))
    want_g = jax.nn.gelu(y.astype(jnp.float32), approximate=True).astype(jnp.bfloat16) * mult[2]
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want_g, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("N,S,with_next,with_scale", [(64, 4, True, False), (1536, 8, True, True),
                                                      (1536, 16, False, False), (80, 2, False, True)])
def test_add_normed_kernel_equals_reference(N, S, with_next, with_scale, dtype):
    x, w, res, nw, nw2 = _arrays(3, dtype, (2, 3, 4 * S), (N, 4 * S), (2, 3, N), (N,), (N,), scale=1.0)
    y = sk.split_matmul(x, w, S)
    kw = dict(eps=EPS, next_weight=nw2 if with_next else None,
              scale=jnp.asarray([0.37], jnp.float32) if with_scale else None)
    want = sk.add_normed_reference(y, res, nw, **kw)
    got = sk.add_normed(y, res, nw, impl="pallas", interpret=INTERPRET, **kw)
    for g, r in zip(got, want):
        if r is None:
            assert g is None
            continue
        assert g.shape == r.shape and g.dtype == r.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), **_tol(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gelu_gate_kernel_equals_reference(dtype):
    L, N, S = 5, 256, 16
    x, w, mult = _arrays(4, dtype, (3, 1, 1536), (N, 1536), (L, 3, 1, N), scale=0.05)
    y = sk.split_matmul(x, w, S)
    for index in (0, 3):
        want = sk.gelu_gate_reference(y, mult, jnp.int32(index))
        got = sk.gelu_gate(y, mult, jnp.int32(index), impl="pallas", interpret=INTERPRET)
        assert got.shape == want.shape == (3, 1, N)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **_tol(dtype))


def test_gradients_through_the_kernels_are_the_references():
    """A Pallas call has no JVP rule: training differentiates through the kernels by the reference's VJP."""
    x, w, res, nw, nw2, mult = _arrays(8, jnp.float32, (2, 1, 256), (64, 256), (2, 1, 64), (64,), (64,), (3, 2, 1, 64))
    scale = jnp.asarray([0.8], jnp.float32)

    def loss(impl, x, w, res, nw, nw2, scale, mult):
        h, n = sk.add_normed(sk.split_matmul(x, w, 4), res, nw, eps=EPS, next_weight=nw2, scale=scale, impl=impl,
                             interpret=INTERPRET)
        g = sk.gelu_gate(sk.split_matmul(n, w[:, :64], 2), mult, jnp.int32(1), impl=impl, interpret=INTERPRET)
        return jnp.sum(h * h) + jnp.sum(jnp.sin(g))

    args = (x, w, res, nw, nw2, scale, mult)
    got = jax.grad(lambda *a: loss("pallas", *a), argnums=tuple(range(7)))(*args)
    want = jax.grad(lambda *a: loss("xla", *a), argnums=tuple(range(7)))(*args)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_auto_takes_the_reference_off_the_gpu_and_for_plain_arrays():
    y, res, w = _arrays(5, jnp.float32, (2, 64), (2, 64), (64,))
    h, _ = sk.add_normed(y, res, w, eps=EPS, impl="pallas")  # a plain array: nothing to sum, the reference
    np.testing.assert_array_equal(np.asarray(h), np.asarray(res + rms_norm(y, EPS, w)))


def test_bad_inputs_are_named():
    x, w, res, nw = _arrays(6, jnp.float32, (2, 64), (48, 64), (2, 40), (48,))
    y = sk.split_matmul(x, w, 4)
    with pytest.raises(ValueError, match="add_normed: partials"):
        sk.add_normed(y, res, nw, eps=EPS)
    with pytest.raises(ValueError, match="gelu_gate: partials"):
        sk.gelu_gate(y, jnp.zeros((2, 2, 40)), jnp.int32(0))
    with pytest.raises(ValueError, match="impl must be"):
        sk.add_normed(y, jnp.zeros((2, 48)), nw, eps=EPS, impl="triton")
    odd = sk.split_matmul(*_arrays(7, jnp.float32, (2, 64), (24, 64)), 4)  # 24 = 8 x 3: no power-of-two chunk >= 16
    with pytest.raises(ValueError, match="power-of-two factor"):
        sk.add_normed(odd, jnp.zeros((2, 24)), jnp.ones((24,)), eps=EPS, impl="pallas")
    h, _ = sk.add_normed(odd, jnp.zeros((2, 24)), jnp.ones((24,)), eps=EPS)  # auto: the reference takes it
    assert h.shape == (2, 24)


def test_plan_splits():
    # E2B at decode: o_proj (K 2048 -> 1536), down_proj (6144 -> 1536), per_layer_input_gate (1536 -> 256).
    assert sk.plan_splits(2, 2048, 1536, budget=HOPPER) == 8
    assert sk.plan_splits(16, 6144, 1536, budget=HOPPER) == 8
    assert sk.plan_splits(16, 12288, 1536, budget=HOPPER) == 8  # the 12288-wide layers' down_proj: 36 MiB
    assert sk.plan_splits(2, 1536, 256, budget=HOPPER) == 16
    assert sk.plan_splits(sk.MAX_ROWS + 1, 6144, 1536, budget=HOPPER) == 1  # verify at B = 16, prefill: XLA's plan
    assert sk.plan_splits(2, 128, 64, budget=HOPPER) == 2  # parts stay >= MIN_SPLIT_K long
    assert sk.plan_splits(2, 96, 64, budget=HOPPER) == 1
    assert sk.plan_splits(2, 2048, 16384, budget=HOPPER) == 1  # 256 column tiles already fill the SMs
    assert sk.plan_splits(2, 21504, 5376, budget=HOPPER) == 1  # 31B's down_proj (231 MB): XLA's plan
    assert sk.plan_splits(2, 8192, 5376, budget=HOPPER) == 1  # 31B's o_proj (88 MB)
    assert sk.plan_splits(2, 12288, 1536, itemsize=4, budget=HOPPER) == 1  # the same matmul in float32: 72 MiB
