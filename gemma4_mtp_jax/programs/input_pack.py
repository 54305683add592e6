"""A step's host inputs as one int32 array, sent in one transfer and read by one kernel.

A step program takes per-row inputs from the host: slots, tokens, lengths, stop ids, sampling rows, page tables.
Passed as separate arrays, each costs a host-to-device transfer per call, and each lands at a new device address:
XLA then re-records every command-buffer node that reads one (the paged-attention kernel of every layer reads the
page tables, the page writes read the positions), 96-215 nodes per call at E2B
(docs/decisions/0002-packed-step-inputs.md).

`pack_rows` lays every leaf of the inputs' pytree out as int32 columns of one array [B, W] (booleans as 0/1,
float32 and uint32 by their bits). Inside the program `unpack_rows` first writes that array into a staging buffer
the device state owns (donated, so it keeps its address from call to call), then reads every leaf from the
staging buffer: one kernel, the write, reads the buffer that moves.

XLA must not see through the write. A copy into a temporary does not survive: XLA drops an optimization barrier
before fusion and fuses the slices back into every reader. A write at offset 0 does not either: on the GPU, XLA
turns a static slice of the written region back into a slice of the array written (17 readers in a tiny
speculative program). So the write's offset is a value XLA cannot know:
the staging buffer's last element, which is 0 and never written (the buffer is larger than any packed input).

The result goes back the same way it came: `return_in` writes a program's packed result over the first columns of
its packed inputs, which the program takes donated. A result in an allocation of its own moves from call to call,
and XLA's buffer assignment places short-lived temporaries in a live-out allocation before its value is written
(36 of them in a small decode program's 32-byte result): every kernel
that touches one is re-recorded in the command buffer on each call. A donated parameter's allocation holds only
that parameter and its update, so only the kernels that read the inputs and write the result touch it.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_BITCAST = (np.dtype(np.float32), np.dtype(np.uint32))  # carried by their bits
_CONVERTED = (np.dtype(np.int32), np.dtype(np.bool_))  # carried by value


def _columns(leaf: Any) -> tuple[int, ...]:
    return tuple(leaf.shape[1:])


def _check_dtype(dtype: Any, where: str) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in _BITCAST + _CONVERTED:
        raise TypeError(f"input_pack: {where} has dtype {dtype}; a packed step input is int32, bool, float32 or uint32")
    return dtype


def packed_width(like: Any) -> int:
    """Columns of the packed array for a pytree of [B, ...] arrays or shapes: one per element of a row."""
    return sum(math.prod(_columns(leaf)) for leaf in jax.tree_util.tree_leaves(like))


def pack_rows(tree: Any) -> np.ndarray:
    """A pytree of host arrays, each [B, ...] (int32, bool, float32 or uint32), as one int32 array [B, W]: each
    leaf's row elements in tree order."""
    leaves = jax.tree_util.tree_leaves(tree)
    B = np.shape(leaves[0])[0]
    cols = []
    for i, leaf in enumerate(leaves):
        a = np.asarray(leaf)
        if a.shape[:1] != (B,):
            raise ValueError(f"input_pack: leaf {i} has shape {a.shape}; every step input is [B = {B}, ...]")
        dtype = _check_dtype(a.dtype, f"leaf {i}")
        a = a.reshape(B, -1)
        cols.append(a.view(np.int32) if dtype in _BITCAST else a.astype(np.int32))
    return np.concatenate(cols, axis=1)


def unpack_rows(packed: jax.Array, like: Any, staging: jax.Array) -> tuple[Any, jax.Array]:
    """Inside a program: the pytree `pack_rows` packed, shaped and typed as `like` (arrays or shapes, [B, ...]),
    read back from `staging` (flat int32, more elements than `packed`, the last one 0) after `packed` is written
    into it. Returns (the tree, the updated staging buffer: hand it back to the device state so that the write
    happens in place)."""
    B, W = packed.shape
    if packed.size >= staging.size:
        raise ValueError(f"input_pack: a packed input of {B} x {W} needs a staging buffer of more than "
                         f"{packed.size} elements, the device state's holds {staging.size}")
    offset = staging[-1]  # always 0, but only the device knows (module docstring)
    staging = lax.dynamic_update_slice(staging, packed.reshape(-1), (offset,))
    body = staging[: B * W].reshape(B, W)
    leaves, treedef = jax.tree_util.tree_flatten(like)
    out, start = [], 0
    for i, leaf in enumerate(leaves):
        shape, n = _columns(leaf), math.prod(_columns(leaf))
        col = body[:, start:start + n].reshape((B, *shape))
        dtype = _check_dtype(leaf.dtype, f"leaf {i}")
        if dtype == np.bool_:
            col = col != 0
        elif dtype in _BITCAST:
            col = lax.bitcast_convert_type(col, jnp.dtype(dtype))
        out.append(col)
        start += n
    if start != W:
        raise ValueError(f"input_pack: {W} packed columns for inputs of {start}")
    return jax.tree_util.tree_unflatten(treedef, out), staging


def return_in(packed: jax.Array, result: jax.Array) -> jax.Array:
    """Inside a program: `result` [B, R] (int32) written over the first R columns of the packed inputs [B, W] it
    was given (donated: the write happens in place), or for R > W returned as it is. The host reads the first R
    columns back (module docstring)."""
    (B, W), (Br, R) = packed.shape, result.shape
    if Br != B:
        raise ValueError(f"input_pack: a result of {Br} rows for packed inputs of {B}")
    if R > W:  # wider than the inputs (a processed program's logprobs at a large k): an allocation of its own
        return result.astype(jnp.int32)
    return lax.dynamic_update_slice(packed, result.astype(jnp.int32), (0, 0))
