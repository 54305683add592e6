"""The step programs' parameters as fewer arrays: the target's leaves packed into a few 1-D arrays per dtype.

Every array passed to a compiled program costs the host a few microseconds per call in JAX's GPU runtime (2.9 us
on the H200, benchmarks/RESULTS.md run 36): E2B's 540 parameter arrays held the dispatching thread 1.5 ms per
step, more than half the step's device time. About half of them are norm scales and layer scalars, 0.6 MB in all.
`ParamPack` concatenates those into one 1-D array per dtype once, at start-up, and a program slices them back out
(static offsets, which XLA fuses into their elementwise consumers), so the model still sees its usual tree.

Modes (`PACK_MODES`): "none" passes every array as it is; "vectors" packs the 0-D and 1-D leaves (the norms and
scalars); "all" packs the matrices too, each at an offset aligned to `ALIGN` elements, a packed array holding at
most `GROUP_ELEMENTS` (so byte offsets stay inside int32 for any kernel) and leaves larger than that kept as they
are. Whether XLA reads a matmul's weights straight out of the packed array or copies the slice first is what
decides "all" on the GPU (scripts/gpu_run37.sh measures it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

# Vectors up to this many elements are packed: every norm scale of the released models (the widest, 31B's 5376)
# and the layer scalars; no matrix qualifies (only 1-D and 0-D leaves do).
MAX_PACKED_ELEMENTS = 1 << 16
# A packed array's size cap (1 GiB of bf16) and the alignment of every leaf in it (128 bytes of bf16: vector loads
# and GEMM operands want aligned addresses).
GROUP_ELEMENTS = 1 << 29
ALIGN = 64
# mode -> (largest leaf packed, largest rank packed); "none" packs nothing.
PACK_MODES: dict[str, tuple[int, int] | None] = {"none": None, "vectors": (MAX_PACKED_ELEMENTS, 1),
                                                 "all": (GROUP_ELEMENTS, 8)}


@dataclasses.dataclass(frozen=True)
class PackedParams:
    """What a step program takes for the target's parameters: the leaves left as they are (tree order), and one
    1-D array per dtype holding the packed ones."""

    kept: tuple[Any, ...]
    packed: tuple[Any, ...]


jax.tree_util.register_dataclass(PackedParams, data_fields=["kept", "packed"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class _Slot:
    group: int  # index into PackedParams.packed; -1: a kept leaf
    index: int  # kept: position in PackedParams.kept; packed: first element in its group
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ParamPack:
    """Where each leaf of a parameter tree lives in its `PackedParams` (built from shapes: works on abstract
    trees too)."""

    treedef: Any
    slots: tuple[_Slot, ...]
    dtypes: tuple[Any, ...]  # of each packed group
    sizes: tuple[int, ...]  # elements of each packed group

    @staticmethod
    def plan(tree: Any, packable: Callable[[str, Any], bool] | None = None, mode: str = "vectors") -> "ParamPack":
        """Pack the leaves `mode` takes (PACK_MODES) for which `packable(path, leaf)` holds (all of them without
        it; a tensor-parallel placement keeps its split leaves out)."""
        if mode not in PACK_MODES:
            raise ValueError(f"pack_params must be one of {sorted(PACK_MODES)}, got {mode!r}")
        limits = PACK_MODES[mode]
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        dtypes: list[Any] = []
        sizes: list[int] = []
        slots = []
        kept = 0
        for path, leaf in leaves:
            n = math.prod(leaf.shape)
            if limits is not None and len(leaf.shape) <= limits[1] and n <= limits[0] and (
                    packable is None or packable(jax.tree_util.keystr(path), leaf)):
                dt = jnp.dtype(leaf.dtype)
                g = max((i for i, d in enumerate(dtypes) if d == dt), default=-1)
                start = -(-sizes[g] // ALIGN) * ALIGN if g >= 0 else 0
                if g < 0 or start + n > GROUP_ELEMENTS:
                    dtypes.append(dt)
                    sizes.append(0)
                    g, start = len(dtypes) - 1, 0
                slots.append(_Slot(g, start, tuple(leaf.shape)))
                sizes[g] = start + n
            else:
                slots.append(_Slot(-1, kept, tuple(leaf.shape)))
                kept += 1
        return ParamPack(treedef, tuple(slots), tuple(dtypes), tuple(sizes))

    @property
    def num_arrays(self) -> int:
        """Arrays a program takes for the tree: the kept leaves and one per packed dtype."""
        return sum(s.group < 0 for s in self.slots) + len(self.dtypes)

    def pack(self, tree: Any) -> PackedParams:
        """The tree's arrays as a PackedParams (the packed groups are new arrays; kept leaves are not copied)."""
        leaves = self.treedef.flatten_up_to(tree)
        kept = tuple(leaf for leaf, s in zip(leaves, self.slots) if s.group < 0)
        packed = []
        for g, (dt, size) in enumerate(zip(self.dtypes, self.sizes)):
            parts, end = [], 0
            for leaf, s in zip(leaves, self.slots):
                if s.group == g:
                    if s.index > end:  # alignment padding
                        parts.append(jnp.zeros((s.index - end,), dt))
                    parts.append(jnp.ravel(leaf).astype(dt))
                    end = s.index + math.prod(s.shape)
            packed.append(jnp.concatenate(parts))
        return PackedParams(kept, tuple(packed))

    def abstract(self, tree: Any, packed_sharding: Any = None) -> PackedParams:
        """The PackedParams of a tree of shapes (jax.ShapeDtypeStruct leaves, with their shardings)."""
        leaves = self.treedef.flatten_up_to(tree)
        kept = tuple(leaf for leaf, s in zip(leaves, self.slots) if s.group < 0)
        packed = tuple(jax.ShapeDtypeStruct((n,), dt, sharding=packed_sharding)
                       for dt, n in zip(self.dtypes, self.sizes))
        return PackedParams(kept, packed)

    def unpack(self, params: PackedParams) -> Any:
        """The tree back from a PackedParams (inside a program: static slices of the packed groups)."""
        leaves = []
        for s in self.slots:
            if s.group < 0:
                leaves.append(params.kept[s.index])
            else:
                n = math.prod(s.shape)
                leaves.append(lax.slice(params.packed[s.group], (s.index,), (s.index + n,)).reshape(s.shape))
        return self.treedef.unflatten(leaves)
