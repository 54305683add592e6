"""The device the programs are compiled for, and what one GPU program may use there: shared memory per block and
the number of SMs, read off the device.

Every Pallas kernel plans its tiling against this budget, so a shape that no tiling fits falls back to the XLA
path instead of failing to compile. Off the GPU (CPU tests, interpret mode) the budget is an H100/H200's, so the
tiling planned there is the one the H200 would run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator

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


def is_gpu(device) -> bool:
    return device.platform in ("gpu", "cuda", "rocm")


def _capability(device) -> tuple[int, int] | None:
    """A GPU's compute capability (major, minor), None where it reports none JAX can parse."""
    try:
        major, minor = (int(x) for x in str(getattr(device, "compute_capability", None)).split(".")[:2])
    except (TypeError, ValueError):
        return None
    return major, minor


def budget_of(device) -> GpuBudget:
    """The budget of `device`: HOPPER off the GPU, else read from its compute capability and SM count."""
    if not is_gpu(device):
        return HOPPER
    cc = _capability(device)
    smem = _SMEM_UNKNOWN if cc is None else _SMEM_BY_CC.get(cc, _SMEM_UNKNOWN)
    sms = int(getattr(device, "core_count", 0) or HOPPER.num_sms)
    return GpuBudget(smem_per_block=smem, num_sms=sms, name=str(getattr(device, "device_kind", "gpu")))


FP8_CAPABILITY = (8, 9)  # Ada and newer: Triton converts float8_e4m3fn (Pallas' lowering refuses it below)


def check_fp8_support(devices, what: str = "fp8 weights") -> None:
    """A ValueError naming the first GPU of `devices` whose compute capability is below FP8_CAPABILITY: fp8 weights
    and an fp8 K/V cache (`what`) are converted inside the kernels that read them. CPUs pass (the tests run fp8
    there: XLA converts in software, the kernels run interpreted); a GPU that reports no capability fails."""
    for d in devices:
        if not is_gpu(d):
            continue
        cc = _capability(d)
        if cc is None or cc < FP8_CAPABILITY:
            have = "no compute capability" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
            raise ValueError(f"{what} need a GPU of compute capability >= {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} "
                             f"(Ada, Hopper or newer); device {getattr(d, 'id', '?')} "
                             f"({getattr(d, 'device_kind', 'gpu')}) has {have}")


def target_device() -> jax.Device:
    """The device the programs traced now are compiled for: JAX's default device where one is set
    (`jax.default_device`, possibly a compile-only device of an ahead-of-time topology, so that a machine without a
    GPU can compile the GPU's programs), else the first device of the default backend."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.devices()[0]
    return jax.devices(device)[0] if isinstance(device, str) else device


def on_gpu() -> bool:
    """Whether the programs traced now are compiled for a GPU."""
    return is_gpu(target_device())


_mode = threading.local()


@contextlib.contextmanager
def pallas_kernels() -> Iterator[None]:
    """Trace programs with the Pallas kernels wherever they are compiled: every "auto" choice of a kernel over XLA's
    math takes the kernel (where its shapes fit, as on a GPU), and off the GPU the kernels run in interpret mode.
    So a machine without a GPU runs the GPU's programs, kernels included (slowly: each kernel's grid becomes a
    loop). The setting is per thread and holds while the programs are traced."""
    before = getattr(_mode, "pallas", False)
    _mode.pallas = True
    try:
        yield
    finally:
        _mode.pallas = before


def kernels_chosen() -> bool:
    """Whether an "auto" choice of a Pallas kernel over XLA's math takes the kernel in the programs traced now: on
    a GPU, and anywhere inside `pallas_kernels()`."""
    return on_gpu() or getattr(_mode, "pallas", False)


def kernels_interpreted() -> bool:
    """Whether a Pallas kernel traced now runs in interpret mode: inside `pallas_kernels()` off the GPU."""
    return getattr(_mode, "pallas", False) and not on_gpu()


@functools.lru_cache(maxsize=None)
def _budget_of(device) -> GpuBudget:
    return budget_of(device)


def default_budget() -> GpuBudget:
    """The budget of the device the programs traced now are compiled for (`target_device`), cached per device."""
    return _budget_of(target_device())
