"""Paged attention for decode/verify: the XLA reference against a dense oracle, the Pallas kernel (compiled on the
GPU, interpret mode elsewhere) against the reference, and the tiling planner against the device budget.

Every case scatters one dense K/V history per sequence into randomly permuted (non-contiguous) pages of a pool
whose every other slot is NaN: unwritten pages, the tail of the last page, positions older than the window or
overwritten in the ring, and unused page-table entries (pointing out of the pool). A NaN read into V would
surface in the output (0 * NaN = NaN), so finite outputs prove those slots are never read.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_mtp_jax.kernels import attention_inputs as ai
from gemma4_mtp_jax.kernels import paged_attention as pa
from gemma4_mtp_jax.kernels.device_budget import HOPPER, GpuBudget
from gemma4_mtp_jax.train.demo_recipe import TARGET_CONFIG
from testenv import INTERPRET


@dataclasses.dataclass
class Case:
    q: np.ndarray  # [B, Tq, nH, D]
    k_pages: np.ndarray  # [nKV, P, ps, D]
    v_pages: np.ndarray
    page_table: np.ndarray  # [B, width] int32
    q_positions: np.ndarray  # [B, Tq] int32
    k_hist: list  # per sequence: [hi+1, nKV, D] float64 (the unpaged K/V)
    v_hist: list
    window: int | None
    ring_pages: int | None

    def args(self, dtype=jnp.float32):
        return (jnp.asarray(self.q, dtype), jnp.asarray(self.k_pages, dtype), jnp.asarray(self.v_pages, dtype),
                jnp.asarray(self.page_table), jnp.asarray(self.q_positions))


def build_case(seed: int, *, Tq: int, nH: int, nKV: int, D: int, page_size: int, starts, n_valid,
               window=None, ring_pages=None, same_position=False, extra_width=2, extra_pages=3) -> Case:
    """starts[b]: mask position of sequence b's first query row; n_valid[b]: its non-padding rows (0 = all padding).
    Keys 0..hi_b are written (hi_b = its last query position); with `same_position` all rows share starts[b]."""
    rng = np.random.default_rng(seed)
    B = len(starts)
    qpos = np.full((B, Tq), -1, np.int32)
    for b in range(B):
        n = n_valid[b]
        qpos[b, :n] = starts[b] if same_position else starts[b] + np.arange(n)
    hi = qpos.max(axis=1)
    lo_q = np.where(qpos >= 0, qpos, np.iinfo(np.int32).max).min(axis=1)

    if ring_pages is None:
        need = [0 if hi[b] < 0 else hi[b] // page_size + 1 for b in range(B)]
        width = max(need) + extra_width
    else:
        assert ring_pages * page_size >= (window or 0) + Tq + 1, "ring too small for the contract"
        need = [0 if hi[b] < 0 else ring_pages for b in range(B)]
        width = ring_pages + extra_width
    P = sum(need) + extra_pages
    perm = rng.permutation(P)
    table = np.full((B, width), P + 1000, np.int32)  # unused entries point far outside the pool
    nxt = 0
    for b in range(B):
        table[b, :need[b]] = perm[nxt:nxt + need[b]]
        nxt += need[b]

    k_pages = np.full((nKV, P, page_size, D), np.nan, np.float64)
    v_pages = np.full((nKV, P, page_size, D), np.nan, np.float64)
    k_hist, v_hist = [], []
    for b in range(B):
        L = hi[b] + 1
        kh = rng.standard_normal((L, nKV, D))
        vh = rng.standard_normal((L, nKV, D))
        k_hist.append(kh)
        v_hist.append(vh)
        if L == 0:
            continue
        # First visible position of any row: older slots are poisoned after writing (never needed).
        lo = 0 if window is None else max(0, lo_q[b] - window + 1)
        for p in range(L):  # in order, so later positions overwrite earlier ones in a ring
            j = p // page_size
            page = table[b, j if ring_pages is None else j % ring_pages]
            poison = p < lo
            k_pages[:, page, p % page_size] = np.nan if poison else kh[p]
            v_pages[:, page, p % page_size] = np.nan if poison else vh[p]
    q = rng.standard_normal((B, Tq, nH, D)) * D ** -0.5
    return Case(q, k_pages, v_pages, table, qpos, k_hist, v_hist, window, ring_pages)


def visible_rows(c: Case):
    """(b, t, h, k, v) for each real query row: the unpaged keys and values [n, D] its window lets it see."""
    B, Tq, nH, D = c.q.shape
    G = nH // c.k_pages.shape[0]
    for b in range(B):
        for t in range(Tq):
            qp = c.q_positions[b, t]
            if qp < 0:
                continue
            lo = 0 if c.window is None else max(0, qp - c.window + 1)
            for h in range(nH):
                yield b, t, h, c.k_hist[b][lo:qp + 1, h // G], c.v_hist[b][lo:qp + 1, h // G]


def dense_oracle(c: Case) -> np.ndarray:
    """Straightforward attention over the unpaged history, float64."""
    out = np.zeros(c.q.shape)
    for b, t, h, k, v in visible_rows(c):
        s = k @ c.q[b, t, h]
        w = np.exp(s - s.max())
        out[b, t, h] = (w / w.sum()) @ v
    return out


def run_kernel(c: Case, dtype=jnp.float32, **kw):
    return pa.paged_attention(*c.args(dtype), window=c.window, ring_pages=c.ring_pages, interpret=INTERPRET, **kw)


def run_reference(c: Case, dtype=jnp.float32):
    return pa.paged_attention_reference(*c.args(dtype), window=c.window, ring_pages=c.ring_pages)


def assert_padding_zero(c: Case, out):
    out = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out))
    assert np.all(out[c.q_positions < 0] == 0)


# Sequences: 0 full rows across several pages, 1 partly padded, 2 all padding, 3 short.
STARTS = [37, 21, 0, 2]


def _valid(Tq):
    return [Tq, max(1, Tq - 2), 0, Tq]


REF_CASES = [
    # (Tq, nH, nKV, D, page_size, window, ring_pages)
    (1, 4, 4, 16, 8, None, None),
    (5, 4, 2, 16, 8, None, None),
    (5, 8, 2, 32, 4, 7, None),
    (1, 2, 1, 16, 8, 9, None),
    (5, 4, 1, 32, 8, 10, 2),  # ring of 16 slots, contexts up to 42
    (1, 8, 2, 16, 4, 6, 2),
]


@pytest.mark.parametrize("Tq,nH,nKV,D,ps,window,ring", REF_CASES)
def test_reference_matches_dense_oracle(Tq, nH, nKV, D, ps, window, ring):
    c = build_case(1, Tq=Tq, nH=nH, nKV=nKV, D=D, page_size=ps, starts=STARTS, n_valid=_valid(Tq), window=window,
                   ring_pages=ring)
    out = run_reference(c)
    assert_padding_zero(c, out)
    np.testing.assert_allclose(np.asarray(out), dense_oracle(c), atol=1e-5, rtol=1e-5)


KERNEL_CASES = {
    # name: (Tq, nH, nKV, D, page_size, window, ring_pages, starts, extra kernel kwargs)
    "q5_gqa4_d32_full": (5, 4, 1, 32, 8, None, None, STARTS, {}),
    "q1_mha_d16_full": (1, 2, 2, 16, 16, None, None, STARTS, {}),
    "q5_gqa2_d16_window": (5, 4, 2, 16, 8, 12, None, STARTS, {}),
    "q5_gqa4_d32_ring": (5, 4, 1, 32, 8, 10, 2, [45, 29, 0, 3], {}),
    "q1_gqa2_d16_ring_small_pages": (1, 4, 2, 16, 4, 9, 3, [50, 13, 0, 6], {}),
    "q5_gqa2_d32_splits": (5, 4, 2, 32, 8, None, None, [70, 33, 0, 2], {"k_splits": 3}),
    "q5_gqa4_d16_window_splits_rowblocks": (5, 8, 2, 16, 8, 11, None, [61, 30, 0, 1],
                                            {"k_splits": 2, "block_rows": 16}),
    "q5_gqa4_d16_ring_splits": (5, 4, 1, 16, 4, 10, 4, [77, 19, 0, 8], {"k_splits": 2}),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_reference_f32(name):
    Tq, nH, nKV, D, ps, window, ring, starts, kw = KERNEL_CASES[name]
    c = build_case(2, Tq=Tq, nH=nH, nKV=nKV, D=D, page_size=ps, starts=starts, n_valid=_valid(Tq),
                   window=window, ring_pages=ring)
    out = run_kernel(c, **kw)
    assert out.shape == c.q.shape and out.dtype == jnp.float32
    assert_padding_zero(c, out)
    np.testing.assert_allclose(np.asarray(out), np.asarray(run_reference(c)), atol=1e-5, rtol=1e-5)


def test_kernel_drafter_pattern_same_positions_under_jit():
    """The drafter: all k rows at the same position P-1 with window W+1; called inside an outer jit."""
    c = build_case(3, Tq=4, nH=4, nKV=2, D=16, page_size=8, starts=[40, 9, 0, 1], n_valid=[4, 4, 0, 2],
                   window=9, ring_pages=3, same_position=True)
    f = jax.jit(lambda *a: pa.paged_attention(*a, window=c.window, ring_pages=c.ring_pages, interpret=INTERPRET))
    out = f(*c.args())
    assert_padding_zero(c, out)
    np.testing.assert_allclose(np.asarray(out), dense_oracle(c), atol=1e-5, rtol=1e-5)


BOUNDS_CASES = {
    # name: (window, ring_pages, image_attention rule, extra kernel kwargs)
    "sliding_layers_ring": (10, 3, "sliding_layers", {}),
    "all_layers_image_wider_than_window": (6, None, "all_layers", {}),
    "all_layers_full_splits": (None, None, "all_layers", {"k_splits": 2}),
}


@pytest.mark.parametrize("name", list(BOUNDS_CASES))
def test_image_queries_see_their_image_ahead(name):
    """A prefill chunk of 12 rows holding an 8-token image (rows 2..9) whose tokens see each other: each row's keys
    are `image_bounds`' interval, some ahead of it. The reference and the kernel against a dense oracle over that
    interval; the image's first row must see its last key (so the test fails on causal masks)."""
    from gemma4_mtp_jax.kernels.dense_attention import image_bounds, image_runs

    window, ring, rule, kw = BOUNDS_CASES[name]
    Tq = 12
    c = build_case(5, Tq=Tq, nH=4, nKV=2, D=16, page_size=8, starts=[37, 21, 0, 2], n_valid=[Tq, 10, 0, Tq],
                   window=window, ring_pages=ring)
    vision = np.zeros(c.q_positions.shape, bool)
    vision[:, 2:10] = True
    vision &= c.q_positions >= 0
    bounds = np.asarray(image_bounds(jnp.asarray(c.q_positions), image_runs(jnp.asarray(vision),
                                                                            jnp.asarray(c.q_positions)),
                                     window, rule))
    assert bounds[0, 2, 1] == c.q_positions[0, 9], "the image's first query does not see its last key"
    B, _, nH, _ = c.q.shape
    G = nH // c.k_pages.shape[0]
    want = np.zeros(c.q.shape)
    for b, t, h in itertools.product(range(B), range(Tq), range(nH)):
        if c.q_positions[b, t] >= 0:
            lo, hi = bounds[b, t]
            k, v = c.k_hist[b][lo:hi + 1, h // G], c.v_hist[b][lo:hi + 1, h // G]
            s = k @ c.q[b, t, h]
            w = np.exp(s - s.max())
            want[b, t, h] = (w / w.sum()) @ v
    for out in (pa.paged_attention_reference(*c.args(), window=window, ring_pages=ring, bounds=jnp.asarray(bounds)),
                run_kernel(c, bounds=jnp.asarray(bounds), **kw)):
        assert_padding_zero(c, out)
        np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,ring,splits", [(None, None, None), (None, None, 3), (10, 2, None)])
def test_kernel_bf16(window, ring, splits):
    c = build_case(4, Tq=5, nH=8, nKV=2, D=32, page_size=8, starts=[44, 17, 0, 3], n_valid=_valid(5),
                   window=window, ring_pages=ring)
    out = run_kernel(c, jnp.bfloat16, k_splits=splits)
    assert out.dtype == jnp.bfloat16
    assert_padding_zero(c, out)
    ref = run_reference(c, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), dense_oracle(c), atol=3e-2, rtol=3e-2)


FP8 = jnp.float8_e4m3fn
K_SCALE, V_SCALE = 2.0**-5, 2.0**-6  # the tiny models' sizes (kv_state.kv_cache_scales); |K|, |V| < 5 stay in range


def fp8_pages(c: Case) -> tuple[jax.Array, jax.Array]:
    """c's pages as a float8 cache holds them: K / K_SCALE and V / V_SCALE in e4m3fn, as the writers round them
    (`to_cache`); the NaN poison stays NaN."""
    return (ai.to_cache(jnp.asarray(c.k_pages, jnp.float32), K_SCALE, FP8),
            ai.to_cache(jnp.asarray(c.v_pages, jnp.float32), V_SCALE, FP8))


def fp8_bound(c: Case) -> np.ndarray:
    """[B, Tq, nH]: how far float8 K/V can move each output row from exact attention. e4m3 rounds to 3 mantissa bits
    (relative error <= 2^-4), subnormals to 2^-9 (absolute <= 2^-10, times the scale): each value moves by
    dv <= 2^-4 |v| + 2^-10 V_SCALE, each score by ds <= sum_i |q_i| (2^-4 |k_i| + 2^-10 K_SCALE). Scores moved by at
    most e change every softmax weight by a factor within e^(+-2e): sum |dp| <= e^(2e) - 1. So
    |d out| <= max dv + (e^(2e) - 1) max |v|, over the row's visible keys."""
    bound = np.zeros(c.q.shape[:3])
    for b, t, h, k, v in visible_rows(c):
        k, v = np.abs(k), np.abs(v)
        ds = (np.abs(c.q[b, t, h]) * (2.0**-4 * k + 2.0**-10 * K_SCALE)).sum(-1).max()
        dv = (2.0**-4 * v + 2.0**-10 * V_SCALE).max()
        bound[b, t, h] = dv + np.expm1(2 * ds) * v.max()
    return bound


@pytest.mark.parametrize("window,ring,splits", [(None, None, None), (None, None, 3), (10, 2, None)])
def test_kernel_fp8_pages(window, ring, splits):
    """A float8 cache (K / K_SCALE, V / V_SCALE in e4m3fn). The reference reads it as the attention of the float8
    values times their scales, bit for bit (the products are exact: powers of two); it strays from exact attention
    on the unquantized K/V by no more than fp8's rounding allows (`fp8_bound`, a worst case; measured on these N(0, 1)
    values: at most 0.11, under 4 % of the row's bound, 0.006 on average). The kernel, computing in the queries'
    dtype, equals the reference in float32 and within bfloat16's rounding in bfloat16."""
    c = build_case(4, Tq=5, nH=8, nKV=2, D=32, page_size=8, starts=[44, 17, 0, 3], n_valid=_valid(5),
                   window=window, ring_pages=ring)
    kq, vq = fp8_pages(c)
    kw = dict(window=window, ring_pages=ring)
    q, _, _, table, qpos = c.args()
    ref = pa.paged_attention_reference(q, kq, vq, table, qpos, k_scale=K_SCALE, v_scale=V_SCALE, **kw)
    dequantized = (kq.astype(jnp.float32) * K_SCALE, vq.astype(jnp.float32) * V_SCALE)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(pa.paged_attention_reference(q, *dequantized, table,
                                                                                           qpos, **kw)))
    err = np.abs(np.asarray(ref, np.float64) - dense_oracle(c)).max(-1)
    assert np.all(err <= fp8_bound(c) + 1e-5), float((err - fp8_bound(c)).max())
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        q = jnp.asarray(c.q, dtype)
        out = pa.paged_attention(q, kq, vq, table, qpos, k_scale=K_SCALE, v_scale=V_SCALE, k_splits=splits,
                                 interpret=INTERPRET, **kw)
        assert out.dtype == dtype
        assert_padding_zero(c, out)
        want = pa.paged_attention_reference(q, kq, vq, table, qpos, k_scale=K_SCALE, v_scale=V_SCALE, **kw)
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("S,B,nKV,R,D,Tq,nH", [(3, 2, 1, 16, 32, 2, 4), (5, 1, 2, 16, 256, 1, 8),
                                                (1, 2, 2, 32, 16, 5, 4)])
def test_split_merge_kernel_matches_reference(S, B, nKV, R, D, Tq, nH):
    """The key splits' merge kernel against its XLA reference, rows put back in q's layout: split counts that are
    not powers of two, D wider than one block, splits that saw no key, rows no split saw a key for (zeros)."""
    rng = np.random.default_rng(S * 100 + D)
    o = jnp.asarray(rng.normal(size=(S, B, nKV, R, D)), jnp.bfloat16)
    m = rng.normal(size=(S, B, nKV, R)).astype(np.float32) * 4
    l = rng.uniform(0.5, 3.0, size=(S, B, nKV, R)).astype(np.float32)
    m[0, 0, 0, 1] = pa._NEG  # one split saw no key for one row
    l[0, 0, 0, 1] = 0
    m[:, -1, -1, 0] = pa._NEG  # no split saw a key for another
    l[:, -1, -1, 0] = 0
    out = pa._merge_splits_pallas(o, jnp.asarray(m), jnp.asarray(l), q_len=Tq, num_heads=nH, dtype=jnp.float32,
                                  interpret=INTERPRET)
    G, rows = nH // nKV, Tq * (nH // nKV)
    ref = pa._merge_splits(o, jnp.asarray(m), jnp.asarray(l))[:, :, :rows]  # [B, nKV, rows (t, g), D]
    ref = ref.reshape(B, nKV, Tq, G, D).transpose(0, 2, 1, 3, 4).reshape(B * Tq * nH, D)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(out).reshape(B, Tq, nKV, G, D)[-1, 0, -1, 0] == 0)


@pytest.mark.parametrize("splits", [None, 2])
def test_all_padding_batch_is_zero(splits):
    """No row sees a key: zeros, never NaN, also where the splits' merge finds no softmax mass at all."""
    c = build_case(5, Tq=2, nH=2, nKV=1, D=16, page_size=8, starts=[0, 0], n_valid=[0, 0])
    c.k_pages[:] = np.nan
    c.v_pages[:] = np.nan
    for out in (run_kernel(c, k_splits=splits), run_reference(c)):
        assert np.all(np.asarray(out) == 0)


def test_attend_paged_dispatch():
    c = build_case(6, Tq=1, nH=2, nKV=1, D=16, page_size=8, starts=[9, 3], n_valid=[1, 1], window=5)
    ref = np.asarray(run_reference(c))
    kw = dict(window=c.window, ring_pages=c.ring_pages)
    np.testing.assert_array_equal(np.asarray(pa.attend_paged(*c.args(), impl="xla", **kw)), ref)
    if jax.default_backend() != "gpu":
        np.testing.assert_array_equal(np.asarray(pa.attend_paged(*c.args(), impl="auto", **kw)), ref)
    with pytest.raises(ValueError):
        pa.attend_paged(*c.args(), impl="cuda", **kw)


def test_kernel_config_defaults():
    # E2B sliding, verify k=4: 5 * 8 = 40 rows in 16-row blocks (the window's keys are few, so re-reading them per
    # block is cheap and the programs triple); a prefill chunk's rows keep large blocks.
    cfg = pa.kernel_config((2, 5, 8, 256), (1, 100, 16, 256), (2, 34), window=512, ring_pages=34)
    assert (cfg.block_rows, cfg.block_k) == (16, 64) and cfg.k_splits >= 4
    assert pa.kernel_config((1, 256, 8, 256), (1, 100, 16, 256), (1, 34), window=512,
                            ring_pages=34).block_rows == 64
    # E2B sliding, decode: a split for each of the (at most 9) 64-key blocks a 512-token window touches; full
    # attention over as many keys keeps two blocks a split.
    for batch in (2, 16):
        cfg = pa.kernel_config((batch, 1, 8, 256), (1, 100, 16, 256), (batch, 34), window=512, ring_pages=34)
        assert (cfg.block_rows, cfg.block_k, cfg.k_splits) == (16, 64, 9)
    assert pa.kernel_config((2, 1, 8, 256), (1, 100, 16, 256), (2, 32)).k_splits == 4
    assert pa.kernel_config((2, 1, 8, 512), (1, 9000, 16, 512), (2, 128)).k_splits == 32
    # E2B full, verify: 40 rows in three 16-row blocks, splits counted per sequence as decode's are (B = 16: 17,
    # the fastest tiling measured: docs/decisions/0005-paged-attention-tiling.md); at B = 2 the merge's reads cap
    # them (42 splits of the 4096 keys).
    cfg = pa.kernel_config((2, 5, 8, 512), (1, 9000, 16, 512), (2, 256))
    assert (cfg.block_rows, cfg.block_k, cfg.k_splits) == (16, 32, 42)
    cfg = pa.kernel_config((16, 5, 8, 512), (1, 9000, 16, 512), (16, 256))
    assert (cfg.block_rows, cfg.block_k, cfg.k_splits, cfg.num_warps, cfg.num_stages) == (16, 32, 17, 4, 2)
    decode = pa.kernel_config((16, 1, 8, 512), (1, 9000, 16, 512), (16, 256))
    assert decode.k_splits == cfg.k_splits
    # A 256-token prefill chunk after 2048 tokens: E2B's one KV head gives 64 (full) or 32 (sliding) row blocks,
    # so splits bring the programs up to one wave of the SMs (the fastest tilings measured: 2 and 4 splits); 31B's
    # four KV heads fill the SMs with row blocks alone.
    prefill = pa.kernel_config((1, 256, 8, 512), (1, 577, 16, 512), (1, 144), budget=HOPPER)
    assert (prefill.block_rows, prefill.k_splits, prefill.num_warps) == (32, 2, 8)
    prefill = pa.kernel_config((1, 256, 8, 256), (1, 197, 16, 256), (1, 49), window=512, ring_pages=49,
                               budget=HOPPER)
    assert (prefill.block_rows, prefill.k_splits) == (64, 4)
    assert pa.kernel_config((1, 256, 32, 512), (4, 577, 16, 512), (1, 144), budget=HOPPER).k_splits == 1
    # Batch 1, long full context: the key range is split to fill the GPU; batch 16 x 16 heads needs no split.
    assert pa.kernel_config((1, 1, 8, 512), (1, 600, 64, 512), (1, 512)).k_splits > 8
    assert pa.kernel_config((16, 1, 32, 256), (16, 600, 64, 256), (16, 9), window=1024,
                            ring_pages=17).k_splits <= 2
    assert not pa.kernel_supported((1, 1, 8, 96), (1, 10, 16, 96))


# Attention geometries that run through the kernel: (name, query heads, KV heads, head dim). Targets' sliding and
# full layers (benchmarks/common.py), their assistants' layers (query heads of the drafter over the target's KV
# heads), the trained demo pair (gemma4_mtp_jax/train/demo_recipe.py) and the random test pair (demo.py).
_DEMO = TARGET_CONFIG  # the assistant has half the target's query heads (train/arch.py's default for PLE targets)
GEOMETRIES = [
    ("e2b_sliding", 8, 1, 256), ("e2b_full", 8, 1, 512), ("e2b_assistant_sliding", 4, 1, 256),
    ("e2b_assistant_full", 4, 1, 512),
    ("e4b_sliding", 8, 2, 256), ("e4b_full", 8, 2, 512), ("e4b_assistant_sliding", 4, 2, 256),
    ("e4b_assistant_full", 4, 2, 512),
    ("26b_sliding", 16, 8, 256), ("26b_full", 16, 2, 512), ("26b_assistant_sliding", 16, 8, 256),
    ("26b_assistant_full", 16, 2, 512),
    ("31b_sliding", 32, 16, 256), ("31b_full", 32, 4, 512), ("31b_assistant_sliding", 32, 16, 256),
    ("31b_assistant_full", 32, 4, 512),
    ("demo_sliding", _DEMO["num_attention_heads"], _DEMO["num_key_value_heads"], _DEMO["head_dim"]),
    ("demo_full", _DEMO["num_attention_heads"], _DEMO["num_key_value_heads"], _DEMO["global_head_dim"]),
    ("demo_assistant_sliding", _DEMO["num_attention_heads"] // 2, _DEMO["num_key_value_heads"], _DEMO["head_dim"]),
    ("demo_assistant_full", _DEMO["num_attention_heads"] // 2, _DEMO["num_key_value_heads"], _DEMO["global_head_dim"]),
    ("random_pair_sliding", 4, 1, 16), ("random_pair_full", 4, 1, 32), ("random_pair_assistant_sliding", 2, 1, 16),
    ("random_pair_assistant_full", 2, 1, 32),
]
# Generic shapes: every power-of-two head dim 16..512 with 1..16 query heads per KV head.
GEOMETRIES += [(f"d{D}_g{G}", G, 1, D) for D, G in itertools.product([16, 32, 64, 128, 256, 512], [1, 2, 4, 8, 16])]
Q_ROWS = [1, 2, 3, 5, 9, 17, 33, 64, 128, 256, 512]  # decode, verify (k + 1), drafter rows, prefill chunks
PAGE_SIZES = [8, 16, 32, 64]


def _check_plan(cfg, rows, D, itemsize, budget):
    assert cfg is not None
    assert cfg.block_rows >= 16 and cfg.block_rows & (cfg.block_rows - 1) == 0
    assert cfg.block_k >= 16 and cfg.block_k & (cfg.block_k - 1) == 0
    smem = pa.smem_bytes(cfg.block_rows, cfg.block_k, D, cfg.num_stages, itemsize)
    assert smem <= budget.smem_per_block, (smem, budget)
    assert cfg.block_rows * (D + cfg.block_k) <= 128 * 32 * cfg.num_warps  # float32 registers per thread
    assert 1 <= cfg.k_splits <= 64 and cfg.num_stages >= 1


@pytest.mark.parametrize("budget", [HOPPER, GpuBudget(163 * 1024, 108, "A100"), GpuBudget(99 * 1024, 84, "L40")])
def test_planner_fits_every_geometry(budget):
    """The planner's tiling fits the device for every geometry x query rows x page size x dtype: no shape the
    engine builds can ask for more shared memory than the GPU has (the first GPU run failed on the demo pair's
    256-token prefill chunk: 1024 query rows x 64 keys in float32, 332 KiB)."""
    n = 0
    for (_, nH, nKV, D), Tq, ps, itemsize, window in itertools.product(GEOMETRIES, Q_ROWS, PAGE_SIZES, [2, 4],
                                                                        [None, 512]):
        B = 2
        q_shape, pages_shape = (B, Tq, nH, D), (nKV, 4096, ps, D)
        width = 8192 // ps
        cfg = pa.kernel_config(q_shape, pages_shape, (B, width), itemsize=itemsize, window=window,
                               ring_pages=None if window is None else -(-(window + Tq) // ps), budget=budget)
        _check_plan(cfg, Tq * nH // nKV, D, itemsize, budget)
        n += 1
    assert n == len(GEOMETRIES) * len(Q_ROWS) * len(PAGE_SIZES) * 4


def test_planner_shrinks_then_refuses():
    """The random test pair's prefill chunk in float32 shrinks from 1024 rows to a tile that fits; a budget smaller than
    the smallest tile gives None; explicit tiling arguments are kept."""
    demo = pa.kernel_config((1, 256, 4, 16), (1, 600, 16, 16), (1, 20), itemsize=4)
    assert demo.block_rows < 1024 and pa.smem_bytes(demo.block_rows, demo.block_k, 16, demo.num_stages, 4) <= \
        HOPPER.smem_per_block
    tiny = GpuBudget(8 * 1024, 132)
    assert pa.kernel_config((1, 5, 8, 512), (1, 600, 16, 512), (1, 40), itemsize=4, budget=tiny) is None
    kept = pa.kernel_config((1, 5, 8, 256), (1, 600, 16, 256), (1, 40), block_rows=16, block_k=32, num_stages=1)
    assert (kept.block_rows, kept.block_k, kept.num_stages) == (16, 32, 1)
    with pytest.raises(ValueError, match="no kernel tiling fits"):
        c = build_case(7, Tq=1, nH=2, nKV=1, D=16, page_size=8, starts=[9], n_valid=[1])
        pa.paged_attention(*c.args(), interpret=INTERPRET, block_rows=1 << 20)


def test_auto_falls_back_to_xla_when_no_tiling_fits(monkeypatch, caplog):
    """On a GPU whose budget no tiling fits, attend_paged(impl="auto") runs the XLA path and says so once."""
    c = build_case(8, Tq=2, nH=4, nKV=1, D=32, page_size=8, starts=[12, 3], n_valid=[2, 1], window=7)
    kw = dict(window=c.window, ring_pages=c.ring_pages)
    want = np.asarray(run_reference(c))
    monkeypatch.setattr(pa, "kernels_chosen", lambda: True)
    monkeypatch.setattr(pa, "default_budget", lambda: GpuBudget(1024, 132, "tiny"))
    pa._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger=pa.__name__):
        for _ in range(2):
            np.testing.assert_array_equal(np.asarray(pa.attend_paged(*c.args(), impl="auto", **kw)), want)
    assert sum("XLA path" in r.getMessage() for r in caplog.records) == 1


# ----------------------------------------------------------------------------------------------------------
# Q-only layers: the raw projection q_norm'ed and roped by the kernel as it loads the query rows
# ----------------------------------------------------------------------------------------------------------


EPS = 1e-6


def prep_inputs(c: Case, seed: int, dtype, rope_shift: int = 1):
    """A raw projection (c.q's shape, not unit scale), a q_norm weight, a proportional-RoPE inverse frequency (zeros
    past the rotated pairs) and RoPE positions apart from the mask positions (the assistant ropes at P and masks
    at P-1): (raw, q_norm, rope_positions, inv_freq, (cos, sin))."""
    rng = np.random.default_rng(seed)
    B, Tq, nH, D = c.q.shape
    raw = jnp.asarray(rng.standard_normal(c.q.shape) * 3 + 0.5, dtype)
    q_norm = jnp.asarray(rng.uniform(0.25, 2.0, D), dtype)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, D, 2) / D)
    inv_freq[3 * D // 8:] = 0  # a proportional RoPE rotates only the first pairs
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    rope_pos = jnp.asarray(np.where(c.q_positions >= 0, c.q_positions + rope_shift, -1), jnp.int32)
    return raw, q_norm, rope_pos, inv_freq, ai.rope_tables(rope_pos, inv_freq, dtype)


def prepared_queries(raw, q_norm, rope_pos, inv_freq):
    """attention_inputs' reference math (the model's `normed_and_roped`)."""
    return ai.normed_and_roped(raw, None, None, q_norm, None, rope_pos, inv_freq, eps=EPS)[0]


def run_kernel_prep(c: Case, raw, q_norm, tables, dtype, **kw):
    _, kp, vp, table, qpos = c.args(dtype)
    return pa.paged_attention(raw, kp, vp, table, qpos, window=c.window, ring_pages=c.ring_pages, q_norm=q_norm,
                              rope=tables, eps=EPS, interpret=INTERPRET, **kw)


def reference_on(c: Case, queries, dtype):
    _, kp, vp, table, qpos = c.args(dtype)
    return pa.paged_attention_reference(queries, kp, vp, table, qpos, window=c.window, ring_pages=c.ring_pages)


PREP_CASES = {
    # name: (Tq, nH, nKV, D, page_size, window, ring_pages, starts, extra kernel kwargs)
    "q1_gqa4_d64_full": (1, 8, 2, 64, 8, None, None, STARTS, {}),
    "q5_gqa4_d128_window": (5, 4, 1, 128, 8, 12, None, STARTS, {}),
    "q1_mha_d16_full": (1, 2, 2, 16, 16, None, None, STARTS, {}),
    "q5_gqa4_d32_ring": (5, 4, 1, 32, 8, 10, 2, [45, 29, 0, 3], {}),
    "q5_gqa2_d64_splits": (5, 4, 2, 64, 8, None, None, [70, 33, 0, 2], {"k_splits": 3}),
    "q5_gqa4_d16_window_splits_rowblocks": (5, 8, 2, 16, 8, 11, None, [61, 30, 0, 1],
                                            {"k_splits": 2, "block_rows": 16}),
}


@pytest.mark.parametrize("name", list(PREP_CASES))
def test_kernel_prepares_queries_f32(name):
    Tq, nH, nKV, D, ps, window, ring, starts, kw = PREP_CASES[name]
    c = build_case(7, Tq=Tq, nH=nH, nKV=nKV, D=D, page_size=ps, starts=starts, n_valid=_valid(Tq),
                   window=window, ring_pages=ring)
    raw, q_norm, rope_pos, inv_freq, tables = prep_inputs(c, 8, jnp.float32)
    out = run_kernel_prep(c, raw, q_norm, tables, jnp.float32, **kw)
    assert out.shape == c.q.shape and out.dtype == jnp.float32
    assert_padding_zero(c, out)
    ref = reference_on(c, prepared_queries(raw, q_norm, rope_pos, inv_freq), jnp.float32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_prepares_queries_as_the_model(dtype):
    """The reference with q_norm and RoPE's tables equals the reference on the model's queries, bit for bit."""
    c = build_case(9, Tq=5, nH=4, nKV=1, D=32, page_size=8, starts=STARTS, n_valid=_valid(5), window=10,
                   ring_pages=2)
    raw, q_norm, rope_pos, inv_freq, tables = prep_inputs(c, 10, dtype)
    _, kp, vp, table, qpos = c.args(dtype)
    out = pa.paged_attention_reference(raw, kp, vp, table, qpos, window=c.window, ring_pages=c.ring_pages,
                                       q_norm=q_norm, rope=tables, eps=EPS)
    queries = prepared_queries(raw, q_norm, rope_pos, inv_freq)
    np.testing.assert_array_equal(np.asarray(ai.normed_and_roped_queries(raw, q_norm, *tables, eps=EPS)),
                                  np.asarray(queries))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(reference_on(c, queries, dtype)))


@pytest.mark.parametrize("window,ring,splits", [(None, None, None), (None, None, 3), (10, 2, None)])
def test_kernel_prepares_queries_bf16(window, ring, splits):
    """bf16: against the reference on the model's queries, and against today's two kernels (attention_inputs, then
    the paged kernel on its queries)."""
    c = build_case(11, Tq=5, nH=8, nKV=2, D=64, page_size=8, starts=[44, 17, 0, 3], n_valid=_valid(5),
                   window=window, ring_pages=ring)
    raw, q_norm, rope_pos, inv_freq, tables = prep_inputs(c, 12, jnp.bfloat16)
    out = run_kernel_prep(c, raw, q_norm, tables, jnp.bfloat16, k_splits=splits)
    assert out.dtype == jnp.bfloat16
    assert_padding_zero(c, out)
    queries = prepared_queries(raw, q_norm, rope_pos, inv_freq)
    ref = reference_on(c, queries, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=3e-2)
    kernel_queries, _ = ai.attention_inputs(raw, None, None, q_norm, None, rope_pos, inv_freq, eps=EPS,
                                            interpret=INTERPRET)
    two_kernels = pa.paged_attention(kernel_queries, *c.args(jnp.bfloat16)[1:], window=c.window,
                                     ring_pages=c.ring_pages, k_splits=splits, interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(two_kernels, np.float32), atol=3e-2,
                               rtol=3e-2)


def test_prep_argument_checks():
    c = build_case(13, Tq=2, nH=2, nKV=1, D=16, page_size=8, starts=[9, 3], n_valid=[2, 1])
    raw, q_norm, _, _, (cos, sin) = prep_inputs(c, 14, jnp.float32)
    args = c.args()[1:]
    for fn in (functools.partial(pa.paged_attention, interpret=INTERPRET), pa.paged_attention_reference):
        with pytest.raises(ValueError, match="q_norm"):
            fn(raw, *args, q_norm=q_norm[:8], rope=(cos, sin), eps=EPS)
        with pytest.raises(ValueError, match="rope"):
            fn(raw, *args, q_norm=q_norm, rope=(cos, sin[:, :1]), eps=EPS)
        with pytest.raises(ValueError, match="rope"):
            fn(raw, *args, q_norm=q_norm, rope=(cos[..., :4], sin[..., :4]), eps=EPS)
        with pytest.raises(ValueError, match="q_norm and rope"):
            fn(raw, *args, q_norm=q_norm, eps=EPS)
        with pytest.raises(ValueError, match="q_norm and rope"):
            fn(raw, *args, rope=(cos, sin), eps=EPS)
        with pytest.raises(ValueError, match="eps"):
            fn(raw, *args, q_norm=q_norm, rope=(cos, sin))


@pytest.fixture
def interpreted_kernels():
    """`attend_paged(impl="pallas")` through the kernel, in interpret mode off the GPU: what a program traced with
    the Pallas kernels does (`device_budget.pallas_kernels`)."""
    from gemma4_mtp_jax.kernels.device_budget import pallas_kernels

    with pallas_kernels():
        yield


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_draft_view_ropes_at_P_and_masks_at_P_minus_1(interpreted_kernels, dtype):
    """PagedDraftKV, kernel path: prepare hands the projections back, attend has the kernel rope them at the
    projections' positions P = lengths while masking at P-1 with window W+1; as today's path (queries prepared,
    then attended), which the "xla" view runs."""
    from gemma4_mtp_jax.model.config import SLIDING
    from gemma4_mtp_jax.model.kv_state import PagedDraftKV
    from gemma4_mtp_jax.model.attention import Projections

    W = 9
    lengths = np.array([41, 14, 0, 7], np.int32)
    c = build_case(15, Tq=1, nH=4, nKV=2, D=32, page_size=4, starts=list(lengths - 1), n_valid=[1, 1, 0, 1],
                   window=W + 1, ring_pages=4)
    raw, q_norm, _, inv_freq, _ = prep_inputs(c, 16, dtype)
    _, kp, vp, table, _ = c.args(dtype)
    p = Projections(raw, None, None, q_norm, None, jnp.asarray(lengths)[:, None], inv_freq, EPS)
    outs = {}
    for impl in ("pallas", "xla"):
        view = PagedDraftKV({5: (kp, vp)}, {SLIDING: table}, jnp.asarray(lengths), {0: 5}, {0: SLIDING}, 4, impl)
        q, view = view.prepare(0, p)
        assert isinstance(q, Projections) == (impl == "pallas")
        outs[impl] = np.asarray(view.attend(0, q, p.positions, W), np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(outs["pallas"], outs["xla"], atol=tol, rtol=tol)
    assert np.all(outs["pallas"][2] == 0)


def test_target_view_q_only_layer(interpreted_kernels):
    """PagedKV, kernel path: a Q-only layer (k None) gets its projections back and the kernel norms and ropes them
    at the layer's positions; an owning layer still gets queries."""
    from gemma4_mtp_jax.model.config import FULL
    from gemma4_mtp_jax.model.kv_state import PagedKV
    from gemma4_mtp_jax.model.attention import Projections

    c = build_case(17, Tq=5, nH=4, nKV=1, D=32, page_size=8, starts=STARTS, n_valid=_valid(5))
    raw, q_norm, _, inv_freq, _ = prep_inputs(c, 18, jnp.float32)
    _, kp, vp, table, qpos = c.args()
    p = Projections(raw, None, None, q_norm, None, qpos, inv_freq, EPS)
    outs = {}
    for impl in ("pallas", "xla"):
        view = PagedKV({3: (kp, vp)}, {FULL: table}, qpos, {3: FULL, 7: FULL}, 8, None, impl)
        q, view = view.prepare(7, p)
        assert isinstance(q, Projections) == (impl == "pallas")
        outs[impl] = np.asarray(view.attend(3, q, qpos, None))
    np.testing.assert_allclose(outs["pallas"], outs["xla"], atol=1e-5, rtol=1e-5)


TP_CHILD = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
import test_paged_attention as t
from gemma4_mtp_jax.model.config import SLIDING
from gemma4_mtp_jax.kernels.device_budget import pallas_kernels
from gemma4_mtp_jax.model.kv_state import PagedDraftKV
from gemma4_mtp_jax.model.attention import Projections

W, lengths = 9, np.array([41, 14, 0, 7], np.int32)
c = t.build_case(19, Tq=1, nH=4, nKV=2, D=32, page_size=4, starts=list(lengths - 1), n_valid=[1, 1, 0, 1],
                 window=W + 1, ring_pages=4)
raw, q_norm, _, inv_freq, _ = t.prep_inputs(c, 20, jnp.float32)
_, kp, vp, table, _ = c.args()
p = Projections(raw, None, None, q_norm, None, jnp.asarray(lengths)[:, None], inv_freq, t.EPS)
outs = {}
for impl in ("pallas", "xla"):
    def f(kp, vp, table, p):
        view = PagedDraftKV({5: (kp, vp)}, {SLIDING: table}, jnp.asarray(lengths), {0: 5}, {0: SLIDING}, 4, impl)
        q, view = view.prepare(0, p)
        assert isinstance(q, Projections) == (impl == "pallas")
        return view.attend(0, q, p.positions, W)
    with jax.set_mesh(Mesh(np.array(jax.devices()[:2]), ("tp",))), pallas_kernels():  # the kernel, interpreted
        text = jax.jit(f).lower(kp, vp, table, p).as_text()
        assert "shard_map" in text or "sdy.manual_computation" in text, "attention not split by heads"
        outs[impl] = np.asarray(jax.jit(f)(kp, vp, table, p))
np.testing.assert_allclose(outs["pallas"], outs["xla"], atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_draft_view_kernel_path_under_tensor_parallelism():
    """Under a 2-way "tp" mesh (CPU devices, in a child process) `head_parallel` hands each device its heads of
    the raw q and the whole q_norm weight and RoPE tables: the same result as today's path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip(),
               PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", TP_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_auto_fallback_prepares_queries_in_xla(monkeypatch):
    """Where no kernel tiling fits, attend_paged(impl="auto") with raw queries norms and ropes them in XLA (the
    model's math, bit for bit) and attends through the reference."""
    c = build_case(21, Tq=2, nH=4, nKV=1, D=32, page_size=8, starts=[12, 3], n_valid=[2, 1], window=7)
    raw, q_norm, rope_pos, inv_freq, (cos, sin) = prep_inputs(c, 22, jnp.float32)
    want = np.asarray(reference_on(c, prepared_queries(raw, q_norm, rope_pos, inv_freq), jnp.float32))
    monkeypatch.setattr(pa, "kernels_chosen", lambda: True)
    monkeypatch.setattr(pa, "default_budget", lambda: GpuBudget(1024, 132, "tiny"))
    out = pa.attend_paged(raw, *c.args()[1:], q_norm, cos, sin, window=c.window, ring_pages=c.ring_pages, eps=EPS,
                          impl="auto")
    np.testing.assert_array_equal(np.asarray(out), want)
