"""Writing a study config back as the TOML `hf-selfspec tune` reads, so a study built in code
(`optimize`, `tune --model`) can be read, edited and re-run by hand.

Files the study uses (a prompt file, adapters, a lookup corpus) are written relative to the TOML,
as the reader resolves them, so the directory holding it can be moved whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .config import PromptConfig, StudyConfig
from .toml_reader import ModelConfig


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    return "[" + ", ".join(_value(item) for item in value) + "]"


def _relative(path: str, directory: Path) -> str:
    return Path(os.path.relpath(Path(path).resolve(), directory.resolve())).as_posix()


def toml_tables(tables: dict[str, dict[str, Any]]) -> str:
    """TOML text of `{section: {key: value}}`; a None value is left out (the reader's default)."""
    lines = []
    for name, entries in tables.items():
        lines += [f"[{name}]", *(f"{key} = {_value(value)}" for key, value in entries.items() if value is not None), ""]
    return "\n".join(lines)


def _prompt_entries(prompts: PromptConfig, directory: Path) -> dict[str, Any]:
    source = prompts.source if prompts.source in ("humaneval", "workload", "streams") else _relative(prompts.source, directory)
    return {
        "source": source,
        "n_prompts": prompts.n_prompts,
        "offset": prompts.offset or None,
        "max_new_tokens": prompts.max_new_tokens,
        # The workload's and the streams' split is implied; only a prompt file's is written.
        "split": prompts.split if prompts.source not in ("workload", "streams") else None,
        "per_category": prompts.per_category,
        "batch_size": prompts.batch_size if prompts.batch_size > 1 else None,
    }


def study_toml(config: StudyConfig, path: Path) -> str:
    """`config` as the text of a study TOML to be saved at `path`."""
    directory = path.parent
    search = config.search
    search_entries: dict[str, Any] = {"strategy": search.strategy}
    search_entries.update({knob: list(span) for knob, span in search.ranges.items()})
    search_entries["warm_start_skip_ratios"] = list(search.warm_start_skip_ratios)
    if search.draft_adapters:
        search_entries["draft_adapters"] = [_relative(weights, directory) for weights in search.draft_adapters.values()]
    if search.lookup_corpus:
        search_entries["lookup_corpus"] = _relative(search.lookup_corpus, directory)
    if search.online_corpus != (False,):
        search_entries["online_corpus"] = list(search.online_corpus)
    study = config.study
    return toml_tables({
        "model": model_entries(config.model),
        "prompts": _prompt_entries(config.prompts, directory),
        "search": search_entries,
        "study": {"name": study.name, "storage": study.storage, "sampler": study.sampler, "seed": study.seed,
                  "n_trials": study.n_trials, "timeout": study.timeout, "objective": study.objective,
                  "confirm_top": study.confirm_top, "confirm_rounds": study.confirm_rounds,
                  "calibration_rounds": study.calibration_rounds},
    })


def model_entries(model: ModelConfig) -> dict[str, Any]:
    return {"name": model.name, "gguf_file": model.gguf_file, "dtype": model.dtype, "device": model.device}
