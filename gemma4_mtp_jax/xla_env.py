"""XLA settings that only take effect when set before JAX starts its GPU client: they go into XLA_FLAGS.

XLA runs each step program as command buffers (CUDA graphs) and, before a run, re-records every graph node whose
buffers moved since the last run. The temporaries are one allocation that every node uses, and it moves whenever a
call is dispatched before the previous one has finished (the engine's async scheduling does exactly that): E2B's
decode then re-records all ~850 nodes, 2-3 ms of host time per step, and the speculative program its ~1000 nodes.
`xla_gpu_command_buffer_update_mode=SKIP_TEMP` gives the temporaries a stable virtual address so those updates stop;
it needs XLA's VMM allocator, which the GPU client only selects when the flag is in XLA_FLAGS at start-up. Passed
per program instead (a compile option, step.compiler_options), it leaves the allocator alone and most updates stay
(docs/decisions/0001-command-buffer-update-mode.md).

The same holds for how much of a GPU's memory JAX's allocator may use (`XLA_PYTHON_CLIENT_MEM_FRACTION`, JAX's
default 0.75, which the VMM allocator takes as its budget of physical memory): a server sets it through
`set_memory_fraction` before it touches a device.

What the allocator may use is then read back with `allocator_memory`: the BFC allocator reports its limit in
`memory_stats()`, but the VMM allocator reports nothing, so there it is the GPU's total memory (from the
CUDA driver) times the fraction JAX started with, which is how the VMM allocator sets its budget.

`set_gpu_runtime_flags()` runs when the package is imported. It only touches XLA_FLAGS where a CUDA plugin of JAX
>= 0.11 is installed (older XLA rejects the value and would abort), JAX_PLATFORMS does not rule the GPU out, and
XLA_FLAGS does not already choose an update mode. Importing the package after JAX has started a backend is too
late (XLA has read its flags): the flag is then left out, with a warning, and the programs fall back on the compile
option.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import logging
import os
import sys

log = logging.getLogger(__name__)

# The XLA option and the value the step programs need, as XLA_FLAGS here and as a compile option in step.py.
UPDATE_MODE_OPTION, STABLE_TEMPORARIES = "xla_gpu_command_buffer_update_mode", "SKIP_TEMP"
UPDATE_MODE = f"--{UPDATE_MODE_OPTION}"
_SET_BY_US = f"{UPDATE_MODE}={STABLE_TEMPORARIES}"
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def _jax_version() -> tuple[int, int]:
    try:
        major, minor = importlib.metadata.version("jaxlib").split(".")[:2]
        return int(major), int(minor)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return (0, 0)


def _cuda_plugin_installed() -> bool:
    for name in _CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # no jax_plugins namespace at all
            return False
    return False


def _backend_started() -> bool:
    """Whether JAX has started a backend in this process (XLA has then read XLA_FLAGS for good)."""
    return bool(getattr(sys.modules.get("jax._src.xla_bridge"), "_backends", None))


def _gpu_allowed() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return not platforms or any(p in platforms.lower() for p in ("cuda", "gpu"))


def set_gpu_runtime_flags() -> bool:
    """Add SKIP_TEMP to XLA_FLAGS where it applies (see the module docstring); True if it was added."""
    flags = os.environ.get("XLA_FLAGS", "")
    if UPDATE_MODE in flags or not _gpu_allowed() or _jax_version() < (0, 11) or not _cuda_plugin_installed():
        return False
    if _backend_started():
        log.warning("JAX started before gemma4_mtp_jax was imported, so XLA_FLAGS can no longer give the step "
                    "programs stable temporaries (%s): import gemma4_mtp_jax first, or set it yourself", _SET_BY_US)
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {_SET_BY_US}".strip()
    return True


MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def set_memory_fraction(fraction: float) -> bool:
    """Let JAX's GPU allocator use `fraction` of each GPU's memory (MEM_FRACTION_ENV). Only before JAX starts its
    backend: after, it is left as it is, with a warning, and False is returned."""
    if not 0 < fraction <= 1:
        raise ValueError(f"a GPU memory fraction must be in (0, 1], got {fraction}")
    if _backend_started():
        log.warning("JAX has started already: %s=%s is not applied", MEM_FRACTION_ENV, fraction)
        return False
    os.environ[MEM_FRACTION_ENV] = str(fraction)
    return True


def update_mode_in_flags() -> bool:
    """Whether XLA_FLAGS chooses a command-buffer update mode (ours or the user's) for every program."""
    return UPDATE_MODE in os.environ.get("XLA_FLAGS", "")


JAX_DEFAULT_MEM_FRACTION = 0.75  # what JAX's GPU allocators take without MEM_FRACTION_ENV


@functools.cache
def _cuda_total_memory(ordinal: int) -> int | None:
    """Bytes of memory of CUDA device `ordinal`, from the driver (no context needed); None without a driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, total = ctypes.c_int(), ctypes.c_size_t()
    if (cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0
            or cuda.cuDeviceTotalMem_v2(ctypes.byref(total), device) != 0):
        return None
    return int(total.value)


def allocator_memory(device) -> tuple[int, int | None] | None:
    """(limit, in use) of the bytes JAX's allocator may take on `device`: `memory_stats()` where the allocator
    reports them (BFC); on an NVIDIA GPU whose allocator reports nothing (XLA's VMM allocator, which
    set_gpu_runtime_flags selects), the device's total memory times the fraction JAX started with, in use
    unknown (None). None where no limit is known (CPU)."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    if device.platform not in ("gpu", "cuda"):
        return None
    total = _cuda_total_memory(int(getattr(device, "local_hardware_id", None) or 0))
    if total is None:
        return None
    try:
        fraction = float(os.environ.get(MEM_FRACTION_ENV, JAX_DEFAULT_MEM_FRACTION))
    except ValueError:
        fraction = JAX_DEFAULT_MEM_FRACTION
    return int(total * fraction), None
