"""What one GPU program may use: shared memory per block and the number of SMs, read off the device.

Every Pallas kernel plans its tiling against this budget, so a shape that no tiling fits falls back to the XLA
path instead of failing to compile. Off the GPU (CPU tests, interpret mode) the budget is an H100/H200's, so the
tiling planned there is the one the H200 would run.
"""

from __future__ import annotations

import dataclasses
import functools

import jax


@dataclasses.dataclass(frozen=True)
class GpuBudget:
    smem_per_block: int  # bytes of shared memory one program may claim (the opt-in maximum)
    num_sms: int  # streaming multiprocessors: grid sizes aim at a few programs per SM
    name: str = ""


HOPPER = GpuBudget(smem_per_block=227 * 1024, num_sms=132, name="H100/H200")

# Opt-in shared memory per block by compute capability (CUDA programming guide, "Compute Capabilities").
_SMEM_BY_CC = {
    (7, 0): 96 * 1024, (7, 5): 64 * 1024,
    (8, 0): 163 * 1024, (8, 7): 163 * 1024, (8, 6): 99 * 1024, (8, 9): 99 * 1024,
    (9, 0): 227 * 1024, (10, 0): 227 * 1024, (12, 0): 99 * 1024,
}
_SMEM_UNKNOWN = 99 * 1024  # a capability not in the table: the smallest budget of recent parts


def _is_gpu(device) -> bool:
    return device.platform in ("gpu", "cuda", "rocm")


def budget_of(device) -> GpuBudget:
    """The budget of `device`: HOPPER off the GPU, else read from its compute capability and SM count."""
    if not _is_gpu(device):
        return HOPPER
    cc = getattr(device, "compute_capability", None)
    try:
        major, minor = (int(x) for x in str(cc).split(".")[:2])
        smem = _SMEM_BY_CC.get((major, minor), _SMEM_UNKNOWN)
    except (TypeError, ValueError):
        smem = _SMEM_UNKNOWN
    sms = int(getattr(device, "core_count", 0) or HOPPER.num_sms)
    return GpuBudget(smem_per_block=smem, num_sms=sms, name=str(getattr(device, "device_kind", "gpu")))


@functools.lru_cache(maxsize=None)
def _default_budget(backend: str) -> GpuBudget:
    return budget_of(jax.devices()[0]) if backend == "gpu" else HOPPER


def default_budget() -> GpuBudget:
    """The budget of the default device (cached per backend)."""
    return _default_budget(jax.default_backend())
