"""The merge-and-o_proj kernel (gemma4_mtp_jax/kernels/merge_project.py; compiled on the GPU, interpret mode
elsewhere) against its plain-XLA reference and against the path it replaces (the merge kernel, then o_proj), its
fallbacks, and the tiny E2B target's paged forward with its attention through the kernels.

The key splits come from the paged kernel itself (`paged_attention(..., merge=False)`) over test_paged_attention's
cases: pages permuted, every slot no query may read poisoned with NaN (a read would surface in the partials)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_mtp_jax.kernels import attention_inputs as ai
from gemma4_mtp_jax.kernels import merge_project as mp
from gemma4_mtp_jax.kernels import paged_attention as pa
from gemma4_mtp_jax.kernels import split_k as sk
from gemma4_mtp_jax.kernels.split_k import SplitSum, split_matmul, total
from test_paged_attention import build_case
from testenv import INTERPRET

# (name, B, Tq, nH, nKV, D, page size, window, ring pages, key splits, N): GQA with two KV heads; a sliding ring
# in 5 splits; decode (one token) and verify-sized rows (B * Tq up to 16); a padding sequence in each.
CASES = [
    ("decode_gqa", 4, 1, 8, 2, 32, 4, None, None, 3, 96),
    ("verify_gqa", 3, 5, 4, 2, 16, 8, None, None, 2, 64),
    ("decode_ring5", 4, 1, 4, 1, 32, 4, 11, 5, 5, 48),
    ("verify_ring5", 3, 5, 4, 2, 32, 4, 11, 5, 5, 80),
    ("verify_16rows", 4, 4, 4, 1, 16, 4, 7, 4, 4, 32),
]
STARTS = [37, 21, 0, 9]


def _splits(name, dtype, seed=0):
    """(KeySplits from the paged kernel, o_proj's weight [N, nH * D]) of case `name`."""
    _, B, Tq, nH, nKV, D, ps, window, ring, S, N = next(c for c in CASES if c[0] == name)
    starts = STARTS[:B]
    valid = [Tq if s else 0 for s in starts]
    valid[1] = max(1, Tq - 2)
    c = build_case(seed, Tq=Tq, nH=nH, nKV=nKV, D=D, page_size=ps, starts=starts, n_valid=valid, window=window,
                   ring_pages=ring)
    splits = pa.paged_attention(*c.args(dtype), window=window, ring_pages=ring, interpret=INTERPRET, k_splits=S,
                                merge=False)
    assert isinstance(splits, pa.KeySplits) and splits.o.shape[0] == S
    w = jax.random.normal(jax.random.key(seed + 1), (N, nH * D), jnp.float32) * (nH * D) ** -0.5
    return splits, w.astype(dtype)


def _old_path(splits, w) -> np.ndarray:
    """What the model computed before: the merge kernel's output, then o_proj as one matmul."""
    x = pa.merge_key_splits(splits)
    B, T, nH, D = x.shape
    return np.asarray(split_matmul(x.reshape(B, T, nH * D), w, 1), np.float32)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_matches_reference_and_old_path(name, dtype):
    splits, w = _splits(name, dtype)
    got = mp.merge_project(splits, w)
    want = mp.merge_project_reference(splits, w)
    nH = splits.num_heads
    B = splits.o.shape[1]
    assert isinstance(got, SplitSum) and got.dtype == jnp.dtype(dtype)
    assert got.partials.shape == want.partials.shape == (nH, B, splits.q_len, w.shape[0])
    assert got.partials.dtype == jnp.float32
    g, r = np.asarray(got.partials), np.asarray(want.partials)
    assert np.all(np.isfinite(g))
    # Per head, the same float32 merge and the same rounding of the merged rows: the partials agree to float32's
    # accumulation order (bf16: a merged value may round to the neighbouring bf16 where the orders differ).
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(g, r, atol=tol, rtol=tol)
    # Padding rows (sequence 2 has none real) give exact zeros.
    assert np.all(g[:, 2] == 0)
    np.testing.assert_allclose(np.asarray(total(got), np.float32), _old_path(splits, w), atol=tol, rtol=tol)


def test_reference_is_the_merge_then_o_proj_per_head():
    """The reference's partial h is head h's merged rows times head h's columns of o_proj."""
    splits, w = _splits("verify_gqa", jnp.float32, seed=3)
    x = np.asarray(pa.merge_key_splits_reference(splits))  # [B, T, nH, D]
    D = x.shape[-1]
    p = np.asarray(mp.merge_project_reference(splits, w).partials)
    for h in range(splits.num_heads):
        np.testing.assert_allclose(p[h], x[:, :, h] @ np.asarray(w)[:, h * D:(h + 1) * D].T, atol=1e-5, rtol=1e-5)


def test_merged_rows_rounded_to_the_dtype_before_the_product():
    """bf16: the kernel's partials are the bf16-rounded merged rows times the weights, as the old path's GEMM read
    the merge kernel's bf16 output (not the float32 merge times the weights)."""
    splits, w = _splits("decode_gqa", jnp.bfloat16, seed=5)
    x = np.asarray(pa.merge_key_splits(splits), np.float32)  # bf16 values
    D = x.shape[-1]
    wf = np.asarray(w, np.float32)
    p = np.asarray(mp.merge_project(splits, w).partials)
    for h in range(splits.num_heads):
        np.testing.assert_allclose(p[h], x[:, :, h] @ wf[:, h * D:(h + 1) * D].T, atol=2e-2, rtol=2e-2)


def test_fallbacks():
    """Where the kernel does not apply: past 16 rows, an unsplit o_proj, weights past split_k's budget (31B's
    full layers), a head dim that is not a power of two, one head."""
    e2b = dict(num_heads=8, head_dim=512, N=1536)
    assert mp.use_merge_project(2, parts=8, **e2b) and mp.use_merge_project(16, parts=8, **e2b)
    assert not mp.use_merge_project(17, parts=8, **e2b)
    assert not mp.use_merge_project(2, parts=1, **e2b)
    assert mp.use_merge_project(2, 4, 256, 256, parts=4)  # the E2B assistant's, its parts added by the FF block
    assert not mp.use_merge_project(2, 32, 512, 5376, parts=8)  # 31B: 176 MB of o_proj
    assert not mp.use_merge_project(2, 8, 96, 1536, parts=8)
    assert not mp.use_merge_project(2, 1, 256, 1536, parts=8)
    splits, w = _splits("verify_gqa", jnp.float32)
    with pytest.raises(ValueError, match="query rows"):
        mp.merge_project(splits._replace(o=jnp.concatenate([splits.o] * 2, 1), m=jnp.concatenate([splits.m] * 2, 1),
                                         l=jnp.concatenate([splits.l] * 2, 1)), w)
    with pytest.raises(ValueError, match="do not fit w"):
        mp.merge_project(splits, w[:, :-1])


def test_splits_past_the_weight_block_are_merged_first(monkeypatch):
    """`splits_fit` at E2B's shapes (decode: full layers 64 splits, sliding 4), and `project_key_splits` taking the
    merge kernel, then o_proj in parts, where the splits do not fit: the same partial sums, through the other path."""
    assert mp.splits_fit(4, 2, 8, 256, 1536) and mp.splits_fit(4, 16, 8, 256, 1536)  # sliding layers
    assert not mp.splits_fit(64, 2, 8, 512, 1536) and not mp.splits_fit(17, 16, 8, 512, 1536)  # full layers
    splits, w = _splits("verify_gqa", jnp.float32)
    B, S = splits.o.shape[1], splits.o.shape[0]
    rows, D, N = B * splits.q_len, splits.o.shape[-1], w.shape[0]
    assert mp.splits_fit(S, rows, splits.num_heads, D, N)
    kernel = mp.merge_project
    calls = []
    monkeypatch.setattr(mp, "merge_project", lambda *a: calls.append("kernel") or kernel(*a))
    fused = mp.project_key_splits(splits, w, splits.num_heads)
    monkeypatch.setattr(mp, "_tiling", lambda *a: (S * rows - 1, 16, 4))  # one split row past the block
    merged_first = mp.project_key_splits(splits, w, splits.num_heads)
    assert calls == ["kernel"] and isinstance(merged_first, SplitSum)
    np.testing.assert_allclose(np.asarray(merged_first.partials.sum(0)), np.asarray(fused.partials.sum(0)),
                               atol=1e-5, rtol=1e-5)


def test_no_splits_come_back_merged():
    """merge=False hands splits back only where the kernel split the keys: one split, and the XLA path, give the
    merged output, as merge=True does."""
    c = build_case(7, Tq=1, nH=4, nKV=2, D=16, page_size=4, starts=[9, 3], n_valid=[1, 1])
    one = pa.paged_attention(*c.args(), interpret=INTERPRET, k_splits=1, merge=False)
    assert isinstance(one, jax.Array)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(pa.paged_attention(*c.args(), interpret=INTERPRET,
                                                                                  k_splits=1)))
    assert isinstance(pa.attend_paged(*c.args(), impl="xla", merge=False), jax.Array)


def test_views_merge_under_tensor_parallelism(monkeypatch):
    """Under tensor parallelism the paged views merge whatever the layer asks (`head_parallel` splits one array
    by heads); on one device they hand the kernel's splits back."""
    from gemma4_mtp_jax import kv_state
    from gemma4_mtp_jax.config import FULL

    monkeypatch.setattr(pa, "paged_attention", functools.partial(pa.paged_attention, interpret=INTERPRET,
                                                                 k_splits=2))
    c = build_case(9, Tq=1, nH=4, nKV=1, D=16, page_size=4, starts=[17, 5], n_valid=[1, 1])
    q, kp, vp, table, qpos = c.args()
    view = kv_state.PagedKV({0: (kp, vp)}, {FULL: table}, qpos, {0: FULL}, 4, None, "pallas")
    assert isinstance(view.attend(0, q, qpos, None, merge=False), pa.KeySplits)
    monkeypatch.setattr(kv_state, "tensor_parallel_size", lambda: 2)
    merged = view.attend(0, q, qpos, None, merge=False)
    assert isinstance(merged, jax.Array)
    np.testing.assert_array_equal(np.asarray(merged), np.asarray(view.attend(0, q, qpos, None)))


def test_tiny_e2b_paged_forward_through_the_kernels(monkeypatch, tiny_ckpts, jax_models):
    """The tiny E2B target's paged forward (a verify-sized chunk, then a decode token) with its attention through
    the kernels in interpret mode, keys in 2 splits, o_proj through merge_project in every layer (split_k's
    minimum part lowered so that the tiny projections split at all): the plain forward's hidden states."""
    from gemma4_mtp_jax.forward import forward_paged
    from gemma4_mtp_jax.kv_state import init_pages, make_layout
    from gemma4_mtp_jax.model import decoder

    target = jax_models.target(tiny_ckpts["e2b"]["target"])
    cfg = target.config
    monkeypatch.setattr(sk, "MIN_SPLIT_K", 16)
    monkeypatch.setattr(pa, "paged_attention", functools.partial(pa.paged_attention, interpret=INTERPRET,
                                                                 k_splits=2))
    monkeypatch.setattr(ai, "attention_inputs", functools.partial(ai.attention_inputs, interpret=INTERPRET))
    calls = []  # how each o_proj traced went: through merge_project, or the merged rows' matmul
    kernel = mp.merge_project
    monkeypatch.setattr(mp, "merge_project", lambda *a: calls.append("merged") or kernel(*a))
    monkeypatch.setattr(decoder, "split_matmul", lambda *a: calls.append("matmul") or split_matmul(*a))

    B, P, ps = 2, 20, 4
    groups = sorted({lc.layer_type for lc in cfg.layers})
    layout = make_layout(cfg, page_size=ps, max_model_len=48, num_pages={g: 64 for g in groups},
                         num_speculative_tokens=4)
    tables = {g: jnp.asarray(1 + np.arange(B * layout.table_width(g)).reshape(B, -1), jnp.int32) for g in groups}
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(3, 500, (B, P)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    run = {impl: jax.jit(functools.partial(forward_paged, target, layout, attention_impl=impl))
           for impl in ("xla", "pallas")}
    _, pages = run["xla"](target.params, init_pages(cfg, layout, jnp.float32), prompt, pos, tables)
    for T in (3, 1):
        tokens = jnp.asarray(rng.integers(3, 500, (B, T)), jnp.int32)
        at = P + jnp.arange(T, dtype=jnp.int32)[None, :] + jnp.asarray([[0], [-7]], jnp.int32)
        want = run["xla"](target.params, pages, tokens, at, tables)[0]
        calls.clear()
        got = run["pallas"](target.params, pages, tokens, at, tables)[0]
        assert calls and set(calls) == {"merged"}, calls
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
