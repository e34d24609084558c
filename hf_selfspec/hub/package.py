"""`hf-selfspec package`: a folder that decodes self-speculatively through transformers' own
`custom_generate`, ready to upload as its own repository or into the model's.

transformers copies into its module cache only `custom_generate/generate.py` and the `.py` files
it reaches by relative imports, and the function learns neither the repository nor its files.
So everything it needs at run time travels as Python modules: the decoding core, copied verbatim
from this package by following those same relative imports (a core module added later is picked
up with no list to keep), and the profiles, written out as a module for models whose own
generation config has none.
"""

from __future__ import annotations

import dataclasses
import json
import pprint
import shutil
import sys
from pathlib import Path
from typing import Any

from ..compatibility import declared_requirements
from ..params import PATH_KEYS
from ..profile_files import check_adapter_copy, copy_adapter, files_named_by, hub_file_address
from ..profiles import (
    PROFILE_KEY,
    TunedProfile,
    read_config_json,
    read_profiles,
    read_profiles_file,
)

CORE_DIR = Path(__file__).resolve().parent.parent  # the flat modules `generate.py` imports from
ENTRY_SOURCE = Path(__file__).with_name("generate_entry.py")
CUSTOM_GENERATE_DIR = "custom_generate"
ENTRY_MODULE = "generate"
BUNDLED_PROFILES_MODULE = "bundled_profiles"
CARD_NAME = "README.md"
REQUIREMENTS_NAME = "requirements.txt"
# Besides the standard library, what the copied core may import: transformers needs torch and
# safetensors anyway.
RUNTIME_DEPENDENCIES = ("torch", "transformers", "safetensors")
_CARD_START = "<!-- hf-selfspec:start -->"
_CARD_END = "<!-- hf-selfspec:end -->"
_CARD_FRONT_MATTER = "---\nlibrary_name: transformers\ntags:\n- custom_generate\n- self-speculative-decoding\n---\n"


class PackageError(ValueError):
    """Bad input or a core that cannot travel: the command prints the message and exits with 2."""


@dataclasses.dataclass(frozen=True)
class PackageResult:
    folder: Path
    profiles: dict[str, TunedProfile]
    modules: list[str]  # the files of custom_generate/, generate.py first
    profile_files: list[str]  # draft adapters and lookup corpora copied beside the config, as its profiles name them


def core_modules() -> list[str]:
    """The core modules `generate.py` needs, found the way transformers will find them.

    Fails if one is missing, or imports anything but the standard library, torch and
    transformers: on the user's side that import would fail, or worse, find another package.
    """
    from transformers.dynamic_module_utils import get_imports, get_relative_imports

    needed: list[str] = []
    pending = [ENTRY_SOURCE]
    while pending:
        source = pending.pop()
        for name in sorted(get_relative_imports(source)):
            if name == BUNDLED_PROFILES_MODULE or name in needed:
                continue
            path = CORE_DIR / f"{name}.py"
            if not path.is_file():
                raise PackageError(f"{source.name} imports .{name}, which is not a module of hf_selfspec/")
            foreign = [
                top
                for top in get_imports(path)
                if top not in RUNTIME_DEPENDENCIES and top not in sys.stdlib_module_names
            ]
            if foreign:
                raise PackageError(
                    f"hf_selfspec/{name}.py imports {', '.join(foreign)}; the packaged core may import only the "
                    f"standard library, {', '.join(RUNTIME_DEPENDENCIES)}"
                )
            needed.append(name)
            pending.append(path)
    return sorted(needed)


def check_package_folder(folder: str | Path, option: str) -> None:
    """Fail unless `folder` holds what `package` writes, before anything slow happens."""
    if not (Path(folder) / CUSTOM_GENERATE_DIR / f"{ENTRY_MODULE}.py").is_file():
        raise PackageError(
            f"{option} {folder}: no {CUSTOM_GENERATE_DIR}/{ENTRY_MODULE}.py; write the folder with `hf-selfspec package`"
        )


def _read_config(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The config's contents, and the files its profiles name (each found beside it)."""
    try:
        data = read_config_json(path, "--config")
    except ValueError as error:
        raise PackageError(str(error)) from None
    # Loading a config marked as derived from the model config drops every key transformers does
    # not know, the profiles included; with profiles in it, it no longer is.
    data.pop("_from_model_config", None)
    try:
        profiles = read_profiles(data)
    except ValueError as error:
        raise PackageError(f"--config {path}: {error}") from None
    if not profiles:
        raise PackageError(f"--config {path} holds no {PROFILE_KEY} profile; write one with `hf-selfspec export`")
    try:
        files = files_named_by(profiles, path.parent)
    except ValueError as error:
        raise PackageError(f"--config {path}: {error}") from None
    return data, files


def _bundled_profiles_source(profiles: dict[str, TunedProfile], files_dir: Path | None) -> str:
    literal = pprint.pformat({key: profile.to_json() for key, profile in sorted(profiles.items())}, width=110)
    return (
        '"""Written by `hf-selfspec package`: the packaged generation_config.json\'s tuned profiles, which\n'
        "`generate.py` lends to a model whose own generation config has none (transformers hands it the\n"
        'model, not the repository it came from, and copies only Python files), and the folder their\n'
        'file names are relative to (None where they are Hub addresses)."""\n\n'
        f"PROFILES = {literal}\n\n"
        f"FILES_DIR = {str(files_dir) if files_dir is not None else None!r}\n"
    )


def bundled_profiles_for_repository(folder: str | Path, repo_id: str) -> str:
    """`bundled_profiles.py` for the package in `folder` once it is in the Hub repository
    `repo_id`: each draft adapter named by its address there. Named as `custom_generate=`, the
    package lends these profiles to a model whose own folder lacks the adapter, and transformers
    tells `generate` neither where the package came from nor copies anything but Python."""
    from transformers.utils import GENERATION_CONFIG_NAME

    profiles = read_profiles_file(Path(folder) / GENERATION_CONFIG_NAME)
    addressed = {
        key: dataclasses.replace(
            profile,
            params={**profile.params, **{k: hub_file_address(repo_id, profile.params[k]) for k in PATH_KEYS if profile.params.get(k)}},
        )
        for key, profile in profiles.items()
    }
    return _bundled_profiles_source(addressed, None)


def _requirements() -> str:
    """What the packaged core imports, with the versions hf-selfspec itself declares: the upper
    bounds too, as the copied core takes over transformers' internals just as installed."""
    declared = declared_requirements()
    return "".join(f"{name}{declared[name].specifier}\n" for name in RUNTIME_DEPENDENCIES)


def _card_section(profiles: dict[str, TunedProfile]) -> str:
    rows = []
    for key, profile in sorted(profiles.items()):
        measured = profile.measured
        speedup = f"{measured['speedup']:.2f}x" if "speedup" in measured else "not recorded"
        acceptance = f"{measured['acceptance_rate']:.0%}" if "acceptance_rate" in measured else "not recorded"
        rows.append(f"| `{key}` | `{profile.strategy}` | {speedup} | {acceptance} |")
    blocks = "\n\n".join(
        f"`{key}`:\n\n```json\n{json.dumps(profile.measured, indent=2, sort_keys=True)}\n```"
        for key, profile in sorted(profiles.items())
    )
    return f"""{_CARD_START}
## Self-speculative decoding (hf-selfspec)

This repository carries tuned self-speculative decoding profiles in `generation_config.json` and the
code that runs them in `custom_generate/`: the model drafts tokens with some of its own layers
skipped and verifies them with all of them, so greedy outputs stay those of plain `generate`.
Nothing needs installing but `transformers`:

```python
out = model.generate(**inputs, custom_generate="THIS_REPO", trust_remote_code=True, max_new_tokens=128)
# or, where this folder is the model's own repository, plainly:
model = AutoModelForCausalLM.from_pretrained("THIS_REPO", trust_remote_code=True)
out = model.generate(**inputs, max_new_tokens=128)
```

The profile for the model's device and dtype is used (its own generation config's if it has any,
else the one shipped here); without one, `generate` decodes plainly and says why once. The
`hf-selfspec` keywords work too (`strategy=`, `attn_skip_layers=`, ..., `strategy="plain"`), and
`return_dict_in_generate=True` adds `strategy_stats`.

| profile | strategy | speedup over plain greedy | draft acceptance |
| --- | --- | --- | --- |
{chr(10).join(rows)}

What each was measured on:

{blocks}
{_CARD_END}
"""


def _write_card(path: Path, section: str) -> None:
    """Replace our section of an existing model card, or append it; a new card gets Hub metadata."""
    if not path.is_file():
        path.write_text(_CARD_FRONT_MATTER + "\n" + section, encoding="utf-8")
        return
    text = path.read_text(encoding="utf-8")
    start, end = text.find(_CARD_START), text.find(_CARD_END)
    if start != -1 and end > start:
        text = text[:start] + section.rstrip("\n") + text[end + len(_CARD_END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text, encoding="utf-8")


def package(config_path: str | Path, output_dir: str | Path) -> PackageResult:
    """Write `output_dir` (created if missing; it may be the model's own directory): the config,
    the files its profiles name (draft adapters, lookup corpora; at the same relative names), `custom_generate/`
    (replaced whole) and our section of `README.md`; nothing else changes."""
    from transformers.utils import GENERATION_CONFIG_NAME

    config_path, output_dir = Path(config_path), Path(output_dir)
    data, named_files = _read_config(config_path)
    if output_dir.exists() and not output_dir.is_dir():
        raise PackageError(f"--output {output_dir} is a file; give the directory to write the package into")
    modules = core_modules()
    target = output_dir / CUSTOM_GENERATE_DIR
    for name in named_files:  # before anything is written
        try:
            check_adapter_copy(config_path.parent / name, (output_dir / name).parent)
        except ValueError as error:
            raise PackageError(f"--output {output_dir}: {error}") from None
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        config_file = output_dir / GENERATION_CONFIG_NAME
        config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for name in named_files:
            copy_adapter(config_path.parent / name, (output_dir / name).parent)
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        shutil.copyfile(ENTRY_SOURCE, target / f"{ENTRY_MODULE}.py")
        for name in modules:
            shutil.copyfile(CORE_DIR / f"{name}.py", target / f"{name}.py")
        profiles = read_profiles_file(config_file)  # as transformers will load it
        (target / f"{BUNDLED_PROFILES_MODULE}.py").write_text(
            _bundled_profiles_source(profiles, output_dir.resolve()), encoding="utf-8"
        )
        (target / REQUIREMENTS_NAME).write_text(_requirements(), encoding="utf-8")
        _write_card(output_dir / CARD_NAME, _card_section(profiles))
    except OSError as error:
        raise PackageError(f"--output {output_dir}: cannot write it ({error.strerror or error})") from None
    files = [f"{ENTRY_MODULE}.py", f"{BUNDLED_PROFILES_MODULE}.py", *(f"{name}.py" for name in modules)]
    return PackageResult(output_dir, profiles, files, named_files)


def summary(result: PackageResult) -> str:
    named = "".join(f"{name}, " for name in result.profile_files)
    return (
        f"Wrote {result.folder}: generation_config.json (profiles for {', '.join(sorted(result.profiles))}), "
        f"{named}custom_generate/ ({len(result.modules)} Python files), README.md\n"
        f'Use it with transformers alone: model.generate(**inputs, custom_generate="{result.folder}", '
        "trust_remote_code=True)"
    )
