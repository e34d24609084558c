"""The exact distribution of a tiny model's first sampled tokens, and the chi-square test that
holds a strategy's samples to it."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy.stats import chisquare

from hf_selfspec.layer_skip import SkippingDecoder

from helpers.tiny_models import tiny_model

VOCAB = 6
# Four tokens, so that drafts of two tokens are verified (the draft is capped by the room left),
# and weights flat enough that the first token is not a foregone conclusion: the joint spreads
# over many cells, and a sampler that is off anywhere in it is caught.
NEW_TOKENS = 4
INITIALIZER_RANGE = 0.1
SAMPLES = 1500
TEMPERATURE = 0.8
TOP_K = 5
PROMPT = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])  # repeats itself, so prompt lookup finds drafts


def _warped_probabilities(logits: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """The processors plain sampling applies here: min_new_tokens bans EOS, then temperature, top-k."""
    scores = logits.float()
    scores[..., eos_token_id] = -float("inf")
    scores = scores / TEMPERATURE
    kth = torch.topk(scores, TOP_K, dim=-1).values[..., -1:]
    return torch.softmax(scores.masked_fill(scores < kth, -float("inf")), dim=-1)


@torch.no_grad()
def exact_joint(model, decoder: SkippingDecoder | None = None, prompt: torch.Tensor = PROMPT) -> np.ndarray:
    """P(new tokens | prompt) over all VOCAB**NEW_TOKENS continuations, in itertools.product order;
    the model's, or with `decoder` in place of its own, its draft's."""
    continuations = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW_TOKENS)))
    sequences = torch.cat([prompt.expand(len(continuations), -1), continuations], dim=1)
    if decoder is None:
        logits = model(sequences, use_cache=False).logits
    else:
        positions = torch.arange(sequences.shape[1]).expand_as(sequences)
        logits = model.get_output_embeddings()(decoder(sequences, positions, None))
    probabilities = _warped_probabilities(logits, model.config.eos_token_id)
    start = prompt.shape[1] - 1
    joint = torch.ones(len(continuations))
    for offset in range(NEW_TOKENS):
        joint *= probabilities[torch.arange(len(continuations)), start + offset, continuations[:, offset]]
    return joint.double().numpy()


def sample_counts(model, seed: int, **strategy_kwargs) -> np.ndarray:
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


# A batch of three left-padded prompts of ragged lengths, each repeating itself (for lookup).
BATCH_PROMPTS = [PROMPT[0].tolist(), [2, 3, 1, 2], [3, 1, 3, 1, 3]]


def batch_sample_counts(model, seed: int, **strategy_kwargs) -> list[np.ndarray]:
    """`sample_counts` for each row of `BATCH_PROMPTS`, sampled together in one batch per draw."""
    width = max(len(prompt) for prompt in BATCH_PROMPTS)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in BATCH_PROMPTS])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in BATCH_PROMPTS])
    torch.manual_seed(seed)
    counts = [np.zeros(VOCAB**NEW_TOKENS) for _ in BATCH_PROMPTS]
    for _ in range(SAMPLES):
        output = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                top_p=1.0, pad_token_id=0, **strategy_kwargs)
        for row, row_counts in zip(output[:, width:].tolist(), counts):
            index = 0
            for token in row:
                index = index * VOCAB + token
            row_counts[index] += 1
    return counts


def goodness_of_fit(counts: np.ndarray, probabilities: np.ndarray) -> float:
    """Chi-square p-value, pooling cells expected to hold fewer than 5 samples into one."""
    expected = probabilities / probabilities.sum() * counts.sum()
    small = expected < 5
    if not small.any():
        return float(chisquare(counts, expected).pvalue)
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    return float(chisquare(observed, expected).pvalue)


def sampling_model(seed: int = 11):
    return tiny_model("llama", vocab_size=VOCAB, initializer_range=INITIALIZER_RANGE, seed=seed)
