"""The draft's predictions after every committed token of the known text, from one pass: what a
real draft would propose there, and how sure it would be."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from hf_selfspec.tuner_api import (
    DraftAdapter,
    DraftChain,
    DraftHeads,
    HeadsShape,
    RestrictedDraftHead,
    SelfSpecParams,
    SkippingDecoder,
    additive_mask,
    decoder_layers,
    load_adapter,
    model_attention_mask,
)

from .teacher_forcing import TeacherForcedPrompt, verifier_forward


def _committed_kv_mask(model, data: TeacherForcedPrompt) -> torch.Tensor | dict[str, torch.Tensor]:
    """Draft query j (at position P + j) sees the full model's KV before it, as a real draft
    does for committed text, and its own KV, which the pass appends after the full model's."""
    rows, kv_length = data.kv_length - data.prompt_length, data.kv_length
    query = torch.arange(rows, device=data.full_text.device)[:, None]
    key = torch.arange(kv_length + rows, device=data.full_text.device)[None, :]
    visible = (key < data.prompt_length + query) | (key == kv_length + query)
    query_positions = data.prompt_length + query[:, 0]
    key_positions = torch.cat([key[0, :kv_length], query_positions])
    return model_attention_mask(model.config, visible, query_positions, key_positions, model.dtype)


def _shallow_states(model, data: TeacherForcedPrompt, exit_layer: int) -> torch.Tensor:
    """`[1, kv_length, hidden]`: the output of layer `exit_layer - 1` over the text, which is what
    a real decode's verifications hand an adapter for committed tokens. Kept per exit layer, so
    the trials that choose the same adapter share one pass."""
    if exit_layer not in data.shallow_states:
        outputs = model.get_decoder()(
            input_ids=data.full_text[None, :-1], use_cache=False, output_hidden_states=[exit_layer]
        )
        data.shallow_states[exit_layer] = outputs.hidden_states[exit_layer]
    return data.shallow_states[exit_layer]


def _adapter_hidden(model, data: TeacherForcedPrompt, adapter: DraftAdapter) -> tuple[torch.Tensor, DynamicCache]:
    """The adapter's output after each committed continuation token, from one causal pass of
    its block over the shallow states of the whole text, and the block's KV of that text."""
    shallow = _shallow_states(model, data, adapter.shape.exit_layer)
    positions = torch.arange(shallow.shape[1], device=shallow.device)[None]
    cache = DynamicCache()
    return adapter(shallow, positions, cache)[0, data.prompt_length :], cache


@torch.no_grad()
def _adapter_drafts_past_misses(
    model,
    data: TeacherForcedPrompt,
    adapter: DraftAdapter,
    adapter_cache: DynamicCache,
    head: RestrictedDraftHead,
    guesses: list[int],
    depth: int,
) -> dict[int, list[tuple[int, float]]]:
    """Where the adapter guesses wrong (row j: its guess at continuation token j + 1), what a
    real draft then goes on to propose: up to `depth` tokens and the draft's confidence in each.

    Every row's text before its wrong guess is right, so each continuation is a side branch off
    the committed text: all of them are drafted at once, one token deep per pass, each branch
    seeing the text up to its guess and its own tokens (one mask), through the model's own
    shallow layers and the adapter, as a decode runs them.
    """
    misses = [row for row, guess in enumerate(guesses) if guess != data.reference[row + 1]]
    if not misses or depth < 1:
        return {}
    device = data.full_text.device
    rows = torch.tensor(misses, device=device)
    committed = torch.arange(data.kv_length, device=device)
    sees_text = committed[None, :] <= data.prompt_length + rows[:, None]  # up to the wrong guess's input
    own_branch = torch.eye(len(misses), dtype=torch.bool, device=device)
    above = tuple(range(adapter.shape.exit_layer, len(decoder_layers(model))))
    shallow_layers = SkippingDecoder(model, above, above)
    tokens = torch.tensor([guesses[row] for row in misses], device=device)
    key_positions, drafted = [committed], [[] for _ in misses]
    try:
        for step in range(1, depth + 1):
            positions = data.prompt_length + rows + step
            key_positions.append(positions)
            visible = torch.cat([sees_text, own_branch.repeat(1, step)], dim=1)
            shallow = shallow_layers.hidden_states(
                tokens[None],
                positions[None],
                data.cache,
                attention_mask=model_attention_mask(model.config, visible, positions, torch.cat(key_positions), model.dtype),
            )
            hidden = adapter(shallow, positions[None], adapter_cache, additive_mask(visible, model.dtype))
            best = torch.softmax(head.subset_logits(hidden[0]).float(), dim=-1).max(dim=-1)
            tokens = head.token_ids[best.indices]
            for branch, token, confidence in zip(drafted, tokens.tolist(), best.values.tolist()):
                branch.append((token, confidence))
    finally:
        data.cache.rollback(data.kv_length)
    return dict(zip(misses, drafted))


def _layer_skip_hidden(model, data: TeacherForcedPrompt, params: SelfSpecParams) -> torch.Tensor:
    """The skipped model's final hidden state after each committed continuation token, from one
    pass over the continuation that reads the full model's KV for the text before each token."""
    continuation = data.full_text[None, data.prompt_length : -1]
    positions = torch.arange(data.prompt_length, data.kv_length, device=continuation.device)[None]
    decoder = SkippingDecoder(model, params.attn_skip_layers, params.mlp_skip_layers)
    try:
        return decoder(continuation, positions, data.cache, attention_mask=_committed_kv_mask(model, data))[0]
    finally:
        data.cache.rollback(data.kv_length)


def final_states(model, data: TeacherForcedPrompt) -> torch.Tensor:
    """Row j: the full model's final hidden state that chose continuation token j, which draft
    heads read to guess token j + 1 on. The verification over the continuation is run again as
    `teacher_force` ran it (same inputs, same widths), so the KV it writes back is the same."""
    if not data.final_states:
        start, final_layer = data.prompt_length - 1, len(decoder_layers(model))
        data.cache.rollback(start)
        try:
            outputs = verifier_forward(model, data.full_text[None, start : data.kv_length], start, data.cache, 1,
                                       output_hidden_states=[final_layer])
        finally:
            data.cache.rollback(data.kv_length)
        data.final_states.append(outputs.hidden_states[final_layer][0, :-1])
    return data.final_states[0]


@dataclass(frozen=True)
class DraftPredictions:
    """Entry j of each list: the draft's guess at continuation token j + 1, after token j."""

    tokens: list[int]
    confidence: list[float]
    alternatives: list[list[int]]  # its `draft_alternatives` runner-ups there
    # Row j -> the tokens a real draft goes on to propose after its guess there, and its
    # confidence in each, where that is not the next rows' guesses: after an adapter's wrong
    # guess, and after every guess of draft heads (their later heads'). Elsewhere (a layer-skip
    # draft, whose later tokens are approximate anyway) the draft is taken to go on with the
    # next rows' guesses.
    continuations: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    # Row j -> the draft's likeliest first tokens there, best first (`lookup_alternatives` of
    # them), where it names them without running a layer (draft heads); empty elsewhere.
    first_guesses: list[list[int]] = field(default_factory=list)

    def chain(self, row: int, limit: int) -> list[tuple[int, float]]:
        """What a real draft starting at `row` proposes, at most `limit` tokens, each with its
        confidence (the exit policy's input)."""
        proposed = []
        for guess_row in range(row, min(row + limit, len(self.tokens))):
            proposed.append((self.tokens[guess_row], self.confidence[guess_row]))
            if guess_row in self.continuations:
                return proposed + self.continuations[guess_row][: limit - len(proposed)]
        return proposed


def _ranked(head: RestrictedDraftHead, hidden: torch.Tensor, alternatives: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(tokens, probabilities)` of the head's `1 + alternatives` likeliest tokens for each state."""
    probabilities = torch.softmax(head.subset_logits(hidden).float(), dim=-1)
    ranked = probabilities.topk(min(1 + alternatives, probabilities.shape[-1]), dim=-1)
    return head.token_ids[ranked.indices], ranked.values


def _heads_ranked(
    model, data: TeacherForcedPrompt, heads: DraftHeads | DraftChain, head: RestrictedDraftHead, alternatives: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(tokens, probabilities)` `[rows, heads, 1 + alternatives]`: what the heads propose after
    each committed continuation token. A chain's first step reads that token, its later steps
    the tokens the chain itself drafted, as a decode's chain does."""
    final = final_states(model, data)
    if isinstance(heads, DraftHeads):
        return _ranked(head, heads(final), alternatives)
    chosen = data.full_text[data.prompt_length : data.kv_length]
    ranked = []
    for _ in range(heads.shape.heads):
        final = heads.step(final, model.get_input_embeddings()(chosen))
        ranked.append(_ranked(head, final, alternatives))
        chosen = ranked[-1][0][:, 0]
    return torch.stack([tokens for tokens, _ in ranked], dim=1), torch.stack([values for _, values in ranked], dim=1)


def _heads_predictions(
    model, data: TeacherForcedPrompt, heads: DraftHeads | DraftChain, head: RestrictedDraftHead, params: SelfSpecParams
) -> DraftPredictions:
    """Draft heads read only the full model's own final states (and a chain, the tokens), so
    what they propose after each committed token is exactly what a decode's heads would: the
    first guess, then the later ones."""
    alternatives = params.draft_alternatives
    ranked = max(alternatives, params.lookup_alternatives - 1)
    tokens, values = _heads_ranked(model, data, heads, head, ranked)  # [rows, heads, ranked]
    continuations = {
        row: list(zip(tokens[row, 1:, 0].tolist(), values[row, 1:, 0].tolist())) for row in range(tokens.shape[0])
    }
    return DraftPredictions(
        tokens[:, 0, 0].tolist(), values[:, 0, 0].tolist(), tokens[:, 0, 1 : 1 + alternatives].tolist(), continuations,
        tokens[:, 0, : params.lookup_alternatives].tolist(),
    )


@torch.no_grad()
def draft_predictions(model, data: TeacherForcedPrompt, params: SelfSpecParams) -> DraftPredictions:
    """The draft's token, confidence and runner-ups after each committed continuation token,
    all read from one pass."""
    if data.kv_length == data.prompt_length:  # a one-token continuation leaves nothing to draft
        return DraftPredictions([], [], [])
    # The head a real draft builds: the lowest ids plus the prompt and the first token (with
    # draft_vocab_size 0, the whole head).
    head = RestrictedDraftHead(model, params.draft_vocab_size, data.full_text[: data.prompt_length + 1])
    adapter = load_adapter(model, params.draft_adapter) if params.draft_adapter else None
    if adapter is not None and isinstance(adapter.shape, HeadsShape):
        return _heads_predictions(model, data, adapter, head, params)
    if adapter is not None:
        hidden, adapter_cache = _adapter_hidden(model, data, adapter)
    else:
        hidden = _layer_skip_hidden(model, data, params)
    ranked_tokens, values = _ranked(head, hidden, params.draft_alternatives)
    guesses = ranked_tokens[:, 0].tolist()
    past_misses = {}
    if adapter is not None:
        past_misses = _adapter_drafts_past_misses(
            model, data, adapter, adapter_cache, head, guesses, params.max_draft_tokens - 1
        )
    return DraftPredictions(guesses, values[:, 0].tolist(), ranked_tokens[:, 1:].tolist(), past_misses)
