"""The search space: what one trial tries, and the trials every study starts with.

A trial chooses its draft, plus the numeric knobs its strategy reads. The draft is either a skip
set, chosen per decoder layer (whether the draft skips its attention, `skip_attn_{i}`, and its
MLP, `skip_mlp_{i}`), or, in a study that lists trained adapters, one of them (`draft_adapter`,
by name). Optuna parameters are named so that the dashboard's parameter plots read per layer and
per adapter; `decode_params` turns them into the `SelfSpecParams` names that `generate` and the
tuned profiles use, so no other module needs to know how a trial is spelt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna

from hf_selfspec.params import SelfSpecParams, default_skip_layers

if TYPE_CHECKING:
    from .config import SearchConfig

SUB_LAYERS = ("attn", "mlp")
ADAPTER_PARAM = "draft_adapter"


@dataclass(frozen=True)
class Knob:
    """One numeric parameter the tuner may search, with the range it searches by default and the
    limits any configured range must respect (None: unbounded on that side)."""

    name: str
    kind: type
    default_range: tuple[float, float]
    limits: tuple[float | None, float | None]
    log: bool = False


_DEFAULTS = SelfSpecParams()


def _fixed_at_default(name: str) -> tuple[float, float]:
    """A range that is just `generate`'s own default: the knob is not searched unless a study
    gives it a range, and its value cannot drift from the default if that changes."""
    value = getattr(_DEFAULTS, name)
    return (value, value)


KNOBS: dict[str, Knob] = {
    knob.name: knob
    for knob in (
        Knob("max_draft_tokens", int, (1, 12), (1, None)),
        Knob("draft_exit_threshold", float, (0.05, 0.95), (0.0, 1.0)),
        # α of Draft & Verify: the acceptance rate the adaptive threshold steers towards.
        Knob("target_acceptance", float, (0.5, 0.95), (0.0, 1.0)),
        # ε of Draft & Verify: how far one verification moves the threshold. Useful values span
        # two orders of magnitude, so it is searched on a log scale.
        Knob("threshold_step", float, (0.001, 0.1), (0.0, 1.0), log=True),
        Knob("target_confidence_threshold", float, (0.05, 0.95), (0.0, 1.0)),
        # Off unless a study opts in with a range: composing prompt lookup with the layer-skip
        # draft, and restricting the draft's LM head, change what the draft costs.
        Knob("prompt_lookup_tokens", int, _fixed_at_default("prompt_lookup_tokens"), (0, None)),
        # The shortest n-gram match a lookup accepts, and the longest it tries first (a range for
        # both must keep the first at most the second; see the config's checks).
        Knob("prompt_lookup_min_ngram", int, _fixed_at_default("prompt_lookup_min_ngram"), (1, None)),
        Knob("prompt_lookup_ngram", int, _fixed_at_default("prompt_lookup_ngram"), (1, None)),
        # How far an adaptive lookup length may grow (0: a fixed length). A range for it must stay
        # at or above prompt_lookup_tokens's, or trials that cross are invalid and pruned.
        Knob("prompt_lookup_max_tokens", int, _fixed_at_default("prompt_lookup_max_tokens"), (0, None)),
        # How often the loser of lookup and the model's draft is probed (0: lookup always first).
        Knob("draft_source_probe_interval", int, _fixed_at_default("draft_source_probe_interval"), (0, None)),
        Knob("draft_vocab_size", int, _fixed_at_default("draft_vocab_size"), (0, None)),
        # Verifying the draft's runner-ups widens every verification: off unless a study asks.
        Knob("draft_alternatives", int, _fixed_at_default("draft_alternatives"), (0, None)),
        # How often the back-off probes the mode it is not using (0: never back off).
        Knob("backoff_probe_interval", int, _fixed_at_default("backoff_probe_interval"), (0, None)),
    )
}

_COMMON_KNOBS = (
    "max_draft_tokens",
    "draft_exit_threshold",
    "prompt_lookup_tokens",
    "prompt_lookup_min_ngram",
    "prompt_lookup_ngram",
    "prompt_lookup_max_tokens",
    "draft_source_probe_interval",
    "draft_vocab_size",
    "draft_alternatives",
    "backoff_probe_interval",
)
STRATEGY_KNOBS: dict[str, tuple[str, ...]] = {
    "self_speculative": _COMMON_KNOBS,
    "adaptive_draft_exit": _COMMON_KNOBS + ("target_acceptance", "threshold_step"),
    "target_confidence_gated": _COMMON_KNOBS + ("target_confidence_threshold",),
    "kangaroo": _COMMON_KNOBS,
}


def skip_param_name(sub_layer: str, layer: int) -> str:
    return f"skip_{sub_layer}_{layer}"


def suggest_params(trial: optuna.Trial, search: SearchConfig, num_layers: int) -> dict[str, Any]:
    """Ask the sampler for one point of the space; returns `generate` keyword arguments, with a
    chosen adapter named by where this worker keeps it."""
    if search.draft_adapters:
        trial.suggest_categorical(ADAPTER_PARAM, list(search.draft_adapters))
    else:
        for layer in range(num_layers):
            for sub_layer in SUB_LAYERS:
                trial.suggest_categorical(skip_param_name(sub_layer, layer), [False, True])
    for name in STRATEGY_KNOBS[search.strategy]:
        knob = KNOBS[name]
        low, high = search.range_of(name)
        if knob.kind is int:
            trial.suggest_int(name, int(low), int(high), log=knob.log)
        else:
            trial.suggest_float(name, float(low), float(high), log=knob.log)
    params = decode_params(trial.params, search.strategy, num_layers)
    if search.draft_adapters:
        params["draft_adapter"] = search.draft_adapters[trial.params[ADAPTER_PARAM]]
    if search.lookup_corpus:
        params["lookup_corpus"] = search.lookup_corpus
    return params


def adapter_file_name(adapter: str) -> str:
    """How a profile names the adapter a trial chose: its weights file, beside the config."""
    return f"{adapter}.safetensors"


def decode_params(values: Mapping[str, Any], strategy: str, num_layers: int) -> dict[str, Any]:
    """Every `SelfSpecParams` field, from a trial's Optuna parameters, as a profile spells them.

    Knobs the strategy does not search keep their documented defaults, and all of them are
    passed and exported explicitly: a measurement then depends only on the trial, never on
    whatever profile or setting the model's own generation config happens to carry. A chosen
    adapter is named by its file name alone, which is where `export` puts it.
    """
    knobs = {name: values[name] for name in STRATEGY_KNOBS[strategy]}
    if ADAPTER_PARAM in values:  # the adapter replaces the skip set as the draft
        draft: dict[str, Any] = {"draft_adapter": adapter_file_name(values[ADAPTER_PARAM])}
    else:
        draft = {
            f"{sub_layer}_skip_layers": tuple(
                layer for layer in range(num_layers) if values[skip_param_name(sub_layer, layer)]
            )
            for sub_layer in SUB_LAYERS
        }
    return SelfSpecParams(**draft, **knobs).as_dict()


def skip_ratio(params: Mapping[str, Any], num_layers: int) -> float:
    """The share of sub-layers (attention and MLP counted apart) the draft skips."""
    return (len(params["attn_skip_layers"]) + len(params["mlp_skip_layers"])) / (2 * num_layers)


def evenly_spread_layers(num_layers: int, ratio: float) -> tuple[int, ...]:
    """`ratio` of the layers, spread evenly between the second and the second-to-last.

    The first layer builds the representation everything else reads and the last one shapes the
    logits, so both are kept; spreading the rest keeps any stretch of the network from being
    dropped wholesale.
    """
    inner = list(range(1, num_layers - 1))
    count = min(round(ratio * num_layers), len(inner))
    return tuple(inner[round((j + 0.5) * len(inner) / count - 0.5)] for j in range(count))


def warm_start_trials(search: SearchConfig, num_layers: int) -> list[dict[str, Any]]:
    """Fixed first trials, in Optuna parameter names. In a study of adapters: each adapter once.
    Otherwise: the documented default skip set, evenly spread skip sets at the configured
    ratios, and no skips at all (the draft is the full model, so it shows what drafting alone
    costs); identical skip sets appear once. Numeric knobs start at their `SelfSpecParams`
    defaults, moved into the configured range."""
    defaults = SelfSpecParams()
    knob_values = {}
    for name in STRATEGY_KNOBS[search.strategy]:
        low, high = search.range_of(name)
        knob_values[name] = min(max(getattr(defaults, name), low), high)
    if search.draft_adapters:
        return [{ADAPTER_PARAM: adapter, **knob_values} for adapter in search.draft_adapters]
    skip_sets = [default_skip_layers(num_layers)[0]]
    skip_sets += [evenly_spread_layers(num_layers, ratio) for ratio in search.warm_start_skip_ratios]
    skip_sets.append(())
    trials = []
    for layers in dict.fromkeys(skip_sets):
        params = {
            skip_param_name(sub_layer, layer): layer in layers
            for layer in range(num_layers)
            for sub_layer in SUB_LAYERS
        }
        trials.append({**params, **knob_values})
    return trials
