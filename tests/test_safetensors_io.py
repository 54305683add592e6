"""SafetensorsCheckpoint: single file, sharded index, bf16, and the errors that name file and tensor."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from gemma4_mtp_jax.weights.safetensors_io import CheckpointError, SafetensorsCheckpoint


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8)).astype(np.float32),
        "model.layers.0.layer_scalar": np.array([0.5], dtype=np.float32),
        "model.norm.weight": rng.standard_normal((8,)).astype(np.float16),
        "masked_embedding.token_ordering": rng.permutation(16).astype(np.int64),
        "scalar": np.array(3.0, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def _write_sharded(directory, tensors: dict[str, np.ndarray], n_shards: int = 3) -> dict[str, str]:
    names = sorted(tensors)
    weight_map = {}
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::n_shards]}
        save_file(part, os.path.join(directory, shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return weight_map


def _check_equal(ckpt: SafetensorsCheckpoint, tensors: dict[str, np.ndarray]) -> None:
    assert ckpt.names() == sorted(tensors)
    for name, ref in tensors.items():
        assert ckpt.shape(name) == ref.shape
        got = ckpt.read(name)
        assert got.dtype == ref.dtype, name
        assert got.shape == ref.shape, name
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), ref.reshape(-1).view(np.uint8))


def test_single_file(tmp_path):
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        _check_equal(ckpt, tensors)
        assert len(ckpt) == len(tensors)
        assert "model.norm.weight" in ckpt
        assert ckpt.dtype("model.embed_tokens.weight") == "BF16"
        assert ckpt.dtype("model.layers.0.self_attn.q_proj.weight") == "F32"
        assert ckpt.dtype("masked_embedding.token_ordering") == "I64"
        assert ckpt.total_bytes() == sum(t.nbytes for t in tensors.values())
        # A read array is a fresh, writable copy.
        a = ckpt.read("model.norm.weight")
        a[...] = 0
        assert np.any(ckpt.read("model.norm.weight") != 0)
        with pytest.raises(KeyError, match="nope"):
            ckpt.read("nope")
    assert ckpt._handles == {}


def test_single_file_path(tmp_path):
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "x.safetensors"))
    with SafetensorsCheckpoint(tmp_path / "x.safetensors") as ckpt:
        _check_equal(ckpt, tensors)


def test_bfloat16_round_trip_bits(tmp_path):
    # Every bf16 bit pattern except NaNs (whose payloads numpy may canonicalise) must come back.
    bits = np.arange(0, 1 << 16, dtype=np.uint16)
    values = bits.view(ml_dtypes.bfloat16)
    values = values[~np.isnan(values.astype(np.float32))].reshape(-1, 2)
    save_file({"w": values}, str(tmp_path / "model.safetensors"))
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert ckpt.dtype("w") == "BF16"
        got = ckpt.read("w")
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), values.view(np.uint16))


def test_torch_written_bf16(tmp_path):
    import torch  # in the test extra: a missing wheel fails, it does not skip
    from safetensors.torch import save_file as torch_save

    t = torch.randn(5, 7).to(torch.bfloat16)
    torch_save({"w": t}, str(tmp_path / "model.safetensors"))
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        got = ckpt.read("w")
    np.testing.assert_array_equal(got.astype(np.float32), t.float().numpy())


def test_sharded(tmp_path):
    tensors = _tensors(1)
    weight_map = _write_sharded(tmp_path, tensors)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert len(ckpt.files) == 3
        _check_equal(ckpt, tensors)
        for name, shard in weight_map.items():
            assert os.path.basename(ckpt.file_of(name)) == shard
        assert ckpt.metadata() == {"format": "pt"}
        seen = [n for n, _ in ckpt.items()]
        assert sorted(seen) == sorted(tensors)


def test_index_preferred_over_stray_files(tmp_path):
    tensors = _tensors(2)
    _write_sharded(tmp_path, tensors, n_shards=2)
    # A stray file that the index does not mention is ignored.
    save_file({"junk": np.zeros(3, np.float32)}, str(tmp_path / "unrelated.safetensors"))
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert "junk" not in ckpt
        _check_equal(ckpt, tensors)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        SafetensorsCheckpoint(tmp_path / "nothing_here")


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no safetensors checkpoint") as e:
        SafetensorsCheckpoint(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_missing_shard(tmp_path):
    tensors = _tensors(3)
    weight_map = _write_sharded(tmp_path, tensors)
    victim = sorted(set(weight_map.values()))[1]
    os.remove(tmp_path / victim)
    with pytest.raises(CheckpointError, match="missing shard") as e:
        SafetensorsCheckpoint(tmp_path)
    msg = str(e.value)
    assert victim in msg and "model.safetensors.index.json" in msg


def test_index_points_to_wrong_shard(tmp_path):
    tensors = _tensors(4)
    weight_map = _write_sharded(tmp_path, tensors, n_shards=2)
    shards = sorted(set(weight_map.values()))
    name = next(n for n, s in weight_map.items() if s == shards[0])
    weight_map[name] = shards[1]
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": weight_map}, f)
    with pytest.raises(CheckpointError, match="does not contain it") as e:
        SafetensorsCheckpoint(tmp_path)
    assert name in str(e.value)


def test_truncated_file_names_file_and_tensor(tmp_path):
    tensors = _tensors(5)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(CheckpointError, match="truncated") as e:
        SafetensorsCheckpoint(tmp_path)
    msg = str(e.value)
    assert str(path) in msg
    assert "tensor '" in msg  # the tensor whose data runs past the end


def test_truncated_header(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_tensors(6), str(path))
    with open(path, "r+b") as f:
        f.truncate(40)  # inside the JSON header
    with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
        SafetensorsCheckpoint(tmp_path)
    assert str(path) in str(e.value)
    path.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="truncated or not a safetensors file"):
        SafetensorsCheckpoint(tmp_path)


def test_corrupt_header_json(tmp_path):
    path = tmp_path / "model.safetensors"
    body = b"{not json" + b" " * 7
    path.write_bytes(len(body).to_bytes(8, "little") + body)
    with pytest.raises(CheckpointError, match="not valid JSON") as e:
        SafetensorsCheckpoint(tmp_path)
    assert str(path) in str(e.value)


def test_inconsistent_offsets(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 16)
    with pytest.raises(CheckpointError, match="need 16") as e:
        SafetensorsCheckpoint(tmp_path)
    assert "'w'" in str(e.value)


def test_duplicate_names_across_files(tmp_path):
    save_file({"a": np.zeros(2, np.float32), "dup": np.ones(2, np.float32)}, str(tmp_path / "one.safetensors"))
    save_file({"b": np.zeros(2, np.float32), "dup": np.ones(2, np.float32)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(CheckpointError, match="duplicate tensor 'dup'") as e:
        SafetensorsCheckpoint(tmp_path)
    assert "one.safetensors" in str(e.value) and "two.safetensors" in str(e.value)


def test_file_shrunk_after_open(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": np.arange(1000, dtype=np.float32)}, str(path))
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
        with pytest.raises(CheckpointError, match="truncated") as e:
            ckpt.read("w")
    assert "'w'" in str(e.value)
