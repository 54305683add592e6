"""A layer's attention inputs from its q / k / v projections: RMSNorm, RoPE and the paged K/V write, in one kernel.

What Gemma 4 does between the projections and attention, per token:
- q: `q_norm` (RMSNorm over the head dim, times its weight), then RoPE;
- k: `k_norm`, then RoPE; v: RMSNorm without a weight (`v_norm`); layers with `attention_k_eq_v` take V from the
  raw K projection (before k_norm);
- the new K and V go into the layer's pages at (page, offset) of their position: as they are, or in a float8 cache
  divided by the layer's static K / V scale (powers of two: exact) and clipped to the format's range (`to_cache`).

XLA runs that as six kernels per layer that owns K/V (three norm fusions, q's rotate-half, two scatters) and two
for a layer that only has queries, each a few microseconds of fixed cost (E2B's decode step had ~21 kernels per
layer: `python benchmarks/kernel_count.py --models e2b --batch 2 --by-scope 3`). `attention_inputs` does all of it
in one Pallas kernel.

Layout: q [..., nH, D], k / v [..., nKV, D] (any leading token dims), positions, page, offset [...]; pages
[nKV, num_pages, page_size, D] (kv_state's pools); inv_freq [D/2] (zeros past a proportional RoPE's rotated pairs).

Two implementations with one contract:
- `attention_inputs_reference`: plain XLA (the model's own math: `rms_norm`, `apply_rope`, `write_pages`, used by
  the model everywhere the kernel is not). The CPU path and the test oracle.
- `attention_inputs`: the Pallas kernel (Triton lowering on GPU, `interpret=True` anywhere). Grid (token, head
  among nH + nKV): a query head's program norms and ropes one [D] row into the queries; a KV head's program norms
  and ropes its K row and norms its V row, and stores both in the pages in place (the pages are aliased in and
  out). RoPE works on the two halves of the row (power-of-two blocks, masked past D/2), so rotate-half needs no
  concatenation. Rounding follows the
  reference: the norm in float32, rounded to the activations' dtype after its weight, RoPE's products and sum in
  that dtype with cos / sin rounded to it, as transformers does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gemma4_mtp_jax.kernels.device_budget import kernels_chosen, kernels_interpreted
from gemma4_mtp_jax.kernels.triton_ops import compiler_params, load, store

Array = jax.Array


# ----------------------------------------------------------------------------------------------------------
# Reference (plain XLA): the model's math
# ----------------------------------------------------------------------------------------------------------


def rms_normalize(x: Array, eps: float) -> Array:
    """x * (mean(x^2) + eps)^-1/2 in float32, returned in float32."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x: Array, eps: float, weight: Array | None = None) -> Array:
    """Gemma 4 RMSNorm: normalized in float32, times `weight` itself (not 1 + weight), back in x's dtype."""
    y = rms_normalize(x, eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


def rope_tables(positions: Array, inv_freq: Array, dtype) -> tuple[Array, Array]:
    """RoPE's (cos, sin) at `positions` [...], [..., D/2] each, rounded to `dtype` (transformers casts them to the
    activations' dtype before the products). The paged-attention kernel takes them to rope a Q-only layer's queries
    (computing them in the kernel spilled)."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)


def rope_with_tables(x: Array, cos: Array, sin: Array) -> Array:
    """Neox "rotate_half" RoPE of x [..., T, heads, D] with `rope_tables`' cos / sin [..., T, D/2]."""
    cos = jnp.concatenate([cos, cos], axis=-1)[..., None, :].astype(x.dtype)
    sin = jnp.concatenate([sin, sin], axis=-1)[..., None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Neox "rotate_half" RoPE. x: [..., T, heads, D]; positions: [..., T]."""
    return rope_with_tables(x, *rope_tables(positions, inv_freq, x.dtype))


def normed_and_roped_queries(q: Array, q_norm: Array, cos: Array, sin: Array, *, eps: float) -> Array:
    """`apply_rope(rms_norm(q, eps, q_norm), ...)` with RoPE's tables given: q [..., T, nH, D], cos / sin
    [..., T, D/2] from `rope_tables`. The same values in the same rounding as `normed_and_roped`'s queries."""
    return rope_with_tables(rms_norm(q, eps, q_norm), cos, sin)


def quantized(dtype) -> bool:
    """Whether a K/V cache of `dtype` holds scaled values: a float8 format, whose range (e4m3fn: +-448) is too narrow
    for K and V as they are and whose overflow is NaN."""
    dtype = jnp.dtype(dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def to_cache(x: Array, scale: float, dtype) -> Array:
    """x as a cache of `dtype` stores it: x / `scale` (a power of two, so the division adds no rounding), clipped to
    the format's finite range where it is float8 (an e4m3fn overflow is NaN), cast. Scale 1.0 and a cache that is
    not float8: the plain cast."""
    if scale == 1.0 and not quantized(dtype):
        return x.astype(dtype)
    y = x.astype(jnp.float32)
    if scale != 1.0:
        y = y * (1.0 / scale)
    if quantized(dtype):
        limit = float(jnp.finfo(dtype).max)
        y = jnp.clip(y, -limit, limit)
    return y.astype(dtype)


def write_pages(pages: tuple[Array, Array], k: Array, v: Array, page: Array, offset: Array, *, k_scale: float = 1.0,
                v_scale: float = 1.0) -> tuple[Array, Array]:
    """Scatter k, v [..., nKV, D] into the pools [nKV, num_pages, page_size, D] at (page, offset) [...], each as its
    pool stores it (`to_cache` with the layer's K / V scale)."""
    kp, vp = pages
    kp = kp.at[:, page, offset].set(to_cache(jnp.moveaxis(k, -2, 0), k_scale, kp.dtype))
    vp = vp.at[:, page, offset].set(to_cache(jnp.moveaxis(v, -2, 0), v_scale, vp.dtype))
    return kp, vp


def _check(q, k, v, q_norm, k_norm, positions, inv_freq, pages, page, offset):
    *lead, nH, D = q.shape
    if positions.shape != tuple(lead):
        raise ValueError(f"positions {positions.shape} do not match q {q.shape}")
    if q_norm.shape != (D,) or inv_freq.shape != (D // 2,) or D % 2:
        raise ValueError(f"q_norm {q_norm.shape} / inv_freq {inv_freq.shape} do not fit head_dim {D}")
    if k is None:
        if v is not None or pages is not None:
            raise ValueError("v or pages given without k: a layer without K has nothing to store")
        return
    if k.shape[:-2] != tuple(lead) or k.shape[-1] != D or (v is not None and v.shape != k.shape):
        raise ValueError(f"k {k.shape} / v {None if v is None else v.shape} do not match q {q.shape}")
    if k_norm is None or k_norm.shape != (D,):
        raise ValueError(f"k_norm {None if k_norm is None else k_norm.shape} does not fit head_dim {D}")
    if pages is None or page is None or offset is None:
        raise ValueError("k given without pages, page and offset to store it in")
    nKV = k.shape[-2]
    if pages[0].shape != pages[1].shape or pages[0].shape[0] != nKV or pages[0].shape[-1] != D:
        raise ValueError(f"pages {pages[0].shape} / {pages[1].shape} do not fit k {k.shape}")
    if page.shape != tuple(lead) or offset.shape != tuple(lead):
        raise ValueError(f"page {page.shape} / offset {offset.shape} do not match q {q.shape}")


def normed_and_roped(q: Array, k: Array | None, v: Array | None, q_norm: Array, k_norm: Array | None,
                     positions: Array, inv_freq: Array, *, eps: float) -> tuple[Array, Array | None, Array | None]:
    """(queries, keys, values): q normed and roped; with k, K normed and roped and V (`v`, or the raw `k` where v is
    None: attention_k_eq_v) normed without a weight. k None: queries only (keys, values None)."""
    queries = apply_rope(rms_norm(q, eps, q_norm), positions, inv_freq)
    if k is None:
        return queries, None, None
    keys = apply_rope(rms_norm(k, eps, k_norm), positions, inv_freq)
    return queries, keys, rms_norm(k if v is None else v, eps)


def attention_inputs_reference(q: Array, k: Array | None, v: Array | None, q_norm: Array, k_norm: Array | None,
                               positions: Array, inv_freq: Array, *, eps: float,
                               pages: tuple[Array, Array] | None = None, page: Array | None = None,
                               offset: Array | None = None, k_scale: float = 1.0,
                               v_scale: float = 1.0) -> tuple[Array, tuple[Array, Array] | None]:
    """(queries, pages): `normed_and_roped`, the keys and values written into `pages` at (page, offset), divided by
    `k_scale` / `v_scale` in a float8 cache (`to_cache`). k None: queries only (a layer reading another's K/V, or the
    assistant's), pages None."""
    _check(q, k, v, q_norm, k_norm, positions, inv_freq, pages, page, offset)
    queries, keys, values = normed_and_roped(q, k, v, q_norm, k_norm, positions, inv_freq, eps=eps)
    if k is None:
        return queries, None
    return queries, write_pages(pages, keys, values, page, offset, k_scale=k_scale, v_scale=v_scale)


# ----------------------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------------------


def _kernel(*refs, nH: int, nKV: int, D: int, eps: float, v_col: int | None, k_scale: float, v_scale: float):
    """One program: token n, head h. x_ref [N, C] holds the token's projections side by side: q heads, then (for
    a layer that stores K/V) k heads, then v heads (none where V is the raw K: v_col is None). A row's two halves
    are loaded as power-of-two blocks, the lanes past D/2 masked. Refs: positions, x, q_norm, inv_freq, [page,
    offset, k_norm, K pages, V pages,] queries[, K pages, V pages] (the pages aliased in and out). The K and V rows
    are stored as the reference stores them (`to_cache`: in a float8 cache divided by their scale, clipped, cast)."""
    if nKV:
        pos_ref, x_ref, q_norm_ref, freq_ref, page_ref, offset_ref, k_norm_ref, _, _, q_ref, k_out, v_out = refs
    else:
        pos_ref, x_ref, q_norm_ref, freq_ref, q_ref = refs
    n, h = pl.program_id(0), pl.program_id(1)
    half = D // 2
    lanes = jnp.arange(_next_pow2(half), dtype=jnp.int32)
    live = lanes < half
    # Column offsets of the first and the second half. Masked lanes are never touched on the GPU; the interpreter
    # reads them and writes their old values back, so they must stay inside the row and apart from the live lanes
    # of the same store: the first half's point into the second half, the second half's into the first.
    first, second = lanes, jnp.where(live, half + lanes, lanes - half)
    dtype = x_ref.dtype
    ang = pos_ref[n].astype(jnp.float32) * load(freq_ref.at[jnp.minimum(lanes, half - 1)], live)
    cos, sin = jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)

    def normed(col, weight_ref):  # the two halves of row [col, col + D), RMSNorm'ed, in dtype
        a = load(x_ref.at[n, col + first], live).astype(jnp.float32)
        b = load(x_ref.at[n, col + second], live).astype(jnp.float32)
        r = jax.lax.rsqrt((jnp.sum(a * a) + jnp.sum(b * b)) / D + eps)
        a, b = a * r, b * r
        if weight_ref is not None:
            a = a * load(weight_ref.at[first], live).astype(jnp.float32)
            b = b * load(weight_ref.at[second], live).astype(jnp.float32)
        return a.astype(dtype), b.astype(dtype)

    def roped(a, b):  # x * cos + rotate_half(x) * sin, rotate_half(x) = [-b, a]
        return a * cos - b * sin, b * cos + a * sin

    @pl.when(h < nH)
    def _query():
        a, b = roped(*normed(h * D, q_norm_ref))
        store(q_ref.at[n, h, first], a, live)
        store(q_ref.at[n, h, second], b, live)

    if nKV:
        @pl.when(h >= nH)
        def _key_value():
            j = h - nH
            slot_page, slot = page_ref[n], offset_ref[n]
            a, b = roped(*normed(nH * D + j * D, k_norm_ref))
            store(k_out.at[j, slot_page, slot, first], to_cache(a, k_scale, k_out.dtype), live)
            store(k_out.at[j, slot_page, slot, second], to_cache(b, k_scale, k_out.dtype), live)
            a, b = normed((nH * D + j * D) if v_col is None else v_col + j * D, None)
            store(v_out.at[j, slot_page, slot, first], to_cache(a, v_scale, v_out.dtype), live)
            store(v_out.at[j, slot_page, slot, second], to_cache(b, v_scale, v_out.dtype), live)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "k_scale", "v_scale"), donate_argnames=("pages",))
def _attention_inputs_pallas(q, k, v, q_norm, k_norm, positions, inv_freq, pages, page, offset, *, eps: float,
                             interpret: bool, k_scale: float = 1.0, v_scale: float = 1.0):
    *lead, nH, D = q.shape
    N = 1
    for d in lead:
        N *= d
    nKV = 0 if k is None else k.shape[-2]
    parts = [q.reshape(N, nH * D)]
    v_col = None
    if k is not None:
        parts.append(k.reshape(N, nKV * D).astype(q.dtype))
        if v is not None:
            v_col = (nH + nKV) * D
            parts.append(v.reshape(N, nKV * D).astype(q.dtype))
    # One operand [N, C]: XLA's dot merger computes q, k and v as one [N, C] matmul, and a concatenation of its
    # output's slices in order is that output again, which XLA sees only when the slices are taken and joined as
    # [N, .] (joined as [B, T, .], it copied the matmul's output in a kernel of its own in every owning layer).
    x = jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    flat = lambda a: jnp.reshape(a, (N,)).astype(jnp.int32)  # noqa: E731
    args = [flat(positions), x, q_norm, inv_freq.astype(jnp.float32)]
    out_shape = [jax.ShapeDtypeStruct((N, nH, D), q.dtype)]
    aliases = {}
    if k is not None:
        args += [flat(page), flat(offset), k_norm, *pages]
        out_shape += [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pages]
        aliases = {len(args) - 2: 1, len(args) - 1: 2}
    kernel = functools.partial(_kernel, nH=nH, nKV=nKV, D=D, eps=eps, v_col=v_col, k_scale=k_scale, v_scale=v_scale)
    outs = pl.pallas_call(
        kernel,
        grid=(N, nH + nKV),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=compiler_params(1, interpret=interpret),
        interpret=interpret,
        name=f"attention_inputs_h{nH}_kv{nKV}_d{D}",
    )(*args)
    queries = outs[0].reshape(*lead, nH, D)
    return queries, (None if k is None else (outs[1], outs[2]))


def attention_inputs(q: Array, k: Array | None, v: Array | None, q_norm: Array, k_norm: Array | None,
                     positions: Array, inv_freq: Array, *, eps: float, pages: tuple[Array, Array] | None = None,
                     page: Array | None = None, offset: Array | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0, interpret: bool = False) -> tuple[Array, tuple[Array, Array] | None]:
    """The Pallas kernel; same contract as `attention_inputs_reference`. `pages` are updated in place (donated)."""
    _check(q, k, v, q_norm, k_norm, positions, inv_freq, pages, page, offset)
    return _attention_inputs_pallas(q, k, v, q_norm, k_norm, positions, inv_freq, pages, page, offset, eps=eps,
                                    interpret=interpret, k_scale=float(k_scale), v_scale=float(v_scale))


def prepare_attention_inputs(q: Array, k: Array | None, v: Array | None, q_norm: Array, k_norm: Array | None,
                             positions: Array, inv_freq: Array, *, eps: float,
                             pages: tuple[Array, Array] | None = None, page: Array | None = None,
                             offset: Array | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                             impl: str = "auto") -> tuple[Array, tuple[Array, Array] | None]:
    """Through the kernel ("pallas"), the reference ("xla"), or "auto": the kernel where `kernels_chosen()` (a GPU),
    the reference elsewhere."""
    if impl == "auto":
        impl = "pallas" if kernels_chosen() else "xla"
    kwargs = dict(eps=eps, pages=pages, page=page, offset=offset, k_scale=k_scale, v_scale=v_scale)
    if impl == "pallas":
        return attention_inputs(q, k, v, q_norm, k_norm, positions, inv_freq, interpret=kernels_interpreted(),
                                **kwargs)
    if impl == "xla":
        return attention_inputs_reference(q, k, v, q_norm, k_norm, positions, inv_freq, **kwargs)
    raise ValueError(f"impl must be 'auto', 'pallas' or 'xla', got {impl!r}")
