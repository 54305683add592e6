"""Attention inputs from the projections: the Pallas kernel (compiled on the GPU, interpret mode elsewhere) against
the plain-XLA reference, which is the model's own math (q_norm / k_norm / v_norm, RoPE, the paged write)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_mtp_jax.kernels import attention_inputs as ai
from testenv import INTERPRET

NULL_PAGE = 0  # padding rows write there (kv_state); what lands in it is not compared


def _case(seed: int, *, mode: str, dtype, B=2, T=3, nH=4, nKV=2, D=16, num_pages=7, page_size=4, padding=0,
          rotated_pairs=None):
    """mode: "kv" (own K and V), "k_eq_v" (V from the raw K), "q" (queries only)."""
    rng = np.random.default_rng(seed)
    arr = lambda *shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, dtype)  # noqa: E731
    positions = rng.integers(0, 5000, size=(B, T)).astype(np.int32)
    n_rot = D // 2 if rotated_pairs is None else rotated_pairs
    inv_freq = np.concatenate([1.0 / 10000 ** (np.arange(n_rot) * 2 / D), np.zeros(D // 2 - n_rot)])
    kw = dict(q=arr(B, T, nH, D, scale=3.0), k=None, v=None, q_norm=arr(D), k_norm=None,
              positions=jnp.asarray(positions), inv_freq=jnp.asarray(inv_freq, jnp.float32))
    if mode == "q":
        return kw, {}
    kw.update(k=arr(B, T, nKV, D), k_norm=arr(D), v=arr(B, T, nKV, D) if mode == "kv" else None)
    slots = rng.permutation(np.arange(page_size, num_pages * page_size))[: B * T].reshape(B, T)  # page 0 left out
    page, offset = slots // page_size, slots % page_size
    if padding:  # the last rows of sequence 0 are padding: they go to the null page, as kv_state sends them
        page[0, -padding:], offset[0, -padding:] = NULL_PAGE, 0
    pages = (arr(nKV, num_pages, page_size, D), arr(nKV, num_pages, page_size, D))
    return kw, dict(pages=pages, page=jnp.asarray(page, jnp.int32), offset=jnp.asarray(offset, jnp.int32))


def _compare(kw, paged, dtype, eps=1e-6):
    befores = [np.asarray(p, np.float32) for p in paged.get("pages", ())]  # the kernel takes the pages donated
    want_q, want_pages = ai.attention_inputs_reference(**kw, **paged, eps=eps)
    got_q, got_pages = ai.attention_inputs(**kw, **paged, eps=eps, interpret=INTERPRET)
    # float32: the kernel sums the squares in another order (a few ulp); bf16: one rounding step of the output
    # where XLA and Triton round a product differently.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    np.testing.assert_allclose(np.asarray(got_q, np.float32), np.asarray(want_q, np.float32), **tol)
    if not paged:
        assert got_pages is None and want_pages is None
        return
    for got, want, before in zip(got_pages, want_pages, befores):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got[:, 1:], want[:, 1:], **tol)
        written = np.zeros(got.shape[1:3], bool)
        written[np.asarray(paged["page"]), np.asarray(paged["offset"])] = True
        np.testing.assert_array_equal(got[:, ~written], before[:, ~written])  # nothing else touched


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mode", ["kv", "k_eq_v", "q"])
def test_kernel_equals_reference(mode, dtype):
    kw, paged = _case(0, mode=mode, dtype=dtype)
    _compare(kw, paged, dtype)


def test_kernel_at_real_head_dims_with_padding_and_proportional_rope():
    """D = 256 with 8 query heads over 1 KV head (E2B's sliding layers); D = 512 with a quarter of the pairs rotated
    (proportional RoPE, Gemma 4's full layers); padding rows written to the null page only."""
    kw, paged = _case(1, mode="kv", dtype=jnp.float32, B=2, T=5, nH=8, nKV=1, D=256, padding=2)
    _compare(kw, paged, jnp.float32)
    kw, paged = _case(2, mode="k_eq_v", dtype=jnp.float32, B=1, T=2, nH=4, nKV=2, D=512, rotated_pairs=64)
    _compare(kw, paged, jnp.float32)


@pytest.mark.parametrize("mode", ["kv", "k_eq_v"])
def test_kernel_writes_fp8_pages_as_the_reference(mode):
    """A float8 cache: the kernel stores K / k_scale and V / v_scale in e4m3fn as the reference does (the same
    pages, bit for bit), and nothing else; the reference's pages are `to_cache` of its keys and values. The scales
    are small enough that the largest K and V exceed e4m3fn's range (448): they are clipped to it, never NaN."""
    kw, paged = _case(7, mode=mode, dtype=jnp.float32)
    paged["pages"] = tuple(p.astype(jnp.float8_e4m3fn) for p in paged["pages"])
    scales = dict(k_scale=2.0**-8, v_scale=2.0**-8)
    befores = [np.asarray(p, np.float32) for p in paged["pages"]]
    want_q, want_pages = ai.attention_inputs_reference(**kw, **paged, **scales, eps=1e-6)
    got_q, got_pages = ai.attention_inputs(**kw, **paged, **scales, eps=1e-6, interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(got_q), np.asarray(want_q), rtol=1e-5, atol=1e-5)
    _, keys, values = ai.normed_and_roped(**kw, eps=1e-6)
    page, offset = np.asarray(paged["page"]), np.asarray(paged["offset"])
    written = np.zeros(befores[0].shape[1:3], bool)
    written[page, offset] = True
    for got, want, before, x, scale in zip(got_pages, want_pages, befores, (keys, values), scales.values()):
        assert got.dtype == want.dtype == jnp.float8_e4m3fn
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_array_equal(got, want)
        stored = np.asarray(ai.to_cache(jnp.moveaxis(x, -2, 0), scale, jnp.float8_e4m3fn), np.float32)
        np.testing.assert_array_equal(want[:, page, offset], stored)
        assert np.abs(want[:, page, offset]).max() == 448 and np.isfinite(got).all()
        np.testing.assert_array_equal(got[:, ~written], before[:, ~written])


@pytest.mark.parametrize("D", [24, 2])
def test_kernel_at_head_dims_whose_half_is_no_power_of_two(D):
    kw, paged = _case(6, mode="kv", dtype=jnp.float32, D=D, rotated_pairs=D // 2)
    _compare(kw, paged, jnp.float32)


def test_reference_is_the_norms_and_rope_of_transformers():
    """q_norm(q) then rotate-half RoPE, written out in numpy float64 from the Gemma 4 definition."""
    kw, paged = _case(3, mode="kv", dtype=jnp.float32, D=8)
    q, _ = ai.attention_inputs_reference(**kw, **paged, eps=1e-6)
    x = np.asarray(kw["q"], np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * np.asarray(kw["q_norm"], np.float64)
    ang = np.asarray(kw["positions"], np.float64)[..., None, None] * np.asarray(kw["inv_freq"], np.float64)
    ang = np.concatenate([ang, ang], -1)
    rotated = np.concatenate([-y[..., 4:], y[..., :4]], -1)
    np.testing.assert_allclose(np.asarray(q), y * np.cos(ang) + rotated * np.sin(ang), rtol=2e-4, atol=2e-4)


def test_bad_shapes_are_named():
    kw, paged = _case(4, mode="kv", dtype=jnp.float32)
    with pytest.raises(ValueError, match="k_norm"):
        ai.attention_inputs_reference(**{**kw, "k_norm": kw["q_norm"][:4]}, **paged, eps=1e-6)
    with pytest.raises(ValueError, match="pages"):
        ai.attention_inputs_reference(**kw, eps=1e-6)
    with pytest.raises(ValueError, match="impl"):
        ai.prepare_attention_inputs(**kw, **paged, eps=1e-6, impl="cuda")


@pytest.mark.parametrize("theta,factor,D", [(10000.0, 1.0, 256), (1e6, 1.0, 512), (1e6, 0.25, 512)])
def test_rope_inv_freq_is_the_float32_rounding_of_its_definition(theta, factor, D):
    """The inverse frequencies (a numpy constant in the model) within one float32 ulp of theta^(-2i/D), zero past a
    proportional RoPE's rotated pairs. They failed this on the GPU machine's CPU while numpy's float32
    power, the CPU's own SIMD routine, computed them."""
    from gemma4_mtp_jax.model.config import RopeConfig
    from gemma4_mtp_jax.model.layers import rope_inv_freq

    got = rope_inv_freq(RopeConfig(theta=theta, partial_rotary_factor=factor), D)
    n = int(factor * D // 2)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (D // 2,)
    exact = theta ** (-np.arange(0, 2 * n, 2, dtype=np.float64) / D)
    np.testing.assert_array_max_ulp(got[:n], exact.astype(np.float32), maxulp=1)
    assert not got[n:].any()
