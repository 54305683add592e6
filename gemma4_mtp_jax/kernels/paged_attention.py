"""Paged attention for decode / verify: a few query tokens per sequence against K/V kept in pages.

Layout (one layer's pool): `k_pages`, `v_pages` are [nKV, num_pages, page_size, D]; `page_table` [B, W] names the
pages of each sequence. Key position p of sequence b lives in page `page_table[b, p // page_size]` at offset
`p % page_size`; with a ring of R pages (sliding layers), logical page j lives in `page_table[b, j % R]`, so
a ring holds the newest N = R * page_size positions (position p in slot p mod N).

Query row t of sequence b (mask position `q_positions[b, t]`, -1 = padding) sees key p iff
`p <= q_positions[b, t]` and (window is None or `p > q_positions[b, t] - window`); with a ring, additionally
`p > max_t q_positions[b, t] - N` (older positions have been overwritten; the caller sizes the ring so that this
never hides a key the window wants: N >= window + Tq + 1). Padding rows give exact zeros. With `bounds` [B, Tq, 2]
(a prefill chunk whose image soft tokens attend to each other: `dense_attention.image_bounds`), row t sees instead
the keys `bounds[b, t, 0] <= p <= bounds[b, t, 1]`, which may lie ahead of it within the chunk (written before
any is read); `window` then only bounds the planned key range.

Two implementations with the same signature:

- `paged_attention_reference`: plain XLA. Gathers each sequence's pages into a dense [B, S, nKV, D] and calls
  `dense_attention.dot_product_attention`. CPU fallback and the test oracle.
- `paged_attention`: a Pallas kernel (Triton lowering) that reads the pages in place. Grid
  (batch, kv head, row block, key split). A program holds the Tq*G query rows of the G query heads that share
  its KV head (rows padded to a power of two >= 16 for the tensor-core dots), walks only the key blocks the rows
  can see -- [max(0, min_q - window + 1), max_q], a dynamic trip count -- gathers each block's K/V rows through
  the page table with masked loads (keys outside the visible range are never read), and runs an online softmax
  in float32. Long contexts split the key range over several programs (flash-decoding), merged afterwards in
  XLA. Sequences whose rows are all padding run zero iterations.

Q-only layers (E2B's KV-shared target layers, every assistant layer): both take, optionally, `q_norm` (the
weight [D]), `rope` = (cos, sin) [B, Tq, D/2] (`attention_inputs.rope_tables` at the layer's RoPE positions, which
for the assistant differ from the mask positions) and `eps`; q is then the raw projection, q_norm'ed and roped as
`attention_inputs` does it (the reference with its math; the kernel as it loads each query row, sparing the layer
that kernel). RoPE's tables come from XLA, not from the kernel: computing cos / sin in the kernel spilled.

A float8 cache (`attention_inputs.quantized`) holds K / (the layer's k_scale) and V / v_scale: both implementations
convert the pages to the queries' dtype as they read them, multiply the float32 scores by k_scale and the output by
v_scale (skipped for a scale of 1.0); the scales are powers of two, so neither multiply rounds.

`attend_paged(..., impl="auto")` picks the kernel on GPU and the reference elsewhere. The tiling comes from
`kernel_config`: the largest blocks whose shared memory (`smem_bytes`, calibrated on the H200) and registers fit
the device's budget (`device_budget.py`); where none fits, the XLA path runs instead, with one log line.

Backend notes. The kernel is lowered through Pallas' Triton backend (selected by passing Triton `CompilerParams`;
deprecated since JAX 0.11 but present in 0.11.2). Everything backend-specific sits in `triton_ops` (`compiler_params`,
`load`: a predicated gather of the page-table entry and the K/V rows of each key, and `dot`); the loop
bounds, masking and online softmax are plain jnp. A Mosaic GPU variant would keep those and replace the
per-key gather by one `copy_gmem_to_smem` per page (H200 has no TMA gather) feeding 64-row wgmma tiles.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from gemma4_mtp_jax.kernels.attention_inputs import normed_and_roped_queries, quantized
from gemma4_mtp_jax.kernels.device_budget import GpuBudget, default_budget, kernels_chosen, kernels_interpreted
from gemma4_mtp_jax.kernels.dense_attention import bounds_mask, causal_window_mask, dot_product_attention
from gemma4_mtp_jax.kernels.triton_ops import compiler_params, dot, load, store

Array = jax.Array
log = logging.getLogger(__name__)

_NEG = -1e30  # finite "minus infinity" for masked scores (exp(_NEG - m) underflows to 0 for any real m)
_SQUEEZED = getattr(pl, "squeezed", None)  # pl.squeezed (newer JAX) == None in a block shape (older JAX)


# ----------------------------------------------------------------------------------------------------------
# Reference (plain XLA)
# ----------------------------------------------------------------------------------------------------------


def _check_shapes(q, k_pages, v_pages, page_table, q_positions, ring_pages, q_norm=None, rope=None, eps=None,
                  bounds=None):
    B, Tq, nH, D = q.shape
    nKV, _, _, Dk = k_pages.shape
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    if Dk != D:
        raise ValueError(f"head_dim of q ({D}) and of the pages ({Dk}) differ")
    if nH % nKV:
        raise ValueError(f"{nH} query heads are not a multiple of {nKV} KV heads")
    if page_table.ndim != 2 or page_table.shape[0] != B:
        raise ValueError(f"page_table {page_table.shape} does not match batch {B}")
    if q_positions.shape != (B, Tq):
        raise ValueError(f"q_positions {q_positions.shape} != {(B, Tq)}")
    if bounds is not None and bounds.shape != (B, Tq, 2):
        raise ValueError(f"bounds {bounds.shape} != {(B, Tq, 2)} (each query's first and last visible key)")
    if ring_pages is not None and not 0 < ring_pages <= page_table.shape[1]:
        raise ValueError(f"ring_pages={ring_pages} must be in 1..{page_table.shape[1]} (the page-table width)")
    if (q_norm is None) != (rope is None):
        raise ValueError(f"q_norm and rope go together (raw queries need both): got q_norm "
                         f"{None if q_norm is None else q_norm.shape} and rope {None if rope is None else 'tables'}")
    if q_norm is not None:
        if q_norm.shape != (D,):
            raise ValueError(f"q_norm {q_norm.shape} != ({D},) (the head dim)")
        if len(rope) != 2 or any(t.shape != (B, Tq, D // 2) for t in rope) or D % 2:
            raise ValueError(f"rope must be (cos, sin), each [B, Tq, D/2] = {(B, Tq, D // 2)}, got "
                             f"{[getattr(t, 'shape', t) for t in rope]}")
        if eps is None:
            raise ValueError("eps (q_norm's epsilon) must be given with q_norm")


def slot_positions(q_positions: Array, num_slots: int, ring: bool) -> Array:
    """Key position held by each of a sequence's `num_slots` slots: [B, S] (-1 or less: holds nothing visible).

    Without a ring, slot s holds position s. A ring of N slots holds the newest N positions up to the sequence's
    highest query position hi: slot s holds the largest p <= hi with p = s (mod N).
    """
    B = q_positions.shape[0]
    slot = jnp.arange(num_slots, dtype=jnp.int32)[None, :]
    if not ring:
        return jnp.broadcast_to(slot, (B, num_slots))
    hi = jnp.max(q_positions, axis=1, keepdims=True).astype(jnp.int32)
    return hi - jnp.mod(hi - slot, num_slots)


def compute_dtype(q_dtype, pages_dtype):
    """The dtype attention computes in: the pages' own, but the queries' over a float8 cache (whose pages are
    converted to it as they are read)."""
    return jnp.dtype(q_dtype) if quantized(pages_dtype) else jnp.dtype(pages_dtype)


def paged_attention_reference(q: Array, k_pages: Array, v_pages: Array, page_table: Array, q_positions: Array,
                              *, window: int | None = None, ring_pages: int | None = None, q_norm: Array | None = None,
                              rope: tuple[Array, Array] | None = None, eps: float | None = None,
                              k_scale: float = 1.0, v_scale: float = 1.0, bounds: Array | None = None) -> Array:
    """Plain-XLA paged attention (see the module docstring). Gathers each sequence's pages into a dense copy. With
    `q_norm` and `rope`, q is the raw projection, turned into queries first (`normed_and_roped_queries`). The pages
    hold K / k_scale and V / v_scale (a float8 cache; 1.0 otherwise): the K/V read are multiplied back, exactly
    (powers of two), which scales the scores and the output as the kernel does."""
    _check_shapes(q, k_pages, v_pages, page_table, q_positions, ring_pages, q_norm, rope, eps, bounds)
    if q_norm is not None:
        q = normed_and_roped_queries(q, q_norm, *rope, eps=eps)
    B, Tq, nH, D = q.shape
    nKV, num_pages, page_size, _ = k_pages.shape
    width = page_table.shape[1] if ring_pages is None else ring_pages
    S = width * page_size
    table = jnp.clip(page_table[:, :width].astype(jnp.int32), 0, num_pages - 1)  # garbage entries stay in bounds

    def dense(pages):  # [nKV, P, ps, D] -> [B, S, nKV, D]
        g = jnp.take(pages, table, axis=1, mode="clip")  # [nKV, B, width, ps, D]
        return jnp.moveaxis(g.reshape(nKV, B, S, D), 0, 2)

    q_positions = q_positions.astype(jnp.int32)
    k_pos = slot_positions(q_positions, S, ring_pages is not None)
    if bounds is None:
        allowed = causal_window_mask(q_positions, k_pos, window)
    else:
        allowed = bounds_mask(k_pos, bounds.astype(jnp.int32))
    allowed &= (k_pos >= 0)[:, None, :] & (q_positions >= 0)[:, :, None]
    # Slots no query row can see may hold anything (stale pages, NaN): zero them so 0 * garbage stays 0.
    seen = jnp.any(allowed, axis=1)[:, :, None, None]
    k = jnp.where(seen, dense(k_pages), 0).astype(q.dtype)
    v = jnp.where(seen, dense(v_pages), 0).astype(q.dtype)
    if k_scale != 1.0:
        k = k * jnp.asarray(k_scale, k.dtype)
    if v_scale != 1.0:
        v = v * jnp.asarray(v_scale, v.dtype)
    out = dot_product_attention(q, k, v, allowed)
    has_key = jnp.any(allowed, axis=2)[:, :, None, None]
    return jnp.where(has_key, out, 0).astype(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tiling of the kernel (planned from the shapes and the device budget by `kernel_config`)."""

    block_rows: int  # query rows (t, g) per program: a power of two >= 16
    block_k: int  # keys per loop iteration: a power of two >= 16
    k_splits: int  # programs splitting one sequence's key range (flash-decoding); 1 = no split
    num_warps: int
    num_stages: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def kernel_supported(q_shape, k_pages_shape) -> bool:
    """Whether the Triton kernel can take these shapes at all (power-of-two head dim >= 16 and page size)."""
    D = q_shape[-1]
    page_size = k_pages_shape[2]
    return _is_pow2(D) and D >= 16 and _is_pow2(page_size)


def smem_bytes(block_rows: int, block_k: int, head_dim: int, num_stages: int, itemsize: int) -> int:
    """Shared memory one program needs, an upper bound: the q tile, the probability tile fed to the second dot,
    and `num_stages` buffers of the K and V blocks. Calibrated on the H200 over 364 tilings: Triton asked for at
    most this much in every tiling that failed to compile, exactly this much in several
    (docs/decisions/0005-paged-attention-tiling.md)."""
    return (block_rows * head_dim * itemsize + block_rows * block_k * itemsize
            + max(1, num_stages) * 2 * block_k * head_dim * itemsize)


_SMEM_RESERVE = 1024  # barriers and reduction scratch beyond the tiles
_F32_PER_THREAD = 128  # accumulator + score tile per thread (float32 registers), leaving room for the rest


def _num_warps(block_rows: int, head_dim: int) -> int:
    return 4 if block_rows * head_dim <= 8192 else 8


def _fits(cfg_rows, cfg_k, cfg_stages, cfg_warps, D, itemsize, budget: GpuBudget) -> bool:
    smem = smem_bytes(cfg_rows, cfg_k, D, cfg_stages, itemsize)
    regs = cfg_rows * (D + cfg_k) // (32 * cfg_warps)  # float32 values per thread: accumulator + scores
    return smem + _SMEM_RESERVE <= budget.smem_per_block and regs <= _F32_PER_THREAD


def kernel_config(q_shape, k_pages_shape, page_table_shape, *, itemsize: int = 2, window=None, ring_pages=None,
                  budget: GpuBudget | None = None, block_rows=None, block_k=None, k_splits=None, num_warps=None,
                  num_stages=None) -> KernelConfig | None:
    """The tiling for these shapes within the device's shared-memory and register budget, or None when no tiling
    fits (the caller then uses the XLA path). `itemsize`: the size of the dtype the kernel computes in
    (`compute_dtype`). Any tiling argument given explicitly is kept; the others shrink until the tiling fits (rows
    per program first, then keys per iteration, then pipeline stages). The rules, and the tilings measured for them:
    docs/decisions/0005-paged-attention-tiling.md."""
    budget = budget or default_budget()
    if not kernel_supported(q_shape, k_pages_shape):
        return None
    B, Tq, nH, D = q_shape
    nKV, _, page_size, _ = k_pages_shape
    rows = Tq * (nH // nKV)
    br = block_rows or min(_next_pow2(max(16, rows)), max(16, 16384 // D))
    if block_rows is None and rows <= 64:
        # A verify step's few rows go in 16-row blocks: each block re-reads the keys (from L2 for all but the
        # first), but a program's serial loop is what bounds these shapes, and 16 rows halve it (the measured
        # tilings: docs/decisions/0005-paged-attention-tiling.md).
        br = 16
    bk = block_k or (64 if D <= 256 else 32)
    st = num_stages or 2
    if not (_is_pow2(br) and br >= 16 and _is_pow2(bk) and bk >= 16):
        raise ValueError(f"block_rows={br} and block_k={bk} must be powers of two >= 16")

    def warps():
        return num_warps or _num_warps(br, D)

    while not _fits(br, bk, st, warps(), D, itemsize, budget):
        if block_rows is None and br > 64:
            br //= 2
        elif block_k is None and bk > 16:
            bk //= 2
        elif num_stages is None and st > 1:
            st -= 1
        elif block_rows is None and br > 16:
            br //= 2
        else:
            return None
    n_row_blocks = -(-rows // br)
    if k_splits is None:
        # Static bound on the keys one sequence's rows can see: the window (+ the query span), or the page table.
        width = page_table_shape[1] if ring_pages is None else ring_pages
        max_keys = width * page_size
        if window is not None:
            max_keys = min(max_keys, window + Tq - 1)
        max_blocks = -(-max_keys // bk) + 1
        # Splits are counted per (sequence, KV head), as a decode step of the batch would take them: the row
        # blocks of a verify step add programs on top rather than taking splits away.
        programs = B * nKV
        if programs >= budget.num_sms:
            k_splits = 1
        else:
            # ~2 programs per SM; >= 2 key blocks per split over full attention, one over a sliding window's few
            # blocks (docs/decisions/0006-sliding-window-key-splits.md); the partial outputs the merge reads back
            # (k_splits x rows x D) at most ~1/4 of the K/V bytes (max_keys x 2 x D); at most 64 splits.
            rows_padded = n_row_blocks * br
            blocks_per_split = 1 if window is not None else 2
            k_splits = max(1, min(-(-2 * budget.num_sms // programs), max_blocks // blocks_per_split,
                                  max_keys // (2 * rows_padded), 64))
            # A prefill chunk's many rows are bound by arithmetic, not by K/V bytes, so the merge's cap above
            # leaves it one split, and its row blocks alone may not fill the SMs (E2B's full layer, 256 queries:
            # 64 programs on 132 SMs). So as many splits as keep the programs within one wave.
            k_splits = max(k_splits, min(budget.num_sms // (programs * n_row_blocks), max_blocks // 2, 64))
    return KernelConfig(int(br), int(bk), int(k_splits), int(warps()), int(st))


def _paged_attention_kernel(pos_ref, table_ref, q_ref, *refs, page_size: int, block_k: int,
                            window: int | None, ring_slots: int | None, ring_pages: int | None,
                            table_width: int, k_splits: int, block_rows: int, q_len: int, num_heads: int,
                            group: int, eps: float | None, dtype, k_scale: float, v_scale: float, bounds: bool):
    """One program: block_rows query rows of one sequence and one KV head, over one split of its key range.

    The query rows are read straight from q's own layout (no padded copy of q) and, without key splits, the output
    is written back into it (no slice of the output): one or two fewer kernels per attention layer. Row j of the
    block is query token t = j // group of head h * group + j % group; rows past q_len * group are masked (padding
    to the tensor-core tile).

    pos_ref [B * Tq] int32 mask positions (-1 = padding); table_ref [table_width] int32 this sequence's pages;
    q_ref [B * Tq * nH, D] (q's rows, token-major); k_ref, v_ref [num_pages * page_size, D] (this KV head's pool,
    rows = page * page_size + offset). Outputs: o_ref [B * Tq * nH, D] in q's layout (normalized over this
    program's keys), or with k_splits > 1 the split's o_ref [R, D] and m_ref, l_ref [R] float32 (running max and
    softmax denominator), merged in XLA.

    With `bounds`, lo_ref and hi_ref [B * Tq] int32 (each row's first and last visible key) come before k_ref.

    With `eps` (a Q-only layer's raw queries): after q_ref come q_norm_ref [D] and cos_ref, sin_ref [B * Tq, D/2]
    (RoPE's tables per query token, in q's dtype), and each loaded row is q_norm'ed and roped as
    `attention_inputs` does it: RMSNorm in float32, times the weight, rounded to q's dtype; then x * cos +
    rotate_half(x) * sin in that dtype. rotate_half's swapped halves come from a second load of the row at the
    other half's columns (Triton cannot concatenate the halves).

    Everything is computed in `dtype` (`compute_dtype`): K/V blocks of a float8 cache are converted to it as they
    are loaded, the scores multiplied by `k_scale` and the output by `v_scale` (powers of two; 1.0: no multiply).
    """
    if eps is not None:
        q_norm_ref, cos_ref, sin_ref, *refs = refs
    if bounds:
        lo_ref, hi_ref, *refs = refs
    k_ref, v_ref, *out_refs = refs
    b, h = pl.program_id(0), pl.program_id(1)
    j = pl.program_id(2) * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    real = j < q_len * group
    t = j // group
    q_row = (b * q_len + t) * num_heads + h * group + j % group  # [R] rows of q (and of the output)
    cols = lax.broadcasted_iota(jnp.int32, (1, q_ref.shape[-1]), 1)
    pos = load(pos_ref.at[b * q_len + t], real, -1)
    q = load(q_ref.at[q_row[:, None], cols], real[:, None], 0)
    if eps is not None:
        q = _normed_and_roped(q, q_ref, q_norm_ref, cos_ref, sin_ref, q_row, b * q_len + t, real, cols, eps)
    q = q.astype(dtype)
    rows, D = q.shape

    # Each row's visible keys [row_lo, row_hi] (row_lo None: from 0), then the block's range [lo, hi]. All-padding
    # blocks get an empty range.
    valid = pos >= 0
    if bounds:
        row_lo = load(lo_ref.at[b * q_len + t], real, 0)
        row_hi = jnp.where(valid, load(hi_ref.at[b * q_len + t], real, -1), -1)
    else:
        row_lo = None if window is None else pos - (window - 1)
        row_hi = pos
    hi = jnp.max(row_hi)
    lo = jnp.int32(0)
    if row_lo is not None:
        lo = jnp.maximum(lo, jnp.min(jnp.where(valid, row_lo, jnp.iinfo(jnp.int32).max)))
    if ring_slots is not None:  # older positions were overwritten in the ring (its newest: the newest query's)
        lo = jnp.maximum(lo, jnp.max(pos) - (ring_slots - 1))
    first_blk = lo // block_k
    n_blk = jnp.where(hi >= 0, hi // block_k - first_blk + 1, 0)
    if k_splits > 1:
        per_split = (n_blk + (k_splits - 1)) // k_splits
        start = first_blk + pl.program_id(3) * per_split
        trip = jnp.clip(first_blk + n_blk - start, 0, per_split)
    else:
        start, trip = first_blk, n_blk

    offs = lax.broadcasted_iota(jnp.int32, (block_k,), 0)

    def body(i, carry):
        acc, m, l = carry
        kpos = (start + i) * block_k + offs  # [bk] logical key positions
        live = (kpos >= lo) & (kpos <= hi)
        logical_page = kpos // page_size
        if ring_pages is not None:
            slot = logical_page % ring_pages
        else:
            slot = jnp.minimum(logical_page, table_width - 1)
        page = load(table_ref.at[slot], live, 0)
        kv_row = (page * page_size + kpos % page_size)[:, None]
        # Gather [bk, D] through two integer indexers (rows, columns): the interpreter cannot mix an integer
        # array with a slice, the Triton lowering turns either form into the same pointer arithmetic.
        k = load(k_ref.at[kv_row, cols], live[:, None], 0).astype(dtype)
        v = load(v_ref.at[kv_row, cols], live[:, None], 0).astype(dtype)
        s = dot(q, k, trans_b=True)  # [R, bk] f32
        if k_scale != 1.0:
            s = s * k_scale
        vis = (kpos[None, :] <= row_hi[:, None]) & live[None, :]
        if row_lo is not None:
            vis &= kpos[None, :] >= row_lo[:, None]
        s = jnp.where(vis, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
        l = l * alpha + jnp.sum(p, axis=1)
        pv = dot(p.astype(v.dtype), v)  # [R, D] f32
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l

    acc = jnp.zeros((rows, D), jnp.float32)
    m = jnp.full((rows,), _NEG, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    acc, m, l = lax.fori_loop(0, trip, body, (acc, m, l))

    o_ref, *stat_refs = out_refs
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    if v_scale != 1.0:
        inv = inv * v_scale
    o = (acc * inv[:, None]).astype(o_ref.dtype)
    if stat_refs:  # split: this split's normalized output plus its softmax statistics, merged in XLA
        o_ref[...] = o
        m_ref, l_ref = stat_refs
        m_ref[...] = m
        l_ref[...] = l
    else:
        store(o_ref.at[q_row[:, None], cols], o, real[:, None])


def _normed_and_roped(x, q_ref, q_norm_ref, cos_ref, sin_ref, q_row, token, real, cols, eps: float):
    """Rows x [R, D] of raw queries (q_ref's rows q_row, of query tokens `token`) q_norm'ed and roped, in x's dtype
    (see `_paged_attention_kernel`)."""
    dtype = x.dtype
    D = x.shape[-1]
    half = D // 2
    first = cols < half  # [1, D]
    other = jnp.where(first, cols + half, cols - half)  # the column rotate_half takes each column from
    w_cols = lax.broadcasted_iota(jnp.int32, (D,), 0)
    w_other = jnp.where(w_cols < half, w_cols + half, w_cols - half)
    all_d = w_cols < D
    y = load(q_ref.at[q_row[:, None], other], real[:, None], 0).astype(jnp.float32)  # x's halves swapped
    x = x.astype(jnp.float32)
    r = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / D + eps)  # [R, 1]
    x = (x * r * load(q_norm_ref.at[w_cols], all_d).astype(jnp.float32)[None, :]).astype(dtype)
    y = (y * r * load(q_norm_ref.at[w_other], all_d).astype(jnp.float32)[None, :]).astype(dtype)
    rotated = jnp.where(first, -y, y)  # rotate_half(x) = [-x2, x1]
    table_cols = jnp.where(first, cols, cols - half)
    cos = load(cos_ref.at[token[:, None], table_cols], real[:, None], 0).astype(dtype)
    sin = load(sin_ref.at[token[:, None], table_cols], real[:, None], 0).astype(dtype)
    return x * cos + rotated * sin


def _merge_kernel(m_ref, l_ref, o_ref, out_ref, *, k_splits: int, splits_pow2: int, padded_rows: int, batch: int,
                  kv_heads: int, q_len: int, num_heads: int, group: int, block_d: int):
    """One program: one query row of one sequence and KV head, one block_d-wide slice of D, over every key split.

    m_ref, l_ref [S, B * nKV * R] float32 (each split's running max and softmax denominator), o_ref
    [S * B * nKV * R, D] (each split's normalized output), rows in the paged kernel's split layout; out_ref
    [B * Tq * nH, D] in q's layout. All the splits' rows of the slice come in one load, so the merge is one wave of
    loads rather than a loop over the splits."""
    b, h, j, c = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    s = lax.broadcasted_iota(jnp.int32, (splits_pow2, 1), 0)  # [Sp, 1]
    live = s < k_splits
    row = (b * kv_heads + h) * padded_rows + j  # this row in a split's [B * nKV * R] rows
    zero = jnp.zeros((1, 1), jnp.int32)
    m = load(m_ref.at[s, zero + row], live, _NEG)  # [Sp, 1]
    l = load(l_ref.at[s, zero + row], live, 0.0)
    cols = c * block_d + lax.broadcasted_iota(jnp.int32, (1, block_d), 1)  # [1, bd]
    o = load(o_ref.at[s * (batch * kv_heads * padded_rows) + row, cols], live, 0)  # [Sp, bd]
    w = jnp.exp(m - jnp.max(m)) * l  # each split's share of the softmax mass, unnormalized
    total = jnp.sum(w)
    out = jnp.sum(w * o.astype(jnp.float32), axis=0, keepdims=True)  # [1, bd]
    out = jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)
    t = j // group
    q_row = (b * q_len + t) * num_heads + h * group + j % group
    out_ref[pl.ds(q_row, 1), pl.ds(c * block_d, block_d)] = out.astype(out_ref.dtype)


def _merge_splits_pallas(o: Array, m: Array, l: Array, *, q_len: int, num_heads: int, dtype, interpret: bool) -> Array:
    """The key splits' partial results (the paged kernel's outputs, o [S, B, nKV, R, D], m and l [S, B, nKV, R])
    merged into [B * Tq * nH, D] in q's layout, by one Pallas kernel: XLA's merge (_merge_splits) plus the
    transpose back to q's layout took two to four kernels per attention layer."""
    S, B, nKV, R, D = o.shape
    G = num_heads // nKV
    rows = q_len * G
    block_d = min(D, 128)
    kernel = functools.partial(
        _merge_kernel, k_splits=S, splits_pow2=_next_pow2(S), padded_rows=R, batch=B,
        kv_heads=nKV, q_len=q_len, num_heads=num_heads, group=G, block_d=block_d)
    whole = lambda b, h, j, c: (0, 0)  # noqa: E731  (indexed inside the kernel)
    return pl.pallas_call(
        kernel,
        grid=(B, nKV, rows, -(-D // block_d)),
        in_specs=[pl.BlockSpec((S, B * nKV * R), whole), pl.BlockSpec((S, B * nKV * R), whole),
                  pl.BlockSpec((S * B * nKV * R, D), whole)],
        out_specs=pl.BlockSpec((B * q_len * num_heads, D), whole),
        out_shape=jax.ShapeDtypeStruct((B * q_len * num_heads, D), dtype),
        compiler_params=compiler_params(4, 1),
        interpret=interpret,
        name=f"paged_attention_merge_s{S}",
    )(m.reshape(S, B * nKV * R), l.reshape(S, B * nKV * R), o.reshape(S * B * nKV * R, D))


def _merge_splits(o: Array, m: Array, l: Array) -> Array:
    """Per-split normalized outputs o [S, ..., D] with running max m and sum l [S, ...] -> the softmax over all
    splits [..., D] in float32 (0 where no split saw a key). The plain-XLA reference of _merge_splits_pallas."""
    w = jnp.exp(m - jnp.max(m, axis=0)[None]) * l  # each split's share of the total softmax mass (unnormalized)
    total = jnp.sum(w, axis=0)
    out = jnp.sum(w[..., None] * o.astype(jnp.float32), axis=0)
    return jnp.where((total > 0)[..., None], out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


@functools.partial(jax.jit, static_argnames=("window", "ring_pages", "interpret", "config", "eps", "k_scale",
                                             "v_scale"))
def _paged_attention_pallas(q, k_pages, v_pages, page_table, q_positions, q_norm, rope, bounds, *, window,
                            ring_pages, interpret, config: KernelConfig, eps, k_scale: float = 1.0,
                            v_scale: float = 1.0):
    B, Tq, nH, D = q.shape
    nKV, num_pages, page_size, _ = k_pages.shape
    G = nH // nKV
    rows = Tq * G
    br = config.block_rows
    n_rb = -(-rows // br)
    R = n_rb * br
    width = page_table.shape[1]
    S = config.k_splits

    dtype = compute_dtype(q.dtype, k_pages.dtype)
    # free: the kernel reads rows in q's own layout (raw queries in their own dtype, for the norm's rounding)
    qf = (q if q_norm is not None else q.astype(dtype)).reshape(B * Tq * nH, D)
    pos = q_positions.astype(jnp.int32).reshape(B * Tq)
    kf = k_pages.reshape(nKV, num_pages * page_size, D)  # free: pages are contiguous rows
    vf = v_pages.reshape(nKV, num_pages * page_size, D)
    table = page_table.astype(jnp.int32)

    sq = _SQUEEZED
    kernel = functools.partial(
        _paged_attention_kernel, page_size=page_size, block_k=config.block_k, window=window,
        ring_slots=None if ring_pages is None else ring_pages * page_size, ring_pages=ring_pages,
        table_width=width, k_splits=S, block_rows=br, q_len=Tq, num_heads=nH, group=G,
        eps=None if q_norm is None else float(eps), dtype=dtype, k_scale=k_scale, v_scale=v_scale,
        bounds=bounds is not None)
    whole = lambda b, h, r, s: (0, 0)  # noqa: E731  (indexed inside the kernel)
    in_specs = [
        pl.BlockSpec((B * Tq,), lambda b, h, r, s: (0,)),  # mask positions, token-major
        pl.BlockSpec((sq, width), lambda b, h, r, s: (b, 0)),  # page table row
        pl.BlockSpec((B * Tq * nH, D), whole),  # q rows
    ]
    args = [pos, table, qf]
    if q_norm is not None:
        in_specs += [pl.BlockSpec((D,), lambda b, h, r, s: (0,)),  # q_norm's weight
                     pl.BlockSpec((B * Tq, D // 2), whole), pl.BlockSpec((B * Tq, D // 2), whole)]  # cos, sin
        args += [q_norm, *(t.astype(q.dtype).reshape(B * Tq, D // 2) for t in rope)]
    if bounds is not None:  # each row's first and last visible key, token-major
        in_specs += [pl.BlockSpec((B * Tq,), lambda b, h, r, s: (0,))] * 2
        args += [bounds[..., i].astype(jnp.int32).reshape(B * Tq) for i in (0, 1)]
    in_specs += [
        pl.BlockSpec((sq, num_pages * page_size, D), lambda b, h, r, s: (h, 0, 0)),  # K pool of head h
        pl.BlockSpec((sq, num_pages * page_size, D), lambda b, h, r, s: (h, 0, 0)),  # V pool of head h
    ]
    if S == 1:
        out_shape = jax.ShapeDtypeStruct((B * Tq * nH, D), dtype)
        out_specs = pl.BlockSpec((B * Tq * nH, D), whole)
    else:
        out_shape = (jax.ShapeDtypeStruct((S, B, nKV, R, D), dtype),
                     jax.ShapeDtypeStruct((S, B, nKV, R), jnp.float32),
                     jax.ShapeDtypeStruct((S, B, nKV, R), jnp.float32))
        out_specs = (pl.BlockSpec((sq, sq, sq, br, D), lambda b, h, r, s: (s, b, h, r, 0)),
                     pl.BlockSpec((sq, sq, sq, br), lambda b, h, r, s: (s, b, h, r)),
                     pl.BlockSpec((sq, sq, sq, br), lambda b, h, r, s: (s, b, h, r)))
    res = pl.pallas_call(
        kernel,
        grid=(B, nKV, n_rb, S),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name=f"paged_attention_r{br}_k{config.block_k}_s{S}" + ("" if q_norm is None else "_qrope"),
    )(*args, kf, vf)
    if S == 1:
        return res.reshape(B, Tq, nH, D).astype(q.dtype)
    o, m, l = res
    return _merge_splits_pallas(o, m, l, q_len=Tq, num_heads=nH, dtype=q.dtype,
                                interpret=interpret).reshape(B, Tq, nH, D)


def paged_attention(q: Array, k_pages: Array, v_pages: Array, page_table: Array, q_positions: Array, *,
                    window: int | None = None, ring_pages: int | None = None, q_norm: Array | None = None,
                    rope: tuple[Array, Array] | None = None, eps: float | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, bounds: Array | None = None, interpret: bool = False,
                    block_rows: int | None = None,
                    block_k: int | None = None, k_splits: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None) -> Array:
    """Pallas paged attention (Triton lowering on GPU; `interpret=True` runs anywhere). Same contract as
    `paged_attention_reference`; the keyword-only tiling arguments override `kernel_config`'s plan. Raises
    ValueError when no tiling of these shapes fits the device (`attend_paged` falls back to XLA instead).

    A Q-only layer's raw projection q [B, Tq, nH, D] goes in with `q_norm` (its weight [D]), `rope` = (cos, sin)
    [B, Tq, D/2] each (`attention_inputs.rope_tables` at the layer's RoPE positions, which may differ from the mask
    positions `q_positions`) and `eps`: the kernel norms and ropes each query row as it loads it, sparing the
    layer an `attention_inputs` kernel, with that kernel's rounding."""
    _check_shapes(q, k_pages, v_pages, page_table, q_positions, ring_pages, q_norm, rope, eps, bounds)
    config = _plan(q, k_pages, page_table, window, ring_pages, block_rows=block_rows, block_k=block_k,
                   k_splits=k_splits, num_warps=num_warps, num_stages=num_stages)
    if config is None:
        raise ValueError(f"no kernel tiling fits q {q.shape}, pages {k_pages.shape} {k_pages.dtype} on "
                         f"{default_budget().name or 'this device'} (the kernel needs a power-of-two head dim "
                         f">= 16 and page size, and tiles within {default_budget().smem_per_block} bytes of shared "
                         f"memory); use the XLA path")
    return _paged_attention_pallas(q, k_pages, v_pages, page_table, q_positions, q_norm,
                                   None if rope is None else tuple(rope), bounds, window=window, ring_pages=ring_pages,
                                   interpret=interpret, config=config, eps=None if q_norm is None else float(eps),
                                   k_scale=float(k_scale), v_scale=float(v_scale))


def _plan(q, k_pages, page_table, window, ring_pages, **overrides) -> KernelConfig | None:
    # A float8 cache's blocks are converted to the compute dtype before the dots: the tiles are planned at its size.
    itemsize = compute_dtype(q.dtype, k_pages.dtype).itemsize
    return kernel_config(q.shape, k_pages.shape, page_table.shape, itemsize=itemsize, window=window,
                         ring_pages=ring_pages, **overrides)


@functools.lru_cache(maxsize=None)
def _log_fallback(q_shape, pages_shape, dtype_name: str) -> None:
    log.warning("paged attention: no kernel tiling fits q %s, pages %s %s on this GPU; these calls use the XLA "
                "path", q_shape, pages_shape, dtype_name)


def attend_paged(q: Array, k_pages: Array, v_pages: Array, page_table: Array, q_positions: Array,
                 q_norm: Array | None = None, cos: Array | None = None, sin: Array | None = None,
                 bounds: Array | None = None, *, window: int | None = None, ring_pages: int | None = None,
                 eps: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0, impl: str = "auto") -> Array:
    """Paged attention through the kernel ("pallas"), the XLA reference ("xla"), or "auto": the kernel where
    `kernels_chosen()` (a GPU) when a tiling of these shapes fits the device (one log line per shape otherwise), the
    reference elsewhere.
    With `q_norm`, `cos`, `sin` (array arguments, so that `sharding.head_parallel` passes them on, replicated), q is
    a Q-only layer's raw projection (see `paged_attention`); `bounds`: each query's visible keys (module docstring).
    `k_scale`, `v_scale`: the scales a float8 cache's pages were written with."""
    prep = {} if q_norm is None else dict(q_norm=q_norm, rope=(cos, sin), eps=eps)
    prep.update(k_scale=k_scale, v_scale=v_scale, bounds=bounds)
    if impl == "auto":
        impl = "xla"
        if kernels_chosen():
            if _plan(q, k_pages, page_table, window, ring_pages) is not None:
                impl = "pallas"
            else:
                _log_fallback(tuple(q.shape), tuple(k_pages.shape), jnp.dtype(k_pages.dtype).name)
    if impl == "pallas":
        return paged_attention(q, k_pages, v_pages, page_table, q_positions, window=window, ring_pages=ring_pages,
                               interpret=kernels_interpreted(), **prep)
    if impl == "xla":
        return paged_attention_reference(q, k_pages, v_pages, page_table, q_positions, window=window,
                                         ring_pages=ring_pages, **prep)
    raise ValueError(f"impl must be 'auto', 'pallas' or 'xla', got {impl!r}")
