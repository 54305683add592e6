"""The MLP's first half, h = gelu_tanh(x @ gate.T) * (x @ up.T), written by the GEMM kernel that reads the weights.

On the GPU XLA runs that line as two kernels: one GEMM over the concatenated gate|up weights writing both products
[M, 2I], then an elementwise fusion reading them back for GELU x up (no XLA option fuses an elementwise consumer into
a cuBLAS / Triton GEMM's epilogue here). At decode and verify (a handful to ~100 rows) the GEMM only streams
weights: E2B's gate and up are 37.7 MB a layer, ~12 us at an H200's ~3.2 TB/s, and the second kernel is a few
microseconds of fixed cost on top, once per decoder layer (E2B, E4B, 26B-A4B's dense MLP, the 31B drafter).

Here one Pallas (Triton) kernel does both. Grid (I / block_n,): program j owns block_n columns of I, i.e. rows
[j * block_n, (j + 1) * block_n) of gate and of up, and loops over H in block_k steps (`lax.fori_loop`, so that
num_stages > 1 lets Triton pipeline the weight loads). Each step loads its gate and up tiles once and multiplies
every 16-row block of x by them (rows masked past M, at most MAX_ROWS // 16 row blocks, each holding a gate and an
up accumulator [16, block_n] float32). The epilogue applies GELU and the product and writes h [M, block_n].

Two implementations with one contract: `gate_up_reference` (plain XLA, the model's math) and the Pallas kernel
(Triton lowering on GPU, `interpret=True` anywhere). Rounding follows the reference: each product accumulated in
float32 over the whole of H and rounded to the activations' dtype (what a matmul returns), GELU in float32 rounded
to the dtype, the product rounded once.

`plan(rows, H, I, dtype)` is the kernel's `Tiling`, or None where XLA's GEMM stays (the CPU, rows past MAX_ROWS,
4-byte activations, gate + up past MAX_WEIGHT_BYTES, widths no power-of-two block fits). Tensor parallelism shards
the weights: the model layer, which knows the mesh, keeps XLA's path there (model/decoder.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from gemma4_mtp_jax.kernels.device_budget import default_budget, on_gpu
from gemma4_mtp_jax.kernels.split_k import split_matmul, with_reference_vjp
from gemma4_mtp_jax.kernels.triton_ops import compiler_params, dot_t, load, store

Array = jax.Array

__all__ = ["Tiling", "plan", "gate_up", "gate_up_reference"]

BLOCK_ROWS = 16  # Triton's smallest matmul
# E2B's verify at B = 16 is 80 rows; past a few row blocks the program's accumulators (2 x 8 x [16, block_n] float32)
# and its x tiles crowd registers and shared memory, and XLA's GEMM, no longer weight-bound, is the better plan.
MAX_ROWS = 128
# E2B's double-wide layers (2 x 12288 x 1536 x 2 B = 75 MiB) and E4B's 105 MB take the kernel; 31B's target MLP
# (441 MiB) streams for ~140 us, where one elementwise kernel less is noise: XLA's autotuned GEMM keeps it.
MAX_WEIGHT_BYTES = 128 << 20
# Default tiling; benchmarks/probe_gate_up.py sweeps these. Run 127 (H100, 8 E2B MLPs, pipelined us a layer of the
# MLP): 32 columns a program 26.2 / 27.9 / 42.8 at 2 / 16 / 80 rows, 16 columns 29.5 / 29.0 / 50.5, 64 columns 26.0 /
# 27.6 / (past shared memory at 80 rows), XLA's GEMM and fusion 35.1 / 29.6 / 46.4.
BLOCK_N = 32
BLOCK_K = 256  # a step's weights, 2 x 16 x 256 x 2 B = 16 KiB, a few in flight per program cover HBM's latency
NUM_WARPS = 4
NUM_STAGES = 3


class Tiling(NamedTuple):
    """The kernel's launch: block_n columns of I per program, H in block_k steps, warps, pipeline stages."""

    block_n: int = BLOCK_N
    block_k: int = BLOCK_K
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _row_blocks(rows: int) -> int:
    return -(-rows // BLOCK_ROWS)


def _shared_bytes(rows: int, t: Tiling, itemsize: int) -> int:
    """What the pipelined loads hold in shared memory: num_stages copies of a step's gate, up and x tiles."""
    return t.num_stages * (2 * t.block_n + _row_blocks(rows) * BLOCK_ROWS) * t.block_k * itemsize


def plan(rows: int, H: int, I: int, dtype) -> Tiling | None:
    """The kernel's tiling for `rows` tokens of x [rows, H] and gate / up [I, H], or None to keep XLA's GEMM."""
    if not on_gpu():
        return None
    itemsize = jnp.dtype(dtype).itemsize
    if not 1 <= rows <= MAX_ROWS or itemsize != 2 or 2 * I * H * itemsize > MAX_WEIGHT_BYTES:
        return None
    block_k = min(BLOCK_K, H & -H)  # 1536 = 3 x 512: the largest power of two dividing H
    block_n = min(BLOCK_N, I & -I)
    if block_k < 16 or block_n < 16:
        return None
    tiling = Tiling(block_n, block_k, NUM_WARPS, NUM_STAGES)
    smem = default_budget().smem_per_block
    while tiling.num_stages > 1 and _shared_bytes(rows, tiling, itemsize) > smem:
        tiling = tiling._replace(num_stages=tiling.num_stages - 1)
    return tiling if _shared_bytes(rows, tiling, itemsize) <= smem else None


# ----------------------------------------------------------------------------------------------------------
# Reference (plain XLA): the model's math
# ----------------------------------------------------------------------------------------------------------


def gate_up_reference(x: Array, gate: Array, up: Array) -> Array:
    """gelu_tanh(x @ gate.T) * (x @ up.T) in x's dtype, weights in PyTorch layout (gate, up [I, H])."""
    return jax.nn.gelu(split_matmul(x, gate, 1), approximate=True) * split_matmul(x, up, 1)


# ----------------------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------------------


def _kernel(x_ref, gate_ref, up_ref, h_ref, *, M: int, H: int, block_k: int):
    """One program: block_n columns of I. x_ref [M, H] (all rows), gate_ref / up_ref [block_n, H] (the program's
    rows of the weights), h_ref [M, block_n] (its columns of h)."""
    dtype = h_ref.dtype
    block_n = gate_ref.shape[0]
    R = _row_blocks(M)
    lane = lax.broadcasted_iota(jnp.int32, (BLOCK_ROWS,), 0)
    rows = [r * BLOCK_ROWS + lane for r in range(R)]
    live = [(rw < M)[:, None] for rw in rows]
    ks = lax.broadcasted_iota(jnp.int32, (block_k,), 0)

    def step(k, accs):
        k0 = pl.multiple_of(k * block_k, block_k)
        # The weight tiles once, for every row block: they are what the kernel streams.
        g_w = gate_ref[:, pl.ds(k0, block_k)].astype(dtype)  # [block_n, block_k]
        u_w = up_ref[:, pl.ds(k0, block_k)].astype(dtype)
        cols = (k0 + ks)[None, :]
        out = []
        for r in range(R):
            xr = load(x_ref.at[(rows[r][:, None], cols)], jnp.broadcast_to(live[r], (BLOCK_ROWS, block_k)))
            out.append(accs[2 * r] + dot_t(xr, g_w))  # [16, block_n]
            out.append(accs[2 * r + 1] + dot_t(xr, u_w))
        return tuple(out)

    zero = jnp.zeros((BLOCK_ROWS, block_n), jnp.float32)
    accs = lax.fori_loop(0, H // block_k, step, (zero,) * (2 * R))
    cols = lax.broadcasted_iota(jnp.int32, (block_n,), 0)[None, :]
    for r in range(R):
        g = accs[2 * r].astype(dtype).astype(jnp.float32)
        u = accs[2 * r + 1].astype(dtype).astype(jnp.float32)
        act = jax.nn.gelu(g, approximate=True).astype(dtype).astype(jnp.float32)
        store(h_ref.at[(rows[r][:, None], cols)], (act * u).astype(dtype),
              jnp.broadcast_to(live[r], (BLOCK_ROWS, block_n)))


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def _gate_up_pallas(x, gate, up, *, tiling: Tiling, interpret: bool):
    *lead, H = x.shape
    x2 = x.reshape(-1, H)
    M, I = x2.shape[0], gate.shape[0]
    bn = tiling.block_n
    weights = pl.BlockSpec((bn, H), lambda j: (j, 0))
    h = pl.pallas_call(
        functools.partial(_kernel, M=M, H=H, block_k=tiling.block_k),
        grid=(I // bn,),
        in_specs=[pl.BlockSpec((M, H), lambda j: (0, 0)), weights, weights],
        out_specs=pl.BlockSpec((M, bn), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((M, I), x.dtype),
        compiler_params=None if interpret else compiler_params(tiling.num_warps, tiling.num_stages),
        interpret=interpret,
        name=f"gate_up_h{H}_i{I}_n{bn}_k{tiling.block_k}",
    )(x2, gate, up)
    return h.reshape(*lead, I)


def gate_up(x: Array, gate: Array, up: Array, *, tiling: Tiling = Tiling(), interpret: bool = False) -> Array:
    """The Pallas kernel; same contract as `gate_up_reference` (x [..., H] with at most MAX_ROWS rows, gate / up
    [I, H]). Differentiates through the reference."""
    H = x.shape[-1]
    if gate.ndim != 2 or gate.shape[1] != H:
        raise ValueError(f"gate_up: gate must be [I, H={H}] (x {x.shape}), got {gate.shape}")
    if up.shape != gate.shape:
        raise ValueError(f"gate_up: up {up.shape} must have gate's shape {gate.shape}")
    I = gate.shape[0]
    rows = x.size // H if H else 0
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gate_up: x {x.shape} has {rows} rows; the kernel takes 1 to {MAX_ROWS}")
    bn, bk = tiling.block_n, tiling.block_k
    if not _pow2(bn) or I % bn:
        raise ValueError(f"gate_up: block_n={bn} must be a power of two >= 16 dividing I={I}")
    if not _pow2(bk) or H % bk:
        raise ValueError(f"gate_up: block_k={bk} must be a power of two >= 16 dividing H={H}")
    if tiling.num_warps < 1 or tiling.num_stages < 1:
        raise ValueError(f"gate_up: num_warps={tiling.num_warps} and num_stages={tiling.num_stages} must be >= 1")
    kernel = functools.partial(_gate_up_pallas, tiling=Tiling(*tiling), interpret=interpret)
    return with_reference_vjp(kernel, gate_up_reference)(x, gate, up)
