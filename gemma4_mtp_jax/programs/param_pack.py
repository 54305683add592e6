"""The step programs' parameters as fewer arrays: the target's leaves stacked as rows of a few 2-D arrays.

Every array passed to a compiled program costs the host a few microseconds per call in JAX's GPU runtime (2.9 us
on the H200, docs/decisions/0004-pack-params.md): E2B's 540 parameter arrays held the dispatching thread 1.5 ms per
step, more than half the step's device time. `ParamPack` stacks the leaves, once at start-up, as rows of a few
2-D arrays, one per (dtype, row width): a leaf of shape [..., n] becomes prod(...) rows of width n (a vector one
row, a scalar one row of width 1), and a program takes each leaf back as a static row slice, so the model still
sees its usual tree.

Why rows: XLA reads a static row slice of a 2-D array in place, inside the matmul or elementwise kernel that
consumes it, while a slice of a flat 1-D array is first copied (35 layers of E2B-width matmuls: 70 kernels either
way for rows, 105 for flat; a flat packing of every E2B leaf took the decode program from 730 to 1007 kernels;
docs/decisions/0004-pack-params.md). A packed array holds at most `GROUP_ELEMENTS` elements, so byte
offsets stay inside int32 for any kernel. Leaves over `MAX_LEAF_ELEMENTS` stay separate arrays: they are few (the
embedding tables, the MoE experts), and their consumers (a gather, the grouped-matmul kernel, which takes its
operand whole) would have to copy a slice; so do the leaves `packable` refuses (those split by tensor parallelism).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

GROUP_ELEMENTS = 1 << 29  # 1 GiB of bf16
MAX_LEAF_ELEMENTS = 1 << 27  # 31B's MLP matrices (116 M) are packed; embeddings and expert stacks are not


@dataclasses.dataclass(frozen=True)
class PackedParams:
    """What a step program takes for the target's parameters: the leaves left as they are (tree order), and the
    packed 2-D arrays."""

    kept: tuple[Any, ...]
    packed: tuple[Any, ...]


jax.tree_util.register_dataclass(PackedParams, data_fields=["kept", "packed"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class _Slot:
    group: int  # index into PackedParams.packed; -1: a kept leaf
    index: int  # kept: position in PackedParams.kept; packed: first row in its group
    shape: tuple[int, ...]


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, width) of a leaf laid out as rows."""
    width = shape[-1] if shape else 1
    return (math.prod(shape) // width if width else 0), width


@dataclasses.dataclass(frozen=True)
class ParamPack:
    """Where each leaf of a parameter tree lives in its `PackedParams` (built from shapes: works on abstract
    trees too)."""

    treedef: Any
    slots: tuple[_Slot, ...]
    groups: tuple[tuple[Any, int, int], ...]  # (dtype, rows, width) of each packed array

    @staticmethod
    def plan(tree: Any, packable: Callable[[str, Any], bool] | None = None, enabled: bool = True) -> "ParamPack":
        """Pack every leaf of at most MAX_LEAF_ELEMENTS elements for which `packable(path, leaf)` holds (all of
        them without it); `enabled=False` keeps every leaf as it is."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        groups: list[list] = []  # [dtype, rows, width]
        slots = []
        kept = 0
        for path, leaf in leaves:
            rows, width = _rows(tuple(leaf.shape))
            if enabled and 0 < rows * width <= MAX_LEAF_ELEMENTS and (
                    packable is None or packable(jax.tree_util.keystr(path), leaf)):
                dt = jnp.dtype(leaf.dtype)
                g = max((i for i, (d, _, w) in enumerate(groups) if d == dt and w == width), default=-1)
                if g < 0 or (groups[g][1] + rows) * width > GROUP_ELEMENTS:
                    groups.append([dt, 0, width])
                    g = len(groups) - 1
                slots.append(_Slot(g, groups[g][1], tuple(leaf.shape)))
                groups[g][1] += rows
            else:
                slots.append(_Slot(-1, kept, tuple(leaf.shape)))
                kept += 1
        return ParamPack(treedef, tuple(slots), tuple(tuple(g) for g in groups))

    @property
    def num_arrays(self) -> int:
        """Arrays a program takes for the tree: the kept leaves and the packed arrays."""
        return sum(s.group < 0 for s in self.slots) + len(self.groups)

    def pack(self, tree: Any) -> PackedParams:
        """The tree's arrays as a PackedParams (the packed arrays are new; kept leaves are not copied)."""
        leaves = self.treedef.flatten_up_to(tree)
        kept = tuple(leaf for leaf, s in zip(leaves, self.slots) if s.group < 0)
        packed = tuple(jnp.concatenate([jnp.reshape(leaf, (-1, width)).astype(dt)
                                        for leaf, s in zip(leaves, self.slots) if s.group == g])
                       for g, (dt, _, width) in enumerate(self.groups))
        return PackedParams(kept, packed)

    def abstract(self, tree: Any, packed_sharding: Any = None) -> PackedParams:
        """The PackedParams of a tree of shapes (jax.ShapeDtypeStruct leaves, with their shardings)."""
        leaves = self.treedef.flatten_up_to(tree)
        kept = tuple(leaf for leaf, s in zip(leaves, self.slots) if s.group < 0)
        packed = tuple(jax.ShapeDtypeStruct((rows, width), dt, sharding=packed_sharding)
                       for dt, rows, width in self.groups)
        return PackedParams(kept, packed)

    def unpack(self, params: PackedParams) -> Any:
        """The tree back from a PackedParams (inside a program: static row slices of the packed arrays)."""
        leaves = []
        for s in self.slots:
            if s.group < 0:
                leaves.append(params.kept[s.index])
            else:
                rows, width = _rows(s.shape)
                block = lax.slice(params.packed[s.group], (s.index, 0), (s.index + rows, width))
                leaves.append(block.reshape(s.shape))
        return self.treedef.unflatten(leaves)
