"""Turning the model into its own draft by not running chosen attention and MLP sub-layers.

The skip is real: a skipped module's forward is replaced, while drafting, by one that returns a
zero contribution without computing anything, so the residual stream passes through unchanged
(in Gemma's sandwich norms too, since RMSNorm maps zero to zero). A layer with both sub-layers
skipped is bypassed whole, which also saves its norms.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from .cache import DraftAwareCache
from .masks import layer_attention_types


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers whose sub-layers can be skipped, or a clear error if there are none."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(model).__name__} has no decoder layers to skip (expected `model.get_decoder().layers`); "
            "self-speculative strategies need a decoder-only transformer"
        )
    for index, layer in enumerate(layers):
        if not (hasattr(layer, "self_attn") and hasattr(layer, "mlp")):
            raise ValueError(
                f"decoder layer {index} of {type(model).__name__} has no `self_attn` and `mlp` sub-modules to skip"
            )
    return layers


def _zero_like(hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states.new_zeros(()).expand_as(hidden_states)


class LayerSkipper:
    """Installs skip-aware forwards on the chosen sub-layers; `drafting()` switches them on.

    The forwards are installed once per `generate` call rather than per draft step, so toggling
    between draft and verify is a flag flip, not a module rewrite.
    """

    def __init__(self, model: nn.Module, attn_skip_layers: tuple[int, ...], mlp_skip_layers: tuple[int, ...]):
        self.layers = decoder_layers(model)
        self.active = False
        self._installed: list[tuple[nn.Module, object]] = []
        whole = set(attn_skip_layers) & set(mlp_skip_layers)
        for index in whole:
            self._install(self.layers[index], lambda original: self._bypass_layer(original))
        for index in set(attn_skip_layers) - whole:
            self._install(self.layers[index].self_attn, lambda original: self._skip_attention(original))
        for index in set(mlp_skip_layers) - whole:
            self._install(self.layers[index].mlp, lambda original: self._skip_mlp(original))
        self.mask_layer_redirect = self._redirect_for(model, set(attn_skip_layers))

    def _install(self, module: nn.Module, make_forward) -> None:
        self._installed.append((module, module.__dict__.get("forward")))
        module.forward = make_forward(module.forward)

    def _bypass_layer(self, original):
        def forward(hidden_states, *args, **kwargs):
            return hidden_states if self.active else original(hidden_states, *args, **kwargs)

        return forward

    def _skip_attention(self, original):
        def forward(*args, **kwargs):
            if self.active:
                hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                return _zero_like(hidden_states), None
            return original(*args, **kwargs)

        return forward

    def _skip_mlp(self, original):
        def forward(hidden_states, *args, **kwargs):
            return _zero_like(hidden_states) if self.active else original(hidden_states, *args, **kwargs)

        return forward

    def _redirect_for(self, model: nn.Module, attn_skipped: set[int]) -> dict[int, int]:
        layer_types = layer_attention_types(model.config)
        running = [i for i in range(len(self.layers)) if i not in attn_skipped]
        redirect = {}
        for index in attn_skipped:
            same_kind = [i for i in running if layer_types[i] == layer_types[index]]
            if same_kind:
                redirect[index] = same_kind[0]
        return redirect

    @contextmanager
    def drafting(self, cache: DraftAwareCache) -> Iterator[None]:
        self.active = True
        cache.mask_layer_redirect = self.mask_layer_redirect
        try:
            yield
        finally:
            self.active = False
            cache.mask_layer_redirect = {}

    def close(self) -> None:
        for module, previous_forward in reversed(self._installed):
            if previous_forward is None:
                del module.forward
            else:
                module.forward = previous_forward
        self._installed.clear()
