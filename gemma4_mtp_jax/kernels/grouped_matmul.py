"""Grouped matmul for the MoE experts: each row is multiplied by the weights of its own group (expert) only.

Rows arrive sorted by group (`sort_by_group`), so group g owns rows [start_g, end_g). The weights keep the
checkpoint layout `w [G, O, I]` (rows are outputs), so nothing is transposed at load time or per step.

    out[r] = x[r] @ w[group(r)].T                               (plain)
    out[r] = gelu_tanh(x[r] @ w_gate.T) * (x[r] @ w_up.T)      (glu: w[g] = [w_gate; w_up], O = 2 * O')

fp8 experts (weights/quantize.py) come with `scale [G, O]` float32: w[g] ~ w_fp8[g] * scale[g][:, None]. The weight
is read as stored and converted to the activations' dtype (exact), the products are summed in float32, and each
output column is multiplied by its group's scale before the one rounding (glu: gate and up each by their own), as
kernels/split_k.py's `split_matmul` does for a projection.

Two implementations with the same contract:

- `grouped_matmul_reference`: plain XLA (`lax.ragged_dot_general` contracting the weights' last axis). CPU path
  and test oracle. On the GPU, XLA lowers it to a masked dense dot over every group: it reads all experts.
- `grouped_matmul`: a Pallas kernel (Triton lowering) over row tiles. `row_tiles` cuts each group's rows into
  tiles of `block_rows` (a group's last tile is partial); the static tile count is the most any routing can
  need, `(M + min(G, M) * (block_rows - 1)) // block_rows`, and unused tiles are empty. Grid (tile, output
  block): a program loads its tile's group id, streams that group's [block_out, I] weight rows through a loop
  over I with float32 accumulation, and writes its rows. Groups that own no row are never read, so a decode step
  reads only the experts its tokens were routed to. With `glu` a program holds two accumulators (gate rows and
  the matching up rows) and writes the activated product, so the [M, 2 O'] intermediate never exists.

Performance (H200, docs/decisions/0010-moe-grouped-matmul.md): the kernels stream the touched experts at the HBM
rate, 3.2-4.3 TB/s of expert weights at 1-16 tokens by trace (`python benchmarks/bench_moe.py --tokens 1 2 16
--profile`; a lone call's wall time measures its launch, not the kernel). 26B-A4B decode at B = 16 runs at the
roofline of the experts it touches (pipelined).

`grouped_matmul_auto` picks the kernel on GPU and the reference elsewhere; `routed_experts` is the whole MoE
expert block on top of it (sort the (token, expert) pairs, two grouped matmuls, weighted sum per token).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from gemma4_mtp_jax.kernels.device_budget import default_budget, kernels_chosen, kernels_interpreted
from gemma4_mtp_jax.kernels.triton_ops import compiler_params, dot, load, store

Array = jax.Array


def _gelu_tanh(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=True)


# ----------------------------------------------------------------------------------------------------------
# Routing: sort rows by group, cut groups into tiles
# ----------------------------------------------------------------------------------------------------------


def sort_by_group(group_ids: Array, num_groups: int) -> tuple[Array, Array]:
    """group_ids [M] int -> (order [M] int32, group_sizes [G] int32): `order` lists row indices grouped by id
    (stable, so rows of one group keep their order); `group_sizes[g]` counts rows with id g."""
    order = jnp.argsort(group_ids, stable=True).astype(jnp.int32)
    sizes = jnp.zeros((num_groups,), jnp.int32).at[group_ids].add(1)
    return order, sizes


def max_tiles(num_rows: int, num_groups: int, block_rows: int) -> int:
    """The most tiles any split of `num_rows` sorted rows into `num_groups` groups can need."""
    return (num_rows + min(num_groups, num_rows) * (block_rows - 1)) // block_rows


@dataclasses.dataclass(frozen=True)
class RowTiles:
    """Tile t covers sorted rows [start[t], end[t]) of group `group[t]`; empty tiles have start == end."""

    group: Array  # [T] int32
    start: Array  # [T] int32
    end: Array  # [T] int32


jax.tree_util.register_dataclass(RowTiles, data_fields=["group", "start", "end"], meta_fields=[])


def row_tiles(group_sizes: Array, num_rows: int, block_rows: int) -> RowTiles:
    """Cut each group's rows into tiles of at most `block_rows` rows (static count `max_tiles`)."""
    G = group_sizes.shape[0]
    T = max_tiles(num_rows, G, block_rows)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    per_group = (group_sizes + block_rows - 1) // block_rows
    tile_end = jnp.cumsum(per_group)  # exclusive end of each group's tiles in tile order
    t = jnp.arange(T, dtype=jnp.int32)
    # compare_all: one fused compare-and-count; the default binary search is a loop of ~2 log2(G) tiny kernels
    # plus copies of its carry, 32 kernels per MoE layer that took a fifth of 26B-A4B's decode step
    # (docs/decisions/0010-moe-grouped-matmul.md).
    g = jnp.minimum(jnp.searchsorted(tile_end, t, side="right", method="compare_all"), G - 1).astype(jnp.int32)
    local = t - (tile_end[g] - per_group[g])
    start = starts[g] + local * block_rows
    used = t < tile_end[-1]
    start = jnp.where(used, start, 0).astype(jnp.int32)
    end = jnp.where(used, jnp.minimum(start + block_rows, ends[g]), 0).astype(jnp.int32)
    return RowTiles(g, start, end)


# ----------------------------------------------------------------------------------------------------------
# Reference (plain XLA)
# ----------------------------------------------------------------------------------------------------------

_CONTRACT_LAST = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def row_groups(group_sizes: Array, num_rows: int) -> Array:
    """The group of each of `num_rows` sorted rows [M] int32 (rows past every group: the last group)."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(num_rows, dtype=ends.dtype)
    return jnp.minimum(jnp.searchsorted(ends, rows, side="right", method="compare_all"),
                       group_sizes.shape[0] - 1).astype(jnp.int32)


def grouped_matmul_reference(x: Array, w: Array, group_sizes: Array, *, glu: bool = False,
                             scale: Array | None = None) -> Array:
    """x [M, I] sorted by group, w [G, O, I], group_sizes [G] -> [M, O] (glu: [M, O/2]) in x.dtype; `scale`
    [G, O]: fp8 w's per-output-channel scales."""
    _check_shapes(x, w, group_sizes, glu, scale)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = lax.ragged_dot_general(x, w.astype(x.dtype), group_sizes, _CONTRACT_LAST, precision=precision,
                               preferred_element_type=jnp.float32)
    if scale is not None:
        y = y * jnp.take(scale.astype(jnp.float32), row_groups(group_sizes, x.shape[0]), axis=0)
    if glu:
        half = w.shape[1] // 2
        # Gate and up are rounded to the activation dtype first, as a separate matmul per projection would.
        gate, up = y[:, :half].astype(x.dtype), y[:, half:].astype(x.dtype)
        return _gelu_tanh(gate) * up
    return y.astype(x.dtype)


def _check_shapes(x, w, group_sizes, glu, scale=None):
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped matmul: x must be [M, I] and w [G, O, I], got x {x.shape}, w {w.shape}")
    if scale is not None and scale.shape != w.shape[:2]:
        raise ValueError(f"grouped matmul: scale must be [G, O] = {w.shape[:2]}, got {scale.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped matmul: group_sizes must be [{w.shape[0]}], got {group_sizes.shape}")
    if glu and w.shape[1] % 2:
        raise ValueError(f"grouped matmul: glu needs an even number of output rows, got w {w.shape}")


# ----------------------------------------------------------------------------------------------------------
# Pallas kernel (Triton lowering)
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_rows: int
    block_out: int
    block_in: int
    num_warps: int
    num_stages: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def kernel_config(num_rows: int, num_groups: int, out_features: int, in_features: int, glu: bool,
                  itemsize: int = 2) -> KernelConfig:
    """Tiles for a memory-bound grouped matmul: few rows per group at decode and verify (16, the smallest
    tensor-core tile), more for prefill; output blocks small enough that one expert's weights spread over many
    programs."""
    small = num_rows <= 16 * num_groups
    block_rows = 16 if small else 64
    # At decode ~16 experts are touched: 32-row glu blocks (gate + up = 64 weight rows) give ~350 programs, a few
    # per SM, where 64-row blocks would leave a third of the SMs a second program.
    block_out = (32 if small else 64) if glu else 128
    block_in = 128 if in_features >= 128 else max(16, _next_pow2(in_features))
    block_out = min(block_out, max(16, _next_pow2(out_features // (2 if glu else 1))))
    stages = 4
    per_stage = (block_rows + (2 if glu else 1) * block_out) * block_in * itemsize
    while stages > 2 and stages * per_stage > default_budget().smem_per_block:
        stages -= 1  # Triton keeps `stages` copies of each loop iteration's tiles in shared memory
    return KernelConfig(block_rows, block_out, block_in, num_warps=4, num_stages=stages)


def _kernel(group_ref, start_ref, end_ref, x_ref, w_ref, *refs, rows_per_group: int, in_features: int,
            out_features: int, glu_half: int | None, block_rows: int, block_out: int, block_in: int,
            scaled: bool):
    """One program: the rows of one tile times one block of output columns of the tile's group.

    x_ref [M, I]; w_ref [G * O, I] (group g's rows at g * O ...; any float dtype, converted to x's as loaded);
    with `scaled`, s_ref [G * O] float32 (the rows' scales); o_ref [M, O] (glu: [M, O / 2])."""
    s_ref, o_ref = refs if scaled else (None, *refs)
    t = pl.program_id(0)
    n0 = pl.program_id(1) * block_out
    g, start, end = group_ref[t], start_ref[t], end_ref[t]

    @pl.when(end > start)
    def _():
        rows = start + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
        live_rows = rows < end
        n = n0 + lax.broadcasted_iota(jnp.int32, (block_out,), 0)
        n_out = glu_half if glu_half is not None else out_features
        live_n = n < n_out
        w_rows = g * rows_per_group + n  # gate rows (or the plain rows)
        k_offs = lax.broadcasted_iota(jnp.int32, (block_in,), 0)

        def body(i, accs):
            k = i * block_in + k_offs
            live_k = k < in_features
            a = load(x_ref.at[rows[:, None], k[None, :]], live_rows[:, None] & live_k[None, :], 0)
            wmask = live_n[:, None] & live_k[None, :]
            b = load(w_ref.at[w_rows[:, None], k[None, :]], wmask, 0).astype(a.dtype)  # fp8: converted here
            new = [accs[0] + dot(a, b, trans_b=True)]
            if glu_half is not None:
                u = load(w_ref.at[(w_rows + glu_half)[:, None], k[None, :]], wmask, 0).astype(a.dtype)
                new.append(accs[1] + dot(a, u, trans_b=True))
            return tuple(new)

        n_acc = 2 if glu_half is not None else 1
        accs = tuple(jnp.zeros((block_rows, block_out), jnp.float32) for _ in range(n_acc))
        accs = lax.fori_loop(0, pl.cdiv(in_features, block_in), body, accs)
        if scaled:  # each output column times its weight row's scale (glu: gate's and up's), before rounding
            rows_of = [w_rows] if glu_half is None else [w_rows, w_rows + glu_half]
            accs = tuple(acc * load(s_ref.at[r], live_n, 0)[None, :] for acc, r in zip(accs, rows_of))
        dt = o_ref.dtype
        if glu_half is not None:
            gate = accs[0].astype(dt).astype(jnp.float32)
            up = accs[1].astype(dt).astype(jnp.float32)
            y = _gelu_tanh(gate) * up
        else:
            y = accs[0]
        store(o_ref.at[rows[:, None], n[None, :]], y.astype(dt), live_rows[:, None] & live_n[None, :])


@functools.partial(jax.jit, static_argnames=("glu", "interpret", "config"))
def _grouped_matmul_pallas(x, w, scale, tiles: RowTiles, *, glu: bool, interpret: bool, config: KernelConfig):
    M, I = x.shape
    G, O, _ = w.shape
    n_out = O // 2 if glu else O
    T = tiles.group.shape[0]
    scaled = scale is not None
    kernel = functools.partial(
        _kernel, rows_per_group=O, in_features=I, out_features=O, glu_half=n_out if glu else None,
        block_rows=config.block_rows, block_out=config.block_out, block_in=config.block_in, scaled=scaled)
    whole = lambda shape: pl.BlockSpec(shape, lambda t, j: (0,) * len(shape))  # noqa: E731
    # The weights go in as stored (an fp8 expert stack is read at one byte a weight, converted in the kernel).
    args = [tiles.group, tiles.start, tiles.end, x, w.reshape(G * O, I)]
    specs = [whole((T,)), whole((T,)), whole((T,)), whole((M, I)), whole((G * O, I))]
    if scaled:
        args.append(scale.astype(jnp.float32).reshape(G * O))
        specs.append(whole((G * O,)))
    return pl.pallas_call(
        kernel,
        grid=(T, pl.cdiv(n_out, config.block_out)),
        in_specs=specs,
        out_specs=whole((M, n_out)),
        out_shape=jax.ShapeDtypeStruct((M, n_out), x.dtype),
        compiler_params=compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name=f"grouped_matmul{'_glu' if glu else ''}{'_scaled' if scaled else ''}_r{config.block_rows}"
             f"_o{config.block_out}",
    )(*args)


def grouped_matmul(x: Array, w: Array, group_sizes: Array, *, glu: bool = False, scale: Array | None = None,
                   interpret: bool = False, config: KernelConfig | None = None) -> Array:
    """Pallas grouped matmul (Triton lowering on GPU; `interpret=True` runs anywhere). Same contract as
    `grouped_matmul_reference`."""
    _check_shapes(x, w, group_sizes, glu, scale)
    M, I = x.shape
    config = config or kernel_config(M, w.shape[0], w.shape[1], I, glu, jnp.dtype(x.dtype).itemsize)
    tiles = row_tiles(group_sizes.astype(jnp.int32), M, config.block_rows)
    return _grouped_matmul_pallas(x, w, scale, tiles, glu=glu, interpret=interpret, config=config)


def grouped_matmul_auto(x: Array, w: Array, group_sizes: Array, *, glu: bool = False, scale: Array | None = None,
                        impl: str = "auto", interpret: bool = False) -> Array:
    """The kernel ("pallas"; `interpret=True` runs it anywhere), the XLA reference ("xla"), or "auto": the kernel
    where `kernels_chosen()` (a GPU), the reference elsewhere."""
    if impl == "auto":
        impl = "pallas" if kernels_chosen() else "xla"
    if impl == "pallas":
        return grouped_matmul(x, w, group_sizes, glu=glu, scale=scale, interpret=interpret or kernels_interpreted())
    if impl == "xla":
        return grouped_matmul_reference(x, w, group_sizes, glu=glu, scale=scale)
    raise ValueError(f"impl must be 'auto', 'pallas' or 'xla', got {impl!r}")


def routed_experts(x: Array, weights: Array, idx: Array, gate_up: Array, down: Array,
                   gate_up_scale: Array | None = None, down_scale: Array | None = None, *,
                   expert_offset: Array | int | None = None, impl: str = "auto", interpret: bool = False) -> Array:
    """The MoE experts on their routed rows only. x [N, H]; weights, idx [N, k] (router output); gate_up
    [E, 2 Im, H] (gate rows first); down [E, H, Im] -> sum_j weights[n, j] * expert_{idx[n, j]}(x[n]): [N, H].
    fp8 experts come with their scales, gate_up_scale [E, 2 Im] and down_scale [E, H].

    The N*k (token, expert) pairs are sorted by expert; both projections run as grouped matmuls over the sorted
    rows (the gate|up one with the activation fused), and each token sums its k outputs. With `expert_offset`
    (expert parallelism: this device holds experts offset .. offset+E-1), pairs routed to other experts add 0."""
    N, k = idx.shape
    E = gate_up.shape[0]
    mm = functools.partial(grouped_matmul_auto, impl=impl, interpret=interpret)
    ids = idx.reshape(-1)  # pair p = token * k + j
    here = None
    if expert_offset is not None:
        ids = ids - expert_offset
        here = (ids >= 0) & (ids < E)
        ids = jnp.where(here, ids, E)  # other devices' pairs sort last, into no group of this device
    order, group_sizes = sort_by_group(ids, E if here is None else E + 1)
    group_sizes = group_sizes[:E]
    xs = jnp.take(x, order // k, axis=0)  # [N*k, H]
    act = mm(xs, gate_up, group_sizes, glu=True, scale=gate_up_scale)  # gelu(gate) * up: [N*k, Im]
    ys = mm(act, down, group_sizes, scale=down_scale)  # [N*k, H]; rows in no group are left undefined
    y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
    if here is not None:
        y = jnp.where(here[:, None], y, 0)
    return jnp.einsum("nkh,nk->nh", y.reshape(N, k, -1), weights.astype(x.dtype))
