"""Compiled step programs kept on disk and loaded back without tracing, lowering or compiling them.

JAX's persistent compilation cache (`step.enable_compilation_cache`) skips XLA's compilation on a restart, but it
is keyed by the lowered program, so every program is still traced and lowered first: 3-4 s a program at 31B, about
a minute for a 31B engine's 17 (docs/decisions/0012-executable-cache.md). This cache is keyed by what decides
a program instead, so a hit costs a file read:
- the program (its name: kind and bucket) and the shapes, dtypes and shardings of everything it takes;
- the engine's static configuration (KV layout, k, slots, dtypes, attention implementation, devices);
- the code that builds it: a digest of every source file of the package;
- the compiler: the JAX and jaxlib versions, the backend and its devices, XLA_FLAGS and the compile options.
Anything else that could change a program changes one of these. A program whose serialized trees do not match the
ones a load would rebuild is not stored; an entry that fails to load is compiled again (with a warning). Nor is,
on the CPU, a program that JAX's persistent compilation cache gave back (`compile_for_cache`): XLA:CPU serializes
such an executable without its kernels, and the copy loads but fails when run ("Function ... not found"; JAX
0.10.2). XLA:GPU keeps them whole: on the H200 (JAX 0.11.2) such copies load and give the same tokens, so the
GPU stores them. Every change of the code or the
configuration adds entries, so the directory is kept under a size (`max_bytes`, default 4 GiB) by removing the
entries used least recently (a load counts as a use).

The server keeps one by default, in `user_cache_dir("executables")` (~/.cache/gemma4_mtp_jax/executables): on the
H200 the demo pair's server is ready 4.4 s after a restart with it, 19.7 s with the compilation cache alone
(`python benchmarks/serve_check.py`).

Only load directories you wrote: an entry is a pickle, and loading one runs code (`jax.experimental.
serialize_executable`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax

log = logging.getLogger(__name__)


DEFAULT_MAX_BYTES = 4 << 30
_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # recorded by JAX in the thread whose compilation it served
_compiling = threading.local()


def _note_jax_cache_hit(event: str, **_: Any) -> None:
    if event == _JAX_CACHE_HIT:
        _compiling.hit = True


jax.monitoring.register_event_listener(_note_jax_cache_hit)


def compile_for_cache(compile: Any) -> tuple[Any, bool]:
    """(compile(), whether this cache may store the executable): on the CPU, not when JAX's persistent compilation
    cache gave it back instead of XLA compiling it (the module's docstring says why)."""
    _compiling.hit = False
    compiled = compile()
    return compiled, not (_compiling.hit and jax.default_backend() == "cpu")


def user_cache_dir(name: str) -> str:
    """~/.cache/gemma4_mtp_jax/NAME: where the package's caches live unless told otherwise."""
    return os.path.join(os.path.expanduser("~"), ".cache", "gemma4_mtp_jax", name)


@functools.cache
def source_digest() -> str:
    """sha256 over the package's source files (relative path and contents, in path order)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _environment() -> tuple:
    import jaxlib

    return (jax.__version__, jaxlib.__version__, jax.default_backend(),
            tuple((d.platform, d.device_kind) for d in jax.devices()), os.environ.get("XLA_FLAGS", ""))


def _describe(tree: Any) -> str:
    """The structure of a tree of arrays or shapes, and each leaf's shape, dtype and sharding."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return repr((str(treedef), [(tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None)))
                                for x in leaves]))


def program_key(name: str, args: Any, static: Any, options: dict[str, str]) -> str:
    """The key of program `name` taking `args` (arrays or shapes), built under `static` (a repr-able description
    of the configuration that shaped it) with compile `options`."""
    h = hashlib.sha256()
    for part in (source_digest(), repr(_environment()), name, _describe(args), repr(static),
                 repr(sorted(options.items()))):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _remove(path: Path) -> None:
    """Remove a file if we may: in a directory we may only read, it stays (a bad or evicted entry then costs a
    compilation or some disk, never the start-up)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


class ExecutableCache:
    """Serialized compiled programs in `directory`, one file per key, at most `max_bytes` of them in all."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES):
        """Raises OSError when `directory` cannot be created."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    @classmethod
    def open(cls, directory: str | os.PathLike | None) -> "ExecutableCache | None":
        """The cache in `directory` (None: none). One that cannot be created (a read-only home) costs only its use,
        with a warning: every program is then compiled."""
        if not directory:
            return None
        try:
            return cls(directory)
        except OSError as e:
            log.warning("executable cache %s cannot be used (%s); compiling every program", directory, e)
            return None

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.jaxexec"

    def load(self, key: str, args: Any, out_like: Any) -> Any | None:
        """The compiled program stored under `key` (None on a miss), for arguments shaped as `args` and results
        as `out_like`; an entry that fails to load is removed and reported."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(key)
        if not path.exists():
            return None
        try:
            compiled = deserialize_and_load(path.read_bytes(), jax.tree_util.tree_structure((args, {})),
                                            jax.tree_util.tree_structure(out_like))
        except Exception as e:  # noqa: BLE001 - a bad entry costs a compilation, never the start-up
            log.warning("executable cache: %s does not load (%s: %s); compiling instead", path.name,
                        type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            _remove(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: the last entry `_evict` would remove
        return compiled

    def store(self, key: str, compiled: Any, args: Any, out_like: Any) -> bool:
        """Write `compiled` under `key` if it serializes and its trees are the ones `load` rebuilds from `args`
        and `out_like`; True if written. Written to a temporary file and renamed: a reader never sees half."""
        from jax.experimental.serialize_executable import serialize

        try:
            payload, in_tree, out_tree = serialize(compiled)
        except Exception as e:  # noqa: BLE001 - an executable that cannot be serialized is simply not cached
            log.warning("executable cache: cannot serialize a program (%s: %s)", type(e).__name__, e)
            return False
        if (in_tree, out_tree) != (jax.tree_util.tree_structure((args, {})), jax.tree_util.tree_structure(out_like)):
            log.warning("executable cache: a program's argument or result trees differ from the ones a load would "
                        "rebuild; not cached")
            return False
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            os.replace(tmp, self._path(key))
        except OSError as e:
            log.warning("executable cache: cannot write %s (%s)", self._path(key), e)
            if tmp is not None:
                _remove(Path(tmp))
            return False
        self._evict(keep=self._path(key))
        return True

    def _evict(self, keep: Path) -> None:
        """Remove the least recently used entries (never `keep`) until the directory holds at most max_bytes."""
        entries = []
        for path in self.directory.glob("*.jaxexec"):
            try:
                st = path.stat()
            except OSError:  # removed meanwhile by another process
                continue
            entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            if path != keep:
                _remove(path)
                total -= size
