"""Grouped matmul for the MoE experts (gemma4_mtp_jax/kernels/grouped_matmul.py): the tiling of sorted rows, the
XLA reference against a per-row oracle, the Pallas kernel (compiled on the GPU, interpret mode elsewhere) against
the reference, and the whole routed-expert block against the dense every-expert computation on the tiny MoE
checkpoint's own expert weights.

Kernel cases fill the weights of every expert that no row was routed to with NaN: a finite output proves the
kernel never reads an expert it does not need (what makes a decode step cheap)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemma4_mtp_jax.kernels import grouped_matmul as gm
from gemma4_mtp_jax.kernels.device_budget import HOPPER
from testenv import INTERPRET


def _oracle(x, w, group_sizes, glu):
    """Each row times its own group's weights, in float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    g = np.repeat(np.arange(w.shape[0]), np.asarray(group_sizes))
    y = np.einsum("mi,moi->mo", x, w[g])
    if glu:
        h = w.shape[1] // 2
        gate = y[:, :h]
        y = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3))) * y[:, h:]
    return y


def _case(M, G, O, I, seed, skew=False):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, max(1, G // 4) if skew else G, size=M)
    sizes = np.bincount(ids, minlength=G).astype(np.int32)
    x = rng.normal(size=(M, I)).astype(np.float32)
    w = (rng.normal(size=(G, O, I)) / np.sqrt(I)).astype(np.float32)
    return x, w, sizes


# row_tiles runs inside the MoE block's jitted program; jitted here too, each example compiles one program for its
# shapes (~0.2 s) instead of dispatching (and compiling) a dozen ops one by one (~1 s).
_row_tiles = jax.jit(gm.row_tiles, static_argnums=(1, 2))


@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12), block=st.sampled_from([1, 4, 16]))
@settings(max_examples=30, deadline=None)  # each example compiles row_tiles for its shapes: 30 keep it ~6 s
def test_row_tiles_cover_every_row_once_within_its_group(sizes, block):
    sizes = np.asarray(sizes, np.int32)
    M = int(sizes.sum())
    tiles = _row_tiles(jnp.asarray(sizes), M, block)
    group, start, end = (np.asarray(a) for a in (tiles.group, tiles.start, tiles.end))
    assert len(group) == gm.max_tiles(M, len(sizes), block)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    covered = np.zeros(M, int)
    for g, s, e in zip(group, start, end):
        assert 0 <= e - s <= block
        if e > s:
            assert bounds[g] <= s and e <= bounds[g + 1], (g, s, e)
            covered[s:e] += 1
    assert (covered == 1).all()


def test_max_tiles_is_reached_when_every_group_has_one_row_past_a_full_tile():
    G, block = 5, 4
    sizes = jnp.full((G,), block + 1, jnp.int32)
    M = G * (block + 1)
    tiles = gm.row_tiles(sizes, M, block)
    assert int(jnp.sum(tiles.end > tiles.start)) == gm.max_tiles(M, G, block) == 2 * G


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("M,G,O,I,skew", [(10, 4, 48, 32, False), (37, 8, 20, 24, True), (16, 128, 64, 64, False),
                                          (300, 6, 32, 160, False), (3, 16, 40, 40, False)])
def test_reference_matches_per_row_oracle(M, G, O, I, skew, glu):
    x, w, sizes = _case(M, G, O, I, seed=M, skew=skew)
    got = gm.grouped_matmul_reference(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), glu=glu)
    np.testing.assert_allclose(np.asarray(got), _oracle(x, w, sizes, glu), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("M,G,O,I,skew", [(10, 4, 48, 32, False), (37, 8, 20, 24, True), (16, 128, 64, 64, False),
                                          (300, 6, 32, 160, False), (3, 16, 40, 40, False)])
def test_kernel_matches_reference_and_never_reads_unrouted_experts(M, G, O, I, skew, glu):
    x, w, sizes = _case(M, G, O, I, seed=M + 1, skew=skew)
    w_poisoned = w.copy()
    w_poisoned[sizes == 0] = np.nan
    got = gm.grouped_matmul(jnp.asarray(x), jnp.asarray(w_poisoned), jnp.asarray(sizes), glu=glu,
                            interpret=INTERPRET)
    want = gm.grouped_matmul_reference(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), glu=glu)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("glu", [False, True])
def test_fp8_experts_scale_each_output_column_by_its_group(glu):
    """fp8 experts (float8_e4m3fn weights, a float32 scale per expert and output row): the reference equals the
    per-row oracle on the weights they stand for (q * scale; glu: gate and up each by their own); the kernel (with
    unrouted experts' weights and scales NaN) equals the reference, in float32 and in bfloat16."""
    from gemma4_mtp_jax.weights.quantize import dequantize, quantize_fp8

    x, w, sizes = _case(37, 8, 20, 24, seed=11, skew=True)
    w = w * np.linspace(0.2, 4.0, 8 * 20).reshape(8, 20, 1)  # distinct scales per expert and row
    q, scale = (np.asarray(a) for a in quantize_fp8(w))
    want = _oracle(x, dequantize(q, scale, np.float64), sizes, glu)
    ref = gm.grouped_matmul_reference(jnp.asarray(x), jnp.asarray(q), jnp.asarray(sizes), glu=glu,
                                      scale=jnp.asarray(scale))
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5)
    q_poisoned, s_poisoned = q.copy(), scale.copy()
    q_poisoned[sizes == 0], s_poisoned[sizes == 0] = np.nan, np.nan
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        xd = jnp.asarray(x, dtype)
        got = gm.grouped_matmul(xd, jnp.asarray(q_poisoned), jnp.asarray(sizes), glu=glu,
                                scale=jnp.asarray(s_poisoned), interpret=INTERPRET)
        assert got.dtype == dtype and np.isfinite(np.asarray(got, np.float32)).all()
        ref = gm.grouped_matmul_reference(xd, jnp.asarray(q), jnp.asarray(sizes), glu=glu, scale=jnp.asarray(scale))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="scale must be"):
        gm.grouped_matmul_reference(jnp.asarray(x), jnp.asarray(q), jnp.asarray(sizes), scale=jnp.asarray(scale.T))


def test_kernel_bf16_within_rounding_of_float32_oracle():
    x, w, sizes = _case(40, 8, 64, 96, seed=3)
    got = gm.grouped_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(sizes),
                            glu=True, interpret=INTERPRET)
    assert got.dtype == jnp.bfloat16
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    wb = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), _oracle(xb, wb, sizes, True), rtol=2e-2, atol=2e-2)


def test_kernel_block_rows_larger_than_every_group_and_all_rows_in_one_group():
    x, w, sizes = _case(33, 4, 32, 48, seed=5)
    one = np.zeros(4, np.int32)
    one[2] = 33
    for s in (sizes, one):
        for cfg in (gm.KernelConfig(16, 16, 16, 4, 2), gm.KernelConfig(64, 32, 32, 4, 2)):
            got = gm.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(s), interpret=INTERPRET, config=cfg)
            np.testing.assert_allclose(np.asarray(got), _oracle(x, w, s, False), rtol=1e-5, atol=1e-5)


def test_shape_errors_name_the_argument():
    x, w, sizes = _case(4, 2, 8, 6, seed=0)
    with pytest.raises(ValueError, match="x must be"):
        gm.grouped_matmul_reference(jnp.asarray(x[:, :5]), jnp.asarray(w), jnp.asarray(sizes))
    with pytest.raises(ValueError, match="group_sizes"):
        gm.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes[:1]), interpret=True)
    with pytest.raises(ValueError, match="glu"):
        gm.grouped_matmul_reference(jnp.asarray(x), jnp.asarray(w[:, :7]), jnp.asarray(sizes), glu=True)
    with pytest.raises(ValueError, match="impl"):
        gm.grouped_matmul_auto(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), impl="cuda")


def _dense_experts(x, weights, idx, gate_up, down):
    """Every expert on every token, weighted by a [N, E] routing matrix that is zero off the top-k (what the
    MoE block computed before the grouped path)."""
    E, two_im, _ = gate_up.shape
    im = two_im // 2
    combine = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32) * weights[..., None], axis=-2)  # [N, E]
    gu = jnp.einsum("nh,eoh->neo", x, gate_up, precision="highest")
    act = jax.nn.gelu(gu[..., :im], approximate=True) * gu[..., im:]
    out = jnp.einsum("nei,ehi->neh", act, down, precision="highest")
    return jnp.einsum("neh,ne->nh", out, combine, precision="highest")


def _expert_layers(params):
    """(gate_up, down) of every MoE layer of a target parameter tree."""
    found = []

    def walk(tree):
        if isinstance(tree, dict):
            if "experts" in tree and "gate_up_proj" in tree["experts"]:
                found.append((tree["experts"]["gate_up_proj"], tree["experts"]["down_proj"]))
            for v in tree.values():
                walk(v)

    walk(params)
    return found


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_routed_experts_equal_dense_experts_on_the_tiny_moe_checkpoint(tiny_ckpts, jax_models, impl):
    target = jax_models.target(tiny_ckpts["a26b"]["target"], "float32")
    layers = _expert_layers(target.params)
    assert layers, "the a26b tiny checkpoint has no MoE layer"
    E, _, H = layers[0][0].shape
    k = target.config.top_k_experts
    rng = np.random.default_rng(0)
    N = 19
    x = jnp.asarray(rng.normal(size=(N, H)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, size=k, replace=False) for _ in range(N)]), jnp.int32)
    weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(N, k)), jnp.float32), axis=-1)
    for gate_up, down in layers:
        got = gm.routed_experts(x, weights, idx, gate_up, down, impl=impl, interpret=INTERPRET)
        want = _dense_experts(x, weights, idx, gate_up, down)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("M", [8, 16, 80, 640, 16384])
@pytest.mark.parametrize("glu", [False, True])
def test_planned_tiles_fit_shared_memory_at_26b_shapes(M, glu):
    E, H, Im = 128, 2816, 704
    O, I = (2 * Im, H) if glu else (H, Im)
    cfg = gm.kernel_config(M, E, O, I, glu)
    per_stage = (cfg.block_rows + (2 if glu else 1) * cfg.block_out) * cfg.block_in * 2
    assert cfg.num_stages * per_stage <= HOPPER.smem_per_block
    assert cfg.block_rows == (16 if M <= 16 * E else 64)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_expert_offset_splits_the_experts_exactly(impl):
    """Expert parallelism: devices holding experts 0..E/2-1 and E/2..E-1 (expert_offset) each add only their own
    pairs; the two partial sums give the whole block (pairs routed elsewhere add exactly 0, never garbage)."""
    rng = np.random.default_rng(4)
    N, H, Im, E, k = 9, 24, 16, 8, 2
    x = jnp.asarray(rng.normal(size=(N, H)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, size=k, replace=False) for _ in range(N)]), jnp.int32)
    weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(N, k)), jnp.float32), axis=-1)
    gate_up = jnp.asarray(rng.normal(size=(E, 2 * Im, H)) / np.sqrt(H), jnp.float32)
    down = jnp.asarray(rng.normal(size=(E, H, Im)) / np.sqrt(Im), jnp.float32)
    run = functools.partial(gm.routed_experts, impl=impl, interpret=INTERPRET)
    whole = run(x, weights, idx, gate_up, down)
    half = E // 2
    parts = [run(x, weights, idx, gate_up[o:o + half], down[o:o + half], expert_offset=o) for o in (0, half)]
    assert all(np.isfinite(np.asarray(p)).all() for p in parts)
    np.testing.assert_allclose(np.asarray(parts[0] + parts[1]), np.asarray(whole), rtol=1e-5, atol=1e-5)
