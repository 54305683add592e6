"""Training checkpoints: plain files under `--out`/checkpoints/step_NNNNNNNN/.

  state.msgpack  the assistant's float32 parameters and the optimizer state (flax.serialization)
  meta.json      step, data position, RNG key, the options the run was started with; written last, so a directory
                 without it (an interrupted save) is ignored

Everything a resumed run needs to continue exactly as an uninterrupted one: batches and bonus positions are pure
functions of (seed, step) (train/data.py `batch_indices`, the per-step RNG key), and the state holds the rest.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import flax.serialization

_PREFIX = "step_"


def checkpoint_dir(out: Path) -> Path:
    return out / "checkpoints"


def list_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under out, oldest first."""
    root = checkpoint_dir(out)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.name.startswith(_PREFIX) and (d / "meta.json").is_file() and (d / "state.msgpack").is_file():
            try:
                found.append((int(d.name[len(_PREFIX):]), d))
            except ValueError:
                continue
    return sorted(found)


def latest(out: Path) -> Path | None:
    found = list_checkpoints(out)
    return found[-1][1] if found else None


def save(out: Path, step: int, state: Any, meta: dict, keep: int) -> Path:
    """Write the checkpoint of `step` (atomically: a temporary directory renamed into place) and keep only the
    newest `keep`."""
    root = checkpoint_dir(out)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:08d}"
    tmp = root / f".tmp_{_PREFIX}{step:08d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / "state.msgpack").write_bytes(flax.serialization.to_bytes(state))
    (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in list_checkpoints(out)[:-max(1, keep)]:
        shutil.rmtree(old)
    return final


def load(directory: Path, template: Any) -> tuple[Any, dict]:
    """(state shaped like `template`, meta) of the checkpoint in directory."""
    meta = json.loads((directory / "meta.json").read_text())
    state = flax.serialization.from_bytes(template, (directory / "state.msgpack").read_bytes())
    return state, meta
