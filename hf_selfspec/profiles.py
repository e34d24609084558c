"""Tuned profiles inside `generation_config.json`: the one definition of their format.

The best skip set differs per model, accelerator and dtype, so one config file carries one
profile per `device/dtype` key under `self_speculative` (a CPU with matrix tiles has a class
key of its own for bfloat16, `cpu/amx/bfloat16`, see `device_profile_keys`):

    "self_speculative": {
      "cpu/float32": {
        "strategy": "adaptive_draft_exit",
        "params": {"attn_skip_layers": [...], "mlp_skip_layers": [...], "max_draft_tokens": 6},
        "measured": {"speedup": 1.31, "acceptance_rate": 0.82, "study": "...", "trial": 41}
      },
      "cuda/NVIDIA H100 80GB HBM3/bfloat16": {...}
    }

`params` uses the names of `hf_selfspec.params.SelfSpecParams`; `measured` is free-form
provenance written by the tuner and never read by decoding.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from .dtypes import cpu_has_amx
from .inputs import InputError, read_text_file
from .params import check_param_types

PROFILE_KEY = "self_speculative"
_PROFILE_FIELDS = {"strategy", "params", "measured"}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TunedProfile:
    strategy: str
    params: dict[str, Any]
    measured: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "params": dict(self.params), "measured": dict(self.measured)}


def device_profile_keys(device: torch.device | str, dtype: torch.dtype) -> tuple[str, ...]:
    """The keys a profile for this device and dtype may sit under, the most specific first:
    `cuda/<device name>/bfloat16` (GPUs of one family differ enough in memory bandwidth that
    their best skip sets differ), `cpu/amx/bfloat16` then `cpu/bfloat16` on a CPU with matrix
    tiles (`cpu_has_amx`), else `cpu/<dtype>`.

    Tiles make a bfloat16 verification of ten tokens cost little more than one, where other CPUs
    pay for every verified token; the best proposal lengths, back-off and source choice differ
    so much between the two that a profile tuned on one class of CPU loses on the other. A CPU
    with tiles still falls back to a plain `cpu/bfloat16` profile where none was tuned for it.
    """
    device = torch.device(device)
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        return (f"cuda/{torch.cuda.get_device_name(device)}/{dtype_name}",)
    general = f"{device.type}/{dtype_name}"
    if device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_amx():
        return (f"cpu/amx/{dtype_name}", general)
    return (general,)


def device_profile_key(device: torch.device | str, dtype: torch.dtype) -> str:
    """The key a profile tuned on this device and dtype is written under: the most specific."""
    return device_profile_keys(device, dtype)[0]


def matching_profile(
    profiles: Mapping[str, TunedProfile], device: torch.device | str, dtype: torch.dtype
) -> tuple[str, TunedProfile | None]:
    """The key and profile `profiles` hold for this device and dtype, the most specific key
    first; without one, the most specific key and None."""
    keys = device_profile_keys(device, dtype)
    for key in keys:
        if key in profiles:
            return key, profiles[key]
    return keys[0], None


def parse_profile(raw: Any, where: str) -> TunedProfile:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: a profile must be an object, got {type(raw).__name__}")
    unknown = set(raw) - _PROFILE_FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown profile key {sorted(unknown)[0]!r}; expected {sorted(_PROFILE_FIELDS)}")
    strategy = raw.get("strategy")
    if not isinstance(strategy, str):
        raise ValueError(f"{where}.strategy: must be a strategy name, got {strategy!r}")
    params = raw.get("params", {})
    if not isinstance(params, Mapping):
        raise ValueError(f"{where}.params: must be an object")
    check_param_types(params, f"{where}.params")
    measured = raw.get("measured", {})
    if not isinstance(measured, Mapping):
        raise ValueError(f"{where}.measured: must be an object")
    return TunedProfile(strategy=strategy, params=dict(params), measured=dict(measured))


def read_profiles(generation_config: Any) -> dict[str, TunedProfile]:
    """All profiles in a `GenerationConfig` (or its dict form), validated."""
    raw = (
        generation_config.get(PROFILE_KEY)
        if isinstance(generation_config, Mapping)
        else getattr(generation_config, PROFILE_KEY, None)
    )
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"generation_config.{PROFILE_KEY}: must map 'device/dtype' keys to profiles")
    return {key: parse_profile(value, f"generation_config.{PROFILE_KEY}[{key!r}]") for key, value in raw.items()}


def read_config_json(path: Path, what: str = "") -> dict[str, Any]:
    """A `generation_config.json` as written, as a dict; an `InputError` (a `ValueError`) naming
    the file (after `what`, an option's name) if it cannot be read or is not a JSON object."""
    named = f"{what} {path}" if what else str(path)
    try:
        data = json.loads(read_text_file(path, what))
    except json.JSONDecodeError as error:
        raise InputError(f"{named}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict):
        raise InputError(f"{named}: must hold a JSON object")
    return data


def read_profiles_file(path: str | Path) -> dict[str, TunedProfile]:
    """The profiles of a `generation_config.json`, read the way a model loading it reads them
    (transformers may drop keys it does not know; see `_from_model_config`)."""
    from transformers import GenerationConfig

    path = Path(path)
    return read_profiles(GenerationConfig.from_pretrained(path.parent, config_file_name=path.name))


def write_profile(generation_config: Any, key: str, profile: TunedProfile) -> None:
    """Add or replace one device's profile, keeping every other device's."""
    profiles = {k: p.to_json() for k, p in read_profiles(generation_config).items()}
    profiles[key] = profile.to_json()
    if isinstance(generation_config, dict):
        generation_config[PROFILE_KEY] = profiles
    else:
        setattr(generation_config, PROFILE_KEY, profiles)


def use_generation_config_file(model: torch.nn.Module, path: str | Path) -> None:
    """Replace the model's generation config with a `generation_config.json` and remember its
    directory, against which the profiles' file names (a draft adapter) are resolved."""
    from transformers import GenerationConfig

    path = Path(path)
    model.generation_config = GenerationConfig.from_pretrained(path.parent, config_file_name=path.name)
    model.selfspec_config_dir = path.parent


_warned_keys: set[tuple[int, str]] = set()


def profile_for_model(
    model: torch.nn.Module, profiles: Mapping[str, TunedProfile] | None = None
) -> TunedProfile | None:
    """The profile matching the device and dtype the model runs on, among `profiles` (by default
    its generation config's), if there is one.

    A config tuned only on other hardware warns once per model and key: applying a CPU skip set
    on a GPU is legal but usually slower than plain decoding, so we stay plain instead.
    """
    profiles = read_profiles(model.generation_config) if profiles is None else profiles
    if not profiles:
        return None
    key, profile = matching_profile(profiles, model.device, model.dtype)
    if profile is not None:
        return profile
    if (id(model), key) not in _warned_keys:
        _warned_keys.add((id(model), key))
        logger.warning(
            "generation_config has self-speculative profiles for %s but not for %s; decoding plainly. "
            "Run `hf-selfspec tune` on this device to add one.",
            ", ".join(sorted(profiles)),
            " or ".join(device_profile_keys(model.device, model.dtype)),
        )
    return None
