"""What the bench compares: each decoding method as the `generate` arguments that select it.

Every contender names its strategy explicitly, the baseline and transformers' own methods
included (`strategy="plain"`): a tuned profile in the model's `generation_config` would otherwise
quietly turn the baseline into a speculative strategy and make every speedup read as 1x.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..layer_skip import decoder_layers
from ..params import resolve_params
from ..profile_files import anchor_profile_files
from ..profiles import TunedProfile, matching_profile, read_profiles, read_profiles_file
from ..strategies import resolve_strategy

BASELINE = "baseline"
PLAIN = "plain"
PROMPT_LOOKUP = "prompt_lookup"  # transformers' prompt lookup: the free speed-up ours must beat
HF_SELFSPEC = "hf_selfspec"  # the family of our own strategies
GATED_STRATEGY = "target_confidence_gated"
CUSTOM_GENERATE = "custom_generate"
PROMPT_LOOKUP_TOKENS = 10
# A transformers contender run again with its forward passes on the kernels our loop takes
# (`generate(narrow_kernels=True)`): beside it, a ratio tells what the draft earns from what the
# kernel does. Named `<contender><OUR_KERNELS>`.
OUR_KERNELS = "+our_kernels"
# One of our contenders run again with an online corpus of its own (`online_contenders`).
ONLINE = "+online"
PLAIN_OUR_KERNELS = f"{PLAIN}{OUR_KERNELS}"
PROMPT_LOOKUP_OUR_KERNELS = f"{PROMPT_LOOKUP}{OUR_KERNELS}"

# Where a contender's decoding knobs come from, shown in the table's "params" column.
TUNED = "tuned"
DEFAULT = "default"


@dataclass(frozen=True)
class Contender:
    """One decoding method under test.

    `lossless` contenders decode greedily and so must reproduce the baseline's tokens exactly;
    the report flags any that do not (a sampled run, `--do-sample`, has nothing to match).
    `family` groups them for the reader: the baseline, transformers' own speed-ups, or this
    package's strategies.
    """

    name: str
    generate_kwargs: Mapping[str, Any]
    family: str
    params_label: str
    lossless: bool = True

    @property
    def takes_our_kernels(self) -> bool:
        """Whether its forward passes run on the kernels `narrow_linear` chooses: our loop's do
        unless told otherwise, transformers' only when told."""
        narrow = self.generate_kwargs.get("narrow_kernels")
        return narrow if narrow is not None else self.family == HF_SELFSPEC

    def describe(self) -> dict[str, Any]:
        """A JSON-safe description; a draft model is recorded by its path, not serialised."""
        kwargs = {
            key: getattr(value, "name_or_path", type(value).__name__) if isinstance(value, torch.nn.Module) else value
            for key, value in self.generate_kwargs.items()
        }
        return {
            "name": self.name,
            "family": self.family,
            "lossless": self.lossless,
            "params_label": self.params_label,
            "generate_kwargs": kwargs,
        }


def _num_layers(model) -> int:
    """Counted the way `generate` counts them, so skip sets are validated against the same depth."""
    return len(decoder_layers(model))


def default_params(model) -> dict[str, Any]:
    """Every parameter at its default, with the documented untuned skip set for this model's
    depth (see `hf_selfspec.params.default_skip_layers`).

    All of them are passed explicitly: `generate` fills unset ones from a tuned profile even
    when the strategy differs from the profile's, which would blur "default" and "tuned".
    """
    return resolve_params(_num_layers(model), {}).as_dict()


def _profile_params(model, profile: TunedProfile, config_dir: Path | None = None) -> dict[str, Any]:
    """A profile's parameters completed and validated exactly as `generate` would (a draft
    adapter's file name resolved against the profile's directory, as `generate` resolves it)."""
    return resolve_params(_num_layers(model), anchor_profile_files(model, profile.params, config_dir)).as_dict()


def compared_profile_contender(model, config_path: str | Path) -> Contender:
    """The tuned profile for the model's device and dtype in another `generation_config.json`,
    as one more contender named `<strategy>@<file stem>`: two tuned profiles for the same
    hardware (say, the shipped default and a kangaroo one) then meet in one interleaved run
    instead of two runs whose machine drift differs. Its draft adapter resolves against that
    file's directory, as `generate` would resolve it with that config loaded."""
    config_path = Path(config_path)
    key, profile = matching_profile(read_profiles_file(config_path), model.device, model.dtype)
    if profile is None:
        raise ValueError(f"--compare-config {config_path} has no profile for {key}")
    params = _profile_params(model, profile, config_path.resolve().parent)
    return Contender(
        f"{profile.strategy}@{config_path.stem}",
        {"strategy": profile.strategy, "do_sample": False, **params},
        family=HF_SELFSPEC,
        params_label=f"{TUNED}, {config_path.name}",
    )


def tuned_profile(model) -> tuple[str, TunedProfile | None]:
    """The profile key for the device and dtype the model runs on, and its profile if the
    model's `generation_config` carries one (a profile for other hardware does not count)."""
    return matching_profile(read_profiles(model.generation_config), model.device, model.dtype)


def build_contenders(
    model,
    strategies: Sequence[str],
    assistant=None,
    custom_generate: str | None = None,
    draft_adapter: str | None = None,
) -> list[Contender]:
    """The baseline first, then transformers' methods, then ours; with `assistant`, also
    transformers' assisted generation and (when available) our gated strategy over that draft;
    with `custom_generate` (a folder written by `hf-selfspec package`), the tuned strategy once
    more, run by that folder's code through transformers' `custom_generate`.

    The strategy a tuned profile names runs with the profile's parameters; every other strategy
    runs with the default skip set, so an untuned model is still measured on equal terms. A
    strategy that drafts only with a trained adapter (kangaroo) runs untuned with `draft_adapter`,
    and is left out when neither a profile nor `draft_adapter` provides one.
    """
    profile_key, profile = tuned_profile(model)
    if profile is not None and profile.strategy not in strategies:
        raise ValueError(
            f"the tuned profile for {profile_key} names strategy {profile.strategy!r}, "
            f"which is not available; known: {', '.join(strategies)}"
        )
    if custom_generate is not None and profile is None:
        raise ValueError(
            f"--custom-generate runs the tuned profile for {profile_key}, and neither --config nor the model's "
            "generation config has one"
        )
    plain = {"strategy": PLAIN, "do_sample": False}
    lookup = {**plain, "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
    our_kernels = {"narrow_kernels": True}
    exit_layer = _num_layers(model) // 2
    contenders = [
        Contender(BASELINE, plain, family="baseline", params_label=PLAIN),
        Contender(PLAIN_OUR_KERNELS, {**plain, **our_kernels}, family="transformers", params_label="our kernels"),
        Contender(PROMPT_LOOKUP, lookup, family="transformers", params_label=f"{PROMPT_LOOKUP_TOKENS} tokens"),
        Contender(
            PROMPT_LOOKUP_OUR_KERNELS,
            {**lookup, **our_kernels},
            family="transformers",
            params_label=f"{PROMPT_LOOKUP_TOKENS} tokens, our kernels",
        ),
        Contender(
            "early_exit",
            {**plain, "assistant_early_exit": exit_layer},
            family="transformers",
            params_label=f"exit at layer {exit_layer}",
        ),
    ]
    contenders += _our_strategies(model, strategies, profile, draft_adapter)
    if custom_generate is not None:
        contenders.append(
            Contender(
                CUSTOM_GENERATE,
                {
                    "custom_generate": custom_generate,
                    "trust_remote_code": True,
                    "strategy": profile.strategy,
                    "do_sample": False,
                    **_profile_params(model, profile),
                },
                family=HF_SELFSPEC,
                params_label=f"{TUNED} {profile.strategy}, packaged",
            )
        )
    if assistant is not None:
        contenders += _assisted(model, strategies, assistant, plain)
    return contenders


def _our_strategies(model, strategies: Sequence[str], profile, draft_adapter: str | None) -> list[Contender]:
    """One contender per strategy: the tuned profile's parameters for the strategy it names, the
    default skip set for the rest, and `draft_adapter` for those that need one (left out without)."""
    contenders = []
    for strategy in strategies:
        if profile is not None and profile.strategy == strategy:
            params, label = _profile_params(model, profile), TUNED
        elif resolve_strategy(strategy).needs_draft_adapter:
            if draft_adapter is None:
                continue
            params, label = {**default_params(model), "draft_adapter": draft_adapter}, f"{DEFAULT}, {draft_adapter}"
        else:
            params, label = default_params(model), DEFAULT
        contenders.append(
            Contender(
                strategy,
                {"strategy": strategy, "do_sample": False, **params},
                family=HF_SELFSPEC,
                params_label=label,
            )
        )
    return contenders


def _assisted(model, strategies: Sequence[str], assistant, plain: dict[str, Any]) -> list[Contender]:
    """Transformers' assisted generation over `assistant`, and our gated strategy over the same
    draft where it is available."""
    draft = getattr(assistant, "name_or_path", "assistant")
    contenders = [
        Contender(
            "assisted",
            {**plain, "assistant_model": assistant},
            family="transformers",
            params_label=f"draft {draft}",
        )
    ]
    if GATED_STRATEGY in strategies:
        contenders.append(
            Contender(
                f"{GATED_STRATEGY}+assistant",
                {
                    "strategy": GATED_STRATEGY,
                    "do_sample": False,
                    "assistant_model": assistant,
                    **default_params(model),
                },
                family=HF_SELFSPEC,
                params_label=f"{DEFAULT}, draft {draft}",
            )
        )
    return contenders


def online_contenders(contenders: Sequence[Contender]) -> list[Contender]:
    """Each of our contenders that composes prompt lookup, again with an online corpus of its own
    (keyed by its name, so no contender proposes what another wrote): beside it, a ratio tells what
    learning across a stream's requests earns. The runner empties the corpus where a stream starts."""
    return [
        Contender(
            f"{contender.name}{ONLINE}",
            {**contender.generate_kwargs, "online_corpus": f"bench/{contender.name}{ONLINE}"},
            family=HF_SELFSPEC,
            params_label=f"{contender.params_label}, online corpus",
        )
        for contender in contenders
        if contender.family == HF_SELFSPEC and contender.generate_kwargs.get("prompt_lookup_tokens")
        and "custom_generate" not in contender.generate_kwargs
    ]


def params_provenance(model) -> dict[str, Any]:
    """Which skip sets the run used, for `results.json`."""
    profile_key, profile = tuned_profile(model)
    return {
        "profile_key": profile_key,
        "default_params": default_params(model),
        "tuned_profile": profile.to_json() if profile is not None else None,
    }
