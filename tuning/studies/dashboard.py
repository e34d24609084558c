"""The dashboard: optuna-dashboard on the study storage, and the markdown note each study carries.

The note is what a person opening the dashboard needs before any plot: what was measured
(model, device, prompts), how fast plain decoding was, and the best trial in words.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

import optuna
from optuna.trial import TrialState

from hf_selfspec.tuner_api import AdaptiveLookupLength, SelfSpecParams

from .. import TuningError
from .categories import describe_categories, is_feasible
from .storage import StudyContext, display_url, open_storage


def _layer_list(layers: Iterable[int]) -> str:
    """`1, 3-5, 9`: runs of consecutive layers collapsed, so a 30-layer skip set stays readable."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _skips_in_words(attrs: dict[str, Any]) -> str:
    parts = [
        f"{name} in layers {_layer_list(attrs[key])}"
        for name, key in (("attention", "attn_skip_layers"), ("the MLP", "mlp_skip_layers"))
        if attrs.get(key)
    ]
    return "skips " + " and ".join(parts) if parts else "skips nothing (the draft is the full model)"


def draft_figure(attrs: dict[str, Any]) -> tuple[str, str]:
    """What a trial's draft was, as a label and a value for one line of a summary: the adapter it
    chose, or the share of sub-layers it skipped."""
    if "draft_adapter" in attrs:
        return "draft adapter", attrs["draft_adapter"]
    return "skip ratio", f"{attrs['skip_ratio']:.0%}"


def _draft_in_words(attrs: dict[str, Any]) -> str:
    if "draft_adapter" in attrs:
        return f"is the model's first layers and the trained adapter {attrs['draft_adapter']}"
    return f"{_skips_in_words(attrs)} ({attrs['skip_ratio']:.0%} of sub-layers)"


def _knobs_in_words(params: dict[str, Any]) -> str:
    defaults = SelfSpecParams()

    def value(name: str) -> Any:
        # A knob the trial did not search (its strategy does not declare it, or the study is older
        # than the knob) was at its default.
        return params.get(name, getattr(defaults, name))

    drafts = value("max_draft_tokens")
    words = [f"drafts up to {drafts} tokens" if drafts else "never lets the model draft"]
    if "target_acceptance" in params:
        words.append(
            f"starts its exit threshold at {value('draft_exit_threshold'):.2f} and steers it towards "
            f"{params['target_acceptance']:.0%} acceptance in steps of {value('threshold_step'):.3g}"
        )
    else:
        words.append(f"ends a draft once its confidence falls below {value('draft_exit_threshold'):.2f}")
    if "target_confidence_threshold" in params:
        words.append(f"drafts only after the full model was at least {params['target_confidence_threshold']:.0%} sure")
    if value("prompt_lookup_tokens"):
        matches = f"from {value('prompt_lookup_min_ngram')}- to {value('prompt_lookup_ngram')}-token matches"
        if value("prompt_lookup_max_tokens"):
            floor = AdaptiveLookupLength(
                value("prompt_lookup_tokens"), value("prompt_lookup_max_tokens"), value("prompt_lookup_min_tokens")
            ).min_tokens
            words.append(
                f"looks up {value('prompt_lookup_tokens')} tokens at first {matches}, growing to "
                f"{value('prompt_lookup_max_tokens')} while lookups are taken whole and shrinking to "
                f"no fewer than {floor} when they are cut short"
            )
        else:
            words.append(f"looks up to {value('prompt_lookup_tokens')} tokens {matches}")
    return ", ".join(words)


def describe_trial(trial: optuna.trial.FrozenTrial) -> str:
    """One trial's result and configuration as a sentence."""
    attrs = trial.user_attrs
    return (
        f"Trial {trial.number} decodes {trial.value:.2f}x as fast as plain greedy decoding "
        f"({attrs['tokens_per_second']:.1f} vs {attrs['baseline_tokens_per_second']:.1f} tokens/s). "
        f"Its draft {_draft_in_words(attrs)} and "
        f"{_knobs_in_words(trial.params)}; {attrs['acceptance_rate']:.0%} of drafted tokens were accepted, "
        f"{attrs['mean_accepted_length']:.2f} per verification."
        + (f" By category: {describe_categories(attrs)}." if describe_categories(attrs) else "")
    )


def count_states(trials: Iterable[optuna.trial.FrozenTrial]) -> dict[TrialState, int]:
    counts = {state: 0 for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
    for trial in trials:
        if trial.state in counts:
            counts[trial.state] += 1
    return counts


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The best complete feasible trial (none of its categories below the study's floor), or
    None; `study.best_trial` raises when there is none."""
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if is_feasible(t)]
    return max(complete, key=lambda trial: trial.value) if complete else None


def infeasible_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The complete trials with a category below the study's floor: never the best, never exported."""
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if not is_feasible(t)]


def study_note(study: optuna.Study) -> str:
    context = StudyContext.load(study)
    counts = count_states(study.get_trials(deepcopy=False))
    best = best_trial(study)
    infeasible = len(infeasible_trials(study))
    model = context.model + (f" ({context.gguf_file})" if context.gguf_file else "")
    selection = f", from #{context.prompt_offset}" if context.prompt_offset else ""
    selection += f", {context.prompt_split} split" if context.prompt_split else ""
    selection += f", {context.prompts_per_category} per category" if context.prompts_per_category else ""
    lines = [
        f"## {study.study_name}",
        "",
        "| | |",
        "|---|---|",
        f"| Model | `{model}`, {context.num_layers} layers |",
        f"| Device | `{context.device_key}` |",
        f"| Strategy | `{context.strategy}` |",
        f"| Prompts | {context.n_prompts} from `{context.prompt_source}`{selection}, "
        f"{context.max_new_tokens} new tokens each |",
        *([f"| Lookup corpus | `{context.lookup_corpus_name}` |"] if context.lookup_corpus else []),
        f"| Plain greedy | {context.baseline_tokens_per_second:.1f} tokens/s |",
        f"| Trials | {counts[TrialState.COMPLETE]} complete, {counts[TrialState.PRUNED]} pruned, "
        f"{counts[TrialState.FAIL]} failed |",
        *(
            [f"| Category floor | {context.category_floor:.2f}x; {infeasible} complete trial(s) below it |"]
            if context.category_floor
            else []
        ),
        "",
        f"**Best so far.** {describe_trial(best)}"
        if best
        else ("No trial has met the category floor yet." if infeasible else "No trial has completed yet."),
        "",
        f"Export it with `hf-selfspec export --study '{study.study_name}' --output DIR`.",
    ]
    return "\n".join(lines)


def write_study_note(study: optuna.Study) -> None:
    from optuna_dashboard import save_note

    save_note(study, study_note(study))


def serve(storage_url: str, host: str, port: int) -> None:
    """Serve the dashboard until interrupted (optuna-dashboard's own server, on our storage)."""
    from optuna_dashboard import run_server

    _check_port_free(host, port)
    storage = open_storage(storage_url)
    print(f"Dashboard for {display_url(storage_url)} at http://{host}:{port}/ (Ctrl-C to stop)", flush=True)
    run_server(storage, host=host, port=port)


def _check_port_free(host: str, port: int) -> None:
    """Bind the address once, so that a port in use, or a host that is not this machine's, is
    one line before the server starts (its own failure comes after its start-up banner)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, port))
    except OSError as error:
        raise TuningError(f"cannot listen on {host}:{port} ({error.strerror or error}); pick another --port or --host") from None
