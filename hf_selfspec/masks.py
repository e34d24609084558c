"""Attention masks built by hand, for the passes whose rows are not one causal run of text.

Three passes need one: a verification carrying the draft's alternatives beside its chain (a
branch sees the chain only up to its own position), the tuner's teacher-forced draft (each row
reads the verifier's KV for the text before it, and its own), and a draft adapter's own block.
Eager and SDPA attention use a 4-D additive mask as it is given, for every layer. A model that
mixes full and sliding-window layers reads one per layer type instead, and a sliding layer's
mask must also hide the keys beyond its window and be exactly as wide as the keys its cache
layer hands the attention.
"""

from __future__ import annotations

import torch
from torch import nn

FULL, SLIDING = "full_attention", "sliding_attention"


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[1, 1, queries, keys]`: 0 where a query may look, the dtype's minimum elsewhere."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def layer_attention_types(config) -> list[str]:
    """Each decoder layer's kind of attention, read as transformers reads it to build the
    model's cache."""
    types = getattr(config, "layer_types", None)
    if types is None:
        kind = SLIDING if getattr(config, "sliding_window", None) is not None else FULL
        types = [kind] * config.num_hidden_layers
    return list(types)


def check_hand_built_masks_supported(model: nn.Module, feature: str, remedy: str) -> None:
    """Fail before any work where a hand-built mask cannot stand for the model's own."""
    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    if implementation not in ("eager", "sdpa"):
        raise ValueError(
            f"{feature} needs attn_implementation 'eager' or 'sdpa' (it masks attention by hand), "
            f"not {implementation!r}; {remedy}"
        )
    unknown = set(layer_attention_types(model.config)) - {FULL, SLIDING}
    if unknown:
        raise ValueError(
            f"{feature} does not support {model.config.model_type}'s {', '.join(sorted(unknown))} layers "
            f"(it masks attention by hand for full and sliding-window layers only); {remedy}"
        )


def model_attention_mask(
    config,
    visible: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    dtype: torch.dtype,
    sliding_keys: int | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """What to pass as the model's `attention_mask`. `visible` `[queries, keys]` says which keys
    each query may read, the window aside; the positions say how far apart they are. One tensor
    where every layer attends alike, else one per layer type. `sliding_keys`: how many of the
    newest keys a sliding layer's cache hands its attention (None: all of them)."""
    masks = {}
    for kind in set(layer_attention_types(config)):
        shown = visible
        if kind == SLIDING:
            shown = shown & (query_positions[:, None] - key_positions[None, :] < config.sliding_window)
            if sliding_keys is not None:
                shown = shown[:, shown.shape[1] - sliding_keys :]
        masks[kind] = additive_mask(shown, dtype)
    return masks.popitem()[1] if len(masks) == 1 else masks
