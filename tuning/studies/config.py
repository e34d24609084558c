"""Study config files (TOML): what to tune, on what, and how long.

Read strictly, by `toml_reader`. A study names its strategy by the name it is registered under
(`register_strategy`), and may give a range to each knob that strategy declares.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_selfspec.tuner_api import (
    HELD_OUT_SPLIT,
    HUMANEVAL,
    STREAMS,
    TUNE_SPLIT,
    WORKLOAD,
    adapter_files,
    available_strategies,
    read_adapter,
    read_adapter_shape,
    read_corpus_description,
    resolve_strategy,
)

from .knobs import KNOBS, ONLINE_CORPUS_KNOBS, strategy_knobs
from .toml_reader import ModelConfig, StudyConfigError, TomlReader, read_model_section, read_toml_config

SAMPLERS = ("tpe", "random")
OBJECTIVES = ("measured", "estimated")
PRUNERS = ("median", "none")
# Prompts per trial from HumanEval or a JSONL file when the config does not say.
DEFAULT_N_PROMPTS = 8
# Why a batched study cannot be estimated: the cost model prices one row's decode.
ESTIMATED_BATCHES = (
    "the estimated objective prices a decode of one prompt, not of a batch; tune a batch_size above 1 "
    'with objective = "measured"'
)


@dataclass(frozen=True)
class PromptConfig:
    source: str = HUMANEVAL  # "humaneval", "workload", "streams", or a JSONL file's resolved path
    # At most this many prompts; None: DEFAULT_N_PROMPTS from a slice, all from a per-category selection.
    n_prompts: int | None = None
    offset: int = 0
    max_new_tokens: int = 64
    # Only prompts marked with this split; the workload's is always the tune split.
    split: str | None = None
    # The first this many prompts of each category (`study_prompts`).
    per_category: int | None = None
    # How many prompts of one category a trial decodes at once, as one batch (`batch_prompts`):
    # what a profile speculates on at that batch size is then what the study weighs.
    batch_size: int = 1


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
    # Whether a trial learns across its prompts with an online corpus of its own: the choices the
    # switch is searched over ((False,): never, (True,): always, both: the sampler decides).
    online_corpus: tuple[bool, ...] = (False,)

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
    # How many times confirmation decodes each prompt, plainly and by each confirmed trial.
    confirm_rounds: int = 1
    # With `estimated`: the rounds the cost model is timed in; fewer where a step is costly.
    calibration_rounds: int = 7
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
_SEARCH_KEYS = {"strategy", "warm_start_skip_ratios", "draft_adapters", "lookup_corpus", "online_corpus", *KNOBS}


def _prompt_source(reader: TomlReader, table: dict[str, Any]) -> str:
    source = reader.get(table, "prompts", "source", str, HUMANEVAL)
    if source in (HUMANEVAL, WORKLOAD, STREAMS):
        return source
    # A prompt file is named relative to the config, so a study directory can be moved whole.
    resolved = (reader.path.parent / source).resolve()
    if not resolved.is_file():
        raise reader.error(
            "prompts.source",
            f"{source!r} is neither {HUMANEVAL!r}, {WORKLOAD!r}, {STREAMS!r} nor a JSONL file ({resolved})",
        )
    return str(resolved)


def _split(reader: TomlReader, table: dict[str, Any], source: str) -> str | None:
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
    return TUNE_SPLIT if source in (WORKLOAD, STREAMS) else split


def _prompts(reader: TomlReader) -> PromptConfig:
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
        batch_size=reader.at_least(table, "prompts", "batch_size", 1, defaults.batch_size),
    )


def _knob_range(reader: TomlReader, name: str, value: Any) -> tuple[float, float]:
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


def _draft_adapters(reader: TomlReader, table: dict[str, Any], strategy: str) -> dict[str, str]:
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


def _lookup_corpus(reader: TomlReader, table: dict[str, Any], ranges: dict[str, tuple[float, float]]) -> str:
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


def _online_corpus(reader: TomlReader, table: dict[str, Any], ranges: dict[str, tuple[float, float]]) -> tuple[bool, ...]:
    """The switch's choices: `true`, `false`, or both as a list. The corpus is one more source of
    prompt lookup, so a trial that may switch it on must look up; and its knobs are read only
    where it is on."""
    key = "search.online_corpus"
    value = table.get("online_corpus", False)
    choices = [value] if isinstance(value, bool) else value
    if not isinstance(choices, list) or not choices or not all(isinstance(c, bool) for c in choices):
        raise reader.error(key, f"must be true, false or [false, true], got {value!r}")
    if True in choices and ranges.get("prompt_lookup_tokens", KNOBS["prompt_lookup_tokens"].default_range)[0] < 1:
        raise reader.error(key, "is a source of prompt lookup: give search.prompt_lookup_tokens a range from 1 up")
    unread = [name for name in ONLINE_CORPUS_KNOBS if name in ranges]
    if unread and True not in choices:
        raise reader.error(f"search.{unread[0]}", "is read only with the online corpus on: set search.online_corpus")
    return tuple(dict.fromkeys(choices))


def _strategy(reader: TomlReader, table: dict[str, Any], default: str) -> str:
    """A registered strategy's name, whose every declared knob the tuner can search."""
    strategy = reader.get(table, "search", "strategy", str, default)
    if strategy not in available_strategies():
        raise reader.error(
            "search.strategy",
            f"must be one of {', '.join(available_strategies())}, got {strategy!r}; a strategy of your own must be "
            "registered (hf_selfspec.register_strategy) before the config is read",
        )
    unsearchable = [name for name in strategy_knobs(strategy) if name not in KNOBS]
    if unsearchable:
        raise reader.error(
            "search.strategy",
            f"strategy {strategy!r} declares tunable knob {unsearchable[0]!r}, which the tuner has no range for; "
            f"it can search {', '.join(KNOBS)}",
        )
    return strategy


def _search(reader: TomlReader) -> SearchConfig:
    table = reader.section("search", _SEARCH_KEYS)
    defaults = SearchConfig()
    strategy = _strategy(reader, table, defaults.strategy)
    ranges = {}
    for name in KNOBS:
        if name not in table:
            continue
        if name not in strategy_knobs(strategy):
            users = [s for s in available_strategies() if name in strategy_knobs(s)]
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
        online_corpus=_online_corpus(reader, table, ranges),
    )


def _study(reader: TomlReader) -> StudySettings:
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
        confirm_rounds=reader.at_least(table, "study", "confirm_rounds", 1, defaults.confirm_rounds),
        calibration_rounds=reader.at_least(table, "study", "calibration_rounds", 1, defaults.calibration_rounds),
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


def load_study_config(path: str | Path) -> StudyConfig:
    reader = read_toml_config(path, _SECTIONS, "study config")
    config = StudyConfig(
        model=read_model_section(reader), prompts=_prompts(reader), search=_search(reader), study=_study(reader)
    )
    if config.prompts.batch_size > 1 and config.study.objective == "estimated":
        raise reader.error("prompts.batch_size", ESTIMATED_BATCHES)
    if "batch_quorum" in config.search.ranges and config.prompts.batch_size == 1:
        # A batch of one is never cut to a quorum: every trial would measure the same decode.
        raise reader.error("search.batch_quorum", "is read only in a batch: set prompts.batch_size above 1")
    return config


def check_adapters_fit(search: SearchConfig, model) -> None:
    """Fail before any trial runs if a listed adapter was trained for another model: a trial
    would only fail, and the sampler would learn nothing from it."""
    for name, weights in search.draft_adapters.items():
        try:
            read_adapter(model, weights)
        except ValueError as error:
            raise StudyConfigError(f"search.draft_adapters: {name!r} does not fit the model: {error}") from None
