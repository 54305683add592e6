"""save_params / restore_params round trips with exact dtypes and values."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from gemma4_mtp_jax.weights.orbax_io import (
    FORMAT_VERSION,
    METADATA_FILE,
    is_orbax_checkpoint,
    read_metadata,
    restore_params,
    save_params,
)
from gemma4_mtp_jax.weights.safetensors_io import CheckpointError


def _params():
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((32, 8)).astype(ml_dtypes.bfloat16),
        "layers": {
            "0": {
                "q": rng.standard_normal((8, 16)).astype(np.float32),
                "scalar": np.array([0.25], np.float32),
            },
            "1": {
                "q": jnp.asarray(rng.standard_normal((8, 16)), dtype=jnp.bfloat16),
                "scalar": jnp.asarray([0.5], dtype=jnp.float32),
            },
        },
        "token_ordering": rng.permutation(32).astype(np.int32),
        "stacked": jnp.asarray(rng.standard_normal((2, 3, 4)), dtype=jnp.float32),
        "zero_d": np.float32(1.5),
    }


def _assert_same(got, ref):
    ref_flat = jax.tree_util.tree_flatten_with_path(ref)[0]
    got_flat = dict(jax.tree_util.tree_flatten_with_path(got)[0])
    assert len(got_flat) == len(ref_flat)
    for path, r in ref_flat:
        g = got_flat[path]
        r = np.asarray(r)
        g_np = np.asarray(g)
        assert g_np.dtype == r.dtype, (path, g_np.dtype, r.dtype)
        assert g_np.shape == r.shape, path
        np.testing.assert_array_equal(g_np.reshape(-1).view(np.uint8), r.reshape(-1).view(np.uint8), err_msg=str(path))


def test_round_trip(tmp_path):
    params = _params()
    out = tmp_path / "ckpt"
    written = save_params(out, params, metadata={"kind": "target", "dtype": "bfloat16", "extra": [1, 2]})
    assert is_orbax_checkpoint(out)
    assert written["num_tensors"] == 8
    restored, meta = restore_params(out)
    _assert_same(restored, params)
    for leaf in jax.tree_util.tree_leaves(restored):
        assert isinstance(leaf, np.ndarray)
    assert meta["kind"] == "target"
    assert meta["dtype"] == "bfloat16"
    assert meta["extra"] == [1, 2]
    assert meta["format_version"] == FORMAT_VERSION
    assert meta == read_metadata(out)


def test_restore_as_jax_arrays(tmp_path):
    params = _params()
    save_params(tmp_path, params, metadata={"kind": "assistant"})
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restored, meta = restore_params(tmp_path, shardings=sharding)
    for leaf in jax.tree_util.tree_leaves(restored):
        assert isinstance(leaf, jax.Array)
    _assert_same(restored, params)
    assert meta["kind"] == "assistant"
    # inferred when not given: bytes are dominated by the bf16 embed + layer 1
    assert meta["dtype"] in ("bfloat16", "float32")


def test_refuses_overwrite(tmp_path):
    params = _params()
    save_params(tmp_path, params, metadata={"kind": "target"})
    with pytest.raises(CheckpointError, match="force=True"):
        save_params(tmp_path, params, metadata={"kind": "target"})
    changed = {"w": np.arange(4, dtype=np.int32)}
    save_params(tmp_path, changed, metadata={"kind": "assistant"}, force=True)
    restored, meta = restore_params(tmp_path)
    _assert_same(restored, changed)
    assert meta["kind"] == "assistant"


def test_not_a_checkpoint(tmp_path):
    assert not is_orbax_checkpoint(tmp_path)
    assert not is_orbax_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="gemma4_mtp_jax.json is missing"):
        restore_params(tmp_path)


def test_unknown_format_version(tmp_path):
    save_params(tmp_path, {"w": np.zeros(3, np.float32)}, metadata={"kind": "target"})
    path = tmp_path / METADATA_FILE
    meta = json.loads(path.read_text())
    meta["format_version"] = 999
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="unknown format_version 999"):
        restore_params(tmp_path)


def test_bad_trees_rejected(tmp_path):
    with pytest.raises(CheckpointError, match="not an array"):
        save_params(tmp_path / "a", {"w": [1, 2, 3]}, metadata={})
    with pytest.raises(CheckpointError, match="not a string"):
        save_params(tmp_path / "b", {1: np.zeros(2)}, metadata={})
    with pytest.raises(CheckpointError, match="JSON"):
        save_params(tmp_path / "c", {"w": np.zeros(2)}, metadata={"x": object()})
    assert not is_orbax_checkpoint(tmp_path / "a")
