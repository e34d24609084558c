"""A Kangaroo-style draft adapter: one decoder block and a final norm that map the hidden state
leaving the model's first `exit_layer` layers to what the model's own LM head expects.

The block is built from the model's own layer class (a copy of layer `exit_layer`), so every
architecture's norms, rotary embeddings and attention variants come for free, and training can
start from that layer's weights rather than from noise. Its attention keeps its own KV cache over
the shallow hidden states of the committed text.

On disk an adapter is `<name>.safetensors` (the block's and the norm's weights) plus `<name>.json`
(its shape), next to the `generation_config.json` whose profile names it.
"""

from __future__ import annotations

import copy
import filecmp
import functools
import hashlib
import inspect
import json
import shutil
import threading
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from .cache import cache_keyword
from .files import save_tensor_file_pair
from .inputs import InputError, existing_file, read_text_file
from .layer_skip import decoder_layers
from .masks import additive_mask
from .params import PATH_KEYS

ADAPTER_FORMAT = "hf-selfspec-draft-adapter/1"


@dataclass(frozen=True)
class AdapterShape:
    """What an adapter file must agree with before its weights can be trusted on a model."""

    model_type: str
    num_layers: int
    hidden_size: int
    exit_layer: int
    mlp: bool = True

    @classmethod
    def for_model(cls, model: nn.Module, exit_layer: int, mlp: bool = True) -> "AdapterShape":
        return cls(model.config.model_type, len(decoder_layers(model)), model.config.hidden_size, exit_layer, mlp)

    def to_json(self) -> dict:
        return {"format": ADAPTER_FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, raw: dict, where: str) -> "AdapterShape":
        if not isinstance(raw, dict) or raw.get("format") != ADAPTER_FORMAT:
            raise ValueError(f"{where}: not a draft adapter description (expected format {ADAPTER_FORMAT!r})")
        try:
            shape = cls(**{key: value for key, value in raw.items() if key != "format"})
        except TypeError as error:
            raise ValueError(f"{where}: {error}") from None
        # JSON's true is not a layer count: a file saying so was not written by save_adapter.
        kinds = {str: "a string", int: "an integer", bool: "true or false"}
        for name, kind in (("model_type", str), ("num_layers", int), ("hidden_size", int), ("exit_layer", int), ("mlp", bool)):
            value = getattr(shape, name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"{where}: {name} must be {kinds[kind]}, got {value!r}")
        return shape

    def check_fits(self, model: nn.Module, where: str) -> None:
        expected = AdapterShape.for_model(model, self.exit_layer, self.mlp)
        for name in ("model_type", "hidden_size", "num_layers"):
            if getattr(self, name) != getattr(expected, name):
                raise ValueError(
                    f"{where}: the adapter was trained for {name} {getattr(self, name)!r}, "
                    f"but the model has {getattr(expected, name)!r}"
                )
        check_exit_layer(self.exit_layer, expected.num_layers, where)


def check_exit_layer(exit_layer: int, num_layers: int, where: str) -> None:
    # The draft needs at least one shared layer, and exiting at the last layer saves nothing.
    if not isinstance(exit_layer, int) or isinstance(exit_layer, bool) or not 1 <= exit_layer < num_layers:
        raise ValueError(f"{where}: exit layer {exit_layer!r} is out of range 1..{num_layers - 1} for this model")


class _NoMLP(nn.Module):
    """A zero feed-forward contribution: the residual passes through (also Gemma's sandwich
    norms, which map zero to zero)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def _additive_causal_mask(query_length: int, past_length: int, like: torch.Tensor) -> torch.Tensor | None:
    """The block's own causal mask (its attention, one layer, knows no window). None for one
    query, which may look at everything."""
    if query_length == 1:
        return None
    keys = torch.arange(past_length + query_length, device=like.device)
    queries = torch.arange(query_length, device=like.device)[:, None] + past_length
    return additive_mask(keys[None, :] <= queries, like.dtype)


class DraftAdapter(nn.Module):
    def __init__(self, model: nn.Module, shape: AdapterShape):
        super().__init__()
        shape.check_fits(model, "draft adapter")
        decoder = model.get_decoder()
        self.shape = shape
        self.block = copy.deepcopy(decoder_layers(model)[shape.exit_layer])
        for module in self.block.modules():
            # The model's hooks are not the adapter's (transformers' output capture, once a call
            # asked for hidden states, would count the block as one of the model's layers).
            module._forward_hooks.clear()
            module._forward_pre_hooks.clear()
        self.block.self_attn.layer_idx = 0  # the only layer of the adapter's own cache
        if hasattr(self.block.self_attn, "sliding_window"):
            self.block.self_attn.sliding_window = None  # the adapter sees every committed token
        if not shape.mlp:
            self.block.mlp = _NoMLP()
        self.norm = copy.deepcopy(decoder.norm)
        # Rotary embeddings carry no trained weights; a copy keeps the adapter self-contained.
        self.rotary = copy.deepcopy(decoder.rotary_emb)
        layer_types = getattr(model.config, "layer_types", None)
        takes_layer_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.rotary_layer_type = layer_types[shape.exit_layer] if takes_layer_type and layer_types else None

    def forward(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Normed hidden states `[1, n, hidden]` for the LM head; with `cache`, the inputs extend
        what it holds, without it they are a whole text. Causal unless `attention_mask` (additive,
        over the cache's keys and the inputs') says otherwise: the tuner drafts side branches."""
        rotary_args = (self.rotary_layer_type,) if self.rotary_layer_type is not None else ()
        position_embeddings = self.rotary(hidden, position_ids, *rotary_args)
        past_length = cache.get_seq_length() if cache is not None else 0
        if attention_mask is None:
            attention_mask = _additive_causal_mask(hidden.shape[1], past_length, hidden)
        output = self.block(
            hidden,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_keyword(cache),
            use_cache=cache is not None,
            position_embeddings=position_embeddings,
        )
        return self.norm(output[0] if isinstance(output, tuple) else output)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The weights that go to disk: the block's and the norm's, not the rotary buffers."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}


def adapter_files(path: str | Path) -> tuple[Path, Path]:
    """`(weights, shape)` paths for an adapter named by either file or by its stem."""
    path = Path(path)
    stem = path.with_suffix("") if path.suffix in (".safetensors", ".json") else path
    return stem.with_name(stem.name + ".safetensors"), stem.with_name(stem.name + ".json")


def save_adapter(adapter: DraftAdapter, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the weights and the shape, each through a temporary file renamed into place."""
    weights_path, shape_path = adapter_files(path)
    tensors = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in adapter.trained_state().items()}
    return save_tensor_file_pair(weights_path, tensors, shape_path, adapter.shape.to_json())


def existing_adapter_files(path: str | Path, what: str = "draft adapter") -> tuple[Path, Path]:
    """`adapter_files(path)`, failing with the name of the first file that is not there: an
    adapter (or a lookup corpus, laid out alike) is only usable, or worth copying, with both."""
    files = adapter_files(path)
    for required in files:
        if not required.is_file():
            raise ValueError(f"{what} file {required} is missing")
    return files


class AdapterConflictError(ValueError):
    """Another adapter of the same file name is already where one is to be copied."""


def check_adapter_copy(source: str | Path, directory: str | Path) -> tuple[Path, Path]:
    """The source's two files, once it is sure that copying them into `directory` replaces
    nothing but identical copies. Profiles name their adapter by file name, so a different file
    of that name may be what another profile of the config there drafts with: overwriting it
    would change that profile's draft silently."""
    sources = existing_adapter_files(source)
    for file in sources:
        target = Path(directory) / file.name
        if target.exists() and not target.samefile(file) and not filecmp.cmp(file, target, shallow=False):
            raise AdapterConflictError(
                f"{target} already exists and differs from {file}; a profile there may draft with it, so it is "
                "not overwritten: give the new adapter another name (profiles name adapters by file name), or "
                "write into another directory"
            )
    return sources


def copy_adapter(source: str | Path, directory: str | Path) -> Path:
    """Copy an adapter's two files into `directory`, so that a profile in the
    `generation_config.json` there can name it by file name alone and the folder travels whole;
    returns the copied weights file. Each file lands through a temporary one renamed into place,
    and nothing is copied unless both exist and neither would replace a different file."""
    directory = Path(directory)
    sources = check_adapter_copy(source, directory)
    directory.mkdir(parents=True, exist_ok=True)
    for file in sources:
        target = directory / file.name
        if target.exists() and target.samefile(file):
            continue
        staging = target.with_name(target.name + ".tmp")
        shutil.copyfile(file, staging)
        staging.replace(target)
    return directory / sources[0].name


def adapter_digest(path: str | Path) -> str:
    """A short SHA-256 of the adapter's weights: a retrained adapter keeps its file name, and a
    study's measurements, or an export of them, must not be credited to different weights."""
    weights, _ = existing_adapter_files(path)
    digest = hashlib.sha256()
    with weights.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def read_adapter_shape(path: str | Path) -> AdapterShape:
    """The shape an adapter file declares, read without a model: enough to reject a file that
    is not an adapter at all before a model is loaded."""
    _, shape_path = existing_adapter_files(path)
    try:
        raw = json.loads(read_text_file(shape_path))
    except json.JSONDecodeError as error:
        raise ValueError(f"{shape_path}: not valid JSON ({error})") from None
    return AdapterShape.from_json(raw, str(shape_path))


def check_adapter_file(path: str | Path, what: str = "draft adapter") -> Path:
    """The weights file of the adapter at `path`, once both its files are there and readable as
    an adapter's, read without a model: a typo then fails before a model loads."""
    from safetensors import SafetensorError, safe_open

    weights, _ = adapter_files(existing_file(path, what) if Path(path).suffix == ".safetensors" else path)
    try:
        read_adapter_shape(weights)
        with safe_open(str(weights), framework="pt"):
            pass
    except SafetensorError as error:
        raise InputError(f"{what} {weights}: not a safetensors file ({error})") from None
    except ValueError as error:
        raise InputError(f"{what} {path}: {error}") from None
    return weights


def read_adapter(model: nn.Module, path: str | Path) -> DraftAdapter:
    """The adapter at `path`, checked against `model`, in the model's dtype and on its device."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_path, shape_path = adapter_files(path)
    shape = read_adapter_shape(path)  # checks that both files are there
    shape.check_fits(model, str(shape_path))
    adapter = DraftAdapter(model, shape)
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{weights_path}: cannot read the adapter's weights ({error})") from None
    expected = adapter.trained_state()
    if set(tensors) != set(expected):
        missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise ValueError(f"{weights_path}: weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{weights_path}: {name} has shape {tuple(tensor.shape)}, the model needs {tuple(expected[name].shape)}"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            # Such a draft proposes nothing greedy decoding can use, and sampling from it fails.
            raise ValueError(f"{weights_path}: {name} holds NaN or infinite weights; train the adapter again")
    adapter.load_state_dict(tensors, strict=False)
    return adapter.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False)


# Loaded adapters per model, so repeated `generate` calls do not re-read the file. An adapter is
# only read by a draft (its own cache is the drafter's), so concurrent calls share it; the lock
# keeps threads that load different adapters for one model from dropping each other's.
_loaded: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
_loading = threading.Lock()


def load_adapter(model: nn.Module, path: str | Path) -> DraftAdapter:
    if str(path).startswith(HUB_ADDRESS_PREFIX):
        path = fetch_hub_file_pair(str(path), "draft adapter")
    weights_path, _ = adapter_files(path)
    stamp = (str(weights_path.resolve()), weights_path.stat().st_mtime_ns if weights_path.is_file() else None,
             model.dtype, model.device)
    with _loading:
        per_model = _loaded.setdefault(model, {})
        if stamp not in per_model:
            per_model.clear()
            per_model[stamp] = read_adapter(model, weights_path)
        return per_model[stamp]


# `hf://{repo_id}@{revision}/{file in the repository}`: where a profile's file is when its model
# was loaded by Hub id. Repository ids hold no "@" and the revision here is always "main" (a
# transformers 5 model does not record the revision it was loaded from), so the address splits
# unambiguously.
HUB_ADDRESS_PREFIX = "hf://"


def hub_file_address(repo_id: str, name: str) -> str:
    return f"{HUB_ADDRESS_PREFIX}{repo_id}@main/{Path(name).as_posix()}"


@functools.lru_cache(maxsize=None)
def fetch_hub_file_pair(address: str, what: str) -> Path:
    """The local copy of an adapter (or a lookup corpus) in a Hub repository, downloaded on
    first use. transformers fetches only the files a model needs, so an adapter beside a Hub
    model's config is not on disk until a profile drafts with it. Asked once a process: each
    `generate` call would otherwise check the Hub again."""
    from transformers.utils.hub import cached_files

    repo_id, _, rest = address[len(HUB_ADDRESS_PREFIX) :].partition("@")
    revision, _, name = rest.partition("/")
    try:
        weights, _ = cached_files(repo_id, [str(p) for p in adapter_files(name)], revision=revision)
    except OSError as error:  # transformers' errors for a missing repository, file or connection
        raise ValueError(f"{what} {name} of {repo_id} (revision {revision}) cannot be fetched: {error}") from None
    return Path(weights)


def anchor_profile_files(
    model: nn.Module, values: Mapping[str, Any], config_dir: str | Path | None = None
) -> dict[str, Any]:
    """Profile or generation-config values with every relative file name (`draft_adapter`,
    `lookup_corpus`) made absolute.

    A profile names its files relative to the `generation_config.json` it came from
    (`config_dir`, by default the one the loaders recorded as `model.selfspec_config_dir`), or
    else to the model's own directory, so they travel together; for a model loaded by Hub id that
    directory is its repository, and a name becomes an address there, fetched only if decoding
    uses it. A name passed to `generate()` itself is relative to the working directory, like any
    path a program is given.
    """
    anchored = dict(values)
    base = config_dir if config_dir is not None else getattr(model, "selfspec_config_dir", None)
    source = str(getattr(model, "name_or_path", "") or "")
    if base is None and not _is_hub_id(source) and Path(source).is_dir():
        base = source
    for key in PATH_KEYS:
        name = values.get(key)
        if not isinstance(name, str) or not name or Path(name).is_absolute() or name.startswith(HUB_ADDRESS_PREFIX):
            continue
        if base is None and _is_hub_id(source):
            anchored[key] = hub_file_address(source, name)
        elif base is not None:
            anchored[key] = str(Path(base) / name)
    return anchored


def _is_hub_id(name_or_path: str) -> bool:
    """`org/name` or a bare legacy name, not a directory on this machine."""
    path = Path(name_or_path)
    local = path.is_dir() or path.is_absolute() or name_or_path.startswith(".")
    return bool(name_or_path) and not local and name_or_path.count("/") <= 1
