"""The files a profile names (draft adapters, lookup corpora): where each one is, how they travel
beside a config without replacing another profile's, and how to tell two of one name apart.

A profile names its files relative to the `generation_config.json` it came from, so that the
folder travels whole; for a model loaded by Hub id that folder is a repository, and a name there
becomes an address that is fetched only when decoding uses it.
"""

from __future__ import annotations

import filecmp
import functools
import hashlib
import shutil
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from .files import adapter_files, existing_adapter_files
from .params import PATH_KEYS
from .profiles import TunedProfile

# `hf://{repo_id}@{revision}/{file in the repository}`: where a profile's file is when its model
# was loaded by Hub id. Repository ids hold no "@" and the revision here is always "main" (a
# transformers 5 model does not record the revision it was loaded from), so the address splits
# unambiguously.
HUB_ADDRESS_PREFIX = "hf://"


def hub_file_address(repo_id: str, name: str) -> str:
    return f"{HUB_ADDRESS_PREFIX}{repo_id}@main/{Path(name).as_posix()}"


@functools.lru_cache(maxsize=None)
def fetch_hub_file_pair(address: str, what: str) -> Path:
    """The local copy of an adapter (or a lookup corpus) in a Hub repository, downloaded on
    first use. transformers fetches only the files a model needs, so an adapter beside a Hub
    model's config is not on disk until a profile drafts with it. Asked once a process: each
    `generate` call would otherwise check the Hub again."""
    from transformers.utils.hub import cached_files

    repo_id, _, rest = address[len(HUB_ADDRESS_PREFIX) :].partition("@")
    revision, _, name = rest.partition("/")
    try:
        weights, _ = cached_files(repo_id, [str(p) for p in adapter_files(name)], revision=revision)
    except OSError as error:  # transformers' errors for a missing repository, file or connection
        raise ValueError(f"{what} {name} of {repo_id} (revision {revision}) cannot be fetched: {error}") from None
    return Path(weights)


def local_file(path: str | Path, what: str) -> str | Path:
    """`path` as a file on this machine: a Hub address fetched (`fetch_hub_file_pair`), any
    other path as it is."""
    if str(path).startswith(HUB_ADDRESS_PREFIX):
        return fetch_hub_file_pair(str(path), what)
    return path


def anchor_profile_files(
    model: nn.Module, values: Mapping[str, Any], config_dir: str | Path | None = None
) -> dict[str, Any]:
    """Profile or generation-config values with every relative file name (`draft_adapter`,
    `lookup_corpus`) made absolute.

    A profile names its files relative to the `generation_config.json` it came from
    (`config_dir`, by default the one the loaders recorded as `model.selfspec_config_dir`), or
    else to the model's own directory, so they travel together; for a model loaded by Hub id that
    directory is its repository, and a name becomes an address there, fetched only if decoding
    uses it. A name passed to `generate()` itself is relative to the working directory, like any
    path a program is given.
    """
    anchored = dict(values)
    base = config_dir if config_dir is not None else getattr(model, "selfspec_config_dir", None)
    source = str(getattr(model, "name_or_path", "") or "")
    if base is None and not _is_hub_id(source) and Path(source).is_dir():
        base = source
    for key in PATH_KEYS:
        name = values.get(key)
        if not isinstance(name, str) or not name or Path(name).is_absolute() or name.startswith(HUB_ADDRESS_PREFIX):
            continue
        if base is None and _is_hub_id(source):
            anchored[key] = hub_file_address(source, name)
        elif base is not None:
            anchored[key] = str(Path(base) / name)
    return anchored


def _is_hub_id(name_or_path: str) -> bool:
    """`org/name` or a bare legacy name, not a directory on this machine."""
    path = Path(name_or_path)
    local = path.is_dir() or path.is_absolute() or name_or_path.startswith(".")
    return bool(name_or_path) and not local and name_or_path.count("/") <= 1


class AdapterConflictError(ValueError):
    """Another adapter of the same file name is already where one is to be copied."""


def check_adapter_copy(source: str | Path, directory: str | Path) -> tuple[Path, Path]:
    """The source's two files, once it is sure that copying them into `directory` replaces
    nothing but identical copies. Profiles name their adapter by file name, so a different file
    of that name may be what another profile of the config there drafts with: overwriting it
    would change that profile's draft silently."""
    sources = existing_adapter_files(source)
    for file in sources:
        target = Path(directory) / file.name
        if target.exists() and not target.samefile(file) and not filecmp.cmp(file, target, shallow=False):
            raise AdapterConflictError(
                f"{target} already exists and differs from {file}; a profile there may draft with it, so it is "
                "not overwritten: give the new adapter another name (profiles name adapters by file name), or "
                "write into another directory"
            )
    return sources


def copy_adapter(source: str | Path, directory: str | Path) -> Path:
    """Copy an adapter's two files into `directory`, so that a profile in the
    `generation_config.json` there can name it by file name alone and the folder travels whole;
    returns the copied weights file. Each file lands through a temporary one renamed into place,
    and nothing is copied unless both exist and neither would replace a different file."""
    directory = Path(directory)
    sources = check_adapter_copy(source, directory)
    directory.mkdir(parents=True, exist_ok=True)
    for file in sources:
        target = directory / file.name
        if target.exists() and target.samefile(file):
            continue
        staging = target.with_name(target.name + ".tmp")
        shutil.copyfile(file, staging)
        staging.replace(target)
    return directory / sources[0].name


def adapter_digest(path: str | Path) -> str:
    """A short SHA-256 of the adapter's weights: a retrained adapter keeps its file name, and a
    study's measurements, or an export of them, must not be credited to different weights."""
    weights, _ = existing_adapter_files(path)
    digest = hashlib.sha256()
    with weights.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def files_named_by(profiles: Mapping[str, TunedProfile], config_dir: str | Path) -> list[str]:
    """The files the profiles name (draft adapters, lookup corpora), as the relative names they
    use, each checked to be beside the config: whatever copies or uploads a config must carry
    these files with it, or its profiles stop loading."""
    names = []
    for key, profile in sorted(profiles.items()):
        for param in PATH_KEYS:
            name = profile.params.get(param)
            if not name:
                continue
            if Path(name).is_absolute():
                raise ValueError(
                    f"profile {key!r}: {param} {name!r} is an absolute path, which does not travel with the "
                    "config; name the file relative to the generation_config.json (hf-selfspec export does)"
                )
            try:
                existing_adapter_files(Path(config_dir) / name, what=param.replace("_", " "))
            except ValueError as error:
                raise ValueError(f"profile {key!r} names {param} {name!r}, but {error}") from None
            names.append(name)
    return list(dict.fromkeys(names))
