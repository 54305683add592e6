"""The paged kernel's key splits merged and multiplied by o_proj in one kernel, one float32 partial per head.

Where the paged-attention kernel splits a sequence's keys over several programs (flash-decoding), a merge kernel
combines the splits into [B * Tq * nH, D] and o_proj's GEMM then reads the merged rows: two kernels. At decode o_proj
is already split along its contraction into parts whose partial products the kernel after it adds (a `SplitSum`:
kernels/split_k.py's residual kernels, kernels/feed_forward.py's block). A head's columns of o_proj's contraction
need only that head's merged rows, so one kernel can do both: program (h, c) merges head h's splits for every query
row (float32, `_merge_splits`' math: each split's share exp(m - max m) * l of the softmax mass), rounds the merged
rows to the activations' dtype (what the merge kernel wrote and the GEMM read) and multiplies them by block c of
o_proj's columns of head h, writing partial h: [nH, ..., N] float32 for the kernel after it to add. One kernel less
per attention layer wherever keys are split.

Two implementations with one contract: `merge_project_reference` (plain XLA: the splits merged, then
`split_matmul` in one part per head) and `merge_project` (the Pallas kernel, Triton lowering on the GPU; it runs
in interpret mode where the splits came from the paged kernel in interpret mode). `use_merge_project` says from
the shapes alone whether a projection goes this way; the model falls back to merging, then o_proj, otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from gemma4_mtp_jax.kernels.device_budget import default_budget
from gemma4_mtp_jax.kernels.paged_attention import (KeySplits, _is_pow2, _next_pow2, merge_key_splits,
                                                    merge_key_splits_reference)
from gemma4_mtp_jax.kernels.split_k import MAX_WEIGHT_BYTES, SplitSum, split_matmul
from gemma4_mtp_jax.kernels.triton_ops import compiler_params, dot, load, store

Array = jax.Array

__all__ = ["use_merge_project", "splits_fit", "project_key_splits", "merge_project", "merge_project_reference"]

BLOCK_ROWS = 16  # the query rows (B * Tq) a program holds: the smallest tensor-core tile
MAX_ROWS = BLOCK_ROWS
BLOCK_K = 128  # rows of o_proj's contraction per dot
# Columns of o_proj per program: 128 x 512 tiles spilled registers (an earlier, lost version of this kernel), and
# a 512-wide head's merged rows take registers of their own.
BLOCK_N = 256
BLOCK_N_WIDE_HEAD = 64
# Narrower blocks re-read their head's splits for little work, and 32 columns spilled at D = 512 in an earlier form
# of this kernel (ptxas, the assistant's full layer at B = 16).
MIN_BLOCK_N = 64
_NEG = -1e30  # the paged kernel's "minus infinity": a padding row's running max


def use_merge_project(rows: int, num_heads: int, head_dim: int, N: int, parts: int, itemsize: int = 2) -> bool:
    """Whether o_proj (contraction num_heads * head_dim, N columns, weights of `itemsize` bytes), which the plan
    splits in `parts` parts for the kernel after it to add, takes the key splits through this kernel: at most
    MAX_ROWS query rows, a split projection (parts > 1: its consumer adds partials, here one per head), weights
    within split_k's budget (larger ones keep XLA's autotuned GEMM), and a power-of-two head dim >= 16."""
    return (1 < parts and 1 < num_heads and rows <= MAX_ROWS and N >= 16 and head_dim >= 16 and _is_pow2(head_dim)
            and num_heads * head_dim * N * itemsize <= MAX_WEIGHT_BYTES)


def splits_fit(splits: int, rows: int, num_heads: int, head_dim: int, N: int) -> bool:
    """Whether each program's re-read of its head's splits (splits x rows rows of head_dim) stays within its own
    block of o_proj's columns (block_n rows of head_dim). Past that, the merge kernel's single read of the splits
    costs less than the kernel this one saves: E2B's full-attention layers split 4096 keys 64 ways at decode (24 MB
    of re-reads a layer at B = 2, against 12.6 MB of weights), its sliding layers 4 ways."""
    return splits * rows <= _tiling(num_heads, head_dim, N)[0]


def _tiling(num_heads: int, head_dim: int, N: int) -> tuple[int, int, int]:
    """(columns per program, contraction per dot, warps)."""
    bn = BLOCK_N if head_dim <= 256 else BLOCK_N_WIDE_HEAD
    bn = min(bn, max(MIN_BLOCK_N, _next_pow2(N)))
    # A few programs would leave most SMs idle while each streams its share of the weights (the assistant's
    # 256-wide o_proj over 4 heads is 4 programs at 256 columns): narrower blocks, at the price of each re-reading
    # its head's splits.
    while num_heads * -(-N // bn) < default_budget().num_sms // 2 and bn > MIN_BLOCK_N:
        bn //= 2
    bk = min(BLOCK_K, head_dim)
    return bn, bk, 8 if bn * bk > 128 * 128 else 4


def _kernel(m_ref, l_ref, o_ref, w_ref, out_ref, *, splits: int, rows: int, batch: int, kv_heads: int,
            padded_rows: int, q_len: int, group: int, head_dim: int, N: int, block_n: int, block_k: int, dtype):
    """One program: head h, columns c * block_n .. of o_proj, every query row r = b * q_len + t.

    m_ref, l_ref [S * B * nKV * R] float32 and o_ref [S * B * nKV * R, D]: the paged kernel's splits (row j of KV
    head kvh holds token j // group of head kvh * group + j % group); w_ref [N, nH * D] o_proj's weight; out_ref
    [nH, rows, N] float32, the heads' partial products.

    Each query row's splits come in one load ([splits, D], as the merge kernel takes them), one row after another:
    a loop over the splits instead would wait on the L2 once per split and block of D (256 times at 64 splits)."""
    h, c = pl.program_id(0), pl.program_id(1)
    r = lax.broadcasted_iota(jnp.int32, (BLOCK_ROWS, 1), 0)
    every = lax.broadcasted_iota(jnp.int32, (_next_pow2(splits), 1), 0)  # [Sp, 1]
    live = every < splits
    stride = batch * kv_heads * padded_rows  # rows per split
    n = c * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    n_live = n < N

    chunks = [k0 + lax.broadcasted_iota(jnp.int32, (1, block_k), 1) for k0 in range(0, head_dim, block_k)]

    def merge_row(i, merged):  # query row i's merged output, put in row i of each chunk's [16, bk]
        b, t = lax.div(i, jnp.int32(q_len)), lax.rem(i, jnp.int32(q_len))  # a Python 1 lowers as a bool
        at = every * stride + (b * kv_heads + h // group) * padded_rows + t * group + h % group  # [Sp, 1]
        m = load(m_ref.at[at], live, _NEG)
        w = jnp.exp(m - jnp.max(m)) * load(l_ref.at[at], live, 0.0)  # each split's share of the softmax mass
        total = jnp.sum(w)
        out = []
        for d, acc in zip(chunks, merged):
            x = jnp.sum(w * load(o_ref.at[at, d], live, 0).astype(jnp.float32), axis=0, keepdims=True)  # [1, bk]
            x = jnp.where(total > 0, x / jnp.where(total > 0, total, 1.0), 0.0)
            out.append(jnp.where(r == i, x, acc))
        return tuple(out)

    merged = lax.fori_loop(0, rows, merge_row, tuple(jnp.zeros((BLOCK_ROWS, block_k), jnp.float32) for _ in chunks))
    out = jnp.zeros((BLOCK_ROWS, block_n), jnp.float32)
    for d, x in zip(chunks, merged):  # the head's contraction a block at a time
        w_tile = load(w_ref.at[n[:, None], h * head_dim + d], n_live[:, None], 0).astype(dtype)  # [bn, bk]
        out = out + dot(x.astype(dtype), w_tile, trans_b=True)
    store(out_ref.at[h, r, n[None, :]], out, (r < rows) & n_live[None, :])


@functools.partial(jax.jit, static_argnames=("q_len", "num_heads", "dtype", "interpret"))
def _merge_project_pallas(o, m, l, w, *, q_len: int, num_heads: int, dtype, interpret: bool) -> Array:
    S, B, nKV, R, D = o.shape
    N = w.shape[0]
    rows = B * q_len
    bn, bk, warps = _tiling(num_heads, D, N)
    kernel = functools.partial(_kernel, splits=S, rows=rows, batch=B, kv_heads=nKV, padded_rows=R, q_len=q_len,
                               group=num_heads // nKV, head_dim=D, N=N, block_n=bn, block_k=bk, dtype=dtype)
    whole = lambda shape: pl.BlockSpec(shape, lambda h, c: (0,) * len(shape))  # noqa: E731  (indexed inside)
    stats = S * B * nKV * R
    partials = pl.pallas_call(
        kernel,
        grid=(num_heads, -(-N // bn)),
        in_specs=[whole((stats,)), whole((stats,)), whole((stats, D)), whole(w.shape)],
        out_specs=whole((num_heads, rows, N)),
        out_shape=jax.ShapeDtypeStruct((num_heads, rows, N), jnp.float32),
        compiler_params=compiler_params(warps, interpret=interpret),
        interpret=interpret,
        name=f"merge_project_s{S}_d{D}_n{bn}",
    )(m.reshape(stats), l.reshape(stats), o.reshape(stats, D), w)
    return partials.reshape(num_heads, B, q_len, N)


def _check(splits: KeySplits, w: Array) -> None:
    S, B, nKV, R, D = splits.o.shape
    nH = splits.num_heads
    if (splits.m.shape != (S, B, nKV, R) or splits.l.shape != (S, B, nKV, R) or nH % nKV or nH < 2
            or R < splits.q_len * (nH // nKV) or w.ndim != 2 or w.shape[1] != nH * D):
        raise ValueError(f"merge_project: splits o {splits.o.shape}, m {splits.m.shape}, l {splits.l.shape} of "
                         f"{splits.q_len} tokens x {nH} heads (at least 2) do not fit w {w.shape} ([N, nH * D])")


def merge_project_reference(splits: KeySplits, w: Array) -> SplitSum:
    """o_proj (w [N, nH * D], PyTorch layout) of the merged splits, rounded to their dtype, as nH partial products
    [nH, B, Tq, N] float32, one per head: the merge, then `split_matmul` in one part per head."""
    _check(splits, w)
    x = merge_key_splits_reference(splits)
    B, T, nH, D = x.shape
    return split_matmul(x.reshape(B, T, nH * D), w, nH)


def project_key_splits(splits: KeySplits, w: Array, parts: int) -> SplitSum | Array:
    """o_proj (w [N, nH * D]) of the key splits: merged and projected in one kernel where they fit (`splits_fit`),
    else merged by the merge kernel, then projected in `parts` parts (`split_matmul`), as a merged output is."""
    S, B = splits.o.shape[:2]
    D, N = splits.o.shape[-1], w.shape[0]
    if splits_fit(S, B * splits.q_len, splits.num_heads, D, N):
        return merge_project(splits, w)
    x = merge_key_splits(splits)
    return split_matmul(x.reshape(B, splits.q_len, -1), w, parts)


def merge_project(splits: KeySplits, w: Array) -> SplitSum:
    """`merge_project_reference` through the kernel, at most MAX_ROWS query rows (B * Tq)."""
    _check(splits, w)
    B, rows = splits.o.shape[1], splits.o.shape[1] * splits.q_len
    if rows > MAX_ROWS:
        raise ValueError(f"merge_project: {rows} query rows (B={B} x Tq={splits.q_len}), at most {MAX_ROWS}")
    dtype = jnp.dtype(splits.dtype)
    p = _merge_project_pallas(splits.o, splits.m, splits.l, w, q_len=splits.q_len, num_heads=splits.num_heads,
                              dtype=dtype, interpret=splits.interpret)
    return SplitSum(p, dtype)
