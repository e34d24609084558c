"""Speculative sampling leaves the output distribution exactly that of plain sampling.

The exact joint distribution of the first four new tokens is computed from the full model's
own forward passes, so the test compares samples with the truth, not with another sample.
Seeds are fixed, so the verdict is the same on every run: it cannot flake. The verifier alone is
also held to a target whose rows do not depend on the text, where thousands of verifications of
three-token drafts take seconds: every depth of a chain is tested with power to spare.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transformers import LogitsProcessorList

from hf_selfspec.decoding_types import DecodingState, Draft
from hf_selfspec.layer_skip import SkippingDecoder
from hf_selfspec.selection import TokenSelector
from hf_selfspec.verifier import verify
from helpers.sampling import (
    BATCH_PROMPTS, NEW_TOKENS, PROMPT, TEMPERATURE, TOP_K, VOCAB, batch_sample_counts, exact_joint, goodness_of_fit,
    sample_counts, sampling_model,
)

SKIP = dict(attn_skip_layers=[1, 2, 3], mlp_skip_layers=[1, 2, 3])


@pytest.fixture(scope="module")
def model():
    return sampling_model()


CASES = {
    "self_speculative": dict(strategy="self_speculative", draft_exit_threshold=0.0, **SKIP),
    "adaptive_draft_exit": dict(strategy="adaptive_draft_exit", **SKIP),
    "target_confidence_gated": dict(strategy="target_confidence_gated", target_confidence_threshold=0.0,
                                    draft_exit_threshold=0.0, **SKIP),
    # One-token matches (min n-gram 1) make lookup propose often even on short prompts.
    "prompt_lookup": dict(strategy="self_speculative", prompt_lookup_tokens=2, prompt_lookup_min_ngram=1,
                          draft_exit_threshold=0.0, **SKIP),
    # The lookup length adapts: one token, two after a whole acceptance, back down after a cut.
    "adaptive_lookup": dict(strategy="self_speculative", prompt_lookup_tokens=1, prompt_lookup_max_tokens=3,
                            prompt_lookup_min_ngram=1, draft_exit_threshold=0.0, **SKIP),
    "lookup_behind_closed_gate": dict(strategy="target_confidence_gated", target_confidence_threshold=1.0,
                                      prompt_lookup_tokens=2, prompt_lookup_min_ngram=1, **SKIP),
    "restricted_draft_head": dict(strategy="self_speculative", draft_vocab_size=2, draft_exit_threshold=0.0, **SKIP),
    # Each rejected token's replacement is offered the draft's runner-ups first.
    "alternatives": dict(strategy="self_speculative", draft_alternatives=2, draft_exit_threshold=0.0, **SKIP),
    "alternatives_with_lookup": dict(strategy="self_speculative", draft_alternatives=1, prompt_lookup_tokens=2,
                                     prompt_lookup_min_ngram=1, draft_exit_threshold=0.0, **SKIP),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_tokens_follow_the_plain_sampling_distribution(model, case):
    counts = sample_counts(model, seed=2024, **CASES[case])
    assert goodness_of_fit(counts, exact_joint(model)) > 1e-3


@pytest.mark.parametrize("case", ["self_speculative", "adaptive_lookup", "lookup_behind_closed_gate",
                                  "restricted_draft_head"])
def test_each_row_of_a_batch_follows_its_own_plain_sampling_distribution(model, case):
    """Three left-padded prompts of ragged lengths sampled together: each row's first tokens
    follow the distribution plain sampling gives that prompt alone."""
    counts = batch_sample_counts(model, seed=2024, **CASES[case])
    for row, prompt in enumerate(BATCH_PROMPTS):
        assert goodness_of_fit(counts[row], exact_joint(model, prompt=torch.tensor([prompt]))) > 1e-3, row


@pytest.mark.parametrize("case", ["self_speculative", "prompt_lookup", "target_confidence_gated", "alternatives"])
def test_bfloat16_sampling_follows_the_plain_sampling_distribution(case):
    """In bfloat16 the verifier's probabilities round differently from plain steps' by an ulp or
    so, far below what 1500 samples resolve; a sampler that skipped verification would not be."""
    bfloat16_model = sampling_model().to(torch.bfloat16)
    counts = sample_counts(bfloat16_model, seed=2024, **CASES[case])
    assert goodness_of_fit(counts, exact_joint(bfloat16_model)) > 1e-3


def test_alternatives_are_accepted_while_sampling(model):
    """The distribution tests above have teeth for alternatives only if they are taken."""
    torch.manual_seed(5)
    rescued = sum(
        model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True,
                       temperature=TEMPERATURE, top_k=TOP_K, top_p=1.0, return_dict_in_generate=True,
                       **CASES["alternatives"]).strategy_stats.accepted_alternatives
        for _ in range(400)
    )
    assert rescued > 10


def test_gate_over_an_assistant_keeps_the_distribution(model):
    assistant = sampling_model(seed=12)
    counts = sample_counts(model, seed=7, strategy="target_confidence_gated", assistant_model=assistant,
                           target_confidence_threshold=0.0, draft_exit_threshold=0.0)
    assert goodness_of_fit(counts, exact_joint(model)) > 1e-3
    # The assistant's own distribution is far from the target's, so the test above has teeth.
    assert goodness_of_fit(counts, exact_joint(assistant)) < 1e-6


def test_the_test_can_tell_the_draft_from_the_target(model):
    """Samples drawn with the layer-skip strategy must be rejected as draws from the draft alone;
    otherwise the goodness-of-fit test above would pass for a sampler that never verifies."""
    counts = sample_counts(model, seed=2024, **CASES["self_speculative"])
    draft_joint = exact_joint(model, SkippingDecoder(model, SKIP["attn_skip_layers"], SKIP["mlp_skip_layers"]))
    assert goodness_of_fit(counts, draft_joint) < 1e-6


# A target whose rows do not depend on the text (row i is the distribution of output position
# i, whatever came before), and a draft with its own, different distribution at each depth.
_ROWS = torch.Generator().manual_seed(3)
TARGET_ROWS = torch.softmax(2 * torch.randn(4, VOCAB, generator=_ROWS), dim=-1)
DRAFT_ROWS = torch.softmax(2 * torch.randn(3, VOCAB, generator=_ROWS), dim=-1)
TRIALS = 6000


def _verified_position_counts(alternatives: int, draft_rows: torch.Tensor = DRAFT_ROWS) -> np.ndarray:
    """`[position, token]` counts of what single verifications commit, over `TRIALS` drafts of
    three tokens drawn from `DRAFT_ROWS` (their likeliest other tokens as alternatives), the
    verifier told they were drawn from `draft_rows`. No model runs, so thousands of trials take
    seconds and resolve a wrong distribution at any depth of the chain."""
    selector = TokenSelector(LogitsProcessorList(), do_sample=True)
    state = DecodingState(torch.zeros((1, 16), dtype=torch.long), torch.arange(16)[None], 4)
    torch.manual_seed(1)
    counts = np.zeros((len(TARGET_ROWS), VOCAB))
    for _ in range(TRIALS):
        tokens = [int(torch.multinomial(row, 1)) for row in DRAFT_ROWS]
        runner_ups = [
            [t for t in row.argsort(descending=True).tolist() if t != token][:alternatives]
            for row, token in zip(DRAFT_ROWS, tokens)
        ]
        draft = Draft(tokens, list(draft_rows), runner_ups if alternatives else [])
        # The chain's rows and the verifier's next, then each alternative's: the row after it.
        rows = [*TARGET_ROWS, *(TARGET_ROWS[depth + 1] for depth, branch in enumerate(draft.alternatives) for _ in branch)]
        for position, token in enumerate(verify(selector, state, draft, torch.stack(rows).log()).tokens):
            counts[position, token] += 1
    return counts


@pytest.mark.parametrize("alternatives", [0, 2])
def test_every_position_a_verification_commits_follows_the_target_there(alternatives):
    counts = _verified_position_counts(alternatives)
    assert counts[-1].sum() > 200  # whole chains are accepted too, so every depth is tested
    for position, row in enumerate(TARGET_ROWS):
        assert goodness_of_fit(counts[position], row.double().numpy()) > 1e-3, position


def test_the_position_test_sees_a_wrong_draft_distribution_below_the_first_token():
    """Told the first depth's draft distribution at every depth (the chain's later tokens were
    drawn from others), the verifier commits the wrong distribution from the second position on;
    the test above must see it, while a check of the first position alone cannot."""
    counts = _verified_position_counts(0, draft_rows=DRAFT_ROWS[[0, 0, 0]])
    assert goodness_of_fit(counts[0], TARGET_ROWS[0].double().numpy()) > 1e-3
    assert min(goodness_of_fit(counts[p], TARGET_ROWS[p].double().numpy()) for p in (1, 2, 3)) < 1e-6
