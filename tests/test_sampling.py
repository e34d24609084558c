"""Speculative sampling leaves the output distribution exactly that of plain sampling.

The exact joint distribution of the first three new tokens is computed from the full model's
own forward passes, so the test compares samples with the truth, not with another sample.
Seeds are fixed, so the verdict is the same on every run: it cannot flake.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from hf_selfspec.layer_skip import LayerSkipper
from tiny_models import tiny_model

VOCAB = 6
NEW_TOKENS = 3
SAMPLES = 1500
TEMPERATURE = 0.8
TOP_K = 5
PROMPT = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])  # repeats itself, so prompt lookup finds drafts
SKIP = dict(attn_skip_layers=[1, 2, 3], mlp_skip_layers=[1, 2, 3])


def _warped_probabilities(logits: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """The processors plain sampling applies here: min_new_tokens bans EOS, then temperature, top-k."""
    scores = logits.float()
    scores[..., eos_token_id] = -float("inf")
    scores = scores / TEMPERATURE
    kth = torch.topk(scores, TOP_K, dim=-1).values[..., -1:]
    return torch.softmax(scores.masked_fill(scores < kth, -float("inf")), dim=-1)


@torch.no_grad()
def _exact_joint(model) -> np.ndarray:
    """P(t1, t2, t3 | prompt) over all VOCAB**3 continuations, in itertools.product order."""
    continuations = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW_TOKENS)))
    sequences = torch.cat([PROMPT.expand(len(continuations), -1), continuations], dim=1)
    probabilities = _warped_probabilities(model(sequences, use_cache=False).logits, model.config.eos_token_id)
    start = PROMPT.shape[1] - 1
    joint = torch.ones(len(continuations))
    for offset in range(NEW_TOKENS):
        joint *= probabilities[torch.arange(len(continuations)), start + offset, continuations[:, offset]]
    return joint.double().numpy()


def _sample_counts(model, seed: int, **strategy_kwargs) -> np.ndarray:
    torch.manual_seed(seed)
    counts = np.zeros(VOCAB**NEW_TOKENS)
    for _ in range(SAMPLES):
        output = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True,
                                temperature=TEMPERATURE, top_k=TOP_K, top_p=1.0, **strategy_kwargs)
        index = 0
        for token in output[0, PROMPT.shape[1]:].tolist():
            index = index * VOCAB + token
        counts[index] += 1
    return counts


def _goodness_of_fit(counts: np.ndarray, probabilities: np.ndarray) -> float:
    """Chi-square p-value, pooling cells expected to hold fewer than 5 samples into one."""
    expected = probabilities / probabilities.sum() * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    return float(chisquare(observed, expected).pvalue)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=VOCAB, initializer_range=0.5, seed=11)


CASES = {
    "self_speculative": dict(strategy="self_speculative", draft_exit_threshold=0.0, **SKIP),
    "adaptive_draft_exit": dict(strategy="adaptive_draft_exit", **SKIP),
    "target_confidence_gated": dict(strategy="target_confidence_gated", target_confidence_threshold=0.0,
                                    draft_exit_threshold=0.0, **SKIP),
    # One-token matches (min n-gram 1) make lookup propose often even on short prompts.
    "prompt_lookup": dict(strategy="self_speculative", prompt_lookup_tokens=2, prompt_lookup_min_ngram=1,
                          draft_exit_threshold=0.0, **SKIP),
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
    counts = _sample_counts(model, seed=2024, **CASES[case])
    assert _goodness_of_fit(counts, _exact_joint(model)) > 1e-3


@pytest.mark.parametrize("case", ["self_speculative", "prompt_lookup", "target_confidence_gated", "alternatives"])
def test_bfloat16_sampling_follows_the_plain_sampling_distribution(case):
    """In bfloat16 the verifier's probabilities round differently from plain steps' by an ulp or
    so, far below what 1500 samples resolve; a sampler that skipped verification would not be."""
    bfloat16_model = tiny_model("llama", vocab_size=VOCAB, initializer_range=0.5, seed=11).to(torch.bfloat16)
    counts = _sample_counts(bfloat16_model, seed=2024, **CASES[case])
    assert _goodness_of_fit(counts, _exact_joint(bfloat16_model)) > 1e-3


def test_alternatives_are_accepted_while_sampling(model):
    """The distribution tests above have teeth for alternatives only if they are taken."""
    torch.manual_seed(5)
    rescued = sum(
        model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True,
                       temperature=TEMPERATURE, top_k=TOP_K, top_p=1.0, return_dict_in_generate=True,
                       **CASES["alternatives"]).strategy_stats.accepted_alternatives
        for _ in range(100)
    )
    assert rescued > 10


def test_gate_over_an_assistant_keeps_the_distribution(model):
    assistant = tiny_model("llama", vocab_size=VOCAB, initializer_range=0.5, seed=12)
    counts = _sample_counts(model, seed=7, strategy="target_confidence_gated", assistant_model=assistant,
                            target_confidence_threshold=0.0, draft_exit_threshold=0.0)
    assert _goodness_of_fit(counts, _exact_joint(model)) > 1e-3
    # The assistant's own distribution is far from the target's, so the test above has teeth.
    assert _goodness_of_fit(counts, _exact_joint(assistant)) < 1e-6


def test_the_test_can_tell_the_draft_from_the_target(model):
    """Samples drawn with the layer-skip strategy must be rejected as draws from the draft alone;
    otherwise the goodness-of-fit test above would pass for a sampler that never verifies."""
    counts = _sample_counts(model, seed=2024, **CASES["self_speculative"])
    skipper = LayerSkipper(model, tuple(SKIP["attn_skip_layers"]), tuple(SKIP["mlp_skip_layers"]))
    skipper.active = True
    try:
        draft_joint = _exact_joint(model)
    finally:
        skipper.close()
    assert _goodness_of_fit(counts, draft_joint) < 1e-6
