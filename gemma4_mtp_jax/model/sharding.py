"""Tensor parallelism: where each parameter and KV page lives on a mesh of devices (one axis, "tp").

Megatron-style by the parameter's role, read from its checkpoint name (the layout is HF's, `weight` [out, in]):
- attention: q / k / v projections split by output rows (heads), the output projection by input columns, so each
  device owns whole heads and the layer needs one all-reduce, after `o_proj`;
- MLP: gate and up split by output rows, down by input columns (one all-reduce after `down_proj`);
- MoE experts split by expert (expert parallelism);
- the embedding whole on every device: its lookups (the target's input and each draft step's token) need no
  collective, and the tied LM head still computes each device's own vocabulary rows (`vocab_parallel`);
- PLE's table split by vocabulary rows (one all-reduce per forward, outside the layers: whole, it would take
  4.7 GB per device at E2B);
- norms, scalars, routers and small projections replicated;
- an fp8 weight's per-output-channel scale like its weight's output rows: split beside column-parallel projections
  and the experts, replicated beside the row-parallel o_proj / down_proj.
K / V projections and pages of a layer whose KV heads N does not divide (31B's 4 global KV heads at N = 8) are
replicated instead, and so are those of the layers the assistant reads (`Placement.whole_kv`): its draft steps then
run on every device whole, with no collective. KV pages `[nKV, pages, page_size, D]` split by KV head like the
projections that fill them. The assistant is replicated: its weights are small
(docs/decisions/0022-collective-free-draft-steps.md).

XLA's SPMD partitioner inserts the collectives. Attention runs under `shard_map` (`head_parallel`), each device on
its own heads, and the MoE experts under `expert_parallel`, each device on its own experts, since the partitioner
cannot split a Pallas kernel; the assistant's attention under `on_every_device`, each device on all of it. Every
program keeps the same shardings in and out, so donated pages are updated in place on every device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gemma4_mtp_jax.model.config import TextConfig, owning_layers

AXIS = "tp"
_LAYER = re.compile(r"^layers_(\d+)\.")


def tensor_parallel_size() -> int:
    """The size of the "tp" axis of the mesh in context while tracing (1 without one)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)  # JAX >= 0.6; without it there is no mesh context
    mesh = get() if get is not None else None
    names = getattr(mesh, "axis_names", ()) or ()
    return dict(zip(names, mesh.axis_sizes)).get(AXIS, 1) if AXIS in names else 1


def head_parallel(attend: Callable[..., jax.Array], q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                  *rest: jax.Array) -> jax.Array:
    """`attend(q, k_pages, v_pages, *rest)` (q [B, T, nH, D], pages [nKV, ...]) run by each device on its own heads
    when a tensor-parallel mesh is in context and both head counts split evenly: a device then owns whole GQA
    groups, and a kernel (a custom call the SPMD partitioner cannot split) sees only its shard. Otherwise as is."""
    n = tensor_parallel_size()
    if n == 1 or q.shape[2] % n or k_pages.shape[0] % n:
        return attend(q, k_pages, v_pages, *rest)
    heads, kv = P(None, None, AXIS, None), P(AXIS)
    return jax.shard_map(attend, in_specs=(heads, kv, kv) + (P(),) * len(rest), out_specs=heads,
                         check_vma=False)(q, k_pages, v_pages, *rest)


def on_every_device(attend: Callable[..., jax.Array], *args: jax.Array) -> jax.Array:
    """`attend(*args)` run whole by every device when a tensor-parallel mesh is in context (its arguments must be
    replicated: a split one would be gathered first), as `head_parallel` runs a kernel on each device's heads:
    the partitioner sees no custom call to split. Otherwise as is."""
    if tensor_parallel_size() == 1:
        return attend(*args)
    return jax.shard_map(attend, in_specs=(P(),) * len(args), out_specs=P(), check_vma=False)(*args)


def vocab_parallel(table: jax.Array) -> jax.Array:
    """The tied LM head's table [V, H] as each device's own vocabulary rows when a tensor-parallel mesh is in
    context and V splits evenly (the table is whole on every device: the slice moves nothing), so that each device
    computes the logits of its rows only. Otherwise as is."""
    n = tensor_parallel_size()
    if n == 1 or table.shape[0] % n:
        return table
    return jax.lax.with_sharding_constraint(table, P(AXIS, *(None,) * (table.ndim - 1)))


def gathered(x: jax.Array) -> jax.Array:
    """x whole on every device when a tensor-parallel mesh is in context (one all-gather where it is split).
    Otherwise as is."""
    if tensor_parallel_size() == 1:
        return x
    return jax.lax.with_sharding_constraint(x, P())


def expert_parallel(experts: Callable[..., jax.Array], x: jax.Array, weights: jax.Array, idx: jax.Array,
                    gate_up: jax.Array, down: jax.Array, *scales: jax.Array) -> jax.Array:
    """`experts(x, weights, idx, gate_up, down, *scales, expert_offset=...)` (kernels.grouped_matmul.routed_experts;
    `scales`: fp8 experts' [E, O] scales, split like their experts) with each device running only its own experts on
    the pairs routed to them, then one all-reduce, when a tensor-parallel mesh is in context and the experts split
    evenly. Otherwise as is."""
    n = tensor_parallel_size()
    if n == 1 or gate_up.shape[0] % n:
        return experts(x, weights, idx, gate_up, down, *scales)
    local = gate_up.shape[0] // n

    def shard(x, weights, idx, gate_up, down, *scales):
        out = experts(x, weights, idx, gate_up, down, *scales, expert_offset=jax.lax.axis_index(AXIS) * local)
        return jax.lax.psum(out, AXIS)

    return jax.shard_map(shard, in_specs=(P(), P(), P(), P(AXIS), P(AXIS)) + (P(AXIS),) * len(scales),
                         out_specs=P(), check_vma=False)(x, weights, idx, gate_up, down, *scales)


def mesh_context(placement: "Placement | None"):
    """The context to trace a program in: its mesh (so `head_parallel` sees it), or nothing for one device."""
    if placement is None:
        return contextlib.nullcontext()
    return jax.set_mesh(placement.mesh)


class ShardingError(ValueError):
    """A model that cannot be split over the asked number of devices."""


def check_tensor_parallel(cfg: TextConfig, n: int) -> None:
    """Errors for a `--tensor-parallel-size` the model cannot take (query heads, MLP width, experts)."""
    if n < 1:
        raise ShardingError(f"tensor_parallel_size must be >= 1, got {n}")
    if n == 1:
        return
    if cfg.num_heads % n:
        raise ShardingError(f"tensor_parallel_size={n} does not divide num_attention_heads={cfg.num_heads}")
    for i, lc in enumerate(cfg.layers):
        if lc.intermediate_size % n:
            raise ShardingError(f"tensor_parallel_size={n} does not divide layer {i}'s intermediate_size="
                                f"{lc.intermediate_size}")
    if cfg.enable_moe_block and cfg.num_experts % n:
        raise ShardingError(f"tensor_parallel_size={n} does not divide num_experts={cfg.num_experts}")


@dataclasses.dataclass(frozen=True)
class Placement:
    """The devices of one engine, as a one-axis mesh. `tp` = 1: one device, everything on it."""

    mesh: Mesh
    # Owning layers whose K / V projections and pages stay whole on every device however their KV heads split: the
    # store layers the assistant reads, so that its attention needs no collective (`with_whole_kv`).
    whole_kv: frozenset[int] = frozenset()

    @classmethod
    def over(cls, devices: Sequence[jax.Device]) -> "Placement":
        return cls(Mesh(np.asarray(list(devices)), (AXIS,)))

    def with_whole_kv(self, layers: Sequence[int]) -> "Placement":
        """This placement with the K / V of `layers` (owning layers) whole on every device too."""
        return dataclasses.replace(self, whole_kv=self.whole_kv | frozenset(layers))

    @property
    def tp(self) -> int:
        return self.mesh.shape[AXIS]

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def _split(self, dim: int) -> bool:
        return self.tp > 1 and dim % self.tp == 0

    def kv_split(self, cfg: TextConfig, layer: int) -> bool:
        """Whether owning layer `layer`'s K / V (projections and pages) are split by KV head."""
        return layer not in self.whole_kv and self._split(cfg.layers[layer].num_kv_heads)

    def page_copies(self, cfg: TextConfig) -> dict[int, int]:
        """Owning layer -> how many devices hold its pages whole (tp), for the layers whose pages are not split:
        the pools' bytes on all devices together are then their split pages' once and these tp times."""
        if self.tp == 1:
            return {}
        return {i: self.tp for i in owning_layers(cfg) if not self.kv_split(cfg, i)}

    def extra_copies(self, params: Any, shardings: Any = None) -> list[jax.ShapeDtypeStruct]:
        """The copies of `params` the devices hold beyond one, as shapes: each leaf whole on every device (its
        sharding in `shardings`, a matching tree, is P(); None: every leaf is) tp - 1 more times, for memory
        planning that splits the weights it is given over the devices. Leaves already placed over several devices
        are left out: the devices' memory in use counts their copies."""
        leaves = jax.tree_util.tree_leaves(params)
        whole = ([True] * len(leaves) if shardings is None
                 else [s.is_fully_replicated for s in jax.tree_util.tree_leaves(shardings)])
        return [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf, w in zip(leaves, whole)
                if w and not (isinstance(leaf, jax.Array) and len(leaf.devices()) > 1)] * (self.tp - 1)

    def target_param_spec(self, cfg: TextConfig, name: str, shape: tuple[int, ...]) -> P:
        """The partition spec of the target parameter `name` (dotted path in the parameter tree)."""
        m = _LAYER.match(name)
        # An fp8 weight's scale (`<weight>_scale`, one per output row) goes where its weight's output rows go.
        scale = name.endswith("_scale")
        weight = name[: -len("_scale")] if scale else name
        rows = lambda split: P(AXIS, *(None,) * (len(shape) - 1)) if split else P()  # noqa: E731
        if weight.endswith(("self_attn.q_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return rows(self._split(shape[0]))
        if weight.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            return rows(m is not None and self.kv_split(cfg, int(m.group(1))))
        if weight.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            return P() if scale else P(None, AXIS) if self._split(shape[1]) else P()
        if weight.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return rows(self._split(shape[0]))
        if name == "embed_tokens_per_layer.weight":
            return P(AXIS, None) if self._split(shape[0]) else P()
        return P()

    def target_params(self, cfg: TextConfig, params: Any) -> Any:
        """A tree of NamedShardings matching the target's parameter tree."""
        def spec(path, leaf):
            name = ".".join(str(getattr(k, "key", k)) for k in path)
            return NamedSharding(self.mesh, self.target_param_spec(cfg, name, tuple(leaf.shape)))

        return jax.tree_util.tree_map_with_path(spec, params)

    def pages(self, cfg: TextConfig) -> dict[int, tuple[NamedSharding, NamedSharding]]:
        """Owning layer -> (K, V) shardings of its page pool [nKV, pages, page_size, D]."""
        out = {}
        for i in owning_layers(cfg):
            s = NamedSharding(self.mesh, P(AXIS) if self.kv_split(cfg, i) else P())
            out[i] = (s, s)
        return out

    def replicate(self, tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda _: self.replicated, tree)

    def put(self, tree: Any, shardings: Any) -> Any:
        return jax.device_put(tree, shardings)
