"""E2B / E4B's per-layer input path in one kernel: the gate, its GELU times the layer's per-layer input, and the
projection back to the hidden width as split-K partial products.

Per token, after the feed-forward block's residual add (x [H]), a layer with per-layer inputs (P = 256) does
    gate = per_layer_input_gate(x)                       # H -> P
    g = gelu_tanh(gate) * per_layer_input[layer]         # the layer's row of the stack [L, ..., P]
    y = per_layer_projection(g)                          # P -> H
and then post_per_layer_input_norm, the residual add and layer_scalar (kernels/split_k.py's `add_normed`).

At decode XLA ran the first three lines as three kernels before the residual kernel: the gate's split-K GEMM, split
_k's `gelu_gate` kernel adding its partials, the projection's split-K GEMM; each moves well under 1 MB of weights
(E2B: 2 x 0.75 MiB) and costs mostly its fixed few microseconds. Here they are one kernel.

Grid (P / chunk, H / block_h): program (s, j) takes chunk s of P. It computes its chunk of the gate for every row,
the whole of H contracted in power-of-two blocks (E2B's 1536 = 3 x 512), then the GELU and the product with the
stack's chunk (the layer picked in the kernel, so nothing copies its slice out first), and writes columns j of
partial s: g[:, chunk s] @ per_layer_projection[j-block, chunk s].T, [S, M, H] float32 with S = P / chunk, a
`SplitSum` over the projection's contraction that the residual kernel adds up. The H / block_h programs of one
chunk each recompute its gate (a [chunk, H] tile of weights, read from L2 after the first): a program streaming the
whole weights alone would run at one SM's share of the bandwidth. Rows go in blocks of 16 (Triton's smallest dot),
masked past M, every block against the same weight tiles.

Two implementations with one contract: `per_layer_input_reference` (plain XLA: the model's math — `split_matmul`
for the gate, split_k's `gelu_gate_reference`, `split_matmul` for the projection) and the Pallas kernel (Triton
lowering on GPU, `interpret=True` anywhere). Rounding follows the reference: the gate's dot accumulated in float32
and rounded to the activations' dtype (what a matmul returns), GELU in float32 rounded to the dtype, the product
with the stack's row rounded once; each partial is a float32 dot over its chunk. The gate sums its contraction in
another order than XLA's split-K GEMM did (float32 either way).

`plan(rows, H, P, dtype)` is the kernel's `Tiling`, or None where the path keeps XLA's kernels (off the GPU, rows
past PLAN_MAX_ROWS, 4-byte activations, widths Triton's power-of-two blocks do not fit). Tensor parallelism is the
decoder's to check: XLA's SPMD partitioner cannot split a Pallas call, and the split-K path is off there too.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from gemma4_mtp_jax.kernels.device_budget import on_gpu
from gemma4_mtp_jax.kernels.split_k import SplitSum, gelu_gate_reference, split_matmul, with_reference_vjp
from gemma4_mtp_jax.kernels.triton_ops import compiler_params, dot_t, load, store

Array = jax.Array

__all__ = ["Tiling", "plan", "per_layer_input", "per_layer_input_reference"]

BLOCK_ROWS = 16
# The kernel takes up to 128 rows (the B = 16 verify's 80), but `plan` gives it decode-sized calls only: at 80 rows
# it took 27-30 us a layer against XLA's 16 on an H100 (run 127: the gate recomputed per column block, the 16
# partials added by the residual kernel), at 2 and 16 rows 14 against 21 and 19.
MAX_ROWS = 128
PLAN_MAX_ROWS = BLOCK_ROWS
# Columns of P a program takes (S = P / CHUNK partials for the residual kernel to add), columns of H it writes, and
# warps: E2B 16 x 6 = 96 programs, each reading 48 KiB of the gate and 8 KiB of the projection. Run 127 (H100,
# probe_per_layer_input.py, 16 layers): 13.7 / 14.1 us a layer at 2 / 16 rows; 32 x 512 (the first guess) 18.5 /
# 13.9, XLA's three kernels 21.4 / 19.1.
CHUNK = 16
BLOCK_H = 256
NUM_WARPS = 4
MAX_BLOCK_K = 512  # the gate's contraction block: a [16, 512] row tile and a [chunk, 512] weight tile


class Tiling(NamedTuple):
    chunk: int  # columns of P per program: the partials are P / chunk
    block_h: int  # columns of H per program
    num_warps: int


def _block_k(H: int) -> int:
    """The largest power of two dividing H, at most MAX_BLOCK_K (H is contracted in blocks of it)."""
    return min(H & -H, MAX_BLOCK_K)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def plan(rows: int, H: int, P: int, dtype) -> Tiling | None:
    """The kernel's tiling for `rows` tokens of width H with per-layer inputs of width P, or None to keep XLA's
    kernels."""
    if not on_gpu() or rows > PLAN_MAX_ROWS or jnp.dtype(dtype).itemsize != 2:
        return None
    block_k, chunk = _block_k(H), min(CHUNK, P & -P)
    if block_k < 16 or chunk < 16:
        return None
    return Tiling(chunk, min(BLOCK_H, block_k), NUM_WARPS)


# ----------------------------------------------------------------------------------------------------------
# Reference (plain XLA): the model's math
# ----------------------------------------------------------------------------------------------------------


def per_layer_input_reference(x: Array, gate_w: Array, stack: Array, index: Array, proj_w: Array, *,
                              splits: int) -> SplitSum:
    """per_layer_projection(gelu_tanh(per_layer_input_gate(x)) * stack[index]) as `splits` float32 partials over
    the projection's contraction. x [..., H], gate_w [P, H], stack [L, ..., P], proj_w [H, P]."""
    g = gelu_gate_reference(split_matmul(x, gate_w, 1), stack, index)
    y = split_matmul(g, proj_w, splits)
    if isinstance(y, SplitSum):
        return y
    # One part: the float32 product itself (split_matmul would round it, the residual kernel rounds the sum).
    w = proj_w.astype(g.dtype)
    return SplitSum(jnp.einsum("...i,oi->...o", g, w, preferred_element_type=jnp.float32)[None], g.dtype)


# ----------------------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------------------


def _kernel(idx_ref, x_ref, gate_ref, stack_ref, proj_ref, p_ref, *, M: int, H: int, chunk: int, block_h: int):
    """Program (s, j): idx_ref [1] the layer, x_ref [M, H], gate_ref [P, H], stack_ref [L, M, P], proj_ref [H, P]
    (whole, in global memory); writes p_ref[s, :, j-block] [M, block_h]."""
    s, j = pl.program_id(0), pl.program_id(1)
    dtype = x_ref.dtype
    block_k = _block_k(H)
    layer = idx_ref[0]
    # The projection's tile first: its load is in flight while the gate runs.
    proj = proj_ref[pl.ds(j * block_h, block_h), pl.ds(s * chunk, chunk)].astype(dtype)  # [block_h, chunk]
    iota = lambda n: lax.broadcasted_iota(jnp.int32, (n,), 0)  # noqa: E731
    rows = [r * BLOCK_ROWS + iota(BLOCK_ROWS) for r in range(-(-M // BLOCK_ROWS))]
    live = [(r < M)[:, None] for r in rows]
    # Weight tiles outer, row blocks inner: each tile is read once, the row blocks' [16, chunk] sums stay resident.
    acc = [None] * len(rows)
    for k in range(H // block_k):
        gate = gate_ref[pl.ds(s * chunk, chunk), pl.ds(k * block_k, block_k)].astype(dtype)  # [chunk, block_k]
        cols = k * block_k + iota(block_k)
        for r, (row, ok) in enumerate(zip(rows, live)):
            xt = load(x_ref.at[row[:, None], cols[None, :]], jnp.broadcast_to(ok, (BLOCK_ROWS, block_k)))
            d = dot_t(xt, gate)  # [16, chunk] float32
            acc[r] = d if acc[r] is None else acc[r] + d
    chunk_cols = s * chunk + iota(chunk)
    out_cols = j * block_h + iota(block_h)
    for row, ok, a in zip(rows, live, acc):
        act = jax.nn.gelu(a.astype(dtype).astype(jnp.float32), approximate=True).astype(dtype)
        mul = load(stack_ref.at[layer, row[:, None], chunk_cols[None, :]], jnp.broadcast_to(ok, (BLOCK_ROWS, chunk)))
        g = (act.astype(jnp.float32) * mul.astype(jnp.float32)).astype(dtype)  # [16, chunk]
        store(p_ref.at[s, row[:, None], out_cols[None, :]], dot_t(g, proj), jnp.broadcast_to(ok, (BLOCK_ROWS, block_h)))


@functools.partial(jax.jit, static_argnames=("chunk", "block_h", "num_warps", "interpret"))
def _pallas(x, gate_w, stack, index, proj_w, *, chunk: int, block_h: int, num_warps: int, interpret: bool):
    *lead, H = x.shape
    M = math.prod(lead)
    L, P = stack.shape[0], stack.shape[-1]
    S = P // chunk
    p = pl.pallas_call(
        functools.partial(_kernel, M=M, H=H, chunk=chunk, block_h=block_h),
        grid=(S, H // block_h),
        out_shape=jax.ShapeDtypeStruct((S, M, H), jnp.float32),
        compiler_params=compiler_params(num_warps, interpret=interpret),
        interpret=interpret,
        name=f"per_layer_input_h{H}_p{P}_c{chunk}_b{block_h}",
    )(jnp.reshape(index, (1,)).astype(jnp.int32), x.reshape(M, H), gate_w, stack.reshape(L, M, P), proj_w)
    return p.reshape(S, *lead, H)


def per_layer_input(x: Array, gate_w: Array, stack: Array, index: Array, proj_w: Array, *, chunk: int = CHUNK,
                    block_h: int = BLOCK_H, num_warps: int = NUM_WARPS, interpret: bool = False) -> SplitSum:
    """The Pallas kernel; same contract as `per_layer_input_reference` with splits = P / chunk (`plan` gives the
    tiling: chunk columns of P and block_h columns of H per program). Differentiates through the reference."""
    *lead, H = x.shape
    P = gate_w.shape[0] if gate_w.ndim == 2 else None
    if gate_w.shape != (P, H):
        raise ValueError(f"per_layer_input: gate_w {gate_w.shape} is not [P, H] for x {x.shape} (H = {H})")
    if proj_w.shape != (H, P):
        raise ValueError(f"per_layer_input: proj_w {proj_w.shape} is not [H, P] = {(H, P)}")
    if stack.ndim < 2 or stack.shape[1:] != (*lead, P):
        raise ValueError(f"per_layer_input: stack {stack.shape} is not [L, ..., P] = [L, {', '.join(map(str, lead))}"
                         f"{', ' if lead else ''}{P}] for x {x.shape}")
    if jnp.ndim(index) != 0 or not jnp.issubdtype(jnp.result_type(index), jnp.integer):
        raise ValueError(f"per_layer_input: index must be an integer scalar, got {jnp.shape(index)} "
                         f"{jnp.result_type(index)}")
    rows = math.prod(lead)
    if rows > MAX_ROWS:
        raise ValueError(f"per_layer_input: no kernel for {rows} rows of x (at most {MAX_ROWS})")
    if not (_pow2(chunk) and P % chunk == 0):
        raise ValueError(f"per_layer_input: chunk={chunk} is not a power of two >= 16 dividing P={P}")
    if not (_pow2(block_h) and H % block_h == 0 and _block_k(H) >= 16):
        raise ValueError(f"per_layer_input: block_h={block_h} is not a power of two >= 16 dividing H={H} (which "
                         f"needs a power-of-two factor >= 16)")
    dtype = jnp.dtype(x.dtype)
    kernel = functools.partial(_pallas, chunk=chunk, block_h=block_h, num_warps=num_warps, interpret=interpret)

    def reference(x, gate_w, stack, index, proj_w):
        return per_layer_input_reference(x, gate_w, stack, index, proj_w, splits=P // chunk).partials

    index = jnp.asarray(index, jnp.int32)
    partials = with_reference_vjp(kernel, reference)(x, gate_w, stack.astype(dtype), index, proj_w)
    return SplitSum(partials, dtype)
