"""Losslessness on the real embedded model, SmolLM2-135M-Instruct, on HumanEval prompts: exact
in float32, consistent (identical or a near-tie, `hf_selfspec.consistency`) in bfloat16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hf_selfspec
from hf_selfspec.cache import cache_keyword
from hf_selfspec.consistency import check_greedy_consistency
from hf_selfspec.dtypes import has_native_bfloat16
from hf_selfspec.embedded import TUNED_CONFIG
from hf_selfspec.profile_files import anchor_profile_files
from hf_selfspec.profiles import read_profiles_file
from hf_selfspec.prompts import encode_prompt, load_prompts

pytestmark = pytest.mark.real_model
NEW_TOKENS = 48
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Case keywords name shipped files as a profile does, relative to the directory they ship in.
SHIPPED = Path(str(TUNED_CONFIG)).parent
ALONE_PROFILE = read_profiles_file(SHIPPED / "kangaroo-alone-generation_config.json")["cpu/bfloat16"]
GENERAL_ALONE_PROFILE = read_profiles_file(SHIPPED / "kangaroo-alone-general-generation_config.json")["cpu/bfloat16"]
# The default a CPU with AMX applies in bfloat16, which no other CPU selects: run here in each dtype.
AMX_PROFILE = read_profiles_file(TUNED_CONFIG)["cpu/amx/bfloat16"]
# The default any other CPU with native bfloat16 applies: a chain of draft heads and their runner-ups beside lookup.
HEADS_PROFILE = read_profiles_file(TUNED_CONFIG)["cpu/bfloat16"]
# The default in float32: the same chain, one token and its runner-ups, tuned where a verification's width costs more.
FLOAT32_PROFILE = read_profiles_file(TUNED_CONFIG)["cpu/float32"]


STRATEGY_KWARGS = {
    "self_speculative": {"strategy": "self_speculative"},
    "adaptive_draft_exit": {"strategy": "adaptive_draft_exit"},
    "target_confidence_gated": {"strategy": "target_confidence_gated"},
    "deep_skip": {"strategy": "adaptive_draft_exit", "attn_skip_layers": list(range(1, 30)), "mlp_skip_layers": [],
                  "draft_exit_threshold": 0.0, "max_draft_tokens": 2},
    "prompt_lookup": {"strategy": "target_confidence_gated", "prompt_lookup_tokens": 8},
    "long_lookup_only": {"strategy": "target_confidence_gated", "prompt_lookup_tokens": 16,
                         "prompt_lookup_min_ngram": 1, "target_confidence_threshold": 1.0, "max_draft_tokens": 16},
    # The trained adapter that ships beside the tuned profiles (docs/kangaroo.md).
    "kangaroo_shipped_adapter": {"strategy": "kangaroo", "max_draft_tokens": 4, "draft_exit_threshold": 0.3,
                                 "draft_adapter": "kangaroo-exit1.safetensors"},
    # Its runner-ups verified beside the chain: branches in the verification's mask.
    "kangaroo_alternatives": {"strategy": "kangaroo", "max_draft_tokens": 3, "draft_exit_threshold": 0.3,
                              "draft_alternatives": 2,
                              "draft_adapter": "kangaroo-exit1.safetensors"},
    # Kangaroo alone as tuned where wide verifications are cheap: six-token drafts, three runner-ups each (25 rows).
    "kangaroo_alone_profile": {"strategy": ALONE_PROFILE.strategy, **ALONE_PROFILE.params},
    # The general adapter alone, as shipped for every kind of text: runner-ups beside each drafted token.
    "kangaroo_alone_general_profile": {"strategy": GENERAL_ALONE_PROFILE.strategy, **GENERAL_ALONE_PROFILE.params},
    # Thirteen-token lookups into the general corpus, the general adapter's drafts, no back-off.
    "amx_default_profile": {"strategy": AMX_PROFILE.strategy, **AMX_PROFILE.params},
    # The shipped chain of draft heads (general-chain3), run here in each dtype.
    "heads_default_profile": {"strategy": HEADS_PROFILE.strategy, **HEADS_PROFILE.params},
    "float32_default_profile": {"strategy": FLOAT32_PROFILE.strategy, **FLOAT32_PROFILE.params},
    # The shipped chain of heads alone, three tokens deep, each with two runner-ups.
    "chain_alone": {"strategy": "kangaroo", "draft_adapter": "general-chain3.safetensors", "max_draft_tokens": 3,
                    "draft_alternatives": 2, "draft_exit_threshold": 0.0, "backoff_probe_interval": 0},
    # The lookup corpus that ships beside them: the model's own continuations of other prompts.
    "lookup_corpus_shipped": {"strategy": "target_confidence_gated", "target_confidence_threshold": 1.0,
                              "prompt_lookup_tokens": 10, "prompt_lookup_ngram": 6, "max_draft_tokens": 10,
                              "lookup_corpus": "own-code.safetensors"},
}


def case_kwargs(model, case: str) -> dict:
    """A case's `generate` keywords, its file names resolved beside the shipped profiles the way
    `generate` resolves a profile's."""
    return anchor_profile_files(model, STRATEGY_KWARGS[case], SHIPPED)


@pytest.fixture(scope="module", params=sorted(DTYPES))
def smollm2(request):
    """The model without profiles, in each dtype, with each prompt's plain greedy tokens and logits."""
    dtype = DTYPES[request.param]
    model, tokenizer = hf_selfspec.load_embedded(dtype=dtype, generation_config=None)
    cases = []
    for prompt in load_prompts("humaneval", n=5):
        inputs = encode_prompt(tokenizer, prompt)
        plain = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, strategy="plain",
                               return_dict_in_generate=True, output_logits=True)
        cases.append((prompt.id, inputs, plain))
    return model, cases


def assert_consistent(output, plain, inputs, dtype, prompt_id):
    length = inputs["input_ids"].shape[1]
    check = check_greedy_consistency(
        output.sequences[0, length:].tolist(), plain.sequences[0, length:].tolist(), plain.logits, dtype
    )
    assert check.consistent, (prompt_id, check)
    if dtype == torch.float32:
        assert output.sequences.tolist() == plain.sequences.tolist(), prompt_id


@pytest.mark.parametrize("case", sorted(STRATEGY_KWARGS))
def test_strategies_reproduce_plain_greedy_on_humaneval(smollm2, case):
    model, cases = smollm2
    drafted = rescued = 0
    for prompt_id, inputs, plain in cases:
        output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                                **case_kwargs(model, case))
        assert_consistent(output, plain, inputs, model.dtype, prompt_id)
        drafted += output.strategy_stats.drafted_tokens
        rescued += output.strategy_stats.accepted_alternatives
    assert drafted > 0
    assert (rescued > 0) == bool(STRATEGY_KWARGS[case].get("draft_alternatives"))


def test_draft_heads_reproduce_plain_greedy_on_humaneval(smollm2, tmp_path):
    """Heads read the final state the verifier hands over; near the identity they guess the
    newest token again, which code often repeats (indentation, brackets), so both acceptances
    and rescues by runner-ups occur."""
    from helpers.adapters import random_heads

    model, cases = smollm2
    heads = random_heads(model, tmp_path, heads=2, scale=0.01)
    drafted = accepted = rescued = 0
    for prompt_id, inputs, plain in cases:
        output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                                strategy="kangaroo", draft_adapter=heads, max_draft_tokens=2,
                                draft_exit_threshold=0.0, draft_alternatives=4, backoff_probe_interval=0)
        assert_consistent(output, plain, inputs, model.dtype, prompt_id)
        stats = output.strategy_stats
        drafted, accepted, rescued = drafted + stats.drafted_tokens, accepted + stats.accepted_tokens, rescued + stats.accepted_alternatives
    assert drafted > 0 and accepted > 0 and rescued > 0


@pytest.mark.parametrize("layout", ["stock", "transposed", "packed"])
def test_the_verifiers_kernel_keeps_decoding_lossless(smollm2, monkeypatch, layout):
    """Whichever kernel this machine's timing picks for a verification's rows
    (`hf_selfspec.narrow_linear`), the shipped adapter with long lookups stays lossless."""
    from hf_selfspec import narrow_linear

    if layout == narrow_linear.PACKED and narrow_linear.pack(torch.randn(4, 4)) is None:
        pytest.skip("this build of torch has no oneDNN packing")
    monkeypatch.setattr(narrow_linear, "fastest_layout", lambda weight, band, packable=False: layout)
    model, cases = smollm2
    kwargs = {**case_kwargs(model, "kangaroo_shipped_adapter"), "prompt_lookup_tokens": 16, "prompt_lookup_min_ngram": 1}
    for prompt_id, inputs, plain in cases:
        output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                                **kwargs)
        assert_consistent(output, plain, inputs, model.dtype, prompt_id)


def test_shipped_profile_is_applied_by_default_and_consistent(smollm2):
    """`load_embedded()` applies the profile tuned for this device and dtype, and it stays lossless."""
    from hf_selfspec.profiles import matching_profile, read_profiles

    reference_model, cases = smollm2
    model, _ = hf_selfspec.load_embedded(dtype=reference_model.dtype)
    key, profile = matching_profile(read_profiles(model.generation_config), model.device, model.dtype)
    assert profile is not None, f"{TUNED_CONFIG} has no profile for {key}"
    for prompt_id, inputs, plain in cases:
        output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
        assert output.strategy_stats.strategy == profile.strategy, prompt_id
        assert_consistent(output, plain, inputs, model.dtype, prompt_id)


def test_auto_dtype_is_the_published_bfloat16_where_the_cpu_has_it():
    model, _ = hf_selfspec.load_embedded(generation_config=None)
    assert model.dtype == (torch.bfloat16 if has_native_bfloat16("cpu") else torch.float32)


CHAT = [
    "Write a Python function that returns the largest of three numbers.",
    "Now make it work for any number of arguments.",
]


@pytest.mark.parametrize("case", ["kangaroo_alternatives", "lookup_corpus_shipped"])
def test_a_chat_continued_from_its_cache_stays_lossless(smollm2, case):
    """Each turn's prompt is the whole chat so far, and the cache holds the earlier turns: the
    decode continues from it (the adapter's shallow states of the cached turns included) and
    gives plain greedy's tokens for that prompt."""
    from transformers import AutoTokenizer, DynamicCache

    from hf_selfspec.embedded import converted_model_dir

    model, _ = smollm2
    tokenizer = AutoTokenizer.from_pretrained(converted_model_dir())
    cache, messages, text = DynamicCache(config=model.config), [], None
    for turn, question in enumerate(CHAT):
        messages.append({"role": "user", "content": question})
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        if text is not None:  # the template renders the earlier turns as they were decoded
            assert inputs["input_ids"][0, : text.shape[1]].tolist() == text[0].tolist()
        plain = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, strategy="plain",
                               return_dict_in_generate=True, output_logits=True)
        output = model.generate(**inputs, **cache_keyword(cache), max_new_tokens=NEW_TOKENS, do_sample=False,
                                return_dict_in_generate=True, **case_kwargs(model, case))
        assert_consistent(output, plain, inputs, model.dtype, f"turn {turn}")
        assert cache.get_seq_length() == output.sequences.shape[1] - 1
        assert output.strategy_stats.drafted_tokens > 0
        text = output.sequences
        reply = tokenizer.decode(text[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})


def test_the_online_corpus_keeps_decoding_lossless(smollm2):
    """With what earlier calls wrote (each prompt's own plain answer among them) in the online
    corpus, the profile that looks up most stays lossless, the corpus's proposals verified like
    any other."""
    model, cases = smollm2
    key = f"real-model-{model.dtype}"
    corpus = hf_selfspec.online_corpus(model, key)
    corpus.clear()
    for _, _, plain in cases:
        corpus.add(plain.sequences[0].tolist())
    for prompt_id, inputs, plain in cases:
        output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                                online_corpus=key, **case_kwargs(model, "amx_default_profile"))
        assert_consistent(output, plain, inputs, model.dtype, prompt_id)
    assert corpus.texts == 2 * len(cases)


# Cases that decode a batch: a skip set, lookup, the shipped adapter, corpus and default profiles.
BATCH_CASES = ["self_speculative", "prompt_lookup", "kangaroo_shipped_adapter", "amx_default_profile",
               "lookup_corpus_shipped"]


@pytest.fixture(scope="module", params=sorted(DTYPES))
def smollm2_batch(request):
    """A batch of four workload prompts of four kinds (held out), left-padded, with plain batched
    greedy's tokens and logits."""
    from hf_selfspec.prompts import HELD_OUT_SPLIT, WORKLOAD, encode_batch

    dtype = DTYPES[request.param]
    model, tokenizer = hf_selfspec.load_embedded(dtype=dtype, generation_config=None)
    prompts, kinds = [], set()
    for prompt in load_prompts(WORKLOAD, split=HELD_OUT_SPLIT):
        if prompt.category not in kinds and len(prompts) < 4:
            prompts.append(prompt)
            kinds.add(prompt.category)
    inputs = encode_batch(tokenizer, prompts)
    common = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    plain = model.generate(**inputs, **common, strategy="plain", return_dict_in_generate=True, output_logits=True)
    return model, inputs, common, plain


@pytest.mark.parametrize("case", BATCH_CASES)
def test_a_batch_of_workload_prompts_reproduces_plain_batched_greedy(smollm2_batch, case):
    """Every row as plain batched greedy decoding gives it in the same batch: identical in
    float32, consistent row by row in bfloat16."""
    model, inputs, common, plain = smollm2_batch
    # Speculate whatever batch size the profile stops at: its drafts are what is checked here.
    kwargs = {**case_kwargs(model, case), "max_batch_size": 0}
    output = model.generate(**inputs, **common, return_dict_in_generate=True, **kwargs)
    assert output.strategy_stats.drafted_tokens > 0
    _assert_rows_are_plain_batched(model, inputs, plain, output, case)


def test_a_batch_beyond_max_batch_size_reproduces_plain_batched_greedy_on_the_loops_kernel(smollm2_batch):
    """A batch the profile will not speculate on takes plain steps on the verifier's kernel, with
    plain batched greedy's rows."""
    model, inputs, common, plain = smollm2_batch
    output = model.generate(**inputs, **common, return_dict_in_generate=True, strategy="self_speculative",
                            max_batch_size=2)
    assert not isinstance(output, hf_selfspec.SelfSpecGenerateOutput)
    _assert_rows_are_plain_batched(model, inputs, plain, output, "max_batch_size=2")


def _assert_rows_are_plain_batched(model, inputs, plain, output, case: str) -> None:
    length = inputs["input_ids"].shape[1]
    for row in range(inputs["input_ids"].shape[0]):
        logits = [step[row] for step in plain.logits]
        check = check_greedy_consistency(
            output.sequences[row, length:].tolist(), plain.sequences[row, length:].tolist(), logits, model.dtype
        )
        assert check.consistent, (case, row, check)
    if model.dtype == torch.float32:
        assert output.sequences.tolist() == plain.sequences.tolist(), case

