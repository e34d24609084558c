"""Study config files (TOML): what to tune, on what, and how long.

Parsing is strict: an unknown section or key, or a value of the wrong type, is an error that
names the file and the key, because a typo in a tuning config otherwise costs hours of search
with a setting silently left at its default.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_selfspec.adapter import read_adapter, read_adapter_shape
from hf_selfspec.dtypes import AUTO, parse_dtype
from hf_selfspec.files import adapter_files
from hf_selfspec.inputs import InputError, model_name, read_text_file, usable_device
from hf_selfspec.lookup_corpus import read_corpus_description
from hf_selfspec.loading import EMBEDDED, load_model_and_tokenizer
from hf_selfspec.prompts import HELD_OUT_SPLIT, HUMANEVAL, TUNE_SPLIT, WORKLOAD
from hf_selfspec.strategies import resolve_strategy

from . import TuningError
from .space import KNOBS, STRATEGY_KNOBS

SAMPLERS = ("tpe", "random")
OBJECTIVES = ("measured", "estimated")
PRUNERS = ("median", "none")
# Prompts per trial from HumanEval or a JSONL file when the config does not say.
DEFAULT_N_PROMPTS = 8


class StudyConfigError(TuningError):
    pass


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


@dataclass(frozen=True)
class PromptConfig:
    source: str = HUMANEVAL  # "humaneval", "workload", or a JSONL file's resolved path
    # At most this many prompts; None: DEFAULT_N_PROMPTS from a slice, all from a per-category selection.
    n_prompts: int | None = None
    offset: int = 0
    max_new_tokens: int = 64
    # Only prompts marked with this split; the workload's is always the tune split.
    split: str | None = None
    # The first this many prompts of each category (`study_prompts`).
    per_category: int | None = None


@dataclass(frozen=True)
class SearchConfig:
    strategy: str = "self_speculative"
    # Configured ranges by knob name; a knob of the strategy that is not listed uses its default.
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    warm_start_skip_ratios: tuple[float, ...] = (0.25, 0.4, 0.5)
    # Trained draft adapters to choose among, by name (the file's stem), each with its weights
    # file; when set, every trial drafts with one of them instead of a skip set.
    draft_adapters: dict[str, str] = field(default_factory=dict)
    # A lookup corpus every trial's prompt lookup continues into (its weights file), or "".
    lookup_corpus: str = ""

    def range_of(self, knob: str) -> tuple[float, float]:
        return self.ranges.get(knob, KNOBS[knob].default_range)


@dataclass(frozen=True)
class StudySettings:
    name: str | None = None
    storage: str | None = None
    sampler: str = "tpe"
    seed: int | None = None
    n_trials: int = 100
    timeout: float | None = None
    pruner: str = "median"
    heartbeat_interval: int = 30
    grace_period: int = 120
    # "estimated": rank trials by teacher-forced acceptance and a timed cost model (seconds per
    # trial), then measure the `confirm_top` best for real in the measured study of the config.
    objective: str = "measured"
    confirm_top: int = 3
    # A trial whose speedup in any category of its prompts is below this is infeasible.
    category_floor: float | None = None


@dataclass(frozen=True)
class StudyConfig:
    model: ModelConfig = ModelConfig()
    prompts: PromptConfig = PromptConfig()
    search: SearchConfig = SearchConfig()
    study: StudySettings = StudySettings()

    def with_overrides(self, n_prompts: int | None = None, max_new_tokens: int | None = None) -> StudyConfig:
        """The config with command-line overrides of the prompt set applied."""
        changes = {k: v for k, v in (("n_prompts", n_prompts), ("max_new_tokens", max_new_tokens)) if v is not None}
        return dataclasses.replace(self, prompts=dataclasses.replace(self.prompts, **changes))


_SECTIONS = {"model": ModelConfig, "prompts": PromptConfig, "search": SearchConfig, "study": StudySettings}
# `search` spells each knob's range as its own key; `ranges` is only the parsed form.
_SEARCH_KEYS = {"strategy", "warm_start_skip_ratios", "draft_adapters", "lookup_corpus", *KNOBS}


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


class _Reader:
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


def _model(reader: _Reader) -> ModelConfig:
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


def _prompt_source(reader: _Reader, table: dict[str, Any]) -> str:
    source = reader.get(table, "prompts", "source", str, HUMANEVAL)
    if source in (HUMANEVAL, WORKLOAD):
        return source
    # A prompt file is named relative to the config, so a study directory can be moved whole.
    resolved = (reader.path.parent / source).resolve()
    if not resolved.is_file():
        raise reader.error(
            "prompts.source", f"{source!r} is neither {HUMANEVAL!r}, {WORKLOAD!r} nor a JSONL file ({resolved})"
        )
    return str(resolved)


def _split(reader: _Reader, table: dict[str, Any], source: str) -> str | None:
    split = reader.get(table, "prompts", "split", str, None)
    if split == HELD_OUT_SPLIT:
        raise reader.error(
            "prompts.split",
            f"a study never tunes on the {HELD_OUT_SPLIT!r} split: it is kept for measuring what tuning "
            f"found (`hf-selfspec bench`); use {TUNE_SPLIT!r}",
        )
    if split is not None and split != TUNE_SPLIT:
        raise reader.error("prompts.split", f"must be {TUNE_SPLIT!r}, got {split!r}")
    if split is not None and source == HUMANEVAL:
        raise reader.error("prompts.split", f"{HUMANEVAL!r} has no splits; keep prompts apart with offset")
    return TUNE_SPLIT if source == WORKLOAD else split


def _prompts(reader: _Reader) -> PromptConfig:
    table = reader.section("prompts", {f.name for f in dataclasses.fields(PromptConfig)})
    defaults = PromptConfig()
    source = _prompt_source(reader, table)
    per_category = reader.at_least(table, "prompts", "per_category", 1, None)
    if per_category is not None and source == HUMANEVAL:
        raise reader.error("prompts.per_category", f"{HUMANEVAL!r} is all one category (code); use n_prompts")
    offset = reader.at_least(table, "prompts", "offset", 0, defaults.offset)
    if offset and (source == WORKLOAD or per_category is not None):
        raise reader.error(
            "prompts.offset",
            "does not apply to prompts chosen per category (the first per_category of each); leave it out",
        )
    return PromptConfig(
        source=source,
        n_prompts=reader.at_least(table, "prompts", "n_prompts", 1, defaults.n_prompts),
        offset=offset,
        max_new_tokens=reader.at_least(table, "prompts", "max_new_tokens", 1, defaults.max_new_tokens),
        split=_split(reader, table, source),
        per_category=per_category,
    )


def _knob_range(reader: _Reader, name: str, value: Any) -> tuple[float, float]:
    knob = KNOBS[name]
    key = f"search.{name}"
    number = (int,) if knob.kind is int else (int, float)
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, number) and not isinstance(v, bool) for v in value)
    ):
        kind = "integers" if knob.kind is int else "numbers"
        raise reader.error(key, f"must be a [low, high] pair of {kind}, got {value!r}")
    low, high = (knob.kind(v) for v in value)
    lower_limit, upper_limit = knob.limits
    if low > high:
        raise reader.error(key, f"low {low} is above high {high}")
    if lower_limit is not None and low < lower_limit or upper_limit is not None and high > upper_limit:
        raise reader.error(key, f"[{low}, {high}] leaves the allowed range [{lower_limit}, {upper_limit or '∞'}]")
    if knob.log and low <= 0:
        raise reader.error(key, f"is searched on a log scale, so low must be above 0, got {low}")
    return low, high


def _draft_adapters(reader: _Reader, table: dict[str, Any], strategy: str) -> dict[str, str]:
    """The listed adapters by name, each found and read as an adapter description now, so that
    a typo stops the study before the model loads; whether one fits the model is checked once
    it has (`check_adapters_fit`)."""
    key = "search.draft_adapters"
    listed = table.get("draft_adapters", [])
    if not isinstance(listed, list) or not all(isinstance(name, str) and name for name in listed):
        raise reader.error(key, f"must be a list of adapter files (relative to this config), got {listed!r}")
    if resolve_strategy(strategy).needs_draft_adapter and not listed:
        raise reader.error(
            key,
            f"strategy {strategy!r} drafts only with a trained adapter: list the adapters to choose among, "
            "trained beforehand with `hf-selfspec train-adapter`",
        )
    adapters: dict[str, str] = {}
    for name in listed:
        # Named relative to the config, like a prompt file, so a study directory can be moved whole.
        weights, _ = adapter_files(reader.path.parent / name)
        try:
            read_adapter_shape(weights)
        except ValueError as error:
            raise reader.error(key, f"{name!r}: {error}") from None
        choice = weights.stem
        if choice in adapters:
            raise reader.error(key, f"two adapters are named {choice!r}; a trial tells them apart by name")
        adapters[choice] = str(weights.resolve())
    return adapters


def _lookup_corpus(reader: _Reader, table: dict[str, Any], ranges: dict[str, tuple[float, float]]) -> str:
    """The corpus file, named relative to the config and read as a corpus description now; it
    extends prompt lookup, so every trial must look up."""
    key = "search.lookup_corpus"
    name = reader.get(table, "search", "lookup_corpus", str, "")
    if not name:
        return ""
    tokens, _ = adapter_files(reader.path.parent / name)
    try:
        read_corpus_description(tokens)
    except ValueError as error:
        raise reader.error(key, f"{name!r}: {error}") from None
    if ranges.get("prompt_lookup_tokens", KNOBS["prompt_lookup_tokens"].default_range)[0] < 1:
        raise reader.error(key, "extends prompt lookup: give search.prompt_lookup_tokens a range from 1 up")
    return str(tokens.resolve())


def _search(reader: _Reader) -> SearchConfig:
    table = reader.section("search", _SEARCH_KEYS)
    defaults = SearchConfig()
    strategy = reader.choice(table, "search", "strategy", tuple(STRATEGY_KNOBS), defaults.strategy)
    ranges = {}
    for name in KNOBS:
        if name not in table:
            continue
        if name not in STRATEGY_KNOBS[strategy]:
            users = [s for s, knobs in STRATEGY_KNOBS.items() if name in knobs]
            raise reader.error(
                f"search.{name}", f"strategy {strategy!r} does not read it (only {', '.join(users)} does)"
            )
        ranges[name] = _knob_range(reader, name, table[name])
    shortest = ranges.get("prompt_lookup_min_ngram", KNOBS["prompt_lookup_min_ngram"].default_range)
    longest = ranges.get("prompt_lookup_ngram", KNOBS["prompt_lookup_ngram"].default_range)
    if shortest[1] > longest[0]:
        raise reader.error(
            "search.prompt_lookup_min_ngram",
            f"reaches {int(shortest[1])}, above the shortest prompt_lookup_ngram searched ({int(longest[0])}): "
            "a trial could ask for matches shorter than they may be",
        )
    ratios = table.get("warm_start_skip_ratios", list(defaults.warm_start_skip_ratios))
    if not isinstance(ratios, list) or not all(
        isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r < 1 for r in ratios
    ):
        raise reader.error(
            "search.warm_start_skip_ratios", f"must be a list of numbers between 0 and 1, got {ratios!r}"
        )
    return SearchConfig(
        strategy=strategy,
        ranges=ranges,
        warm_start_skip_ratios=tuple(float(r) for r in ratios),
        draft_adapters=_draft_adapters(reader, table, strategy),
        lookup_corpus=_lookup_corpus(reader, table, ranges),
    )


def _study(reader: _Reader) -> StudySettings:
    table = reader.section("study", {f.name for f in dataclasses.fields(StudySettings)})
    defaults = StudySettings()
    timeout = reader.get(table, "study", "timeout", (int, float), None)
    if timeout is not None and timeout <= 0:
        raise reader.error("study.timeout", f"must be a positive number of seconds, got {timeout}")
    settings = StudySettings(
        name=reader.get(table, "study", "name", str, None),
        storage=reader.get(table, "study", "storage", str, None),
        sampler=reader.choice(table, "study", "sampler", SAMPLERS, defaults.sampler),
        seed=reader.get(table, "study", "seed", int, None),
        n_trials=reader.at_least(table, "study", "n_trials", 1, defaults.n_trials),
        timeout=timeout,
        pruner=reader.choice(table, "study", "pruner", PRUNERS, defaults.pruner),
        heartbeat_interval=reader.at_least(table, "study", "heartbeat_interval", 1, defaults.heartbeat_interval),
        grace_period=reader.at_least(table, "study", "grace_period", 1, defaults.grace_period),
        objective=reader.choice(table, "study", "objective", OBJECTIVES, defaults.objective),
        confirm_top=reader.at_least(table, "study", "confirm_top", 0, defaults.confirm_top),
        category_floor=reader.get(table, "study", "category_floor", (int, float), None),
    )
    if settings.category_floor is not None and settings.category_floor <= 0:
        raise reader.error(
            "study.category_floor",
            f"must be a speedup above 0 (1.0: no category slower than plain), got {settings.category_floor}",
        )
    if settings.grace_period <= settings.heartbeat_interval:
        # A live worker would see its own running trial declared dead between two heartbeats.
        raise reader.error(
            "study.grace_period",
            f"must exceed heartbeat_interval ({settings.heartbeat_interval}), got {settings.grace_period}",
        )
    return settings


def read_toml_config(path: str | Path, sections: set[str] | dict, what: str = "config") -> _Reader:
    """A config file parsed strictly: unknown sections are errors, and so is a file that is
    missing, a directory, not UTF-8 or not TOML, each in one line naming the file."""
    path = Path(path)
    try:
        data = tomllib.loads(read_text_file(path, what))
    except InputError as error:
        raise StudyConfigError(str(error)) from None
    except tomllib.TOMLDecodeError as error:
        raise StudyConfigError(f"{path}: not valid TOML ({error})") from None
    reader = _Reader(path, data)
    for section in data:
        if section not in sections:
            raise reader.error(section, f"unknown section; this {what} has {', '.join(f'[{s}]' for s in sections)}")
    return reader


def load_study_config(path: str | Path) -> StudyConfig:
    reader = read_toml_config(path, _SECTIONS, "study config")
    return StudyConfig(model=_model(reader), prompts=_prompts(reader), search=_search(reader), study=_study(reader))


def check_adapters_fit(search: SearchConfig, model) -> None:
    """Fail before any trial runs if a listed adapter was trained for another model: a trial
    would only fail, and the sampler would learn nothing from it."""
    for name, weights in search.draft_adapters.items():
        try:
            read_adapter(model, weights)
        except ValueError as error:
            raise StudyConfigError(f"search.draft_adapters: {name!r} does not fit the model: {error}") from None
