"""Where a checkpoint argument points: a local directory, or a Hugging Face hub id to download.

The loaders (`load_target`, `load_assistant`, their `*_shapes`) and the converter (`python -m checkpoints_convert
--hf`) read checkpoint arguments through these two functions, so that both accept the same things.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gemma4_mtp_jax.model.config import ConfigError

# What a snapshot downloads: configs and weights (single or sharded, with the index), the tokenizer, the chat template.
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model"]
# The hub's repository id form, 'org/name' (names of letters, digits, '.', '_', '-').
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_id(path_or_id: str | os.PathLike) -> str | None:
    """None when `path_or_id` is a local directory (`~` expanded); else the hub id it names. A file, or a missing
    path that is not of the form 'org/name', is a ConfigError naming it. Reads nothing but the file system."""
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        return None
    s = str(path_or_id)
    if p.exists():
        raise ConfigError(f"{s}: is a file, expected a checkpoint directory or a hub id")
    if not _HUB_ID.match(s):
        raise ConfigError(f"{s}: no such checkpoint directory (and not a hub id of the form 'org/name')")
    return s


def resolve_checkpoint(path_or_id: str | os.PathLike) -> Path:
    """The checkpoint directory `path_or_id` names: a local directory as given (`~` expanded), or a hub id's snapshot
    (HUB_FILES) downloaded to the Hugging Face cache, where a later call finds it. Errors as `hub_id`'s; a failed
    download raises huggingface_hub's own error."""
    repo = hub_id(path_or_id)
    if repo is None:
        return Path(path_or_id).expanduser()
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise ConfigError(f"{repo}: not a local directory, and huggingface_hub is not installed") from e
    return Path(snapshot_download(repo, allow_patterns=HUB_FILES))
