"""Functions traced once per program however often a program calls them.

A step program unrolls its loops: 60 decoder layers at 31B, k draft steps of the assistant. Traced inline, each
repetition is traced and lowered again (2-6 s of start-up per program at 31B on the H200:
docs/decisions/0011-trace-layers-once.md). As a
jitted function called with the same argument shapes, it is traced once and lowered once per program; XLA inlines
the calls, so the compiled program computes the same (bitwise in float32; in bfloat16 XLA's excess precision may
keep other intermediates in float32).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import jax

from gemma4_mtp_jax.kernels.device_budget import kernels_chosen, kernels_interpreted

# (ids of the owners, key) -> (the owners, the jitted function). The owners (configs, models) are kept alive with
# their functions, so an id is never reused while its entry exists.
_TRACED: dict[tuple, tuple[tuple, Callable]] = {}


def traced_once(owners: tuple, key: Hashable, build: Callable[[], Callable]) -> Callable:
    """`jax.jit(build())`, built once per (owners, key): `owners` are the objects the function closes over (compared
    by identity: configs holding dicts cannot be hashed), `key` the hashable rest of what shapes it. The kernel
    choices in force (`device_budget.pallas_kernels`, a per-thread setting JAX's own caches do not see) are part of
    the key too."""
    k = (tuple(map(id, owners)), key, kernels_chosen(), kernels_interpreted())
    hit = _TRACED.get(k)
    if hit is None or any(a is not b for a, b in zip(hit[0], owners)):
        hit = _TRACED[k] = (owners, jax.jit(build()))
    return hit[1]
