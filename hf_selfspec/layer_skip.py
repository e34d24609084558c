"""Turning the model into its own draft by not running chosen attention and MLP sub-layers.

The skip is real: the draft runs the decoder's layers itself and leaves the skipped sub-layers
out, so their contribution to the residual stream is zero and costs nothing. A layer with both
sub-layers skipped is left out whole, which also saves its norms. The model itself is never
changed, so calls that draft and calls that decode plainly can share it from several threads.
"""

from __future__ import annotations

import inspect
import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .cache import cache_keyword
from .masks import SLIDING, layer_attention_types


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


# The layer layouts whose attention or MLP half can run alone: the norms each half owns, in
# the order it applies them around its sub-layer (before, after).
_PRE_NORM_HALVES = {"attention": ("input_layernorm", None), "mlp": ("post_attention_layernorm", None)}
_SANDWICH_HALVES = {
    "attention": ("input_layernorm", "post_attention_layernorm"),
    "mlp": ("pre_feedforward_layernorm", "post_feedforward_layernorm"),
}
_SUB_LAYERS = {"attention": "self_attn", "mlp": "mlp"}


def _layer_halves(model: nn.Module, index: int, layer: nn.Module) -> dict[str, tuple[str, str | None]]:
    """The norms around each half of a decoder layer, by the modules it has: Llama, Mistral and
    Qwen norm before each sub-layer; Gemma 2 and 3 also after (sandwich norms)."""
    has = {name for name, _ in layer.named_children()}
    sandwich = {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"}
    if sandwich <= has:
        return _SANDWICH_HALVES
    if {"input_layernorm", "post_attention_layernorm"} <= has and not has & {"pre_feedforward_layernorm", "post_feedforward_layernorm"}:
        return _PRE_NORM_HALVES
    raise ValueError(
        f"decoder layer {index} of {type(model).__name__} ({type(layer).__name__}) has a layout whose attention or MLP "
        f"cannot run alone; skip both of its sub-layers or neither (attn_skip_layers and mlp_skip_layers)"
    )


def _padding(cache: Cache | None, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor | None:
    """The 2-D padding mask over what layer `layer_idx` of a batch's cache holds and the new
    inputs (`DraftAwareCache.padding_mask`); None where no row has padding."""
    if getattr(cache, "starts", None) is None:
        return None
    held = cache.layers[layer_idx].get_seq_length() if layer_idx < len(cache.layers) else 0
    return cache.padding_mask(held + hidden.shape[1], hidden.device)


class SkippingDecoder:
    """The model's decoder run layer by layer, leaving out chosen attention and MLP sub-layers.

    Everything a pass needs lives in the call (masks, position embeddings, the cache it is given),
    so one model serves concurrent calls that skip differently, or not at all: nothing on the
    model is patched or switched while a draft runs. A layer with both sub-layers skipped is not
    run; one with a single sub-layer skipped runs the other half, its norms and residual; the
    rest run whole, through the layer's own forward.
    """

    def __init__(self, model: nn.Module, attn_skip_layers=(), mlp_skip_layers=()):
        self.config = model.config
        self.decoder = model.get_decoder()
        layers = decoder_layers(model)
        for name in ("embed_tokens", "rotary_emb", "norm"):
            if not isinstance(getattr(self.decoder, name, None), nn.Module):
                raise ValueError(
                    f"{type(model).__name__}'s decoder has no `{name}`: a draft that skips layers runs the decoder's "
                    "embedding, rotary embeddings, layers and final norm itself"
                )
        attn_skipped, mlp_skipped = set(attn_skip_layers), set(mlp_skip_layers)
        self.layer_types = layer_attention_types(model.config)
        # (layer index, layer, its half that runs: None for the whole layer)
        self.steps: list[tuple[int, nn.Module, tuple[str, tuple[str, str | None]] | None]] = []
        for index, layer in enumerate(layers):
            if index in attn_skipped and index in mlp_skipped:
                continue
            half = None
            if index in attn_skipped or index in mlp_skipped:
                kind = "mlp" if index in attn_skipped else "attention"
                half = (kind, _layer_halves(model, index, layer)[kind])
            self.steps.append((index, layer, half))
        # transformers sizes each kind's mask from one cache layer of that kind; a layer whose
        # attention does not run lags behind, so the first one whose attention runs is asked.
        self.mask_layers: dict[str, int] = {}
        for index, _, half in self.steps:
            if half is None or half[0] == "attention":
                self.mask_layers.setdefault(self.layer_types[index], index)
        self.rotary_by_kind = "layer_type" in inspect.signature(self.decoder.rotary_emb.forward).parameters

    def _masks(self, hidden, position_ids, cache, attention_mask) -> dict[str, torch.Tensor | None]:
        if isinstance(attention_mask, dict):
            return attention_mask
        if attention_mask is not None:  # one hand-built mask for every layer, as the models take it
            return dict.fromkeys(self.mask_layers, attention_mask)
        masks = {}
        for kind, layer_idx in self.mask_layers.items():
            build = create_sliding_window_causal_mask if kind == SLIDING else create_causal_mask
            masks[kind] = build(
                config=self.config, inputs_embeds=hidden, attention_mask=_padding(cache, layer_idx, hidden),
                position_ids=position_ids, layer_idx=layer_idx, **cache_keyword(cache),
            )
        return masks

    def _position_embeddings(self, hidden, position_ids) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        rotary = self.decoder.rotary_emb
        if self.rotary_by_kind:
            return {kind: rotary(hidden, position_ids, kind) for kind in self.mask_layers}
        return dict.fromkeys(self.mask_layers, rotary(hidden, position_ids))

    def hidden_states(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Cache | None, attention_mask=None
    ) -> torch.Tensor:
        """The residual stream after the last layer run, before the final norm. `attention_mask`:
        a hand-built additive mask (one, or one per layer kind) instead of the causal one."""
        hidden = self.decoder.embed_tokens(input_ids)
        masks = self._masks(hidden, position_ids, cache, attention_mask)
        embeddings = self._position_embeddings(hidden, position_ids)
        for index, layer, half in self.steps:
            kind = self.layer_types[index]
            attention_inputs = {
                "attention_mask": masks.get(kind), "position_embeddings": embeddings.get(kind),
                "position_ids": position_ids, **cache_keyword(cache),
            }
            if half is None:
                output = layer(hidden, **attention_inputs)
                hidden = output[0] if isinstance(output, tuple) else output
                continue
            sub_layer, (norm_before, norm_after) = _SUB_LAYERS[half[0]], half[1]
            contribution = getattr(layer, norm_before)(hidden)
            if sub_layer == "self_attn":
                contribution, _ = layer.self_attn(hidden_states=contribution, **attention_inputs)
            else:
                contribution = layer.mlp(contribution)
            if norm_after is not None:
                contribution = getattr(layer, norm_after)(contribution)
            hidden = hidden + contribution
        return hidden

    def __call__(self, input_ids, position_ids, cache, attention_mask=None) -> torch.Tensor:
        """The final, normed hidden states, as the decoder's `last_hidden_state`."""
        return self.decoder.norm(self.hidden_states(input_ids, position_ids, cache, attention_mask))
