"""The full model's pass over plain greedy's known text, which every trial reads: its tokens,
the full model's confidence in each, and its KV of the whole text."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_selfspec.tuner_api import DraftAwareCache, cache_keyword, check_hand_built_masks_supported, verifying

from ..studies.objective import PreparedPrompt
from .timing import device_timer, interleaved_medians


@dataclass(frozen=True)
class TeacherForcedPrompt:
    """What every trial reads for one prompt: plain decoding's tokens, the full model's
    confidence in each, and the full model's KV of the whole text, which a real draft reads for
    every token already committed."""

    prompt: PreparedPrompt
    prompt_length: int
    full_text: torch.Tensor  # [P + n]: prompt and plain decoding's continuation
    verifier_confidence: tuple[float, ...]  # the full model's probability of each continuation token
    cache: DraftAwareCache  # full-model KV of full_text[:-1]; rolled back to that after every use
    prefill_seconds: float
    max_new_tokens: int
    # exit layer -> what enters that layer at every position of full_text[:-1]; filled on first use
    shallow_states: dict[int, torch.Tensor] = field(default_factory=dict, compare=False)
    # The final hidden state (what the LM head reads) that chose each continuation token, in a
    # list of one once read (`predictions.final_states`)
    final_states: list[torch.Tensor] = field(default_factory=list, compare=False)

    @property
    def reference(self) -> list[int]:
        return self.prompt.reference_tokens

    @property
    def kv_length(self) -> int:
        return self.full_text.shape[0] - 1


@torch.no_grad()
def verifier_forward(
    model,
    input_ids: torch.Tensor,
    start: int,
    cache: DraftAwareCache,
    logits_to_keep: int,
    **kwargs,
):
    """The full model's forward pass over `input_ids` from position `start`, as the decoding
    loop verifies (`model_forward`), on the same kernels: outside autograd, as `generate` runs,
    whoever calls it (the cost-model watch probes from an Optuna callback)."""
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    with verifying(model):
        return model(
            input_ids=input_ids,
            position_ids=positions,
            **cache_keyword(cache),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )


def check_supported(model) -> None:
    check_hand_built_masks_supported(model, 'objective = "estimated"', 'use objective = "measured"')


@torch.no_grad()
def teacher_force(model, prompt: PreparedPrompt, max_new_tokens: int) -> TeacherForcedPrompt:
    prompt_ids = prompt.inputs["input_ids"].to(model.device)
    length = prompt_ids.shape[1]
    reference = torch.tensor(prompt.reference_tokens, device=model.device)
    full_text = torch.cat([prompt_ids[0], reference])
    cache = DraftAwareCache()  # no windows: the draft pass reads back from every row
    prefill = {"prefill": lambda: (cache.rollback(0), verifier_forward(model, prompt_ids, 0, cache, 1))}
    prefill_seconds = interleaved_medians(prefill, 2, device_timer(model.device))["prefill"]
    # The verifier's probabilities of its own tokens, for the gate: row j scores continuation token j.
    cache.rollback(length - 1)
    logits = verifier_forward(model, full_text[None, length - 1 : -1], length - 1, cache, 0).logits[0]
    confidence = torch.softmax(logits.float(), dim=-1).gather(-1, reference[:, None])[:, 0]
    return TeacherForcedPrompt(
        prompt, length, full_text, tuple(confidence.tolist()), cache, prefill_seconds, max_new_tokens
    )
