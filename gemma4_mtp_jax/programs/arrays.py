"""The arrays every step program takes besides its host inputs, where they live: the target's parameters (placed
on the programs' devices once, optionally packed as rows of a few arrays: param_pack.py), the drafter's, and the
engine's device state (its shapes, shardings and first value). With a tensor-parallel placement, parameters and
pages are split as sharding.py says and everything else is replicated."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from gemma4_mtp_jax.kernels.device_budget import check_fp8_support, target_device
from gemma4_mtp_jax.model.kv_state import KVLayout, abstract_pages, init_pages
from gemma4_mtp_jax.model.runtime import Target, shapes_only
from gemma4_mtp_jax.model.sharding import Placement, mesh_context
from gemma4_mtp_jax.programs.param_pack import PackedParams, ParamPack
from gemma4_mtp_jax.steps.device_state import DeviceState, init_processing, init_slots, processing_shapes


def shapes_of(tree: Any, shardings: Any = None) -> Any:
    """A pytree of arrays (or shapes) as jax.ShapeDtypeStruct leaves, with `shardings` (a matching tree) if given."""
    if shardings is None:
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    return jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


@dataclasses.dataclass(frozen=True)
class MeshJit:
    """A jitted function traced (lowered or called) inside its placement's mesh, so that attention and the MoE
    split by heads and experts (sharding.head_parallel, sharding.expert_parallel)."""

    jitted: Any
    placement: Placement

    def lower(self, *args) -> jax.stages.Lowered:
        with mesh_context(self.placement):
            return self.jitted.lower(*args)

    def __call__(self, *args):
        with mesh_context(self.placement):
            return self.jitted(*args)


def jit_on(placement: Placement | None, fn: Callable, donate: tuple[int, ...], out: Any) -> Any:
    """fn jitted with `donate`d arguments for `placement` (None: one device, no sharding annotations; else with
    `out` shardings, traced inside its mesh)."""
    if placement is None:
        return jax.jit(fn, donate_argnums=donate)
    return MeshJit(jax.jit(fn, donate_argnums=donate, out_shardings=out), placement)


class ProgramArrays:
    """`program_params` (the target's parameters as the programs take them), `draft_params` (the drafter's device
    arrays, or None), and the device state's shapes and shardings for `num_slots` slots and a staging buffer of
    `input_capacity` elements. Parameters of shapes alone (jax.ShapeDtypeStruct leaves) stay shapes: programs then
    lower and compile but never run."""

    def __init__(self, target: Target, layout: KVLayout, cache_dtype: Any, draft_params: Any, num_slots: int,
                 input_capacity: int, placement: Placement | None = None, pack_params: bool = False):
        self.target, self.layout, self.cache_dtype = target, layout, cache_dtype
        # The drafter's h per slot: the target's activations as they are (a float8 K/V cache scales K/V, not h).
        self.hidden_dtype = jnp.dtype(target.dtype)
        self.num_slots, self.input_capacity, self.placement = num_slots, input_capacity, placement
        self.with_hidden = draft_params is not None  # a drafter reads each sequence's h
        self.replicated = None if placement is None else placement.replicated
        if any(jnp.dtype(leaf.dtype) == jnp.float8_e4m3fn for leaf in jax.tree_util.tree_leaves(
                (target.params, draft_params))):  # fp8 weights (weights/quantize.py) meet the programs' devices
            check_fp8_support([target_device()] if placement is None else list(placement.mesh.devices.flat))
        # On the programs' devices once (a loader may leave the weights in host memory: each tensor then goes
        # straight to its shards); already-placed arrays are not copied.
        pl, tree = placement, target.params
        shardings = self.param_shardings()
        if pl is None:
            self.pack = ParamPack.plan(tree, enabled=pack_params)
        else:  # only replicated leaves are packed: the packed groups are replicated
            flat = dict(zip((jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shardings)[0]),
                            jax.tree_util.tree_leaves(shardings)))
            self.pack = ParamPack.plan(tree, lambda path, _: flat[path].is_fully_replicated, enabled=pack_params)
        # What the programs take for the target's parameters: with `pack_params` its leaves stacked into a few
        # arrays (param_pack.py says why), else every array as it is. Packed, the leaves go to the device group by
        # group and only the packed arrays stay there (weights loaded into host memory are never whole on the
        # device twice); `params` then rebuilds the tree on demand.
        if shapes_only(tree):
            self._params, self.draft_params = tree, draft_params
            self.program_params = self.pack.abstract(shapes_of(tree, shardings), self.replicated)
            return
        if draft_params is not None:
            draft_params = jax.device_put(draft_params) if pl is None else pl.put(draft_params,
                                                                                  pl.replicate(draft_params))
        self.draft_params = draft_params
        packed = self.pack.pack(tree)  # packed groups are concatenated on the default device
        if pl is None:
            packed = jax.device_put(packed)
        else:
            kept_shardings = tuple(s for s, slot in zip(self.pack.treedef.flatten_up_to(shardings), self.pack.slots)
                                   if slot.group < 0)
            packed = PackedParams(pl.put(packed.kept, kept_shardings), pl.put(packed.packed, self.replicated))
        self.program_params = packed
        # Unpacked, every leaf is kept: the kept leaves, placed, are the tree.
        self._params = None if pack_params else self.pack.treedef.unflatten(packed.kept)

    @property
    def params(self) -> Any:
        """The target's parameter tree on the programs' devices. Packed, it is rebuilt from the packed arrays on
        each access (a copy of the weights: for inspection, not for the step loop)."""
        if self._params is not None:
            return self._params
        return jax.jit(self.pack.unpack)(self.program_params)

    def param_shardings(self) -> Any:
        pl = self.placement
        return None if pl is None else pl.target_params(self.target.config, self.target.params)

    def page_shardings(self) -> Any:
        return None if self.placement is None else self.placement.pages(self.target.config)

    def state_shardings(self) -> Any:
        """The DeviceState's shardings (None without a placement): pages by KV head, the rest replicated."""
        if self.placement is None:
            return None
        rep = self.replicated
        return DeviceState(self.page_shardings(), rep if self.with_hidden else None, rep, rep, rep, rep, rep, rep,
                           rep)

    def abstract_params(self) -> tuple[Any, Any]:
        """(program params, draft params) as shapes, with their shardings."""
        params = self.pack.abstract(shapes_of(self.target.params, self.param_shardings()), self.replicated)
        draft = None if self.placement is None else self.placement.replicate(self.draft_params)
        return params, shapes_of(self.draft_params, draft)

    def abstract_state(self) -> DeviceState:
        H = self.target.config.hidden_size
        pages = abstract_pages(self.target.config, self.layout, self.cache_dtype)
        hidden = jax.ShapeDtypeStruct((self.num_slots + 1, H), self.hidden_dtype) if self.with_hidden else None
        slots = [jax.ShapeDtypeStruct((self.num_slots + 1,), jnp.int32)] * 3
        inputs = jax.ShapeDtypeStruct((self.input_capacity,), jnp.int32)
        history = processing_shapes(self.num_slots, self.target.config.vocab_size)
        return shapes_of(DeviceState(pages, hidden, *slots, inputs, *history), self.state_shardings())

    def init_state(self, pages: Any = None, hidden: Any = None) -> DeviceState:
        """The engine's device state, made where it lives: zeroed page pools (or `pages`, e.g. a benchmark's random
        ones), with a drafter its zeroed hidden buffer [num_slots + 1, H] (or `hidden`), every slot finished, and
        the staging buffer for the steps' inputs."""
        H = self.target.config.hidden_size

        def make(pages, hidden):
            if pages is None:
                pages = init_pages(self.target.config, self.layout, self.cache_dtype)
            if hidden is None and self.with_hidden:
                hidden = jnp.zeros((self.num_slots + 1, H), self.hidden_dtype)
            inputs = jnp.zeros((self.input_capacity,), jnp.int32)
            history = init_processing(self.num_slots, self.target.config.vocab_size)
            return DeviceState(pages, hidden, *init_slots(self.num_slots), inputs, *history)

        donate = tuple(i for i, a in enumerate((pages, hidden)) if a is not None)
        return jit_on(self.placement, make, donate, self.state_shardings())(pages, hidden)
