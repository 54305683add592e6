"""Where an engine's KV pools fit: the device memory its weights and programs leave, and how the pools are cut to
it; and a device out of memory at start-up, explained in the engine's terms."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from gemma4_mtp_jax.engine.config import EngineConfig
from gemma4_mtp_jax.model.kv_state import KVLayout
from gemma4_mtp_jax.xla_env import allocator_memory

log = logging.getLogger(__name__)


class DeviceMemoryError(RuntimeError):
    """The engine's weights, KV pools and programs do not fit in its devices' memory (raised at start-up)."""


def _nbytes(leaf: Any) -> int:
    """Bytes of an array or of a shape alone (jax.ShapeDtypeStruct)."""
    return int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize


def pool_memory_left(devices: Sequence[jax.Device], params: Any) -> int | None:
    """Bytes of KV pool the devices can take, in all (pages are split over tensor-parallel devices): what each
    device's allocator has left (`xla_env.allocator_memory`: its limit less what is in use), less the share of
    `params` not on the device yet (a loader may leave weights in host memory until the programs place them), less
    a reserve for the programs' temporaries and for XLA's GEMM autotuning at compile time, which allocates the
    operands of each matmul it tunes: twice the largest weight, plus 1 GiB. Where an allocator does not say what
    it holds (XLA's VMM allocator), the weights already on the devices count as its use. None where a device has
    no known memory limit (CPU). Across processes (multi-host) each reads its own devices: the pools are split
    alike over all of them."""
    memory = [allocator_memory(d) for d in devices if d.process_index == jax.process_index()]
    if not memory or any(m is None for m in memory):
        return None
    leaves = jax.tree_util.tree_leaves(params)
    nbytes = [_nbytes(x) for x in leaves]
    placed = [isinstance(x, jax.Array) and {d.platform for d in x.devices()} == {devices[0].platform}
              for x in leaves]
    # Shapes alone (jax.ShapeDtypeStruct: an engine that compiles before the weights are loaded, `compile_ahead`)
    # count as weights still to come, so that it plans the pools the engine built after loading plans.
    host = sum(n for x, n, p in zip(leaves, nbytes, placed)
               if isinstance(x, (np.ndarray, jax.Array, jax.ShapeDtypeStruct)) and not p)
    on_devices = sum(n for n, p in zip(nbytes, placed) if p)
    reserve = 2 * max(nbytes, default=0) + (1 << 30)
    free = min(limit - (on_devices // len(devices) if used is None else used) for limit, used in memory)
    return max(0, len(devices) * (free - host // len(devices) - reserve))


def pool_sizes(probe: KVLayout, config: EngineConfig, page_bytes: dict[str, int], weights: Any,
               devices: Sequence[jax.Device] | None) -> dict[str, int]:
    """Pages per KV group's pool (`probe`: the layout with unbounded pools, for table widths and rings): from
    `config.kv_cache_bytes`, or else room for max_num_seqs sequences of max_model_len (then no sequence is ever
    preempted) where the device memory left after `weights` allows (`pool_memory_left`), else what it allows."""
    groups = [g for g, _ in probe.pages_per_seq]
    # With the prefix cache, sliding pools hold one ring more than the running sequences take: a finished sequence's
    # window then outlives the next admission (which takes a whole ring), so the next request with the same prefix
    # finds it. Without that room every admission evicts the cached windows.
    spare = {g: probe.table_width(g) if config.enable_prefix_caching and probe.ring_pages(g) else 0 for g in groups}
    roomy = {g: config.max_num_seqs * probe.table_width(g) + spare[g] + 1 for g in groups}
    if config.kv_cache_bytes is not None:
        return _pages_for_memory(probe, config, page_bytes, roomy, config.kv_cache_bytes, "kv_cache_bytes")
    tp = config.tensor_parallel_size
    left = pool_memory_left(list(devices) if devices is not None else jax.devices()[:tp], weights)
    want = sum(n * page_bytes[g] for g, n in roomy.items())
    if left is None or want <= left:
        log.info("KV pools: %.2f GB for %d sequences of %d tokens (device memory left for them: %s)",
                 want / 1e9, config.max_num_seqs, config.max_model_len,
                 "not reported by the allocator" if left is None else f"{left / 1e9:.2f} GB")
        return roomy
    log.warning("the default KV pools (%.2f GB: %d sequences of %d tokens) do not fit in the %.2f GB of device "
                "memory left for them; sizing them to it (sequences beyond it are preempted)", want / 1e9,
                config.max_num_seqs, config.max_model_len, left / 1e9)
    return _pages_for_memory(probe, config, page_bytes, roomy, left, "the device memory left for the KV cache")


def _pages_for_memory(probe: KVLayout, config: EngineConfig, page_bytes: dict[str, int], roomy: dict[str, int],
                      budget: int, what: str) -> dict[str, int]:
    """Pool sizes within `budget` bytes: the sliding pools as `roomy` has them (a ring per sequence, taken whole at
    admission, and the prefix cache's spare ring), and the rest split evenly, in pages, between the groups whose
    pages grow with the sequence."""
    rings = {g: n for g, n in roomy.items() if probe.ring_pages(g)}
    growing = [g for g in roomy if g not in rings]
    left = budget - sum(n * page_bytes[g] for g, n in rings.items())
    n = left // sum(page_bytes[g] for g in growing) if growing else 0
    short = [g for g in growing if n - 1 < probe.table_width(g)]
    if left < 0 or short:
        need = (sum(n * page_bytes[g] for g, n in rings.items())
                + sum((probe.table_width(g) + 1) * page_bytes[g] for g in growing))
        raise ValueError(f"{what}={budget} cannot hold the sliding rings of max_num_seqs={config.max_num_seqs} "
                         f"sequences plus one sequence of max_model_len={config.max_model_len}: that needs at least "
                         f"{need} bytes (fewer sequences, a shorter max_model_len or, on a GPU, a larger "
                         f"--gpu-memory-utilization)")
    return {**rings, **{g: int(n) for g in growing}}


@contextlib.contextmanager
def out_of_memory_explained(doing: str, config: EngineConfig, weights: Any, kv_cache_bytes: int) -> Iterator[None]:
    """A device out of memory while the engine starts, said in the engine's terms: what takes the memory and which
    settings give some back."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        weight_bytes = sum(map(_nbytes, jax.tree_util.tree_leaves(weights)))
        raise DeviceMemoryError(
            f"out of device memory {doing}: the weights take {weight_bytes / 1e9:.2f} GB and the KV pools "
            f"{kv_cache_bytes / 1e9:.2f} GB (max_num_seqs={config.max_num_seqs} sequences of "
            f"max_model_len={config.max_model_len} tokens, {config.tensor_parallel_size} device(s)); lower "
            f"--max-num-seqs or --max-model-len, set --kv-cache-memory, or raise --gpu-memory-utilization "
            f"({str(e).splitlines()[0][:300]})") from e
