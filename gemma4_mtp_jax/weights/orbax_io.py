"""Orbax checkpoints of converted Gemma 4 parameters.

Layout of a converted checkpoint directory ``D``::

    D/params/              the Orbax (PyTreeCheckpointer, OCDBT) checkpoint of the parameter pytree
    D/gemma4_mtp_jax.json  our metadata: format name and version, kind, dtype, tensor count, ...
    D/config.json ...      (written by the converter: HF config, generation config, tokenizer files)

``gemma4_mtp_jax.json`` is written last, after Orbax has committed ``params/``, so an interrupted
save never looks like a checkpoint.

Arrays are restored from the checkpoint's own metadata (no shapes/structure needed in advance) as host
numpy arrays with the saved dtypes, or — when ``shardings`` is given — as ``jax.Array`` placed
directly with those shardings.  Works with orbax-checkpoint 0.12.4 … 0.12.8.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Mapping

import jax
import numpy as np

from gemma4_mtp_jax.weights.safetensors_io import CheckpointError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "PARAMS_SUBDIR",
    "save_params",
    "restore_params",
    "read_metadata",
    "is_orbax_checkpoint",
]

FORMAT_NAME = "gemma4_mtp_jax"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
METADATA_FILE = "gemma4_mtp_jax.json"
PARAMS_SUBDIR = "params"


def _ocp():
    # Imported lazily: orbax pulls in tensorstore etc., which the safetensors path does not need.
    import orbax.checkpoint as ocp

    return ocp


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, jax.Array))


def _check_tree(params: Any, path: str = "params") -> None:
    """Only (nested) dicts with string keys and array leaves are allowed."""
    if isinstance(params, Mapping):
        for k, v in params.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{path}: key {k!r} is not a string")
            if not k or "/" in k:
                raise CheckpointError(f"{path}: key {k!r} is empty or contains '/'")
            _check_tree(v, f"{path}[{k!r}]")
    elif not _is_array(params):
        raise CheckpointError(f"{path}: leaf of type {type(params).__name__} is not an array")


def _leaves_summary(params: Any) -> tuple[int, int, dict[str, int]]:
    leaves = jax.tree_util.tree_leaves(params)
    nbytes = 0
    by_dtype: dict[str, int] = {}
    for x in leaves:
        dt = np.dtype(x.dtype)
        n = int(np.prod(x.shape, dtype=np.int64)) * dt.itemsize
        nbytes += n
        by_dtype[dt.name] = by_dtype.get(dt.name, 0) + n
    return len(leaves), nbytes, by_dtype


def _to_savable(x: Any) -> Any:
    # Orbax gets host arrays only: its own copies of device arrays, made from its writer threads, crash the
    # process (SIGSEGV) under XLA's VMM allocator, which the package selects on a GPU (xla_env.py;
    # docs/decisions/0001-command-buffer-update-mode.md), so each leaf is copied to the host here.
    return np.asarray(x)


def _version_info() -> dict[str, str]:
    from importlib import metadata as importlib_metadata

    out = {}
    for dist in ("gemma4_mtp_jax", "jax", "orbax-checkpoint", "flax"):
        try:
            out[dist] = importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            pass
    return out


def is_orbax_checkpoint(directory: str | os.PathLike) -> bool:
    """True if ``directory`` holds a checkpoint written by :func:`save_params`."""
    d = os.path.abspath(os.fspath(directory))
    return os.path.isfile(os.path.join(d, METADATA_FILE)) and os.path.isdir(os.path.join(d, PARAMS_SUBDIR))


def read_metadata(directory: str | os.PathLike) -> dict:
    """Read and check ``gemma4_mtp_jax.json``; raises CheckpointError if missing/unknown version."""
    d = os.path.abspath(os.fspath(directory))
    path = os.path.join(d, METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{d}: not a gemma4_mtp_jax Orbax checkpoint ({METADATA_FILE} is missing; convert a Hugging "
            "Face checkpoint with `python -m checkpoints_convert`)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable metadata: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: not a {FORMAT_NAME} metadata file (format={found!r})")
    version = meta.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        raise CheckpointError(
            f"{path}: unknown format_version {version!r} (this gemma4_mtp_jax reads {list(SUPPORTED_VERSIONS)}); "
            "re-convert the checkpoint or upgrade gemma4_mtp_jax"
        )
    return meta


def save_params(
    directory: str | os.PathLike,
    params: Mapping[str, Any],
    metadata: Mapping[str, Any] | None = None,
    *,
    force: bool = False,
) -> dict:
    """Write ``params`` (nested dict of numpy / jax arrays) as an Orbax checkpoint under ``directory``.

    ``metadata`` (JSON-serialisable; typically ``{"kind": "target"|"assistant", "dtype": ...}``) is
    stored in ``gemma4_mtp_jax.json`` together with the format version and a summary.  An existing
    checkpoint in ``directory`` is refused unless ``force=True`` (which replaces ``params/`` and the
    metadata file only; other files in ``directory`` are left alone).  Returns the metadata written.
    """
    ocp = _ocp()
    d = os.path.abspath(os.fspath(directory))
    params_dir = os.path.join(d, PARAMS_SUBDIR)
    meta_path = os.path.join(d, METADATA_FILE)
    if not isinstance(params, Mapping):
        raise CheckpointError(f"params must be a (nested) dict of arrays, got {type(params).__name__}")
    _check_tree(params)
    metadata = dict(metadata or {})
    try:
        json.dumps(metadata)
    except TypeError as e:
        raise CheckpointError(f"metadata is not JSON-serialisable: {e}") from e

    existing = [p for p in (params_dir, meta_path) if os.path.exists(p)]
    if existing and not force:
        raise CheckpointError(f"{d}: already holds a checkpoint ({', '.join(existing)}); pass force=True to overwrite")
    if os.path.exists(d) and not os.path.isdir(d):
        raise CheckpointError(f"{d}: exists and is not a directory")
    os.makedirs(d, exist_ok=True)
    # Remove the metadata first so a failure below never leaves a stale-but-valid-looking checkpoint.
    if os.path.exists(meta_path):
        os.remove(meta_path)
    if os.path.exists(params_dir):
        shutil.rmtree(params_dir)

    n_tensors, n_bytes, by_dtype = _leaves_summary(params)
    tree = jax.tree_util.tree_map(_to_savable, dict(params))
    t0 = time.perf_counter()
    ckptr = ocp.PyTreeCheckpointer()
    try:
        ckptr.save(params_dir, args=ocp.args.PyTreeSave(tree))
        wait = getattr(ckptr, "wait_until_finished", None)
        if wait is not None:
            wait()
    finally:
        ckptr.close()

    if "dtype" not in metadata:
        floats = {k: v for k, v in by_dtype.items() if np.issubdtype(np.dtype(k), np.floating) or k == "bfloat16"}
        if floats:
            metadata["dtype"] = max(floats, key=floats.get)
    full = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **metadata,
        "params_dir": PARAMS_SUBDIR,
        "num_tensors": n_tensors,
        "num_bytes": n_bytes,
        "bytes_by_dtype": by_dtype,
        "save_seconds": round(time.perf_counter() - t0, 3),
        "created_with": _version_info(),
    }
    tmp = meta_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(full, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, meta_path)
    return full


def _tree_of_metadata(ckptr, params_dir: str):
    md = ckptr.metadata(params_dir)
    # orbax >= 0.11: StepMetadata(item_metadata=TreeMetadata(tree=...)); be lenient about wrappers.
    for attr in ("item_metadata", "tree"):
        inner = getattr(md, attr, None)
        if inner is not None:
            md = inner
    return md


def restore_params(
    directory: str | os.PathLike,
    *,
    shardings: Any = None,
) -> tuple[dict, dict]:
    """Restore ``(params, metadata)`` from a checkpoint written by :func:`save_params`.

    Without ``shardings`` every leaf comes back as a host ``numpy.ndarray`` with exactly the saved
    dtype (bfloat16 as ``ml_dtypes.bfloat16``).  With ``shardings`` — one ``jax.sharding.Sharding``
    for all leaves, or a pytree of them matching the params (``None`` leaves → numpy) — leaves are
    restored straight onto devices as ``jax.Array``.
    """
    ocp = _ocp()
    d = os.path.abspath(os.fspath(directory))
    meta = read_metadata(d)
    params_dir = os.path.join(d, meta.get("params_dir", PARAMS_SUBDIR))
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"{d}: the Orbax parameter directory {params_dir} is missing")

    ckptr = ocp.PyTreeCheckpointer()
    try:
        try:
            tree_md = _tree_of_metadata(ckptr, params_dir)
        except Exception as e:  # orbax raises assorted types for a damaged checkpoint
            raise CheckpointError(f"{params_dir}: cannot read Orbax metadata: {e}") from e

        is_md_leaf = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # noqa: E731
        if shardings is None:
            restore_args = jax.tree_util.tree_map(
                lambda m: ocp.RestoreArgs(restore_type=np.ndarray), tree_md, is_leaf=is_md_leaf
            )
        else:
            if isinstance(shardings, jax.sharding.Sharding):
                shard_tree = jax.tree_util.tree_map(lambda m: shardings, tree_md, is_leaf=is_md_leaf)
            else:
                shard_tree = shardings

            def make(m, s):
                if s is None:
                    return ocp.RestoreArgs(restore_type=np.ndarray)
                return ocp.ArrayRestoreArgs(sharding=s, global_shape=tuple(m.shape), dtype=m.dtype)

            restore_args = jax.tree_util.tree_map(
                make, tree_md, shard_tree, is_leaf=is_md_leaf
            )
        try:
            params = ckptr.restore(params_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{params_dir}: cannot restore Orbax checkpoint: {e}") from e
    finally:
        ckptr.close()
    return params, meta
