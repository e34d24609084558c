"""Verifying the draft's runner-up tokens beside its chain, in the same forward pass.

A verification of a few more tokens costs next to nothing where a forward pass is bound by
reading the weights (a GPU, or a CPU with native bfloat16). A rejected draft token is the
verifier's second opinion of a spot the draft was unsure about, and the draft's runner-up there
is often what the verifier chose; verified beside the chain, it earns the verifier's next token
from its own row instead of a whole new cycle. Each alternative of drafted token i sits at that
token's position and sees the committed text, the chain before token i, and itself. How the
verifier accepts one, greedy or sampling, is the verifier's (`verifier.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import DraftAwareCache
from .masks import model_attention_mask


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
    model: nn.Module,
    cache: DraftAwareCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | dict[str, torch.Tensor] | None]:
    """`(input_ids, position_ids, attention_mask)` for verifying the one text from `kv_length` to
    the end of the `drafted` tokens written at `committed_length`, followed by the alternatives,
    into `cache`. Without alternatives the mask is the cache's padding mask (None without
    padding): the model's own causal mask is the right one."""
    end = committed_length + drafted
    input_ids, position_ids = sequence[:, kv_length:end], positions[:, kv_length:end]
    branches = alternative_rows(alternatives)
    if not branches:
        return input_ids, position_ids, None if cache is None else cache.padding_mask(end, sequence.device)
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
    if cache is not None and cache.starts is not None:
        visible[:, : cache.starts[0]] = False  # the prompt's left padding
    key_positions = torch.cat([positions[0, :kv_length], position_ids[0]])
    sliding_keys = None if cache is None else cache.sliding_keys(rows)
    mask = model_attention_mask(model.config, visible, position_ids[0], key_positions, model.dtype, sliding_keys)
    return input_ids, position_ids, mask
