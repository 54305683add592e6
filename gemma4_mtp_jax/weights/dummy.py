"""Random weights at a config's shapes (`--load-format dummy`, as vLLM's): for timing real shapes without the
real checkpoint. They prove speed, never quality."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random_leaf(key, shape, dtype, kind):
    if kind == "int":
        return jax.random.permutation(key, shape[0]).astype(dtype)
    if kind == "vector":
        return (1 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_params(abstract: Any, seed: int = 0) -> Any:
    """Random weights with the abstract tree's shapes/dtypes, made on the default device leaf by leaf (never
    zeros: zeros run faster than real data). Norm-like vectors ~1, matrices ~N(0, 0.02), int leaves (a centroid
    head's token ordering) a permutation. One compiled generator per distinct (shape, dtype): layers of the same
    shape reuse it."""
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    key = jax.random.PRNGKey(seed)
    out = []
    for i, leaf in enumerate(leaves):
        kind = "int" if jnp.issubdtype(leaf.dtype, jnp.integer) else "vector" if len(leaf.shape) <= 1 else "matrix"
        out.append(_random_leaf(jax.random.fold_in(key, i), tuple(leaf.shape), jnp.dtype(leaf.dtype), kind))
    jax.block_until_ready(out)
    return jax.tree_util.tree_unflatten(treedef, out)
