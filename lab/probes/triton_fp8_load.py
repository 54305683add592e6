"""Probe: does Pallas' Triton lowering load and store float8_e4m3fn on this GPU (convert to bf16 after a masked load,
a dot with a bf16 tile, an fp8 store)? The fp8 KV cache and fp8 expert weights rely on it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from gemma4_mtp_jax.kernels.triton_ops import compiler_params, dot_t, load, store

F8 = jnp.float8_e4m3fn


def kernel(x_ref, w_ref, o_ref, q_ref):
    rows = jnp.arange(16) < 16
    x = load(x_ref.at[:, :], rows[:, None])
    w = load(w_ref.at[:, :], jnp.ones((64, 1), bool)).astype(x.dtype)
    y = dot_t(x, w)
    o_ref[...] = y
    store(q_ref.at[:, :], jnp.clip(y, -448, 448), rows[:, None])


@jax.jit
def run(x, w):
    return pl.pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((16, 64), jnp.float32),
                                             jax.ShapeDtypeStruct((16, 64), F8)),
                          compiler_params=compiler_params(4))(x, w)


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, 64)), F8)
    y, q = run(x, w)
    ref = np.asarray(x, np.float32) @ np.asarray(w.astype(jnp.float32)).T
    print("triton fp8 load/dot max err", float(np.max(np.abs(np.asarray(y) - ref))),
          "store ok", bool(np.allclose(np.asarray(q.astype(jnp.float32)), np.asarray(jnp.clip(y, -448, 448).astype(F8).astype(jnp.float32)))))
