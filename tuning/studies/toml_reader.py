"""Reading the tuner's TOML config files strictly, and the [model] section they all share.

Parsing is strict: an unknown section or key, or a value of the wrong type, is an error that
names the file and the key, because a typo in a tuning config otherwise costs hours of search
with a setting silently left at its default. Nothing here needs optuna, so the commands that only
read a config and run the model (train-adapter, write-lookup-corpus) load without it.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_selfspec.tuner_api import (
    AUTO,
    EMBEDDED,
    InputError,
    load_model_and_tokenizer,
    model_name,
    parse_dtype,
    read_text_file,
    usable_device,
)

from .. import TuningError


class StudyConfigError(TuningError):
    """A config file that cannot be used as written: the message names the file and the key."""


@dataclass(frozen=True)
class ModelConfig:
    name: str = EMBEDDED
    gguf_file: str | None = None
    dtype: str = AUTO
    device: str = "cpu"

    def load(self):
        """`(model, tokenizer)`; a name that is neither a model directory nor a Hub id this
        machine can fetch fails in one line naming the [model] section."""
        try:
            return load_model_and_tokenizer(self.name, self.gguf_file, self.dtype, self.device)
        except (OSError, ValueError) as error:
            raise StudyConfigError(f"cannot load [model] name {self.name!r}: {' '.join(str(error).split())}") from None


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


class TomlReader:
    """Typed access to one parsed file, every message naming the file and the dotted key."""

    def __init__(self, path: Path, data: dict[str, Any]):
        self.path = path
        self.data = data

    def error(self, key: str, problem: str) -> StudyConfigError:
        return StudyConfigError(f"{self.path}: {key}: {problem}")

    def section(self, name: str, known: set[str]) -> dict[str, Any]:
        table = self.data.get(name, {})
        if not isinstance(table, dict):
            raise self.error(name, f"must be a [{name}] table, got {table!r}")
        for key in table:
            if key not in known:
                raise self.error(f"{name}.{key}", f"unknown key; [{name}] takes {', '.join(sorted(known))}")
        return table

    def get(self, table: dict[str, Any], section: str, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        if key not in table:
            return default
        value = table[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # TOML booleans are Python ints; a `true` where a count belongs is a mistake, not 1.
        if isinstance(value, bool) or not isinstance(value, kinds):
            expected = " or ".join(_KIND_NAMES[k] for k in kinds)
            raise self.error(f"{section}.{key}", f"must be {expected}, got {value!r}")
        return float(value) if float in kinds else value

    def at_least(self, table: dict[str, Any], section: str, key: str, minimum: int, default: Any) -> Any:
        value = self.get(table, section, key, int, default)
        if value is not None and value < minimum:
            raise self.error(f"{section}.{key}", f"must be at least {minimum}, got {value}")
        return value

    def choice(self, table: dict[str, Any], section: str, key: str, choices: tuple[str, ...], default: str) -> str:
        value = self.get(table, section, key, str, default)
        if value not in choices:
            raise self.error(f"{section}.{key}", f"must be one of {', '.join(choices)}, got {value!r}")
        return value


def read_toml_config(path: str | Path, sections: set[str] | dict, what: str = "config") -> TomlReader:
    """A config file parsed strictly: unknown sections are errors, and so is a file that is
    missing, a directory, not UTF-8 or not TOML, each in one line naming the file."""
    path = Path(path)
    try:
        data = tomllib.loads(read_text_file(path, what))
    except InputError as error:
        raise StudyConfigError(str(error)) from None
    except tomllib.TOMLDecodeError as error:
        raise StudyConfigError(f"{path}: not valid TOML ({error})") from None
    reader = TomlReader(path, data)
    for section in data:
        if section not in sections:
            raise reader.error(section, f"unknown section; this {what} has {', '.join(f'[{s}]' for s in sections)}")
    return reader


def read_section(reader: TomlReader, section: str, cls):
    """One section as the dataclass `cls`, each key typed after its default (unknown keys are errors)."""
    table = reader.section(section, {f.name for f in dataclasses.fields(cls)})
    values = {}
    for f in dataclasses.fields(cls):
        default = getattr(cls(), f.name)
        if f.name not in table:
            continue
        value = table[f.name]
        if isinstance(default, tuple):
            kind = type(default[0])
            if not isinstance(value, list) or not value or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
                raise reader.error(f"{section}.{f.name}", f"must be a non-empty list of {_KIND_NAMES[kind].split()[-1]}s, got {value!r}")
            values[f.name] = tuple(value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise reader.error(f"{section}.{f.name}", f"must be true or false, got {value!r}")
            values[f.name] = value
        else:
            kind = float if isinstance(default, float) else int if isinstance(default, int) or default is None else str
            values[f.name] = reader.get(table, section, f.name, kind, default)
    return cls(**values)


def read_model_section(reader: TomlReader) -> ModelConfig:
    """The [model] section: what to load and where, checked before anything loads."""
    table = reader.section("model", {f.name for f in dataclasses.fields(ModelConfig)})
    defaults = ModelConfig()
    dtype = reader.get(table, "model", "dtype", str, defaults.dtype)
    try:
        parse_dtype(dtype)
    except ValueError as error:
        raise reader.error("model.dtype", str(error)) from None
    device = reader.get(table, "model", "device", str, defaults.device)
    name = reader.get(table, "model", "name", str, defaults.name)
    # Checked now, so that a typo stops the command before a model loads or a study starts.
    try:
        usable_device(device, "")
    except InputError as error:
        raise reader.error("model.device", str(error).strip()) from None
    try:
        name = model_name(name, "")
    except InputError as error:
        raise reader.error("model.name", str(error).strip()) from None
    return ModelConfig(
        name=name,
        gguf_file=reader.get(table, "model", "gguf_file", str, None),
        dtype=dtype,
        device=device,
    )
