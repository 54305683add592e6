"""Centroid head kernels (gemma4_mtp_jax/kernels/centroid_head.py): Pallas (compiled on the GPU, interpret mode
elsewhere) vs the XLA reference, the reference vs transformers' semantics (§4.4 of
reference/gemma4_architecture.md), suppress, bf16, ties.

Data: a CANONICAL table [V, Ha] (row = token id, as in the checkpoint), a random permutation token_ordering, and the
ordered table ordered[row] = canonical[token_ordering[row]] that the kernels read (built at load time in the model).
"""

from __future__ import annotations

import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_mtp_jax.kernels import centroid_head as ch
from gemma4_mtp_jax.kernels.device_budget import HOPPER, GpuBudget
from testenv import INTERPRET

# (T, Ha, V, C, K)
SHAPES = [(5, 32, 512, 16, 4), (3, 64, 1024, 64, 8)]


def make_data(T, Ha, V, C, K, *, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    hn = jax.random.normal(k[0], (T, Ha), jnp.float32).astype(dtype)
    canonical = jax.random.normal(k[1], (V, Ha), jnp.float32).astype(dtype)
    centroids = jax.random.normal(k[2], (C, Ha), jnp.float32).astype(dtype)
    ordering = jax.random.permutation(k[3], V).astype(jnp.int32)
    ordered = canonical[ordering]  # row r holds token ordering[r]
    scores = ch.centroid_scores(hn, centroids)
    top = ch.top_centroids(scores, K)
    return dict(hn=hn, canonical=canonical, centroids=centroids, ordering=ordering, ordered=ordered, scores=scores,
                top=top, R=V // C, C=C, V=V, K=K)


def _argmax_both(d, suppress=None, **launch):
    args = (d["hn"], d["scores"], d["ordered"], d["ordering"], suppress)
    ref = ch.centroid_argmax_reference(*args, top_k=d["K"])
    ker = ch.centroid_argmax(*args, top_k=d["K"], interpret=INTERPRET, **launch)
    return ref, ker


def _sparse_both(d, suppress=None, **launch):
    args = (d["hn"], d["scores"], d["ordered"], d["ordering"], suppress)
    ref = ch.centroid_sparse_logits_reference(*args, top_k=d["K"])
    ker = ch.centroid_sparse_logits(*args, top_k=d["K"], interpret=INTERPRET, **launch)
    return ref, ker


def _assert_argmax_equal(ref, ker, atol=1e-5):
    np.testing.assert_array_equal(np.asarray(ker[0]), np.asarray(ref[0]))
    np.testing.assert_allclose(np.asarray(ker[1]), np.asarray(ref[1]), rtol=1e-5, atol=atol)
    assert ker[0].dtype == jnp.int32 and ker[1].dtype == jnp.float32


def _candidate_ids(d):
    """transformers: groups = token_ordering.view(C, V/C); cand = groups[top] (canonical ids), [T, K*R]."""
    groups = np.asarray(d["ordering"]).reshape(d["C"], d["R"])
    return groups[np.asarray(d["top"])].reshape(d["top"].shape[0], -1)


def _dense_restricted_logits(d):
    """Full canonical-vocab logits hn @ canonical.T (float64 on the host), -inf outside the candidate set."""
    hn = np.asarray(d["hn"], np.float64)
    full = hn @ np.asarray(d["canonical"], np.float64).T  # [T, V]
    out = np.full_like(full, -np.inf)
    cand = _candidate_ids(d)
    rows = np.arange(full.shape[0])[:, None]
    out[rows, cand] = full[rows, cand]
    return out


# ------------------------------------------------------------------------------------------------------------------


# (block_rows, chunks_per_program): the default; 8-row tiles one per program, two per program (inside a cluster),
# two clusters' worth per program, and one program for all of a token's candidates (SHAPES[0]: 4 tiles per cluster)
LAUNCHES = [(None, None), (8, 1), (8, 2), (8, 8), (8, 16)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_rows,chunks", LAUNCHES)
def test_argmax_kernel_matches_reference(shape, block_rows, chunks):
    d = make_data(*shape)
    ref, ker = _argmax_both(d, block_rows=block_rows, chunks_per_program=chunks)
    _assert_argmax_equal(ref, ker)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_rows,chunks", LAUNCHES)
def test_sparse_kernel_matches_reference(shape, block_rows, chunks):
    d = make_data(*shape)
    (rl, ri), (kl, ki) = _sparse_both(d, block_rows=block_rows, chunks_per_program=chunks)
    T, K, R = d["hn"].shape[0], d["K"], d["R"]
    assert kl.shape == (T, K * R) and ki.shape == (T, K * R)
    assert kl.dtype == jnp.float32 and ki.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ki), np.asarray(ri))
    np.testing.assert_allclose(np.asarray(kl), np.asarray(rl), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_argmax_equals_dense_argmax_restricted_to_candidates(shape):
    d = make_data(*shape, seed=1)
    dense = _dense_restricted_logits(d)
    want_tok = dense.argmax(-1)
    want_logit = dense.max(-1)
    ref, ker = _argmax_both(d)
    for tok, logit in (ref, ker):
        np.testing.assert_array_equal(np.asarray(tok), want_tok)
        np.testing.assert_allclose(np.asarray(logit), want_logit, rtol=1e-5, atol=1e-4)
    # and the sparse logits, scattered to the canonical vocab, give the same dense vector
    (rl, ri), (kl, ki) = _sparse_both(d)
    for lg, ids in ((rl, ri), (kl, ki)):
        full = np.full(dense.shape, -np.inf)
        full[np.arange(dense.shape[0])[:, None], np.asarray(ids)] = np.asarray(lg)
        np.testing.assert_allclose(full, dense, rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(full.argmax(-1), want_tok)


def test_reference_matches_transformers_semantics():
    """cand = token_ordering.view(C, V/C)[top] of the canonical table; sel = canonical[cand] @ hn."""
    d = make_data(*SHAPES[0], seed=2)
    hn = np.asarray(d["hn"], np.float64)
    cand = _candidate_ids(d)  # [T, K*R]
    sel = np.einsum("td,tsd->ts", hn, np.asarray(d["canonical"], np.float64)[cand])
    logits, ids = ch.centroid_sparse_logits_reference(d["hn"], d["scores"], d["ordered"], d["ordering"],
                                                      top_k=d["K"])
    np.testing.assert_array_equal(np.asarray(ids), cand)
    np.testing.assert_allclose(np.asarray(logits), sel, rtol=1e-5, atol=1e-4)
    # transformers' full logits (fill = min(sel) - 1 elsewhere) -> the same argmax token
    fill = sel.min() - 1.0
    full = np.full((hn.shape[0], d["V"]), fill)
    full[np.arange(hn.shape[0])[:, None], cand] = sel
    tok, _ = ch.centroid_argmax_reference(d["hn"], d["scores"], d["ordered"], d["ordering"], top_k=d["K"])
    np.testing.assert_array_equal(np.asarray(tok), full.argmax(-1))
    # the centroid choice is transformers': top-k of hn @ centroids.T
    scores = hn @ np.asarray(d["centroids"], np.float64).T
    want_top = np.sort(np.argsort(-scores, axis=-1, kind="stable")[:, : d["K"]], axis=-1)  # kept in index order
    np.testing.assert_array_equal(np.asarray(d["top"]), want_top)


def test_reference_matches_model_centroid_head():
    """The dispatcher (XLA and Pallas) reproduces model/assistant.py CentroidHead's sparse logits and ids."""
    from gemma4_mtp_jax.model.assistant import CentroidHead

    T, Ha, V, C, K = SHAPES[0]
    d = make_data(T, Ha, V, C, K, seed=3)
    mod = CentroidHead(num_centroids=C, top_k=K, vocab_size=V)
    params = {"params": {"centroids": {"weight": d["centroids"]}, "ordered_embedding": d["ordered"],
                         "token_ordering": d["ordering"]}}
    want_l, want_i = mod.apply(params, d["hn"])
    for impl in ("xla", "pallas"):
        lg, ids = ch.centroid_head(d["hn"], d["centroids"], d["ordered"], d["ordering"], K, mode="sparse",
                                   impl=impl, interpret=INTERPRET)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_i))
        np.testing.assert_allclose(np.asarray(lg), np.asarray(want_l), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sup_dtype", [jnp.bool_, jnp.int8])
def test_suppress_honoured(shape, sup_dtype):
    d = make_data(*shape, seed=4)
    ref0, _ = _argmax_both(d)
    best = np.asarray(ref0[0])
    ordering = np.asarray(d["ordering"])
    row_of = np.argsort(ordering)  # canonical id -> row
    sup = np.zeros(d["V"], bool)
    sup[row_of[best]] = True  # suppress every token's winner (row order)
    # the expected winners: dense restricted argmax with those tokens masked out
    dense = _dense_restricted_logits(d)
    dense[:, best] = -np.inf
    want = dense.argmax(-1)
    suppress = jnp.asarray(sup).astype(sup_dtype)
    ref, ker = _argmax_both(d, suppress)
    _assert_argmax_equal(ref, ker)
    np.testing.assert_array_equal(np.asarray(ker[0]), want)
    assert not np.isin(np.asarray(ker[0]), best).any()
    (rl, ri), (kl, ki) = _sparse_both(d, suppress)
    np.testing.assert_array_equal(np.asarray(ki), np.asarray(ri))
    np.testing.assert_allclose(np.asarray(kl), np.asarray(rl), rtol=1e-5, atol=1e-5)
    hit = np.isin(np.asarray(ki), best)
    assert hit.any() and np.all(np.isneginf(np.asarray(kl)[hit])) and np.all(np.isfinite(np.asarray(kl)[~hit]))


@pytest.mark.parametrize("chunks", [1, 4])
def test_all_candidates_suppressed(chunks):
    d = make_data(*SHAPES[0], seed=5)
    sup = jnp.ones(d["V"], bool)
    ref, ker = _argmax_both(d, sup, block_rows=8, chunks_per_program=chunks)
    first = _candidate_ids(d)[:, 0]  # the tie rule: first candidate
    for tok, logit in (ref, ker):
        np.testing.assert_array_equal(np.asarray(tok), first)
        assert np.all(np.isneginf(np.asarray(logit)))


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_inputs(shape):
    d = make_data(*shape, dtype=jnp.bfloat16, seed=6)
    ref, ker = _argmax_both(d)
    _assert_argmax_equal(ref, ker, atol=1e-4)
    (rl, ri), (kl, ki) = _sparse_both(d)
    np.testing.assert_array_equal(np.asarray(ki), np.asarray(ri))
    np.testing.assert_allclose(np.asarray(kl), np.asarray(rl), rtol=1e-5, atol=1e-4)
    # f32 hn with a bf16 table (mixed) also runs and agrees
    d["hn"] = d["hn"].astype(jnp.float32)
    ref, ker = _argmax_both(d)
    _assert_argmax_equal(ref, ker, atol=1e-4)


@pytest.mark.parametrize("block_rows,chunks", LAUNCHES)
def test_tie_rule_first_candidate_wins(block_rows, chunks):
    """Exact ties: the first candidate (the lowest row: kept centroids in index order, then row order) wins, on both
    paths, within and across centroids, tiles and programs."""
    T, Ha, V, C, K = SHAPES[0]
    d = make_data(T, Ha, V, C, K, seed=7)
    R = d["R"]
    top = np.asarray(d["top"])
    ordered = np.array(d["ordered"])
    hn = np.asarray(d["hn"])
    expect = []
    for t in range(T):
        win = 3.0 * hn[t] / np.linalg.norm(hn[t]) * np.sqrt(Ha)  # far above every random row's logit
        # The winning row three times: a late row of the second kept centroid (the first candidate) and two early
        # rows of the third; within one centroid only (last token): rows 20 and 12 of the first -> row 12. Tokens
        # share centroids, so each token takes rows (offsets by t) no other token writes.
        rows = [top[t, 1] * R + R - 1 - t, top[t, 2] * R + t, top[t, 2] * R + 5 + t]
        if t == T - 1:
            rows = [top[t, 0] * R + 20, top[t, 0] * R + 12]
        for r in rows:
            ordered[r] = win
        expect.append(min(rows))
    d["ordered"] = jnp.asarray(ordered)
    ref, ker = _argmax_both(d, block_rows=block_rows, chunks_per_program=chunks)
    want = np.asarray(d["ordering"])[np.array(expect)]
    np.testing.assert_array_equal(np.asarray(ref[0]), want)
    np.testing.assert_array_equal(np.asarray(ker[0]), want)
    # The winning logit: both paths sum the same float32 products in different orders (the module's contract:
    # equal to ~1e-7 relative, bitwise equal only where the orders happen to agree, as on the CPU).
    want_logit = np.einsum("th,th->t", hn.astype(np.float64), ordered[np.array(expect)].astype(np.float64))
    for got in (ref, ker):
        np.testing.assert_allclose(np.asarray(got[1]), want_logit, rtol=1e-6)


@pytest.mark.parametrize("mode", ["argmax", "sparse"])
def test_dispatcher(mode):
    T, Ha, V, C, K = SHAPES[1]
    d = make_data(T, Ha, V, C, K, seed=8)
    sup = jnp.zeros(V, bool).at[jnp.arange(0, V, 7)].set(True)
    args = (d["hn"], d["centroids"], d["ordered"], d["ordering"], K, sup)
    x = ch.centroid_head(*args, mode=mode, impl="xla")
    p = ch.centroid_head(*args, mode=mode, impl="pallas", interpret=INTERPRET)
    a = ch.centroid_head(*args, mode=mode)  # auto: XLA on the CPU
    for got in (p, a):
        np.testing.assert_array_equal(np.asarray(got[1] if mode == "sparse" else got[0]),
                                      np.asarray(x[1] if mode == "sparse" else x[0]))
        np.testing.assert_allclose(np.asarray(got[0] if mode == "sparse" else got[1]),
                                   np.asarray(x[0] if mode == "sparse" else x[1]), rtol=1e-5, atol=1e-5)
    # jit-compatible end to end
    f = jax.jit(lambda *a: ch.centroid_head(*a, K, sup, mode=mode, impl="pallas", interpret=INTERPRET))
    j = f(d["hn"], d["centroids"], d["ordered"], d["ordering"])
    np.testing.assert_array_equal(np.asarray(j[1]), np.asarray(p[1]))


def test_rejects_bad_config():
    d = make_data(*SHAPES[0])
    with pytest.raises(ValueError, match="block_rows"):
        ch.centroid_argmax(d["hn"], d["scores"], d["ordered"], d["ordering"], top_k=d["K"], interpret=INTERPRET,
                           block_rows=12)
    for chunks in (3, 32):  # not a power of two; more than the 16 tiles of 8 rows a token has
        with pytest.raises(ValueError, match="chunks_per_program"):
            ch.centroid_argmax(d["hn"], d["scores"], d["ordered"], d["ordering"], top_k=d["K"], interpret=INTERPRET,
                               block_rows=8, chunks_per_program=chunks)
    with pytest.raises(ValueError, match="top_k"):
        ch.centroid_argmax_reference(d["hn"], d["scores"], d["ordered"], d["ordering"], top_k=d["C"] + 1)
    with pytest.raises(ValueError, match="not a multiple"):
        ch.centroid_argmax_reference(d["hn"], d["scores"][:, :-1], d["ordered"], d["ordering"], top_k=d["K"])
    assert ch.default_config(1, 32, 128, 256, 2)["block_rows"] in (16, 32, 64, 128)


@pytest.mark.parametrize("budget", [HOPPER, GpuBudget(99 * 1024, 84), GpuBudget(163 * 1024, 108)])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_launch_config_fits_budget(budget, itemsize):
    """Every token count and head width the drafters use (E2B/E4B: Ha 256, R 128, top 32; the demo: Ha 32, R 32,
    top 4), and widths up to 2048: the tile fits the registers and shared memory, with >= 2 programs per SM once
    tokens' programs in one wave (at most one per SM) unless a token's candidates need a program each, and tiles no
    smaller than that needs."""
    for T, K, R, Ha in itertools.product([1, 2, 5, 16, 64, 128, 256], [4, 5, 32], [32, 128],
                                         [32, 64, 256, 1024, 2048]):
        cfg = ch.default_config(T, K, R, Ha, itemsize, budget)
        assert cfg is not None, (T, K, R, Ha)
        bp, g, w = cfg["block_rows"], cfg["chunks_per_program"], cfg["num_warps"]
        units = K * (R // bp)
        assert R % bp == 0 and bp & (bp - 1) == 0 and w in (4, 8) and g & (g - 1) == 0 and units % g == 0
        assert bp * Ha <= 128 * 32 * w and bp * Ha * itemsize <= budget.smem_per_block
        programs = T * units // g
        assert programs <= budget.num_sms or g == units or units % (2 * g), (T, K, R, Ha, cfg)
        if g > 1:  # no fewer programs than one wave needs
            assert T * units // (g // 2) > budget.num_sms
        if bp > 16:  # tiles as small as one wave can hold, down to 16 rows
            assert T * K * (R // (bp // 2)) > budget.num_sms
    hopper = ch.default_config(1, 32, 128, 256, 2, HOPPER)  # E2B's drafter at B = 1: 128 programs of 32 rows
    assert (hopper["block_rows"], hopper["chunks_per_program"]) == (32, 1)
    hopper = ch.default_config(16, 32, 128, 256, 2, HOPPER)  # at B = 16: 128 programs of 4 x 128 rows
    assert (hopper["block_rows"], hopper["chunks_per_program"]) == (128, 4)
    assert ch.default_config(1, 32, 128, 256, 2, budget)["block_rows"] >= 16
    assert ch.default_config(1, 1, 4, 1 << 16, 4, GpuBudget(16 * 1024, 1)) is None  # a row wider than any tile


def test_dispatcher_falls_back_when_no_tile_fits(monkeypatch, caplog):
    """On a GPU whose budget no tile fits, `impl="auto"` takes the XLA path with one log line instead of failing."""
    T, Ha, V, C, K = SHAPES[0]
    d = make_data(T, Ha, V, C, K, seed=9)
    args = (d["hn"], d["centroids"], d["ordered"], d["ordering"], K)
    want = ch.centroid_head(*args, impl="xla")
    monkeypatch.setattr(ch, "_kernels_for", lambda x: True)
    monkeypatch.setattr(ch, "default_budget", lambda: GpuBudget(64, 132))
    ch._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger=ch.__name__):
        for _ in range(2):
            got = ch.centroid_head(*args)
            np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert sum("XLA path" in r.getMessage() for r in caplog.records) == 1


def _kept_by_kernel(d) -> np.ndarray:
    """The clusters the sparse kernel served, per token, from the ids it wrote (rows come in whole clusters)."""
    _, ids = ch.centroid_sparse_logits(d["hn"], d["scores"], d["ordered"], d["ordering"], top_k=d["K"],
                                       interpret=INTERPRET)
    row_of = np.argsort(np.asarray(d["ordering"]))  # canonical id -> row
    rows = row_of[np.asarray(ids)].reshape(ids.shape[0], d["K"], d["R"])
    assert np.all(rows // d["R"] == rows[..., :1] // d["R"]) and np.all(np.diff(rows, axis=-1) == 1)
    return rows[..., 0] // d["R"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("levels", [3, 7, 1000])
def test_kernel_selection_is_top_k_with_ties(dtype, levels):
    """The kernel's own selection keeps lax.top_k's set, in index order, when many scores tie at the K-th (scores
    drawn from a few levels, negative and positive, some -0.0), and when none do."""
    T, Ha, V, C, K = 6, 32, 2048, 64, 8
    d = make_data(T, Ha, V, C, K, dtype=dtype, seed=10)
    rng = np.random.default_rng(levels)
    vals = rng.choice(np.linspace(-2.0, 1.5, levels), size=(T, C))
    vals[0, :3] = -0.0
    d["scores"] = jnp.asarray(vals, jnp.float32).astype(dtype)
    d["top"] = ch.top_centroids(d["scores"], K)
    np.testing.assert_array_equal(_kept_by_kernel(d), np.asarray(d["top"]))
    want = np.sort(np.argsort(-np.asarray(d["scores"], np.float64), axis=-1, kind="stable")[:, :K], axis=-1)
    np.testing.assert_array_equal(np.asarray(d["top"]), want)


def test_kernel_selection_keeps_all_when_k_is_c():
    T, Ha, V, C = 2, 32, 512, 16
    d = make_data(T, Ha, V, C, C, seed=11)
    np.testing.assert_array_equal(_kept_by_kernel(d), np.tile(np.arange(C), (T, 1)))
