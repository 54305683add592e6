"""A small decoder layer's feed-forward block in one kernel: the attention block's residual add and its norms, the
MLP, and down_proj's partial products.

Per token, Gemma 4's layer does after attention (o = o_proj's output, r = the residual stream):
    x = r + rms_norm(o, post_attention_layernorm)
    m = rms_norm(x, pre_feedforward_layernorm)
    f = down_proj(gelu_tanh(gate_proj(m)) * up_proj(m))
and then the post-feedforward norm and residual add (kernels/split_k.py's `add_normed`, which sums partials).

XLA runs those first lines as four kernels: a norm fusion, the merged gate|up GEMM, GELU x up, down_proj. In the
assistant (H = 256, I = 2048: 3 MiB of weights a layer) each of them is a few microseconds of fixed cost around
well under a microsecond of reading (a draft step was 57 kernels: docs/decisions/0009-drafter-feed-forward-kernel.md).
Here they are one.
Grid (S,): program s reads the whole of o and r (a few rows of H), recomputes x and m (cheap: H wide), takes its
own chunk of I/S columns of gate and up and rows of down, and writes x @ its chunk's share of down_proj as partial
s: [S, M, H] float32, a `SplitSum` over down_proj's contraction, which the layer's last residual kernel adds up.
Program 0 also writes x. Rows sit in one block of 16 (Triton's smallest matmul), masked past M.

Two implementations with one contract: `feed_forward_block_reference` (plain XLA: split_k's `add_normed_reference`,
then `mlp`, the model's own math) and the Pallas kernel (Triton lowering on GPU, `interpret=True` anywhere).
Rounding follows the reference: the norms in float32 rounded after their weights, the residual add rounded once,
gate and up rounded to the activations' dtype as a matmul returns them, GELU in float32 rounded before the
product, the product rounded once; each partial is a float32 sum over its chunk.

`plan_block(rows, H, I, dtype, quantized)` is the kernel's S, or None where the block takes XLA's kernels (the CPU,
rows past MAX_ROWS, weights past MAX_WEIGHT_BYTES, 4-byte activations, fp8 weights, widths Triton's power-of-two
blocks do not fit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from gemma4_mtp_jax.kernels.device_budget import kernels_chosen
from gemma4_mtp_jax.kernels.split_k import SplitSum, add_normed_reference, split_matmul, with_reference_vjp
from gemma4_mtp_jax.kernels.triton_ops import compiler_params, dot_t, load, store

Array = jax.Array

__all__ = ["mlp", "plan_block", "input_parts", "feed_forward_block", "feed_forward_block_reference"]

BLOCK_ROWS = 16
MAX_ROWS = BLOCK_ROWS
# Every program recomputes the block's input and reads 1/S of the weights: measured only at the assistants' sizes
# (E2B / E4B: 3 MiB). The targets' MLPs (E2B: 54 MiB) stream for tens of microseconds and keep XLA's GEMMs.
MAX_WEIGHT_BYTES = 8 << 20
# Columns of I per program, and warps: 32 programs of 8 warps at I = 2048. A program's time grows with the weights it
# reads, and the residual kernel after it with the partials it adds; 32 programs balance the two (the measured
# tilings: docs/decisions/0009-drafter-feed-forward-kernel.md).
CHUNK = 64
NUM_WARPS = 8
# o_proj's partial products the kernel adds itself: the assistant's 1024-wide o_proj ran as one GEMM in 4.1 us, in
# 4 parts in 2.5 us for 0.3-0.7 us more in the kernel; 16 parts cost the kernel 2.5 us more at 16 rows (H200,
# docs/decisions/0009-drafter-feed-forward-kernel.md).
INPUT_PARTS = 4
MAX_HIDDEN = 1024  # a [16, H] row block and a [CHUNK, H] weight tile per operand stay in registers / shared memory


def _gelu_tanh(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=True)


def mlp(x: Array, gate: Array, up: Array, down: Array, splits: int = 1,
        scales: tuple[Array | None, Array | None, Array | None] = (None, None, None)) -> Array | SplitSum:
    """down(gelu_tanh(gate(x)) * up(x)) with PyTorch-layout weights (gate, up [I, H], down [H, I]); down_proj split
    in `splits` parts of its contraction (a SplitSum) when splits > 1. `scales`: the three weights' per-output-channel
    scales where they are fp8 (`split_matmul`)."""
    sg, su, sd = scales
    h = _gelu_tanh(split_matmul(x, gate, 1, sg)) * split_matmul(x, up, 1, su)
    return split_matmul(h, down, splits, sd)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def plan_block(rows: int, H: int, I: int, dtype, quantized: bool = False) -> int | None:
    """S (programs, each CHUNK columns of I) for a block of `rows` tokens, or None to keep XLA's kernels. fp8 weights
    (`quantized`) keep XLA's: the kernel is sized for the assistants' MLPs, whose 3 MiB are not worth quantizing by
    default, and reads its weights in the activations' dtype."""
    if not kernels_chosen() or quantized:
        return None
    itemsize = jnp.dtype(dtype).itemsize
    if rows > MAX_ROWS or itemsize != 2 or 3 * H * I * itemsize > MAX_WEIGHT_BYTES:
        return None
    chunk = min(CHUNK, I & -I)
    if not _pow2(H) or H > MAX_HIDDEN or chunk < 16:
        return None
    return I // chunk


def input_parts(K: int) -> int:
    """How many parts the projection feeding the block (o_proj, contraction K) is split in, for the kernel to add."""
    return INPUT_PARTS if K % INPUT_PARTS == 0 and K // INPUT_PARTS >= 64 else 1


# ----------------------------------------------------------------------------------------------------------
# Reference (plain XLA): the model's math
# ----------------------------------------------------------------------------------------------------------


def feed_forward_block_reference(a: Array | SplitSum, residual: Array, post_attention_norm: Array,
                                 pre_feedforward_norm: Array, gate: Array, up: Array, down: Array, *, eps: float,
                                 splits: int) -> tuple[Array, SplitSum | Array]:
    """(x, down_proj's output in `splits` parts): x = residual + rms_norm(a, post_attention_norm), the MLP of
    rms_norm(x, pre_feedforward_norm)."""
    x, m = add_normed_reference(a, residual, post_attention_norm, eps=eps, next_weight=pre_feedforward_norm)
    return x, mlp(m, gate, up, down, splits)


# ----------------------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------------------


def _normed(x: Array, w: Array, eps: float, dtype) -> Array:
    """rms_norm of each row of float32 x [R, H]: float32, times the weight, rounded to dtype."""
    r = lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
    return (x * r * w.astype(jnp.float32)[None, :]).astype(dtype)


def _kernel(a_ref, res_ref, wpa_ref, wpf_ref, gate_ref, up_ref, down_ref, x_ref, p_ref, *, M: int, S_a: int,
            H: int, eps: float):
    """One program: chunk s of I. a_ref [S_a, M, H] (o_proj's partials, or its output as one part), res_ref /
    x_ref [M, H], gate_ref / up_ref [CHUNK, H] and down_ref [H, CHUNK] (the chunk's blocks), p_ref [S, M, H]."""
    s = pl.program_id(0)
    dtype = x_ref.dtype
    # The chunk's weights first: their loads are in flight while the norms run.
    gate, up, down = (ref[...].astype(dtype) for ref in (gate_ref, up_ref, down_ref))
    rows = lax.broadcasted_iota(jnp.int32, (BLOCK_ROWS,), 0)
    cols = lax.broadcasted_iota(jnp.int32, (H,), 0)
    live = jnp.broadcast_to((rows < M)[:, None], (BLOCK_ROWS, H))
    at = (rows[:, None], cols[None, :])

    acc = load(a_ref.at[(0, *at)], live).astype(jnp.float32)
    for i in range(1, S_a):
        acc = acc + load(a_ref.at[(i, *at)], live).astype(jnp.float32)
    o = acc.astype(dtype).astype(jnp.float32)
    x = (load(res_ref.at[at], live).astype(jnp.float32)
         + _normed(o, wpa_ref[...], eps, dtype).astype(jnp.float32)).astype(dtype)

    @pl.when(s == 0)
    def _():
        store(x_ref.at[at], x, live)

    m = _normed(x.astype(jnp.float32), wpf_ref[...], eps, dtype)  # [16, H]
    g = dot_t(m, gate).astype(dtype)  # [16, CHUNK]
    u = dot_t(m, up).astype(dtype)
    h = (_gelu_tanh(g.astype(jnp.float32)).astype(dtype).astype(jnp.float32) * u.astype(jnp.float32)).astype(dtype)
    store(p_ref.at[(s, *at)], dot_t(h, down), live)


@functools.partial(jax.jit, static_argnames=("dtype", "eps", "splits", "num_warps", "interpret"))
def _block_pallas(a_parts, residual, wpa, wpf, gate, up, down, *, dtype, eps: float, splits: int, num_warps: int,
                  interpret: bool):
    S_a, *lead, H = a_parts.shape
    a = a_parts.reshape(S_a, -1, H)
    M = a.shape[1]
    I = gate.shape[0]
    chunk = I // splits
    whole = lambda shape: pl.BlockSpec(shape, lambda s: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(_kernel, M=M, S_a=S_a, H=H, eps=eps)
    x, p = pl.pallas_call(
        kernel,
        grid=(splits,),
        in_specs=[whole((S_a, M, H)), whole((M, H)), whole((H,)), whole((H,)),
                  pl.BlockSpec((chunk, H), lambda s: (s, 0)), pl.BlockSpec((chunk, H), lambda s: (s, 0)),
                  pl.BlockSpec((H, chunk), lambda s: (0, s))],
        out_specs=[whole((M, H)), whole((splits, M, H))],
        out_shape=[jax.ShapeDtypeStruct((M, H), dtype), jax.ShapeDtypeStruct((splits, M, H), jnp.float32)],
        compiler_params=compiler_params(num_warps, interpret=interpret),
        interpret=interpret,
        name=f"feed_forward_block_h{H}_s{splits}",
    )(a, residual.reshape(M, H), wpa, wpf, gate, up, down)
    return x.reshape(*lead, H), p.reshape(splits, *lead, H)


def feed_forward_block(a: Array | SplitSum, residual: Array, post_attention_norm: Array, pre_feedforward_norm: Array,
                       gate: Array, up: Array, down: Array, *, eps: float, splits: int, num_warps: int = NUM_WARPS,
                       interpret: bool = False) -> tuple[Array, SplitSum]:
    """The Pallas kernel; same contract as `feed_forward_block_reference` (splits: the kernel's programs, each
    I / splits columns of gate / up; `plan_block`). Differentiates through the reference."""
    H, I = residual.shape[-1], gate.shape[0]
    parts = a.partials if isinstance(a, SplitSum) else a[None]
    if (parts.shape[1:] != residual.shape or gate.shape != (I, H) or up.shape != (I, H) or down.shape != (H, I)
            or post_attention_norm.shape != (H,) or pre_feedforward_norm.shape != (H,)):
        raise ValueError(f"feed_forward_block: a {parts.shape[1:]}, residual {residual.shape}, gate {gate.shape}, "
                         f"up {up.shape}, down {down.shape}, norms {post_attention_norm.shape} / "
                         f"{pre_feedforward_norm.shape} disagree")
    rows = residual.size // H
    if rows > MAX_ROWS or not _pow2(H) or splits < 1 or I % splits or not _pow2(I // splits):
        raise ValueError(f"feed_forward_block: no kernel for {rows} rows (at most {MAX_ROWS}), H={H} (a power of "
                         f"two >= 16) and I={I} in {splits} parts (power-of-two parts >= 16)")
    dtype = jnp.dtype(a.dtype)
    kernel = functools.partial(_block_pallas, dtype=dtype, eps=eps, splits=splits, num_warps=num_warps,
                               interpret=interpret)

    def reference(parts, residual, wpa, wpf, gate, up, down):
        x, f = feed_forward_block_reference(SplitSum(parts, dtype), residual, wpa, wpf, gate, up, down, eps=eps,
                                            splits=splits)
        return x, (f.partials if isinstance(f, SplitSum) else f[None].astype(jnp.float32))

    x, p = with_reference_vjp(kernel, reference)(parts, residual.astype(dtype), post_attention_norm,
                                                 pre_feedforward_norm, gate, up, down)
    return x, SplitSum(p, dtype)
