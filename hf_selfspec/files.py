"""Writing the files hf-selfspec produces: whole or not at all, and readable as the user's umask says.

A file lands through a temporary one renamed into place, so a crash never leaves half of one
that a later load would trust. safetensors and `tempfile` create private files (mode 0600, 0700
for a directory); an adapter, a corpus or the converted model in a shared cache must be readable
by whoever the umask lets read what the user writes.

A draft adapter and a lookup corpus are each a pair of files, `NAME.safetensors` and its
`NAME.json` description, named here once so that every place such a pair travels through (a
copy beside a config, a Hub download) treats both alike.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def cache_root() -> Path:
    """Where hf-selfspec keeps what it can make again: converted models, generated text,
    training checkpoints (`HF_SELFSPEC_CACHE`, else `hf_selfspec` in the XDG cache)."""
    base = os.environ.get("HF_SELFSPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hf_selfspec"
    )
    return Path(base)


def _umask() -> int:
    # The only portable way to read the umask is to set it; it is put back at once.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_as_umask_allows(path: str | Path) -> None:
    """Give `path`, and everything under it if it is a directory, the modes a plain write by
    this user would have given it."""
    mask = _umask()
    path = Path(path)
    for entry in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.chmod(entry, (0o777 if entry.is_dir() else 0o666) & ~mask)


def adapter_files(path: str | Path) -> tuple[Path, Path]:
    """`(weights, shape)` paths for an adapter (or a lookup corpus, laid out alike) named by
    either file or by its stem."""
    path = Path(path)
    stem = path.with_suffix("") if path.suffix in (".safetensors", ".json") else path
    return stem.with_name(stem.name + ".safetensors"), stem.with_name(stem.name + ".json")


def existing_adapter_files(path: str | Path, what: str = "draft adapter") -> tuple[Path, Path]:
    """`adapter_files(path)`, failing with the name of the first file that is not there: an
    adapter (or a lookup corpus, laid out alike) is only usable, or worth copying, with both."""
    files = adapter_files(path)
    for required in files:
        if not required.is_file():
            raise ValueError(f"{what} file {required} is missing")
    return files


def save_tensor_file_pair(weights_path: Path, tensors: dict[str, torch.Tensor], description_path: Path, description: dict) -> Path:
    """Write `NAME.safetensors` and its `NAME.json` description (an adapter, a lookup corpus),
    each through a temporary file renamed into place; returns the weights file."""
    from safetensors.torch import save_file

    weights_path.parent.mkdir(parents=True, exist_ok=True)
    staging = weights_path.with_name(weights_path.name + ".tmp")
    save_file(tensors, str(staging))
    share_as_umask_allows(staging)
    staging.replace(weights_path)
    staging = description_path.with_name(description_path.name + ".tmp")
    staging.write_text(json.dumps(description, indent=2) + "\n", encoding="utf-8")
    staging.replace(description_path)
    return weights_path
