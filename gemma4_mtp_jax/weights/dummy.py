"""Random weights at a config's shapes (`--load-format dummy`, as vLLM's): for timing real shapes without the
real checkpoint. They prove speed, never quality."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from gemma4_mtp_jax.weights.quantize import FP8, FP8_MAX, is_scale, quantize_abstract

STD = 0.02  # a matrix's weights ~N(0, STD), quantized or not
# An fp8 weight's values ~N(0, FP8_MAX / SPREAD) and its scales ~STD * SPREAD / FP8_MAX: a row's largest weights
# (about SPREAD standard deviations out) reach the top of fp8's range, as in a checkpoint quantized by amax.
SPREAD = 4.0


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random_leaf(key, shape, dtype, kind):
    if kind == "int":
        return jax.random.permutation(key, shape[0]).astype(dtype)
    if kind == "vector":
        return (1 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    if kind == "fp8":
        values = jax.random.normal(key, shape, jnp.float32) * (FP8_MAX / SPREAD)
        return jnp.clip(values, -FP8_MAX, FP8_MAX).astype(dtype)
    if kind == "scale":
        return (STD * SPREAD / FP8_MAX * (1 + 0.1 * jax.random.normal(key, shape, jnp.float32))).astype(dtype)
    return (STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _kind(path: str, leaf) -> str:
    if jnp.issubdtype(leaf.dtype, jnp.integer):
        return "int"
    if jnp.dtype(leaf.dtype) == FP8:
        return "fp8"
    if is_scale(path):
        return "scale"
    return "vector" if len(leaf.shape) <= 1 else "matrix"


def random_params(abstract: Any, seed: int = 0, quantization: str | None = None) -> Any:
    """Random weights with the abstract tree's shapes/dtypes, made on the default device leaf by leaf (never
    zeros: zeros run faster than real data). Norm-like vectors ~1, matrices ~N(0, 0.02), int leaves (a centroid
    head's token ordering) a permutation. One compiled generator per distinct (shape, dtype): layers of the same
    shape reuse it.

    fp8 weights (an abstract tree from `weights.quantize.quantize_abstract`, or `quantization="fp8"` to quantize the
    unquantized tree's shapes here): values spread over fp8's range and per-output-channel scales, so that the
    weights they stand for are ~N(0, 0.02) too."""
    if quantization == "fp8":
        abstract = quantize_abstract(abstract)
    elif quantization not in (None, "none"):
        raise ValueError(f"quantization must be None, 'none' or 'fp8', got {quantization!r}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    key = jax.random.PRNGKey(seed)
    out = []
    for i, (path, leaf) in enumerate(leaves):
        kind = _kind(".".join(str(getattr(k, "key", k)) for k in path), leaf)
        out.append(_random_leaf(jax.random.fold_in(key, i), tuple(leaf.shape), jnp.dtype(leaf.dtype), kind))
    jax.block_until_ready(out)
    return jax.tree_util.tree_unflatten(treedef, out)
