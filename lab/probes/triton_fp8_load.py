"""Probe: which ways of loading and storing float8_e4m3fn lower through Pallas' Triton backend on this GPU. The
fp8 KV cache and fp8 expert weights rely on one of them. Each variant: a [16, 64] bf16 tile times a [64, 64] fp8
tile, and an fp8 store of the product."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from gemma4_mtp_jax.kernels.triton_ops import compiler_params, dot_t, load, store

F8 = jnp.float8_e4m3fn


def make(variant):
    def kernel(x_ref, w_ref, o_ref, q_ref):
        x = x_ref[...]
        cols = jnp.arange(64) < 64
        if variant == "masked_other0":
            w = load(w_ref.at[:, :], cols[:, None])
        elif variant == "masked_other_f8":
            w = load(w_ref.at[:, :], cols[:, None], other=jnp.zeros((), F8))
        elif variant == "masked_no_other":
            from jax.experimental.pallas import triton as pltriton
            w = pltriton.load(w_ref.at[:, :], mask=cols[:, None])
        elif variant == "plain":
            w = w_ref[...]
        w = w.astype(x.dtype)
        y = dot_t(x, w)
        o_ref[...] = y
        if variant == "plain":
            q_ref[...] = jnp.clip(y, -448, 448).astype(F8)
        else:
            store(q_ref.at[:, :], jnp.clip(y, -448, 448), jnp.ones((16, 1), bool))
    return kernel


def run(variant, x, w):
    return jax.jit(pl.pallas_call(make(variant), out_shape=(jax.ShapeDtypeStruct((16, 64), jnp.float32),
                                                              jax.ShapeDtypeStruct((16, 64), F8)),
                                  compiler_params=compiler_params(4)))(x, w)


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(64, 64)), F8)
    ref = np.asarray(x, np.float32) @ np.asarray(w.astype(jnp.float32)).T
    for variant in ("plain", "masked_no_other", "masked_other_f8", "masked_other0"):
        try:
            y, q = run(variant, x, w)
            want = np.asarray(jnp.clip(jnp.asarray(ref), -448, 448).astype(F8).astype(jnp.float32))
            print(variant, "dot max err", float(np.max(np.abs(np.asarray(y) - ref))),
                  "store mismatches", int(np.sum(np.asarray(q.astype(jnp.float32)) != want)), flush=True)
        except Exception as e:
            print(variant, "FAILS:", type(e).__name__, str(e).splitlines()[0][:200], flush=True)
