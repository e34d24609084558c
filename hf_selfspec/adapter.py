"""A Kangaroo-style draft adapter: one decoder block and a final norm that map the hidden state
leaving the model's first `exit_layer` layers to what the model's own LM head expects.

The block is built from the model's own layer class (a copy of layer `exit_layer`), so every
architecture's norms, rotary embeddings and attention variants come for free, and training can
start from that layer's weights rather than from noise. Its attention keeps its own KV cache over
the shallow hidden states of the committed text.

On disk an adapter is `<name>.safetensors` (the block's and the norm's weights) plus `<name>.json`
(its shape), next to the `generation_config.json` whose profile names it. The same pair may hold
draft heads instead (`draft_heads.py`), which its description says: reading and loading here
serve both kinds.
"""

from __future__ import annotations

import copy
import inspect
import json
import threading
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .cache import cache_keyword
from .draft_heads import HEADS_FORMAT, DraftChain, DraftHeads, HeadsShape, heads_for
from .files import adapter_files, existing_adapter_files, save_tensor_file_pair
from .inputs import InputError, existing_file, read_text_file
from .layer_skip import decoder_layers
from .masks import additive_mask
from .profile_files import local_file

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


def save_adapter(adapter: DraftAdapter | DraftHeads | DraftChain, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write the weights and the shape, each through a temporary file renamed into place."""
    weights_path, shape_path = adapter_files(path)
    tensors = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in adapter.trained_state().items()}
    return save_tensor_file_pair(weights_path, tensors, shape_path, adapter.shape.to_json())


def read_adapter_shape(path: str | Path) -> AdapterShape | HeadsShape:
    """The shape an adapter file (or a heads file) declares, read without a model: enough to
    reject a file that is neither before a model is loaded."""
    _, shape_path = existing_adapter_files(path)
    try:
        raw = json.loads(read_text_file(shape_path))
    except json.JSONDecodeError as error:
        raise ValueError(f"{shape_path}: not valid JSON ({error})") from None
    if isinstance(raw, dict) and raw.get("format") == HEADS_FORMAT:
        return HeadsShape.from_json(raw, str(shape_path))
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


def read_adapter(model: nn.Module, path: str | Path) -> DraftAdapter | DraftHeads | DraftChain:
    """The adapter (or draft heads) at `path`, checked against `model`, in the model's dtype and
    on its device."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_path, shape_path = adapter_files(path)
    shape = read_adapter_shape(path)  # checks that both files are there
    shape.check_fits(model, str(shape_path))
    adapter = heads_for(shape) if isinstance(shape, HeadsShape) else DraftAdapter(model, shape)
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


def load_adapter(model: nn.Module, path: str | Path) -> DraftAdapter | DraftHeads | DraftChain:
    weights_path, _ = adapter_files(local_file(path, "draft adapter"))
    stamp = (str(weights_path.resolve()), weights_path.stat().st_mtime_ns if weights_path.is_file() else None,
             model.dtype, model.device)
    with _loading:
        per_model = _loaded.setdefault(model, {})
        if stamp not in per_model:
            per_model.clear()
            per_model[stamp] = read_adapter(model, weights_path)
        return per_model[stamp]
