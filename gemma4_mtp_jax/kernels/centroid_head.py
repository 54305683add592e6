"""The centroid-masked LM head of the E2B/E4B assistants: centroid selection, sparse gather-dot and argmax / sparse
logits, fused into one kernel after the centroid scores.

transformers' `Gemma4AssistantMaskedEmbedder` (reference/gemma4_architecture.md §4.4) scores C token clusters
("centroids"), keeps the top-K, and computes logits only for the V/C tokens of each kept cluster. The head's rows
are stored permuted by `token_ordering` (done once at load time, see model/assistant.py `CentroidHead`), so
cluster c is the contiguous rows c*R .. (c+1)*R-1 of `ordered_embedding` (R = V/C) and `token_ordering[row]` is the
canonical token id of a row. A token's candidates are therefore K contiguous [R, Ha] tiles.

Selection: the K clusters of highest score `hn @ centroids.T` (computed as the assistant's `Linear` computes it, in
hn's dtype), on equal scores the lower index first: the set `jax.lax.top_k` picks. Only the set matters downstream,
so the kept clusters are taken in INDEX order, which a kernel can find without sorting.

Candidate order and the tie rule (the reference and the kernels implement it identically):
    candidate j (0 <= j < K*R) of a token is row  top[t, j // R] * R + j % R  of `ordered_embedding`, with top[t]
    the kept clusters in ascending index order; candidates are therefore in ascending row order. The argmax returns
    the candidate with the largest float32 logit; among equal logits the FIRST candidate (the lowest row) wins.
    Suppressed rows get -inf (if every candidate is suppressed the first candidate is returned, with logit -inf).
    NaNs are not handled.

Numerics: logits are float32 dot products of hn and the row, both upcast to float32 (bf16 x bf16 products are
exact in float32, so only the summation order differs between the XLA reference and the kernel, ~1e-7 relative).

Functions:
    centroid_scores(hn, centroids)                          -> scores [T, C] (plain XLA, hn's dtype)
    top_centroids(scores, top_k) / select_centroids(...)    -> top [T, K] int32, index order (plain XLA)
    centroid_argmax_reference / centroid_argmax             -> (token [T] int32, logit [T] f32), from the scores
    centroid_sparse_logits_reference / centroid_sparse_logits  -> (logits [T, K*R] f32, ids [T, K*R] i32)
    centroid_head(..., mode="argmax"|"sparse", impl="auto"|"pallas"|"xla")  -> dispatcher

Pallas kernels (Triton lowering, selected by passing `jax.experimental.pallas.triton.CompilerParams`):
    a token's K*R candidates are U = K*R/BP units of BP rows (BP = `block_rows`, a power of two dividing R), unit j
    being rows (j % (R/BP))*BP .. +BP-1 of its k-th kept cluster, k = j // (R/BP). Grid (T, U/G): program (t, q)
    serves the G = `chunks_per_program` consecutive units q*G .. q*G+G-1 of token t (G and R/BP powers of two, so
    a program's units lie in one cluster or cover whole clusters).
    Selection, once per program (the scores of a token are C values, read from L2; no program waits for another):
    the scores as integers of the same order (the float bits, negatives' magnitude bits flipped); the K-th largest
    value tau found digit by digit, two bits per round (4 candidate thresholds counted at once); kept = greater
    than tau, or equal to it among the first K - #greater in index order (a cumulative count); the k-th kept
    cluster by a second cumulative count. This replaces XLA's sort of the scores (`lax.top_k` sorts for K > 16) and
    the launch it cost on the draft step's critical path. The selection is a chain of dependent reductions, the
    program's latency, so the default G makes one wave of programs (about one per SM) cover the candidates.
    Then per unit ONE contiguous [BP, Ha] tile load (BP*Ha*itemsize bytes), issued whole, plus the BP token ids
    (and suppress flags) of those rows. Logits are an elementwise f32 multiply by hn and a row sum (a GEMV: tensor
    cores would need a 16-wide N and buy nothing, the work is bandwidth bound).
    argmax kernel: each program writes the max logit over its G*BP rows and the canonical token id of the FIRST row
    holding it (partials [T, U/G]); programs are in candidate order, so a first-occurrence argmax over them in XLA
    (one tiny fusion) gives exactly the tie rule above.
    sparse kernel: each program writes its G*BP logits and ids into [T, K*R] (candidate order).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gemma4_mtp_jax.kernels.device_budget import GpuBudget, default_budget, is_gpu, kernels_chosen, kernels_interpreted

Array = jax.Array
log = logging.getLogger(__name__)

try:  # the Triton lowering of Pallas on GPU (deprecated in JAX 0.11, still works in 0.11.2)
    from jax.experimental.pallas import triton as _pl_triton
except Exception:  # pragma: no cover - a JAX without the Triton backend
    _pl_triton = None

__all__ = [
    "centroid_scores",
    "top_centroids",
    "select_centroids",
    "centroid_argmax_reference",
    "centroid_argmax",
    "centroid_sparse_logits_reference",
    "centroid_sparse_logits",
    "centroid_head",
    "default_config",
    "pallas_supported",
]

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------------------------
# Shared: centroid scores and selection (plain XLA)
# --------------------------------------------------------------------------------------------------------------


def centroid_scores(hn: Array, centroids: Array) -> Array:
    """scores [T, C] = hn @ centroids.T (`centroids` [C, Ha], PyTorch layout), computed as the assistant's `Linear`
    does (weight cast to hn's dtype, default precision, result in hn's dtype), so the selection is the model's."""
    return jnp.einsum("th,ch->tc", hn, centroids.astype(hn.dtype))


def top_centroids(scores: Array, top_k: int) -> Array:
    """top [T, K] int32: the K clusters `jax.lax.top_k` keeps (descending score, lower index first on ties), in
    ascending index order."""
    return jnp.sort(jax.lax.top_k(scores, top_k)[1].astype(jnp.int32), axis=-1)


def select_centroids(hn: Array, centroids: Array, top_k: int) -> Array:
    """top [T, K] int32: the K best clusters of hn, in index order (`centroid_scores`, `top_centroids`)."""
    return top_centroids(centroid_scores(hn, centroids), top_k)


def _check_shapes(hn, scores, top_k, ordered_embedding, token_ordering, suppress):
    if hn.ndim != 2 or scores.ndim != 2 or ordered_embedding.ndim != 2:
        raise ValueError(f"expected hn [T, Ha], scores [T, C], ordered_embedding [V, Ha]; got {hn.shape}, "
                         f"{scores.shape}, {ordered_embedding.shape}")
    T, Ha = hn.shape
    (V, Hv), C = ordered_embedding.shape, scores.shape[1]
    if Hv != Ha or scores.shape[0] != T:
        raise ValueError(f"shape mismatch: hn {hn.shape}, scores {scores.shape}, ordered_embedding "
                         f"{ordered_embedding.shape}")
    if V % C:
        raise ValueError(f"ordered_embedding's {V} rows are not a multiple of the {C} centroids of the scores")
    if not 1 <= top_k <= C:
        raise ValueError(f"top_k={top_k} must be in 1..{C} (the number of centroids)")
    if token_ordering.shape != (V,):
        raise ValueError(f"token_ordering must be [V={V}], got {token_ordering.shape}")
    if suppress is not None and suppress.shape != (V,):
        raise ValueError(f"suppress must be [V={V}] (row order), got {suppress.shape}")
    return V // C


# --------------------------------------------------------------------------------------------------------------
# XLA reference
# --------------------------------------------------------------------------------------------------------------


def _candidate_logits_xla(hn, top, ordered_embedding, token_ordering, suppress, rows_per_centroid):
    """(logits [T, K*R] f32, ids [T, K*R] i32) in candidate order: gather the K tiles, f32 dot, -inf where suppressed."""
    T, Ha = hn.shape
    V = ordered_embedding.shape[0]
    R = rows_per_centroid
    C = V // R
    K = top.shape[1]
    tiles = jnp.take(ordered_embedding.reshape(C, R, Ha), top, axis=0)  # [T, K, R, Ha]
    dt = jnp.promote_types(hn.dtype, ordered_embedding.dtype)
    logits = jnp.einsum(
        "th,tkrh->tkr", hn.astype(dt), tiles.astype(dt),
        preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST,
    ).astype(jnp.float32)
    ids = jnp.take(token_ordering.reshape(C, R), top, axis=0).astype(jnp.int32)  # [T, K, R]
    if suppress is not None:
        sup = jnp.take(suppress.reshape(C, R), top, axis=0).astype(jnp.bool_)
        logits = jnp.where(sup, _NEG_INF, logits)
    return logits.reshape(T, K * R), ids.reshape(T, K * R)


def centroid_argmax_reference(hn, scores, ordered_embedding, token_ordering, suppress=None, *, top_k: int):
    """(token [T] int32, logit [T] float32): the greedy draft token of the centroid head, plain XLA.

    `scores` [T, C] are the centroid scores (`centroid_scores`), of which the `top_k` best clusters are kept;
    R = V/C rows per centroid. Tie rule: see the module docstring."""
    R = _check_shapes(hn, scores, top_k, ordered_embedding, token_ordering, suppress)
    logits, ids = _candidate_logits_xla(hn, top_centroids(scores, top_k), ordered_embedding, token_ordering,
                                        suppress, R)
    j = jnp.argmax(logits, axis=-1)  # first occurrence of the max = the tie rule
    tok = jnp.take_along_axis(ids, j[:, None], axis=-1)[:, 0]
    logit = jnp.take_along_axis(logits, j[:, None], axis=-1)[:, 0]
    return tok.astype(jnp.int32), logit


def centroid_sparse_logits_reference(hn, scores, ordered_embedding, token_ordering, suppress=None, *, top_k: int):
    """(logits [T, K*R] float32, ids [T, K*R] int32) in candidate order (kept clusters in index order, then row
    order), plain XLA. Suppressed rows have logit -inf."""
    R = _check_shapes(hn, scores, top_k, ordered_embedding, token_ordering, suppress)
    return _candidate_logits_xla(hn, top_centroids(scores, top_k), ordered_embedding, token_ordering, suppress, R)


# --------------------------------------------------------------------------------------------------------------
# Pallas kernels (Triton lowering)
# --------------------------------------------------------------------------------------------------------------


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


_F32_PER_THREAD = 128  # float32 values of the upcast row tile per thread: more would spill registers
_MAX_WARPS = 8
_DIGIT_BITS = 2  # bits of the K-th largest score found per selection round (2^bits thresholds counted at once)
_INT_MIN = -(2**31)


def default_config(T: int, K: int, R: int, Ha: int, itemsize: int, budget: GpuBudget | None = None) -> dict | None:
    """Launch config {block_rows, chunks_per_program, num_warps, num_stages} for T tokens, or None when no tile fits
    the device.

    Every program first selects its token's clusters, a chain of dependent reductions that is the kernel's latency,
    so the grid aims at one wave: at most one program per SM (the device's SM count), each with as many rows as
    that needs, but at least 16. The rows of a program are G tiles of block_rows; the [block_rows, Ha] tile is
    upcast to float32 in registers, so the warps are chosen so that each thread holds at most 128 of its values,
    and the tile shrinks when 8 warps are not enough; its bytes must also fit the shared memory per block, should
    the compiler stage it there. Tuned by benchmarks/bench_centroid_head.py."""
    budget = budget or default_budget()

    def warps(bp: int) -> int | None:
        for w in (4, _MAX_WARPS):
            if bp * Ha <= _F32_PER_THREAD * 32 * w:
                return w
        return None

    def fits(bp: int) -> bool:
        return warps(bp) is not None and bp * Ha * itemsize <= budget.smem_per_block

    bp = R
    while bp > 1 and not fits(bp):
        bp //= 2
    if not fits(bp):
        return None
    while bp > 16 and T * K * (R // (bp // 2)) <= budget.num_sms:  # smaller tiles while one wave still holds them
        bp //= 2
    return dict(block_rows=bp, chunks_per_program=_one_wave(T, K * (R // bp), budget), num_warps=warps(bp),
                num_stages=1)


def _one_wave(T: int, units: int, budget: GpuBudget) -> int:
    """The fewest units per program (a power of two dividing `units`, a token's) that put T tokens' programs in one
    wave of at most one per SM, or all of a token's units when T alone fills the SMs."""
    g = 1
    while T * units // g > budget.num_sms and units % (2 * g) == 0:
        g *= 2
    return g


def _low_zero_bits(dtype) -> int:
    """Low bits of a float32 that are zero in every value of `dtype` (bfloat16: 16): the selection skips them."""
    return 23 - jnp.finfo(dtype).nmant


def pallas_supported(hn, scores, ordered_embedding, block_rows=None) -> bool:
    """Whether the Pallas kernels take these shapes and dtypes (Triton needs power-of-two tiles; the selection
    reads scores of float32 or a narrower float whose float32 bits it walks in whole digits)."""
    Ha, C = hn.shape[-1], scores.shape[-1]
    R = ordered_embedding.shape[0] // C
    bp = R if block_rows is None else block_rows
    dt = jnp.dtype(scores.dtype)
    return (_is_pow2(Ha) and _is_pow2(R) and _is_pow2(C) and _is_pow2(bp) and bp <= R and R % bp == 0
            and jnp.issubdtype(dt, jnp.floating) and dt.itemsize <= 4
            and (32 - _low_zero_bits(dt)) % _DIGIT_BITS == 0)


def _kept_clusters(scores_ref, *, K: int, C: int, low: int):
    """(kept [C] bool, rank [C] int32): the K clusters `top_centroids` keeps for this program's token, and each
    cluster's 1-based rank among the kept ones in index order."""
    x = scores_ref[...].astype(jnp.float32)  # [C]
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    # Same order as the floats: a negative's magnitude bits flipped; bits that are zero in every value of the
    # scores' dtype cleared (a negative bfloat16 would otherwise carry ones there).
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)) & jnp.int32(-(1 << low))
    # tau, the K-th largest key, digit by digit from the top in offset binary (unsigned order): the largest
    # threshold with at least K keys at or above it.
    digits = jax.lax.broadcasted_iota(jnp.int32, (1 << _DIGIT_BITS, 1), 0)
    prefix = jnp.int32(0)
    for shift in range(32 - _DIGIT_BITS, low - 1, -_DIGIT_BITS):
        thresholds = (prefix | (digits << shift)) ^ jnp.int32(_INT_MIN)  # [2^digit, 1], back in key order
        counts = jnp.sum((key[None, :] >= thresholds).astype(jnp.int32), axis=1)  # non-increasing
        prefix = prefix | ((jnp.sum((counts >= K).astype(jnp.int32)) - 1) << shift)
    tau = prefix ^ jnp.int32(_INT_MIN)
    above = key > tau
    at = key == tau
    need = K - jnp.sum(above.astype(jnp.int32))  # of the clusters at tau, the lowest indices are kept
    kept = above | (at & (jnp.cumsum(at.astype(jnp.int32)) <= need))
    return kept, jnp.cumsum(kept.astype(jnp.int32))


def _program_chunks(hn_ref, scores_ref, emb_ref, ord_ref, sup_ref, *, R, BP, G, K, C, low):
    """The (logits [BP] f32, ids [BP] i32) of each of program (t, q)'s G units, in candidate order."""
    kept, rank = _kept_clusters(scores_ref, K=K, C=C, low=low)
    iota = jax.lax.broadcasted_iota(jnp.int32, (C,), 0)
    h = hn_ref[...].astype(jnp.float32)  # [Ha]
    chunks_per_centroid = R // BP
    first = pl.program_id(1) * G  # the program's first unit
    k0, chunk0 = first // chunks_per_centroid, first % chunks_per_centroid
    out, c = [], None
    for u in range(G):
        # Units u and u+1 share a cluster unless a cluster boundary falls between them (known statically: G and
        # R/BP are powers of two, so a program starts at chunk 0 of a cluster whenever it spans several).
        if c is None or (G > chunks_per_centroid and u % chunks_per_centroid == 0):
            k = k0 + u // chunks_per_centroid
            c = jnp.sum(jnp.where(kept & (rank == k + 1), iota, 0))
        base = c * R + (chunk0 + u % chunks_per_centroid) * BP  # first row of the unit in ordered_embedding
        rows = emb_ref[pl.ds(base, BP), :].astype(jnp.float32)  # [BP, Ha]: one contiguous tile load
        ids = ord_ref[pl.ds(base, BP)]  # [BP]
        logits = jnp.sum(rows * h[None, :], axis=1)  # [BP] f32
        if sup_ref is not None:
            logits = jnp.where(sup_ref[pl.ds(base, BP)] != 0, _NEG_INF, logits)
        out.append((logits, ids))
    return out


def _argmax_kernel(hn_ref, scores_ref, emb_ref, ord_ref, *rest, has_suppress, **dims):
    if has_suppress:
        sup_ref, m_ref, tok_ref = rest
    else:
        sup_ref = None
        m_ref, tok_ref = rest
    BP = dims["BP"]
    iota = jax.lax.broadcasted_iota(jnp.int32, (BP,), 0)
    best_m = best_tok = None
    for logits, ids in _program_chunks(hn_ref, scores_ref, emb_ref, ord_ref, sup_ref, **dims):
        m = jnp.max(logits)
        first = jnp.min(jnp.where(logits == m, iota, BP))  # first row of the unit holding the max
        tok = jnp.max(jnp.where(iota == first, ids, jnp.iinfo(jnp.int32).min))
        if best_m is None:  # the first unit always counts, so all -inf returns its first candidate
            best_m, best_tok = m, tok
        else:  # a later unit only on a strictly larger max: the first candidate wins ties
            better = m > best_m
            best_m, best_tok = jnp.where(better, m, best_m), jnp.where(better, tok, best_tok)
    m_ref[...] = best_m
    tok_ref[...] = best_tok


def _sparse_kernel(hn_ref, scores_ref, emb_ref, ord_ref, *rest, has_suppress, **dims):
    if has_suppress:
        sup_ref, lg_ref, id_ref = rest
    else:
        sup_ref = None
        lg_ref, id_ref = rest
    BP = dims["BP"]
    for u, (logits, ids) in enumerate(_program_chunks(hn_ref, scores_ref, emb_ref, ord_ref, sup_ref, **dims)):
        lg_ref[pl.ds(u * BP, BP)] = logits
        id_ref[pl.ds(u * BP, BP)] = ids


def _compiler_params(num_warps, num_stages):
    if _pl_triton is None:
        return None
    return _pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


_LAUNCH_KNOBS = ("block_rows", "chunks_per_program", "num_warps", "num_stages")


def _pallas_common(hn, scores, top_k, ordered_embedding, token_ordering, suppress, launch: dict):
    R = _check_shapes(hn, scores, top_k, ordered_embedding, token_ordering, suppress)
    T, Ha = hn.shape
    C = scores.shape[1]
    cfg = default_config(T, top_k, R, Ha, jnp.dtype(ordered_embedding.dtype).itemsize)
    if cfg is None and any(launch[n] is None for n in _LAUNCH_KNOBS):
        raise ValueError(f"no centroid-head tile fits Ha={Ha} ({ordered_embedding.dtype}) on "
                         f"{default_budget().name or 'this device'}; use impl='xla'")
    BP = cfg["block_rows"] if launch["block_rows"] is None else launch["block_rows"]
    if not pallas_supported(hn, scores, ordered_embedding, BP):
        raise ValueError(f"Pallas centroid head needs power-of-two Ha ({Ha}), C ({C}), R=V/C ({R}) and block_rows "
                         f"({BP}) with block_rows | R, and float scores of at most 32 bits ({scores.dtype}); "
                         f"use impl='xla'")
    units = top_k * (R // BP)  # per token
    G = launch["chunks_per_program"]
    if G is None:  # the default's G, or for a tile given without one the same rule at that tile
        G = cfg["chunks_per_program"] if launch["block_rows"] is None else _one_wave(T, units, default_budget())
    if not (_is_pow2(G) and units % G == 0):
        raise ValueError(f"chunks_per_program={G} must be a power of two dividing the {units} units of "
                         f"block_rows={BP} rows per token (top_k={top_k} x R/block_rows={R // BP})")
    num_warps, num_stages = (cfg[n] if launch[n] is None else launch[n] for n in ("num_warps", "num_stages"))
    in_specs = [
        pl.BlockSpec((None, Ha), lambda t, q: (t, 0)),  # hn row t
        pl.BlockSpec((None, C), lambda t, q: (t, 0)),  # the scores of token t
        pl.BlockSpec(ordered_embedding.shape, lambda t, q: (0, 0)),  # whole table (dynamic row slices)
        pl.BlockSpec(token_ordering.shape, lambda t, q: (0,)),
    ]
    args = [hn, scores, ordered_embedding, token_ordering.astype(jnp.int32)]
    if suppress is not None:
        in_specs.append(pl.BlockSpec(suppress.shape, lambda t, q: (0,)))
        args.append(suppress)
    dims = dict(R=R, BP=BP, G=G, K=top_k, C=C, low=_low_zero_bits(scores.dtype))
    return dict(T=T, NP=units // G, dims=dims, in_specs=in_specs, args=args,
                compiler_params=_compiler_params(num_warps, num_stages))


_STATIC = ("top_k", "interpret") + _LAUNCH_KNOBS


@functools.partial(jax.jit, static_argnames=_STATIC)
def centroid_argmax(hn, scores, ordered_embedding, token_ordering, suppress=None, *, top_k: int, interpret=False,
                    block_rows=None, chunks_per_program=None, num_warps=None, num_stages=None):
    """(token [T] int32, logit [T] float32): Pallas version of `centroid_argmax_reference` (same selection, same
    tie rule).

    Partial argmaxes per (token, program) from the kernel, combined by a first-occurrence argmax over programs
    (XLA). Launch knobs default to `default_config`."""
    c = _pallas_common(hn, scores, top_k, ordered_embedding, token_ordering, suppress,
                       dict(block_rows=block_rows, chunks_per_program=chunks_per_program, num_warps=num_warps,
                            num_stages=num_stages))
    T, NP = c["T"], c["NP"]
    kernel = functools.partial(_argmax_kernel, has_suppress=suppress is not None, **c["dims"])
    m, tok = pl.pallas_call(
        kernel,
        grid=(T, NP),
        in_specs=c["in_specs"],
        out_specs=[pl.BlockSpec((None, None), lambda t, q: (t, q)),
                   pl.BlockSpec((None, None), lambda t, q: (t, q))],
        out_shape=[jax.ShapeDtypeStruct((T, NP), jnp.float32), jax.ShapeDtypeStruct((T, NP), jnp.int32)],
        compiler_params=c["compiler_params"],
        interpret=interpret,
        name="centroid_argmax",
    )(*c["args"])
    j = jnp.argmax(m, axis=-1)  # first program holding the max = first candidate (programs in candidate order)
    token = jnp.take_along_axis(tok, j[:, None], axis=-1)[:, 0]
    logit = jnp.take_along_axis(m, j[:, None], axis=-1)[:, 0]
    return token, logit


@functools.partial(jax.jit, static_argnames=_STATIC)
def centroid_sparse_logits(hn, scores, ordered_embedding, token_ordering, suppress=None, *, top_k: int,
                           interpret=False, block_rows=None, chunks_per_program=None, num_warps=None,
                           num_stages=None):
    """(logits [T, K*R] float32, ids [T, K*R] int32) in candidate order: Pallas version of
    `centroid_sparse_logits_reference`."""
    c = _pallas_common(hn, scores, top_k, ordered_embedding, token_ordering, suppress,
                       dict(block_rows=block_rows, chunks_per_program=chunks_per_program, num_warps=num_warps,
                            num_stages=num_stages))
    T, NP = c["T"], c["NP"]
    width = c["dims"]["BP"] * c["dims"]["G"]  # rows per program
    kernel = functools.partial(_sparse_kernel, has_suppress=suppress is not None, **c["dims"])
    logits, ids = pl.pallas_call(
        kernel,
        grid=(T, NP),
        in_specs=c["in_specs"],
        out_specs=[pl.BlockSpec((None, width), lambda t, q: (t, q)),
                   pl.BlockSpec((None, width), lambda t, q: (t, q))],
        out_shape=[jax.ShapeDtypeStruct((T, NP * width), jnp.float32),
                   jax.ShapeDtypeStruct((T, NP * width), jnp.int32)],
        compiler_params=c["compiler_params"],
        interpret=interpret,
        name="centroid_sparse_logits",
    )(*c["args"])
    return logits, ids


# --------------------------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------------------------


def _kernels_for(x) -> bool:
    """Whether "auto" takes the kernel for x: a concrete array's devices decide (all GPUs), a tracer's the programs
    traced now (`kernels_chosen`)."""
    try:
        devs = x.devices()  # a concrete array
    except Exception:  # a tracer: decide by the device compiled for
        return kernels_chosen()
    return all(is_gpu(d) for d in devs) or kernels_interpreted()


@functools.lru_cache(maxsize=None)
def _log_fallback(hn_shape, table_shape, dtype_name: str) -> None:
    log.warning("centroid head: no kernel tile fits hn %s, table %s %s on this GPU; these calls use the XLA path",
                hn_shape, table_shape, dtype_name)


def centroid_head(hn, centroids, ordered_embedding, token_ordering, top_k, suppress=None, *, mode="argmax",
                  impl="auto", interpret=False, **launch):
    """The whole centroid head: the centroid scores (XLA), then the selection with the argmax (greedy drafting) or
    the sparse logits (sampled drafting).

    hn [T, Ha]; centroids [C, Ha]; ordered_embedding [V, Ha] (rows permuted by token_ordering); token_ordering [V];
    suppress: optional [V] bool in row order. mode "argmax" -> (token [T] i32, logit [T] f32);
    mode "sparse" -> (logits [T, top_k*V/C] f32, ids [T, top_k*V/C] i32).
    impl "auto": Pallas on GPU (when the shapes suit Triton and a tile fits the device's budget; otherwise XLA,
    with one log line), XLA elsewhere; "pallas" forces the kernel
    (with `interpret=True` it runs anywhere); "xla" the reference. `launch` (block_rows, chunks_per_program,
    num_warps, num_stages) goes to the kernel."""
    if mode not in ("argmax", "sparse"):
        raise ValueError(f"mode must be 'argmax' or 'sparse', got {mode!r}")
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl must be 'auto', 'pallas' or 'xla', got {impl!r}")
    scores = centroid_scores(hn, centroids)
    if impl == "auto":
        use_pallas = (interpret or _kernels_for(hn)) and pallas_supported(hn, scores, ordered_embedding,
                                                                       launch.get("block_rows"))
        R = ordered_embedding.shape[0] // scores.shape[1]
        if use_pallas and "block_rows" not in launch and default_config(
                hn.shape[0], top_k, R, hn.shape[1], jnp.dtype(ordered_embedding.dtype).itemsize) is None:
            use_pallas = False
            _log_fallback(tuple(hn.shape), tuple(ordered_embedding.shape), jnp.dtype(ordered_embedding.dtype).name)
    else:
        use_pallas = impl == "pallas"
    if use_pallas:
        fn = centroid_argmax if mode == "argmax" else centroid_sparse_logits
        return fn(hn, scores, ordered_embedding, token_ordering, suppress, top_k=top_k,
                  interpret=interpret or kernels_interpreted(), **launch)
    fn = centroid_argmax_reference if mode == "argmax" else centroid_sparse_logits_reference
    return fn(hn, scores, ordered_embedding, token_ordering, suppress, top_k=top_k)
