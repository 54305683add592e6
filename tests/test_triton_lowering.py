"""Every Pallas GPU kernel lowers to Triton for CUDA at the real Gemma 4 shapes, on any machine, CPU included.

`jax.export` lowers for a platform the machine lacks. Pallas' Triton lowering then runs in Python, as it would on
the GPU, and rejects what Triton cannot express: an op without a lowering rule, a block that is not a power of two,
an index it cannot turn into pointers. So CI catches those without a GPU. What only the GPU can check (Triton's own
compilation: registers, shared memory; and the numbers) stays with BUILD.md's GPU suite. The tilings are the
planners', so each case lowers what the engine would run on an H200 at that shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

from gemma4_mtp_jax.kernels import attention_inputs as ai
from gemma4_mtp_jax.kernels import centroid_head as ch
from gemma4_mtp_jax.kernels import device_budget as db
from gemma4_mtp_jax.kernels import feed_forward as ff
from gemma4_mtp_jax.kernels import grouped_matmul as gm
from gemma4_mtp_jax.kernels import paged_attention as pa
from gemma4_mtp_jax.kernels import split_k as sk

TRITON = "__gpu$xla.gpu.triton"  # the custom call a Pallas kernel lowered by Triton becomes
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32


def _spec(shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


def lowered_for_cuda(fn, *args) -> str:
    """The StableHLO of `fn` lowered for CUDA (its Pallas kernels through Triton's lowering), as text."""
    exp = export.export(jax.jit(fn), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    return exp.mlir_module()


def triton_calls(text: str) -> int:
    return text.count(f"@{TRITON}(")


def test_the_device_compiled_for_is_the_default_device(monkeypatch):
    """Kernel choices and tilings follow `jax.default_device`, so that under a compile-only GPU device (benchmarks/
    common.py compile_only_device, which CI's CPU install cannot make) a machine without a GPU traces the GPU's
    programs. Here the backend's first device is a stand-in H200 and the default device the suite's own (the CPU,
    or the GPU where BUILD.md's GPU suite runs, which has no CPU backend)."""
    real = jax.devices()[0]
    h200 = type("Device", (), dict(platform="gpu", compute_capability="9.0", core_count=132, device_kind="H200"))
    real_devices = jax.devices
    monkeypatch.setattr(jax, "devices", lambda backend=None: real_devices(backend) if backend else [h200])
    assert db.target_device() is h200 and db.on_gpu()
    assert db.default_budget() == db.GpuBudget(227 * 1024, 132, "H200")
    with jax.default_device(real):
        assert db.target_device() is real and db.on_gpu() == (real.platform != "cpu")
        # off the GPU: the H200's budget
        assert db.default_budget() == (db.budget_of(real) if db.on_gpu() else db.HOPPER)
    with jax.default_device(real.platform):
        assert db.target_device() is real
    a100 = type("Device", (), dict(platform="cuda", compute_capability="8.0", core_count=108, device_kind="A100"))
    assert db.is_gpu(a100) and db.budget_of(a100) == db.GpuBudget(163 * 1024, 108, "A100")


# (name, query heads, KV heads, head dim, sliding window) of the targets' attention layers.
ATTENTION = [("e2b_sliding", 8, 1, 256, 512), ("e2b_full", 8, 1, 512, None), ("31b_sliding", 32, 16, 256, 1024),
             ("31b_full", 32, 4, 512, None)]
# (batch, query tokens, context): decode, a verify step of k = 4, a drafter's k rows, a 256-token prefill chunk.
ATTENTION_CALLS = [(2, 1, 4096), (16, 5, 4096), (16, 4, 4096), (1, 256, 2048)]


@pytest.mark.parametrize("B,Tq,ctx", ATTENTION_CALLS, ids=lambda v: str(v))
@pytest.mark.parametrize("name,nH,nKV,D,window", ATTENTION, ids=[a[0] for a in ATTENTION])
def test_paged_attention_lowers(name, nH, nKV, D, window, B, Tq, ctx):
    page_size = 16
    width = ctx // page_size
    ring = None if window is None else -(-(window + Tq + 1) // page_size)
    pages = _spec((nKV, B * (ring or width) + 1, page_size, D))
    args = (_spec((B, Tq, nH, D)), pages, pages, _spec((B, ring or width), I32), _spec((B, Tq), I32))
    cfg = pa.kernel_config(args[0].shape, pages.shape, args[3].shape, window=window, ring_pages=ring)
    assert cfg is not None, "the planner finds no tiling for a real shape"
    text = lowered_for_cuda(lambda *a: pa.paged_attention(*a, window=window, ring_pages=ring), *args)
    assert triton_calls(text) >= 1
    assert f"paged_attention_r{cfg.block_rows}_k{cfg.block_k}_s{cfg.k_splits}" in text


@pytest.mark.parametrize("B,Tq", [(2, 1), (16, 1), (2, 5), (16, 5)], ids=lambda v: str(v))
@pytest.mark.parametrize("name,nH,nKV,D,window", ATTENTION[:2], ids=[a[0] for a in ATTENTION[:2]])
def test_paged_attention_with_query_prep_lowers(name, nH, nKV, D, window, B, Tq):
    """E2B's Q-only layers (its KV-shared target layers, the assistant's): the kernel q_norms and ropes the raw
    projection (q_norm [D], RoPE's cos / sin [B, Tq, D/2]) as it loads the query rows."""
    page_size, ctx = 16, 4096
    width = ctx // page_size
    ring = None if window is None else -(-(window + Tq + 1) // page_size)
    pages = _spec((nKV, B * (ring or width) + 1, page_size, D))
    args = (_spec((B, Tq, nH, D)), pages, pages, _spec((B, ring or width), I32), _spec((B, Tq), I32), _spec((D,)),
            _spec((B, Tq, D // 2)), _spec((B, Tq, D // 2)))
    cfg = pa.kernel_config(args[0].shape, pages.shape, args[3].shape, window=window, ring_pages=ring)
    text = lowered_for_cuda(lambda q, kp, vp, t, pos, w, cos, sin: pa.paged_attention(
        q, kp, vp, t, pos, window=window, ring_pages=ring, q_norm=w, rope=(cos, sin), eps=1e-6), *args)
    assert triton_calls(text) >= 1
    assert f"paged_attention_r{cfg.block_rows}_k{cfg.block_k}_s{cfg.k_splits}_qrope" in text


@pytest.mark.parametrize("T", [1, 2, 16])
def test_centroid_head_lowers(T):
    """E2B's assistant head: 2048 centroids, the 32 best kept, 128 rows each, 256 wide."""
    Ha, V, C, K = 256, 262144, 2048, 32
    args = (_spec((T, Ha)), _spec((T, C)), _spec((V, Ha)), _spec((V,), I32))
    assert ch.pallas_supported(*args[:3])
    for fn in (ch.centroid_argmax, ch.centroid_sparse_logits):
        assert triton_calls(lowered_for_cuda(lambda *a, fn=fn: fn(*a, top_k=K), *args)) >= 1


@pytest.mark.parametrize("B", [2, 16])
def test_feed_forward_block_lowers(B):
    """The E2B assistant's block (H = 256, I = 2048) after o_proj's partial products, at its planned grid."""
    H, I = 256, 2048
    parts = ff.input_parts(H * 4)  # o_proj's contraction: 4 query heads x 256
    splits = 32

    def block(p, res, wpa, wpf, gate, up, down):
        x, f = ff.feed_forward_block(sk.SplitSum(p, BF16), res, wpa, wpf, gate, up, down, eps=1e-6, splits=splits)
        return x, f.partials

    args = (_spec((parts, B, 1, H), F32), _spec((B, 1, H)), _spec((H,)), _spec((H,)), _spec((I, H)),
            _spec((I, H)), _spec((H, I)))
    assert triton_calls(lowered_for_cuda(block, *args)) == 1


@pytest.mark.parametrize("rows,S", [(2, 8), (16, 16), (80, 4)])
def test_split_k_kernels_lower(rows, S):
    """E2B's residual kernel after a split o_proj / down_proj (N = 1536, both norms and the layer scalar), and the
    per-layer-input gate (N = 256)."""
    N, L = 1536, 35

    def add_normed(p, res, w, w2, scale):
        return sk.add_normed(sk.SplitSum(p, BF16), res, w, eps=1e-6, next_weight=w2, scale=scale, impl="pallas")

    text = lowered_for_cuda(add_normed, _spec((S, rows, 1, N), F32), _spec((rows, 1, N)), _spec((N,)),
                            _spec((N,)), _spec((1,), F32))
    assert triton_calls(text) == 1

    def gelu_gate(p, mult):
        return sk.gelu_gate(sk.SplitSum(p, BF16), mult, jnp.int32(3), impl="pallas")

    assert triton_calls(lowered_for_cuda(gelu_gate, _spec((S, rows, 1, 256), F32), _spec((L, rows, 1, 256)))) == 1


@pytest.mark.parametrize("mode", ["q", "k", "kv"])
@pytest.mark.parametrize("B,T", [(2, 1), (16, 5), (1, 256)])
def test_attention_inputs_lower(mode, B, T):
    """E2B's full layer (D = 512, one KV head): queries only (a layer reading another's K/V, the assistant), K
    with V = K (attention_k_eq_v), K and V; written into the pages."""
    nH, nKV, D, pages = 8, 1, 512, 600
    q, kv, norm = _spec((B, T, nH, D)), _spec((B, T, nKV, D)), _spec((D,))
    pos, inv_freq, pool = _spec((B, T), I32), _spec((D // 2,), F32), _spec((nKV, pages, 16, D))

    def inputs(q, k, v, q_norm, k_norm, positions, inv_freq, kp, vp, page, offset):
        if mode == "q":
            return ai.attention_inputs(q, None, None, q_norm, None, positions, inv_freq, eps=1e-6)
        return ai.attention_inputs(q, k, v if mode == "kv" else None, q_norm, k_norm, positions, inv_freq,
                                   eps=1e-6, pages=(kp, vp), page=page, offset=offset)

    text = lowered_for_cuda(inputs, q, kv, kv, norm, norm, pos, inv_freq, pool, pool, pos, pos)
    assert triton_calls(text) == 1


@pytest.mark.parametrize("glu", [True, False])
@pytest.mark.parametrize("M", [16, 128, 2048])
def test_grouped_matmul_lowers(M, glu):
    """26B-A4B's experts: 128 of them, gate|up [2 x 704, 2816] or down [2816, 704]; M = tokens x 8 routed."""
    E, H, I = 128, 2816, 704
    w = _spec((E, 2 * I, H)) if glu else _spec((E, H, I))
    x = _spec((M, H if glu else I))
    text = lowered_for_cuda(lambda x, w, s: gm.grouped_matmul(x, w, s, glu=glu), x, w, _spec((E,), I32))
    assert triton_calls(text) == 1


@pytest.mark.parametrize("glu", [True, False])
def test_grouped_matmul_fp8_lowers(glu):
    """26B-A4B's fp8 experts at decode (16 rows): the kernel loads float8_e4m3fn tiles (masked lanes a float8 zero:
    `triton_ops.load`), converts them to bf16 and scales each output column by its float32 scale."""
    E, H, I = 128, 2816, 704
    w = _spec((E, 2 * I, H) if glu else (E, H, I), jnp.float8_e4m3fn)
    x = _spec((16, H if glu else I))
    text = lowered_for_cuda(lambda x, w, s, scale: gm.grouped_matmul(x, w, s, glu=glu, scale=scale), x, w,
                            _spec((E,), I32), _spec(w.shape[:2], F32))
    assert triton_calls(text) == 1
