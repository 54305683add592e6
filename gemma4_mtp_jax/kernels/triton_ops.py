"""What every Pallas kernel of this package does the same way on Pallas' Triton backend: masked loads and
stores, a matmul with float32 accumulation, and the compiler parameters that select the backend.

`jax.experimental.pallas.triton` is imported where it is used: it is part of jaxlib's GPU support, and the CPU
path (interpret mode) must not need it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

Array = jax.Array

__all__ = ["load", "store", "dot", "dot_t", "compiler_params"]


def load(ref, mask, other=0) -> Array:
    """ref[...] (an indexed ref) with the lanes where `mask` is False never read (they give `other`)."""
    from jax.experimental.pallas import triton as pltriton

    if jnp.dtype(ref.dtype).itemsize == 1 and jnp.issubdtype(ref.dtype, jnp.floating):
        # The Triton lowering cannot cast a Python scalar to float8 (it splats an int32 first); a float8 `other`
        # lowers (tests/test_triton_lowering.py: test_grouped_matmul_fp8_lowers).
        other = jnp.asarray(other, ref.dtype)
    return pltriton.load(ref, mask=mask, other=other)


def store(ref, value: Array, mask) -> None:
    """ref[...] = value (cast to the ref's dtype) where `mask` holds; other lanes are never written."""
    from jax.experimental.pallas import triton as pltriton

    pltriton.store(ref, value.astype(ref.dtype), mask=mask)


def _precision(dtype):
    # float32 operands at full precision: TF32 would change the parity tests' numbers.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def dot(a: Array, b: Array, trans_b: bool = False) -> Array:
    """a @ b (or a @ b.T) with float32 accumulation, through Pallas' own dot (the Triton backend's where present)."""
    from jax.experimental.pallas import triton as pltriton

    f = getattr(pltriton, "dot", None) or pl.dot
    return f(a, b, trans_b=trans_b, precision=_precision(a.dtype))


def dot_t(a: Array, b: Array) -> Array:
    """a @ b.T with float32 accumulation, as a dot_general (what interpret mode and Triton both lower)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a.dtype),
                           preferred_element_type=jnp.float32)


def compiler_params(num_warps: int, num_stages: int = 1, *, interpret: bool = False):
    """Triton's compiler parameters (they select the Triton lowering), or None in interpret mode."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
