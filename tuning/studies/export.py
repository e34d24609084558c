"""Exporting a study's best trial as a tuned profile in `DIR/generation_config.json`.

The file starts as the one already in DIR, or else the model's own generation config, and only
this device's profile is added or replaced (in the format `hf_selfspec.profiles` defines), so
one config file collects profiles measured on many machines. A profile that drafts with a
trained adapter gets the adapter's two files copied beside the config and names it by file name,
so DIR is self-contained; so does a lookup corpus, and the saved online corpus of a trial that
learned across its prompts (`online_corpus_file`: what the call's online corpus starts from, once
an operator switches it on). Nothing else in DIR is touched, which makes DIR safely a model
directory.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from hf_selfspec.tuner_api import (
    AdapterConflictError,
    InputError,
    TunedProfile,
    adapter_digest,
    copy_adapter,
    output_directory,
    pretrained_source,
    read_config_json,
    write_profile,
)

from .. import TuningError
from .categories import POOLED
from .dashboard import best_trial, count_states, infeasible_trials
from .space import decode_params, uses_online_corpus
from .storage import StudyContext, load_existing_study

CONFIG_NAME = "generation_config.json"


class ExportError(TuningError):
    pass


@dataclass(frozen=True)
class ExportResult:
    path: Path
    key: str
    profile: TunedProfile
    # Complete trials passed over for a category below the study's floor, by number.
    infeasible_trials: tuple[int, ...] = ()


def _model_generation_config(context: StudyContext) -> dict[str, Any]:
    """The tuned model's own generation config, as the dict `save_pretrained` would write.

    A GGUF file carries no generation config, so for one without a `generation_config.json`
    beside it the config is derived from the model config, as transformers does when loading.
    """
    from transformers import AutoConfig, GenerationConfig

    source = pretrained_source(context.model)
    try:
        try:
            config = GenerationConfig.from_pretrained(source)
        except OSError:
            extra = {"gguf_file": context.gguf_file} if context.gguf_file else {}
            config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(source, **extra))
    except (OSError, ValueError) as error:
        raise ExportError(f"cannot read the generation config of {context.model}: {error}") from None
    return json.loads(config.to_json_string(use_diff=True))


def _read_existing(path: Path) -> dict[str, Any]:
    try:
        return read_config_json(path)
    except ValueError as error:
        raise ExportError(str(error)) from None


def _write_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write through a temporary file and a rename, so a crash never leaves half a config."""
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        # mkstemp makes the file private; a model directory's config is meant to be read by all.
        os.chmod(temporary, path.stat().st_mode if path.exists() else 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def best_profile(study, context: StudyContext, trial_number: int | None = None) -> TunedProfile:
    """The study's best complete feasible trial (or the complete trial `trial_number`, chosen by
    another measurement) as a profile, with what it was measured on."""
    best = best_trial(study) if trial_number is None else _complete_trial(study, trial_number)
    infeasible = infeasible_trials(study)
    if best is None and infeasible:
        raise ExportError(
            f"study {study.study_name!r} has no trial that meets its category floor: all {len(infeasible)} "
            "complete trials fall below it in some category; tune longer, or lower [study] category_floor"
        )
    if best is None:
        counts = count_states(study.get_trials(deepcopy=False))
        raise ExportError(
            f"study {study.study_name!r} has no completed trial yet ({sum(counts.values())} finished: "
            f"{', '.join(f'{n} {s.name.lower()}' for s, n in counts.items())}); run `hf-selfspec tune` first"
        )
    attrs = best.user_attrs
    measured = {
        "speedup": best.value,
        "acceptance_rate": attrs["acceptance_rate"],
        "mean_accepted_length": attrs["mean_accepted_length"],
        "tokens_per_second": attrs["tokens_per_second"],
        "baseline_tokens_per_second": attrs["baseline_tokens_per_second"],
        # Trials from before categories were counted had a pooled speedup.
        "speedup_kind": attrs.get("speedup_kind", POOLED),
        "prompts": {
            "source": context.prompt_source,
            "n_prompts": context.n_prompts,
            "offset": context.prompt_offset,
            "max_new_tokens": context.max_new_tokens,
            **({"split": context.prompt_split} if context.prompt_split else {}),
            **({"per_category": context.prompts_per_category} if context.prompts_per_category else {}),
            # The batch the speedup was measured on; left out, one prompt at a time.
            **({"batch_size": context.batch_size} if context.batch_size > 1 else {}),
        },
        "study": study.study_name,
        "trial": best.number,
        "measured_at": best.datetime_complete.isoformat(timespec="seconds") if best.datetime_complete else None,
        "versions": context.versions,
    }
    if "category_speedups" in attrs:
        measured["categories"] = {
            name: {
                "speedup": speedup,
                "acceptance_rate": attrs["category_acceptance"][name],
                "prompts": attrs["category_prompts"][name],
            }
            for name, speedup in attrs["category_speedups"].items()
        }
    if context.category_floor:
        measured["category_floor"] = context.category_floor
    params = decode_params(best.params, context.strategy, context.num_layers)
    params["lookup_corpus"] = context.lookup_corpus_name  # beside the config, where `export` puts it
    if uses_online_corpus(best.params):  # what its corpus learned, beside the config too
        params["online_corpus_file"] = Path(context.online_corpus_file).name
    return TunedProfile(context.strategy, params, measured)


def _complete_trial(study, number: int):
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    chosen = next((trial for trial in trials if trial.number == number), None)
    if chosen is None:
        raise ExportError(f"study {study.study_name!r} has no complete trial {number}")
    return chosen


def export_profile(
    storage_url: str, study_name: str, output_dir: str | Path, trial_number: int | None = None
) -> ExportResult:
    try:
        output_dir = output_directory(output_dir, "--output")
    except InputError as error:
        raise ExportError(str(error)) from None
    study = load_existing_study(storage_url, study_name)
    context = StudyContext.load(study)
    profile = best_profile(study, context, trial_number)
    path = output_dir / CONFIG_NAME
    data = _read_existing(path) if path.is_file() else _model_generation_config(context)
    # transformers drops every key it does not know, our profiles included, when it loads a
    # config marked as derived from the model config; with a profile in it, it no longer is.
    data.pop("_from_model_config", None)
    try:
        write_profile(data, context.device_key, profile)  # validates the profiles already there
    except ValueError as error:
        raise ExportError(f"{path if path.is_file() else context.model}: {error}") from None
    if profile.params["draft_adapter"]:
        _copy_chosen_adapter(context, profile.params["draft_adapter"], output_dir)
    if context.lookup_corpus:
        _copy_measured_file(context.lookup_corpus, context.lookup_corpus_digest, output_dir, "looks up in")
    if profile.params["online_corpus_file"]:
        _copy_measured_file(context.online_corpus_file, context.online_corpus_digest, output_dir, "starts its online corpus from")
    output_dir.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, data)
    return ExportResult(
        path, context.device_key, profile, tuple(trial.number for trial in infeasible_trials(study))
    )


def _copy_chosen_adapter(context: StudyContext, file_name: str, output_dir: Path) -> None:
    """Put the trial's adapter beside the config, from where the study's worker kept it; before
    the config is written, so a missing adapter leaves DIR as it was."""
    source = context.draft_adapters.get(Path(file_name).stem)
    if source is None:
        raise ExportError(
            f"the best trial drafts with {file_name}, which the study does not record; "
            f"it lists {', '.join(context.draft_adapters) or 'no adapters'}"
        )
    _copy_measured_file(source, context.draft_adapter_digests.get(Path(file_name).stem), output_dir, "drafts with")


def _copy_measured_file(source: str, measured_digest: str | None, output_dir: Path, use: str) -> None:
    """Copy a file the best trial used (an adapter, a lookup corpus) beside the config, refusing
    one whose contents are no longer what the study measured."""
    file_name = Path(source).name
    try:
        if measured_digest and adapter_digest(source) != measured_digest:
            raise ExportError(
                f"the best trial {use} {file_name}, but {source} now holds other contents than the study "
                "measured (rewritten since?); tune a new study with it, or put the measured file back"
            )
        copy_adapter(source, output_dir)
    except AdapterConflictError as error:
        raise ExportError(f"the best trial {use} {file_name}, but {error}") from None
    except ValueError as error:
        raise ExportError(
            f"the best trial {use} {file_name}, but {error}; put it back, or export on the machine that tuned"
        ) from None
