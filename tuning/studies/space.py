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
from typing import Any

import optuna

from hf_selfspec.tuner_api import SelfSpecParams, default_skip_layers

from .config import SearchConfig
from .knobs import KNOBS, ONLINE_CORPUS_KNOBS, strategy_knobs

SUB_LAYERS = ("attn", "mlp")
ADAPTER_PARAM = "draft_adapter"
# Whether the trial learns across its prompts with an online corpus of its own (a study that
# never switches it on does not ask for it, so its trials read as they did before it existed).
ONLINE_CORPUS_PARAM = "online_corpus"


def uses_online_corpus(values: Mapping[str, Any]) -> bool:
    """Whether a trial (its Optuna parameters) decodes with an online corpus."""
    return bool(values.get(ONLINE_CORPUS_PARAM, False))


def skip_param_name(sub_layer: str, layer: int) -> str:
    return f"skip_{sub_layer}_{layer}"


def suggest_params(trial: optuna.trial.BaseTrial, search: SearchConfig, num_layers: int) -> dict[str, Any]:
    """Ask the sampler for one point of the space; returns `generate` keyword arguments, with a
    chosen adapter named by where this worker keeps it."""
    if search.draft_adapters:
        trial.suggest_categorical(ADAPTER_PARAM, list(search.draft_adapters))
    else:
        for layer in range(num_layers):
            for sub_layer in SUB_LAYERS:
                trial.suggest_categorical(skip_param_name(sub_layer, layer), [False, True])
    online = True in search.online_corpus and trial.suggest_categorical(ONLINE_CORPUS_PARAM, list(search.online_corpus))
    for name in strategy_knobs(search.strategy):
        if name in ONLINE_CORPUS_KNOBS and not online:
            continue  # read only where the corpus is on: the sampler is not asked for what is ignored
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

    Knobs the strategy does not search, or that the trial did not read (the online corpus's,
    with the corpus off), keep their documented defaults, and all of them are
    passed and exported explicitly: a measurement then depends only on the trial, never on
    whatever profile or setting the model's own generation config happens to carry. A chosen
    adapter is named by its file name alone, which is where `export` puts it.
    """
    knobs = {name: values[name] for name in strategy_knobs(strategy) if name in values}
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
    defaults, moved into the configured range. Where that range lets `max_draft_tokens` be 0,
    one more trial, the first again, has the model never draft (lookup alone), so that a study on
    a model no draft pays for starts from what copying gains. Where runner-ups are searched, one
    more has the first verify as many as the range allows: a range reaches that far only where
    wide verifications cost little, and there the widest tree is the likeliest good one."""
    defaults = SelfSpecParams()
    # A study that may switch the corpus on starts with it on: it was written for text that repeats.
    online = True in search.online_corpus
    knob_values: dict[str, Any] = {ONLINE_CORPUS_PARAM: True} if online else {}
    for name in strategy_knobs(search.strategy):
        if name in ONLINE_CORPUS_KNOBS and not online:
            continue
        low, high = search.range_of(name)
        knob_values[name] = min(max(getattr(defaults, name), low), high)
    if search.draft_adapters:
        trials = [{ADAPTER_PARAM: adapter, **knob_values} for adapter in search.draft_adapters]
    else:
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
    if search.range_of("max_draft_tokens")[0] == 0:
        trials.append({**trials[0], "max_draft_tokens": 0})
    widest = search.range_of("draft_alternatives")[1] if "draft_alternatives" in knob_values else 0
    if widest > knob_values.get("draft_alternatives", 0):
        trials.append({**trials[0], "draft_alternatives": int(widest)})
    return trials
