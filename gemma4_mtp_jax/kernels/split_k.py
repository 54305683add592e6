"""A matmul with few rows split over its contraction, its partial sums added by the kernel that consumes them.

At decode a projection has a handful of rows (the batch) and thousands of columns: to keep every SM busy, XLA
splits the contraction K into S parts (split K), one GEMM kernel writes S partial products, and a second kernel
adds them. The norm after the projection is a third. Gemma 4's sandwich norms put such a pair after o_proj,
down_proj and (E2B / E4B) per_layer_input_gate in every layer: at E2B decode that is 3 of a layer's ~19 kernels,
each a few microseconds of fixed cost (docs/decisions/0008-split-k-projections.md).

Here the split is written out: `SplitSum` holds the S partial products of `x @ w.T` (one batched matmul, so XLA
still runs one GEMM kernel over S x (column tiles) programs), and the consumer adds them up in its own kernel:
- `add_normed(y, residual, weight, next_weight=None, scale=None)`: h = residual + rms_norm(y, weight) (times
  `scale`, the layer's `layer_scalar`, for the layer's last residual add) and, optionally, rms_norm(h,
  next_weight) — post_attention_layernorm + residual + pre_feedforward_layernorm, post_feedforward_layernorm +
  residual, or post_per_layer_input_norm + residual;
- `gelu_gate(y, multiplier, index)`: gelu_tanh(y) * multiplier[index] — the per-layer-input gate, reading its
  layer's per-layer input out of the stack of all layers' (so no kernel copies the slice out first).
`y` may also be a plain array (a projection that was not split): then both are the model's plain XLA math.

Two implementations with one contract: the `*_reference` functions (plain XLA: the sum, then the model's math) and
the Pallas kernel (Triton lowering on GPU, `interpret=True` anywhere). Grid: one program per row; the row is
processed in power-of-two chunks of the width (1536 = 3 x 512), with the S partials summed in float32. Rounding
follows the reference: the sum rounded to the activations' dtype (what the matmul returns), each norm in float32
rounded after its weight, the residual add and the gate's product rounded once each.

`plan_splits(rows, K, N)` decides S (1: do not split) from the shape alone, so a program's plan is the same on
every backend.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gemma4_mtp_jax.kernels.attention_inputs import rms_norm
from gemma4_mtp_jax.kernels.device_budget import GpuBudget, default_budget, kernels_chosen, kernels_interpreted
from gemma4_mtp_jax.kernels.triton_ops import compiler_params

Array = jax.Array

__all__ = ["SplitSum", "split_matmul", "plan_splits", "total", "add_normed", "add_normed_reference", "gelu_gate",
           "gelu_gate_reference"]

MAX_ROWS = 16  # more rows than a decode batch: XLA's own GEMM plan is left alone (verify, prefill)
# Larger weights keep XLA's autotuned plan: measured only at E2B (at most 36 MiB, down_proj of its 12288-wide
# layers), and a matmul that streams for tens of microseconds gains little from one kernel less (31B: 88-231 MB).
MAX_WEIGHT_BYTES = 40 << 20
# fp8 weights meet bfloat16 activations of this many rows or more as W8A8 (`_w8a8`): past 64 rows XLA's weight-only
# GEMM slows (80 rows: no faster than bf16 on the H100) and cuBLASLt's fp8 GEMM wins (1.5x bf16 at 80-2048 rows),
# `python benchmarks/bench_fp8_matmul.py` in docs/decisions/0017-fp8-weights.md.
W8A8_MIN_ROWS = 65
MIN_SPLIT_K = 64  # contraction per part: shorter parts make the partials' bytes rival the weights'
MAX_SPLITS = 16
_COLUMN_TILE = 64  # the column tile a skinny GEMM takes, for counting its programs


class SplitSum(NamedTuple):
    """The S partial products of a matmul, [S, ..., N] float32, awaiting their sum in `dtype`."""

    partials: Array
    dtype: jnp.dtype


def plan_splits(rows: int, K: int, N: int, itemsize: int = 2, budget: GpuBudget | None = None) -> int:
    """S for a matmul of `rows` rows, contraction K and N columns (weights of `itemsize` bytes): the fewest
    power-of-two parts (each at least MIN_SPLIT_K long) that give the GEMM about one program per SM, at most
    MAX_SPLITS; 1 past MAX_ROWS rows or MAX_WEIGHT_BYTES of weights."""
    if rows > MAX_ROWS or K * N * itemsize > MAX_WEIGHT_BYTES:
        return 1
    sms = (budget or default_budget()).num_sms
    tiles = -(-N // _COLUMN_TILE)
    s = 1
    while s < MAX_SPLITS and tiles * s < sms and K % (2 * s) == 0 and K // (2 * s) >= MIN_SPLIT_K:
        s *= 2
    return s


def split_matmul(x: Array, w: Array, splits: int, scale: Array | None = None) -> Array | SplitSum:
    """x [..., K] @ w.T (w [N, K], PyTorch layout) in x's dtype; with splits > 1, the unsummed `SplitSum`.

    The one place a projection's matmul happens, quantized or not. With `scale` ([N] float32: w is an fp8 weight,
    weights/quantize.py) the weight is converted to x's dtype as read (exact: every float8_e4m3fn value is a
    bfloat16 one), the products are summed in float32 and each output column is multiplied by its scale, rounded
    once to x's dtype: a per-output-channel scale commutes with the contraction, so it belongs on the output, not
    on each weight (which would round every dequantized weight to bfloat16). Split, the float32 partials are
    multiplied by the scale, which commutes with their sum too. bfloat16 activations of W8A8_MIN_ROWS rows or more
    (prefill, a large verify) take `_w8a8` instead."""
    if scale is not None and scale.shape != w.shape[:1]:
        raise ValueError(f"split_matmul: scale {scale.shape} does not fit w {w.shape} (one per output row)")
    if scale is not None and splits == 1 and _w8a8_rows(x):
        return _w8a8(x, w, scale)
    w = w.astype(x.dtype)
    if splits == 1:
        if scale is None:
            return jnp.einsum("...i,oi->...o", x, w)
        y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)
    *lead, K = x.shape
    if K % splits:
        raise ValueError(f"split_matmul: splits={splits} does not divide the contraction K={K}")
    xs = x.reshape(*lead, splits, K // splits)
    ws = w.reshape(w.shape[0], splits, K // splits)
    partials = jnp.einsum("...si,osi->s...o", xs, ws, preferred_element_type=jnp.float32)
    if scale is not None:
        partials = partials * scale.astype(jnp.float32)
    return SplitSum(partials, x.dtype)


def _w8a8_rows(x: Array) -> bool:
    """Whether an fp8 weight meets `x` through `_w8a8`: bfloat16 activations of at least W8A8_MIN_ROWS rows. float32
    activations (the parity tests') always take the weight-only path, which rounds nothing but the result."""
    return x.dtype == jnp.bfloat16 and math.prod(x.shape[:-1]) >= W8A8_MIN_ROWS


def _w8a8(x: Array, q: Array, scale: Array) -> Array:
    """x [..., K] @ (q * scale[:, None]).T with x quantized too: each row to q's fp8 format by its own amax, both
    fp8 operands in one GEMM (cuBLASLt's fp8 GEMM on the GPU) summed in float32, each output multiplied by its row's
    and its column's scale and rounded once to x's dtype (compressed-tensors' "FP8 dynamic": per-channel weights,
    per-token activations)."""
    top = float(jnp.finfo(q.dtype).max)
    xf = x.astype(jnp.float32)
    sx = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / top
    sx = jnp.where(sx > 0, sx, 1.0)  # an all-zero row: 0 / 1
    xq = jnp.clip(xf / sx, -top, top).astype(q.dtype)
    y = jnp.einsum("...i,oi->...o", xq, q, preferred_element_type=jnp.float32)
    return (y * sx * scale.astype(jnp.float32)).astype(x.dtype)


def total(y: Array | SplitSum) -> Array:
    """The matmul's result: the partials summed in float32, rounded to its dtype."""
    if isinstance(y, SplitSum):
        return jnp.sum(y.partials, axis=0).astype(y.dtype)
    return y


# ----------------------------------------------------------------------------------------------------------
# Reference (plain XLA): the model's math
# ----------------------------------------------------------------------------------------------------------


def add_normed_reference(y: Array | SplitSum, residual: Array, weight: Array, *, eps: float,
                         next_weight: Array | None = None, scale: Array | None = None) -> tuple[Array, Array | None]:
    """(h, rms_norm(h, next_weight) or None) with h = residual + rms_norm(y, weight), times `scale` ([1]) if given."""
    h = residual + rms_norm(total(y), eps, weight)
    if scale is not None:
        h = h * scale.astype(h.dtype)
    return h, (None if next_weight is None else rms_norm(h, eps, next_weight))


def gelu_gate_reference(y: Array | SplitSum, multiplier: Array, index: Array) -> Array:
    """gelu_tanh(y) * multiplier[index]: the GELU in float32, rounded to the dtype before the product."""
    g = total(y)
    act = jax.nn.gelu(g.astype(jnp.float32), approximate=True).astype(g.dtype)
    return act * jnp.take(multiplier, index, axis=0)


# ----------------------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------------------


def _chunk_width(N: int) -> int:
    """The largest power of two dividing N, at most 1024 (a row is processed in chunks of it)."""
    return min(N & -N, 1024)


def supported(N: int) -> bool:
    """Whether the kernel takes rows of width N (Triton's blocks are powers of two: N needs a factor >= 16)."""
    return _chunk_width(N) >= 16


def _summed(p_ref, m, S: int, N: int, dtype) -> list[Array]:
    """Row m of the partials' sum, rounded to dtype, as chunks of `_chunk_width(N)`."""
    C = _chunk_width(N)
    chunks = []
    for c in range(N // C):
        acc = p_ref[0, m, pl.ds(c * C, C)]
        for s in range(1, S):
            acc = acc + p_ref[s, m, pl.ds(c * C, C)]
        chunks.append(acc.astype(dtype))
    return chunks


def _normed(chunks: list[Array], w_ref, N: int, eps: float, dtype) -> list[Array]:
    """rms_norm of a row given as chunks: float32, times the weight, rounded to dtype."""
    C = _chunk_width(N)
    f = [x.astype(jnp.float32) for x in chunks]
    ss = sum(jnp.sum(x * x) for x in f)
    r = jax.lax.rsqrt(ss / N + eps)
    return [(x * r * w_ref[pl.ds(c * C, C)].astype(jnp.float32)).astype(dtype) for c, x in enumerate(f)]


def _add_normed_kernel(p_ref, res_ref, w_ref, *refs, S: int, N: int, eps: float, with_next: bool,
                       with_scale: bool):
    refs = list(refs)
    w2_ref = refs.pop(0) if with_next else None
    scale_ref = refs.pop(0) if with_scale else None
    h_ref, n_ref = (refs + [None])[:2]
    m = pl.program_id(0)
    C = _chunk_width(N)
    dtype = h_ref.dtype
    y = _normed(_summed(p_ref, m, S, N, dtype), w_ref, N, eps, dtype)
    h = [(res_ref[m, pl.ds(c * C, C)].astype(jnp.float32) + x.astype(jnp.float32)).astype(dtype)
         for c, x in enumerate(y)]
    if with_scale:
        scale = scale_ref[0].astype(dtype).astype(jnp.float32)
        h = [(x.astype(jnp.float32) * scale).astype(dtype) for x in h]
    for c, x in enumerate(h):
        h_ref[m, pl.ds(c * C, C)] = x
    if with_next:
        for c, x in enumerate(_normed(h, w2_ref, N, eps, dtype)):
            n_ref[m, pl.ds(c * C, C)] = x


def _gelu_gate_kernel(p_ref, idx_ref, mul_ref, g_ref, *, S: int, N: int):
    m = pl.program_id(0)
    C = _chunk_width(N)
    dtype = g_ref.dtype
    layer = idx_ref[0]
    for c, x in enumerate(_summed(p_ref, m, S, N, dtype)):
        act = jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(dtype)
        mul = mul_ref[layer, m, pl.ds(c * C, C)]
        g_ref[m, pl.ds(c * C, C)] = (act.astype(jnp.float32) * mul.astype(jnp.float32)).astype(dtype)


def _rows(partials: Array) -> tuple[Array, tuple[int, ...], int]:
    """The partials [S, ..., N] as [S, M, N] with M the flattened leading dims, those dims, and N."""
    S, *lead, N = partials.shape
    return partials.reshape(S, -1, N), tuple(lead), N


@functools.partial(jax.jit, static_argnames=("dtype", "eps", "interpret"))
def _add_normed_pallas(partials, residual, weight, next_weight, scale, *, dtype, eps: float, interpret: bool):
    p, lead, N = _rows(partials)
    S, M = p.shape[:2]
    args = [p, residual.reshape(M, N), weight] + [a for a in (next_weight, scale) if a is not None]
    out = jax.ShapeDtypeStruct((M, N), dtype)
    kernel = functools.partial(_add_normed_kernel, S=S, N=N, eps=eps, with_next=next_weight is not None,
                               with_scale=scale is not None)
    outs = pl.pallas_call(
        kernel,
        grid=(M,),
        out_shape=[out] if next_weight is None else [out, out],
        compiler_params=compiler_params(4 if N <= 2048 else 8, interpret=interpret),
        interpret=interpret,
        name=f"split_k_add_normed_s{S}_n{N}",
    )(*args)
    h = outs[0].reshape(*lead, N)
    return h, (None if next_weight is None else outs[1].reshape(*lead, N))


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def _gelu_gate_pallas(partials, multiplier, index, *, dtype, interpret: bool):
    p, lead, N = _rows(partials)
    S, M = p.shape[:2]
    mul = multiplier.reshape(multiplier.shape[0], M, N)
    g = pl.pallas_call(
        functools.partial(_gelu_gate_kernel, S=S, N=N),
        grid=(M,),
        out_shape=jax.ShapeDtypeStruct((M, N), dtype),
        compiler_params=compiler_params(4 if N <= 2048 else 8, interpret=interpret),
        interpret=interpret,
        name=f"split_k_gelu_gate_s{S}_n{N}",
    )(p, jnp.reshape(index, (1,)).astype(jnp.int32), mul)
    return g.reshape(*lead, N)


def with_reference_vjp(kernel, reference):
    """`kernel`'s values, `reference`'s gradients: a Pallas call has no JVP rule, and training differentiates
    through the layers (the assistant's trainer, on the GPU)."""
    f = jax.custom_vjp(kernel)
    f.defvjp(lambda *args: (kernel(*args), args), lambda args, ct: jax.vjp(reference, *args)[1](ct))
    return f


def _use_kernel(y, N: int, impl: str) -> bool:
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl must be 'auto', 'pallas' or 'xla', got {impl!r}")
    if not isinstance(y, SplitSum) or impl == "xla":
        return False
    if not supported(N):
        if impl == "pallas":
            raise ValueError(f"the split-K kernels need a width with a power-of-two factor >= 16, got N={N}")
        return False
    return impl == "pallas" or kernels_chosen()


def add_normed(y: Array | SplitSum, residual: Array, weight: Array, *, eps: float, next_weight: Array | None = None,
               scale: Array | None = None, impl: str = "auto", interpret: bool = False) -> tuple[Array, Array | None]:
    """`add_normed_reference`, through the kernel when `y` is a SplitSum and impl is "pallas" or ("auto")
    `kernels_chosen()` (a GPU)."""
    N = residual.shape[-1]
    if isinstance(y, SplitSum) and (y.partials.shape[1:] != residual.shape or weight.shape != (N,)
                                    or (next_weight is not None and next_weight.shape != (N,))
                                    or (scale is not None and scale.shape != (1,))):
        raise ValueError(f"add_normed: partials {y.partials.shape}, residual {residual.shape}, weight "
                         f"{weight.shape}, next_weight {None if next_weight is None else next_weight.shape}, scale "
                         f"{None if scale is None else scale.shape} disagree")
    if not _use_kernel(y, N, impl):
        return add_normed_reference(y, residual, weight, eps=eps, next_weight=next_weight, scale=scale)
    dtype = jnp.dtype(y.dtype)
    kernel = functools.partial(_add_normed_pallas, dtype=dtype, eps=eps, interpret=interpret or kernels_interpreted())

    def reference(partials, residual, weight, next_weight, scale):
        return add_normed_reference(SplitSum(partials, dtype), residual, weight, eps=eps, next_weight=next_weight,
                                    scale=scale)

    return with_reference_vjp(kernel, reference)(y.partials, residual.astype(dtype), weight, next_weight, scale)


def gelu_gate(y: Array | SplitSum, multiplier: Array, index: Array, *, impl: str = "auto",
              interpret: bool = False) -> Array:
    """`gelu_gate_reference` (multiplier [L, ..., N], index a scalar), through the kernel as `add_normed` decides."""
    N = multiplier.shape[-1]
    if isinstance(y, SplitSum) and y.partials.shape[1:] != multiplier.shape[1:]:
        raise ValueError(f"gelu_gate: partials {y.partials.shape} do not fit the multiplier {multiplier.shape}")
    if not _use_kernel(y, N, impl):
        return gelu_gate_reference(y, multiplier, index)
    dtype = jnp.dtype(y.dtype)
    kernel = functools.partial(_gelu_gate_pallas, dtype=dtype, interpret=interpret or kernels_interpreted())

    def reference(partials, multiplier, index):
        return gelu_gate_reference(SplitSum(partials, dtype), multiplier, index)

    return with_reference_vjp(kernel, reference)(y.partials, multiplier.astype(dtype), index)
