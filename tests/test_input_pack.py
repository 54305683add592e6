"""The step programs' packed host inputs (input_pack.py): every dtype comes back bit for bit, through the staging
buffer; the result comes back over the inputs' first columns; bad inputs fail with the leaf named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma4_mtp_jax.programs.input_pack import pack_rows, packed_width, return_in, unpack_rows


def _tree(B: int, rng: np.random.Generator) -> dict:
    floats = rng.standard_normal(B).astype(np.float32)
    floats[0] = np.inf  # bits, not values: the extremes must survive too
    return {
        "flag": rng.random(B) < 0.5,
        "ids": rng.integers(-(2**31), 2**31 - 1, (B, 3), dtype=np.int32),
        "temperature": floats,
        "seed": np.array([2**32 - 1] + [7] * (B - 1), np.uint32),
        "table": {"full": rng.integers(0, 100, (B, 5), dtype=np.int32)},
    }


def test_round_trip_through_the_staging_buffer():
    rng = np.random.default_rng(0)
    tree = _tree(3, rng)
    packed = pack_rows(tree)
    assert packed.dtype == np.int32 and packed.shape == (3, packed_width(tree)) == (3, 1 + 3 + 1 + 1 + 5)
    staging = jnp.full((packed.size + 5,), -7, jnp.int32).at[-1].set(0)  # its last element is the write's offset

    @jax.jit
    def roundtrip(packed, staging):
        return unpack_rows(packed, tree, staging)

    out, staged = roundtrip(packed, staging)
    for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree_util.tree_leaves(out)):
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape, jax.tree_util.keystr(path)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), jax.tree_util.keystr(path)
    staged = np.asarray(staged)
    assert np.array_equal(staged[: packed.size], packed.reshape(-1)) and (staged[packed.size:-1] == -7).all()


def test_bad_inputs_name_the_leaf():
    rng = np.random.default_rng(1)
    tree = _tree(2, rng)
    with pytest.raises(TypeError, match="leaf 0 has dtype float64"):
        pack_rows({"a": np.zeros(2, np.float64)})
    with pytest.raises(ValueError, match=r"leaf 1 has shape \(3,\)"):
        pack_rows({"a": np.zeros(2, np.int32), "b": np.zeros(3, np.int32)})
    packed = pack_rows(tree)
    with pytest.raises(ValueError, match="staging buffer of more than"):
        unpack_rows(jnp.asarray(packed), tree, jnp.zeros((packed.size,), jnp.int32))


def test_result_returned_in_the_donated_inputs():
    """The inputs are read (staged) before the result overwrites their first columns, in place."""
    rng = np.random.default_rng(2)
    tree = _tree(3, rng)
    packed = pack_rows(tree)
    staging = jnp.zeros((packed.size + 1,), jnp.int32)

    @jax.jit
    def step(packed, staging):
        out, staged = unpack_rows(packed, tree, staging)
        return staged, return_in(packed, out["table"]["full"][:, :2] * 2)

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(packed, staging).compile()
    assert "{1}: (0, {}" in compiled.as_text().splitlines()[0], "the result does not alias the donated inputs"
    _, got = compiled(jnp.asarray(packed), staging)
    want = packed.copy()
    want[:, :2] = tree["table"]["full"][:, :2] * 2
    assert np.array_equal(np.asarray(got), want)
    wide = jnp.arange(3 * (packed.shape[1] + 1), dtype=jnp.int32).reshape(3, -1)
    assert np.array_equal(np.asarray(return_in(jnp.asarray(packed), wide)), np.asarray(wide))  # its own array
    with pytest.raises(ValueError, match=r"result of 2 rows for packed inputs of 3"):
        return_in(jnp.asarray(packed), jnp.zeros((2, 2), jnp.int32))
