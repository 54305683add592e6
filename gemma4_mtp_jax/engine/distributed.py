"""Several hosts: one JAX program across processes (`jax.distributed.initialize`).

Every process runs the same command with its own process id; process 0's address is the coordinator. After
`initialize`, `jax.devices()` lists the devices of every process, so `--tensor-parallel-size` can span hosts and
each step stays one SPMD program. Every process feeds the same host arrays and reads the same replicated results:
`generate`'s engines schedule the same requests in the same order, a server's followers run the program calls
process 0 publishes (multihost.py).
"""

from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger(__name__)

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join the multi-process job from arguments, else from $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES and
    $JAX_PROCESS_ID. Returns False (and does nothing) when neither names a coordinator: one process. Call before
    anything touches a device."""
    coordinator_address = coordinator_address or os.environ.get(ENV[0])
    if not coordinator_address:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise ValueError("--num-processes / --process-id need --coordinator-address (or $JAX_COORDINATOR_ADDRESS)")
        return False
    try:
        num_processes = int(num_processes if num_processes is not None else os.environ[ENV[1]])
        process_id = int(process_id if process_id is not None else os.environ[ENV[2]])
    except KeyError as e:
        raise ValueError(f"a multi-process run needs --num-processes and --process-id (or ${e.args[0]})") from None
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id} must be in [0, --num-processes {num_processes})")
    if (os.environ.get("JAX_PLATFORMS") or "").startswith("cpu"):
        # CPU devices of different processes talk through gloo (the default CPU backend has no collectives).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    log.info("process %d of %d: %d local devices, %d in all", process_id, num_processes, len(jax.local_devices()),
             len(jax.devices()))
    return True

