"""Streaming reader for Hugging Face safetensors checkpoints.

A checkpoint directory holds either one ``model.safetensors`` file or a set of shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``).  Opening a
:class:`SafetensorsCheckpoint` reads only the JSON headers of the files (a few KiB each) and checks
them; :meth:`SafetensorsCheckpoint.read` then loads exactly one tensor into a fresh numpy array with
a single ``readinto`` (no memory map, no second copy).

The file format (https://huggingface.co/docs/safetensors) is parsed here directly rather than
through ``safetensors.safe_open``, so that

* bfloat16 / float8 tensors come back as ``ml_dtypes`` numpy arrays on every safetensors version,
* a truncated or corrupt file is reported at open time, naming the file and the tensor, and
* only one tensor's bytes are ever resident.

Layout of one file: 8 bytes little-endian unsigned header length ``N``; ``N`` bytes of JSON
``{name: {"dtype": str, "shape": [int], "data_offsets": [begin, end]}, "__metadata__": {...}}``;
then the data buffer, offsets relative to its start, all tensors little-endian and C-contiguous.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Iterator

import ml_dtypes
import numpy as np

__all__ = [
    "CheckpointError",
    "SafetensorsCheckpoint",
    "SINGLE_FILE",
    "INDEX_FILE",
    "SAFETENSORS_DTYPES",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype string -> numpy dtype (explicitly little-endian where it matters).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}

# A header larger than this is certainly corrupt (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """A checkpoint directory or file is missing, inconsistent or corrupt."""


@dataclass(frozen=True)
class _TensorInfo:
    file: str  # absolute path of the file that holds the tensor
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in ``file``
    nbytes: int


def _parse_header(path: str) -> tuple[dict[str, _TensorInfo], dict[str, str]]:
    """Read and validate the header of one safetensors file.

    Returns ``({name: info}, user metadata)``.  Raises CheckpointError naming ``path`` (and the
    tensor, where one is at fault) for anything that would make a later read fail or return garbage.
    """
    try:
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"{path}: file is truncated or not a safetensors file ({file_size} bytes, "
                    "shorter than the 8-byte header length)"
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise CheckpointError(
                    f"{path}: file is truncated or corrupt: header length {header_len} bytes but "
                    f"the file has only {file_size} bytes"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON): {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header ('__metadata__' is not an object)")
    data_start = 8 + header_len
    data_size = file_size - data_start
    tensors: dict[str, _TensorInfo] = {}
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        try:
            dtype = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: corrupt header entry {entry!r}") from e
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{where}: unsupported dtype {dtype!r}")
        if any(d < 0 for d in shape) or begin < 0 or end < begin:
            raise CheckpointError(f"{where}: corrupt header entry {entry!r}")
        expected = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if end - begin != expected:
            raise CheckpointError(
                f"{where}: header says {end - begin} bytes but dtype {dtype} and shape "
                f"{list(shape)} need {expected}"
            )
        if end > data_size:
            raise CheckpointError(
                f"{where}: file is truncated: the tensor's data ends at byte {data_start + end} but "
                f"the file has only {file_size} bytes"
            )
        tensors[name] = _TensorInfo(path, dtype, shape, data_start + begin, end - begin)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


class SafetensorsCheckpoint:
    """Lazy, read-one-tensor-at-a-time view of a Hugging Face safetensors checkpoint.

    ``directory`` is a checkpoint directory (``model.safetensors``, or shards listed by
    ``model.safetensors.index.json``, or — lacking both — every ``*.safetensors`` file in it), or
    the path of a single ``.safetensors`` file.

    Use as a context manager (or call :meth:`close`) to release the open file handles::

        with SafetensorsCheckpoint(path) as ckpt:
            for name in ckpt.names():
                array = ckpt.read(name)
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.path.abspath(os.fspath(directory))
        self._handles: dict[str, BinaryIO] = {}
        self._tensors: dict[str, _TensorInfo] = {}
        self._file_metadata: dict[str, dict[str, str]] = {}
        self.index_metadata: dict = {}
        self.files: list[str] = self._discover_files()
        for path in self.files:
            tensors, meta = _parse_header(path)
            self._file_metadata[path] = meta
            for name, info in tensors.items():
                if name in self._tensors:
                    raise CheckpointError(
                        f"{self.directory}: duplicate tensor {name!r} in {self._tensors[name].file} "
                        f"and {path}"
                    )
                self._tensors[name] = info
        self._sorted_names = sorted(self._tensors)
        if self._weight_map is not None:
            for name, shard in self._weight_map.items():
                info = self._tensors.get(name)
                expected = os.path.join(self.directory, shard)
                if info is None or info.file != expected:
                    raise CheckpointError(
                        f"{os.path.join(self.directory, INDEX_FILE)}: tensor {name!r} is mapped to "
                        f"{shard!r} but that shard does not contain it"
                        + (f" (found in {info.file})" if info is not None else "")
                    )

    # ------------------------------------------------------------------ discovery
    def _discover_files(self) -> list[str]:
        self._weight_map: dict[str, str] | None = None
        if os.path.isfile(self.directory):
            if not self.directory.endswith(".safetensors"):
                raise CheckpointError(f"{self.directory}: not a .safetensors file or a directory")
            return [self.directory]
        if not os.path.isdir(self.directory):
            raise CheckpointError(f"{self.directory}: no such checkpoint directory")
        index_path = os.path.join(self.directory, INDEX_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    index = json.load(f)
                weight_map = index["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: unreadable or malformed index: {e}") from e
            self.index_metadata = dict(index.get("metadata") or {})
            self._weight_map = {str(k): str(v) for k, v in weight_map.items()}
            shards = sorted(set(self._weight_map.values()))
            for shard in shards:
                if os.path.basename(shard) != shard:
                    raise CheckpointError(f"{index_path}: shard name {shard!r} is not a plain file name")
                if not os.path.isfile(os.path.join(self.directory, shard)):
                    example = next(n for n, s in self._weight_map.items() if s == shard)
                    raise CheckpointError(
                        f"{index_path}: refers to missing shard {shard!r} (holding e.g. tensor "
                        f"{example!r})"
                    )
            if not shards:
                raise CheckpointError(f"{index_path}: weight_map is empty")
            return [os.path.join(self.directory, s) for s in shards]
        single = os.path.join(self.directory, SINGLE_FILE)
        if os.path.isfile(single):
            return [single]
        found = sorted(
            os.path.join(self.directory, n) for n in os.listdir(self.directory) if n.endswith(".safetensors")
        )
        if not found:
            raise CheckpointError(
                f"{self.directory}: no safetensors checkpoint here (neither {SINGLE_FILE} nor "
                f"{INDEX_FILE} nor any *.safetensors file)"
            )
        return [p for p in found if os.path.isfile(p)]

    # ------------------------------------------------------------------ queries
    def _info(self, name: str) -> _TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.directory}: no tensor named {name!r}") from None

    def names(self) -> list[str]:
        """All tensor names, sorted."""
        return list(self._sorted_names)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def dtype(self, name: str) -> str:
        """The safetensors dtype string (``"BF16"``, ``"F32"``, ``"I64"``, ...)."""
        return self._info(name).dtype

    def numpy_dtype(self, name: str) -> np.dtype:
        return SAFETENSORS_DTYPES[self._info(name).dtype]

    def nbytes(self, name: str) -> int:
        return self._info(name).nbytes

    def file_of(self, name: str) -> str:
        """Absolute path of the file holding ``name``."""
        return self._info(name).file

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` of all files merged (e.g. ``{"format": "pt"}``)."""
        merged: dict[str, str] = {}
        for path in self.files:
            merged.update(self._file_metadata[path])
        return merged

    # ------------------------------------------------------------------ reading
    def _handle(self, path: str) -> BinaryIO:
        f = self._handles.get(path)
        if f is None or f.closed:
            try:
                f = open(path, "rb", buffering=0)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open: {e}") from e
            self._handles[path] = f
        return f

    def read(self, name: str) -> np.ndarray:
        """Load one tensor as a new, writable, C-contiguous numpy array (native byte order).

        BF16 / F8 tensors come back with ``ml_dtypes`` dtypes.
        """
        info = self._info(name)
        dtype = SAFETENSORS_DTYPES[info.dtype]
        out = np.empty(info.shape, dtype=dtype)
        if info.nbytes:
            buf = out.reshape(-1).view(np.uint8)
            f = self._handle(info.file)
            f.seek(info.offset)
            got = 0
            view = memoryview(buf)
            while got < info.nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise CheckpointError(
                        f"{info.file}: tensor {name!r}: file is truncated (read {got} of "
                        f"{info.nbytes} bytes at offset {info.offset})"
                    )
                got += n
        if dtype.byteorder == ">" or (dtype.byteorder == "<" and not np.little_endian):
            out = out.astype(dtype.newbyteorder("="))
        return out

    def items(self, names: list[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(name, array)`` one tensor at a time, grouped by file."""
        wanted = self.names() if names is None else list(names)
        wanted.sort(key=lambda n: (self._info(n).file, self._info(n).offset))
        for name in wanted:
            yield name, self.read(name)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        handles, self._handles = self._handles, {}
        for f in handles.values():
            f.close()

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort; explicit close() / `with` is preferred
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({self.directory!r}, {len(self._tensors)} tensors in {len(self.files)} file(s))"
