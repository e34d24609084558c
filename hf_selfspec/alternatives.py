"""Verifying the draft's runner-up tokens beside its chain, in the same forward pass.

A verification of a few more tokens costs next to nothing where a forward pass is bound by
reading the weights (a GPU, or a CPU with native bfloat16). A rejected draft token is the
verifier's second opinion of a spot the draft was unsure about, and the draft's runner-up there
is often what the verifier chose; verified beside the chain, it earns the verifier's next token
from its own row instead of a whole new cycle. Each alternative of drafted token i sits at that
token's position and sees the committed text, the chain before token i, and itself.

Greedy only: plain sampling would need a multi-candidate acceptance rule to keep the
distribution, so under sampling (or logits processors) the alternatives are not verified. The
mask is one for every layer, so a sliding-window model cannot take them.
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import has_sliding_window


def check_alternatives_supported(model: nn.Module) -> None:
    """Fail before decoding where a hand-built mask cannot stand for the model's own."""
    config = model.config
    if has_sliding_window(config):
        raise ValueError(
            f"draft_alternatives is not supported with {type(model).__name__}'s sliding-window attention "
            "(its verification mask is one for every layer); use draft_alternatives=0"
        )
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in ("eager", "sdpa"):
        raise ValueError(
            f"draft_alternatives needs attn_implementation 'eager' or 'sdpa' (a mask for the branches), "
            f"not {implementation!r}; use draft_alternatives=0"
        )


def alternative_rows(alternatives: list[list[int]]) -> list[tuple[int, int]]:
    """`(drafted index, token)` of every alternative, in the order they follow the chain."""
    return [(index, token) for index, tokens in enumerate(alternatives) for token in tokens]


def verification_inputs(
    sequence: torch.Tensor,
    positions: torch.Tensor,
    kv_length: int,
    committed_length: int,
    drafted: int,
    alternatives: list[list[int]],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`(input_ids, position_ids, attention_mask)` for verifying the text from `kv_length` to
    the end of the `drafted` tokens written at `committed_length`, followed by the alternatives.
    The mask is None without alternatives: the model's own causal mask is the right one."""
    end = committed_length + drafted
    input_ids, position_ids = sequence[:, kv_length:end], positions[:, kv_length:end]
    branches = alternative_rows(alternatives)
    if not branches:
        return input_ids, position_ids, None
    branch_positions = torch.tensor([committed_length + index for index, _ in branches], device=sequence.device)
    input_ids = torch.cat([input_ids, torch.tensor([[token for _, token in branches]], device=sequence.device)], dim=1)
    position_ids = torch.cat([position_ids, branch_positions[None]], dim=1)

    chain, rows = end - kv_length, end - kv_length + len(branches)
    keys = torch.arange(kv_length + rows, device=sequence.device)[None, :]
    chain_rows = torch.arange(chain, device=sequence.device)[:, None]
    visible_from_chain = keys <= kv_length + chain_rows  # causal over the chain; no branch
    # A branch sees the past and the chain up to its own position, excluded, then itself.
    branch_rows = torch.arange(chain, rows, device=sequence.device)[:, None]
    visible_from_branch = (keys < branch_positions[:, None]) | (keys == kv_length + branch_rows)
    visible = torch.cat([visible_from_chain, visible_from_branch])
    mask = torch.zeros(visible.shape, dtype=dtype, device=sequence.device)
    return input_ids, position_ids, mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]
