"""Prompt lookup continued into a lookup corpus (the model's own earlier writing): the index
agrees with a brute-force reading, decoding with it stays lossless on every tiny architecture,
and files that do not fit are clear errors."""

from __future__ import annotations

import json
import os
import random
from collections import Counter

import pytest
import torch
from transformers import GenerationConfig

from hf_selfspec.consistency import check_greedy_consistency
from hf_selfspec.files import adapter_files
from hf_selfspec.lookup_corpus import LookupCorpus, load_lookup_corpus, save_lookup_corpus
from hf_selfspec.profile_files import anchor_profile_files
from hf_selfspec.profiles import TunedProfile, device_profile_key, write_profile
from helpers.greedy import assert_same_greedy, random_prompts
from helpers.sampling import VOCAB, exact_joint, goodness_of_fit, sample_counts, sampling_model
from helpers.tiny_models import ARCHITECTURES, tiny_model

LOOKUP = dict(prompt_lookup_tokens=4, prompt_lookup_min_ngram=1, prompt_lookup_ngram=3, backoff_probe_interval=0)


def _reference_continuation(texts, text, min_ngram, max_ngram, max_tokens):
    """The rule written out over plain lists: the longest suffix n-gram found inside one text,
    then the token more than half of the agreeing occurrences continue with, until none is."""
    for n in range(min(max_ngram, len(text)), min_ngram - 1, -1):
        suffix = text[-n:]
        occurrences = [(t, i + n) for t, words in enumerate(texts) for i in range(len(words) - n) if words[i : i + n] == suffix]
        if not occurrences:
            continue
        path = []
        while len(path) < max_tokens:
            following = Counter(texts[t][p + len(path)] if p + len(path) < len(texts[t]) else None for t, p in occurrences)
            token, count = following.most_common(1)[0]  # when it counts, more than half: unique
            if token is None or 2 * count <= len(occurrences):
                break
            path.append(token)
            occurrences = [(t, p) for t, p in occurrences if p + len(path) - 1 < len(texts[t]) and texts[t][p + len(path) - 1] == token]
        return path
    return []


def test_the_continuation_follows_the_majority_of_the_longest_match():
    corpus = LookupCorpus([[1, 2, 3, 4, 5], [8, 2, 3, 4, 6], [7, 2, 3, 4, 6, 9]])
    # "2 3" occurs three times; all continue with 4, two of three then with 6, then the texts split.
    assert corpus.continuation(torch.tensor([0, 2, 3]), 1, 2, 8) == [4, 6]
    # "1 2 3" occurs once, and its text ends after 5: nothing crosses into the next text.
    assert corpus.continuation(torch.tensor([1, 2, 3]), 1, 3, 8) == [4, 5]
    assert corpus.continuation(torch.tensor([1, 2, 3]), 1, 3, 1) == [4]
    # "5" ends its text, so it has no continuation; "4 5" neither, and no shorter n-gram is allowed.
    assert corpus.continuation(torch.tensor([4, 5]), 2, 3, 8) == []
    # "2 3 4" continues with 5 once and 6 twice: 6 holds more than half, then 9 is one of two.
    assert corpus.continuation(torch.tensor([2, 3, 4]), 3, 3, 8) == [6]
    assert corpus.continuation(torch.tensor([99, 98]), 1, 2, 8) == []


def test_the_index_agrees_with_a_brute_force_reading():
    generator = random.Random(3)
    texts = [[generator.randrange(6) for _ in range(generator.randrange(1, 40))] for _ in range(30)]
    corpus = LookupCorpus(texts)
    for _ in range(300):
        text = [generator.randrange(7) for _ in range(generator.randrange(1, 8))]
        min_ngram = generator.randrange(1, 3)
        max_ngram = generator.randrange(min_ngram, 5)
        expected = _reference_continuation(texts, text, min_ngram, max_ngram, 6)
        assert corpus.continuation(torch.tensor(text), min_ngram, max_ngram, 6) == expected, (text, min_ngram, max_ngram)


def _own_writing_corpus(model, directory, name="corpus"):
    """The model's own greedy continuations of prompts other than the test's, and random text:
    proposals from it are accepted often and rejected often."""
    texts = []
    for seed in range(4):
        prompt = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(100 + seed))
        texts.append(model.generate(prompt, max_new_tokens=40, do_sample=False, strategy="plain")[0].tolist())
    generator = torch.Generator().manual_seed(7)
    texts += [torch.randint(0, model.config.vocab_size, (30,), generator=generator).tolist() for _ in range(4)]
    return str(save_lookup_corpus(texts, directory / name, model.config.vocab_size, "test corpus"))


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_lookups_in_the_corpus_match_plain_greedy(architecture, tmp_path):
    model = tiny_model(architecture, initializer_range=0.3)
    corpus = _own_writing_corpus(model, tmp_path)
    with_corpus = without = 0
    for prompt in random_prompts(model.config.vocab_size):
        # A closed gate: every proposal is a lookup, in the text or in the corpus.
        for strategy, knobs in (("target_confidence_gated", {"target_confidence_threshold": 1.0}),
                                ("self_speculative", {"draft_exit_threshold": 0.0, "attn_skip_layers": [1]})):
            output = assert_same_greedy(model, prompt, strategy=strategy, lookup_corpus=corpus, **LOOKUP, **knobs)
            if strategy == "target_confidence_gated":  # only lookups propose there
                with_corpus += output.strategy_stats.drafted_tokens
                output = assert_same_greedy(model, prompt, strategy=strategy, **LOOKUP, **knobs)
                without += output.strategy_stats.drafted_tokens
    assert with_corpus > without  # the corpus really proposes where the text alone does not


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
def test_lookups_in_the_corpus_are_consistent_in_bfloat16(architecture, tmp_path):
    model = tiny_model(architecture, initializer_range=0.3).to(torch.bfloat16)
    corpus = _own_writing_corpus(model, tmp_path)
    for prompt in random_prompts(model.config.vocab_size):
        length, new_tokens = prompt.shape[1], 29
        plain = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, strategy="plain",
                               return_dict_in_generate=True, output_logits=True)
        ours = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, strategy="target_confidence_gated",
                              target_confidence_threshold=1.0, lookup_corpus=corpus, **LOOKUP)
        check = check_greedy_consistency(
            ours[0, length:].tolist(), plain.sequences[0, length:].tolist(), plain.logits, torch.bfloat16
        )
        assert check.consistent, check


def test_sampling_with_corpus_proposals_keeps_the_distribution(tmp_path):
    model = sampling_model()
    generator = torch.Generator().manual_seed(3)
    texts = [torch.randint(0, VOCAB, (12,), generator=generator).tolist() for _ in range(20)]
    corpus = str(save_lookup_corpus(texts, tmp_path / "corpus", VOCAB, "random"))
    counts = sample_counts(model, seed=2024, strategy="target_confidence_gated", target_confidence_threshold=1.0,
                           lookup_corpus=corpus, prompt_lookup_tokens=2, prompt_lookup_min_ngram=2,
                           prompt_lookup_ngram=2)
    assert goodness_of_fit(counts, exact_joint(model)) > 1e-3


def _generate(model, corpus, **knobs):
    return model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, strategy="target_confidence_gated",
                          lookup_corpus=str(corpus), **{**LOOKUP, **knobs})


def test_a_corpus_that_does_not_fit_is_a_clear_error(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="lookup corpus file .*nothing.safetensors is missing"):
        _generate(model, tmp_path / "nothing.safetensors")
    path = save_lookup_corpus([[1, 2, 3]], tmp_path / "other-vocab", 50, "too small")
    with pytest.raises(ValueError, match="vocabulary of 50 tokens, the model has 96"):
        _generate(model, path)
    path = save_lookup_corpus([[1, 2, 300]], tmp_path / "out-of-range", 96, "bad ids")
    with pytest.raises(ValueError, match="holds token id 300"):
        _generate(model, path)
    path = save_lookup_corpus([[1, 2, 3]], tmp_path / "not-a-corpus", 96, "")
    adapter_files(path)[1].write_text(json.dumps({"format": "hf-selfspec-draft-adapter/1"}))
    with pytest.raises(ValueError, match="not a lookup corpus description"):
        _generate(model, path)
    path = save_lookup_corpus([[1, 2, 3]], tmp_path / "fine", 96, "")
    with pytest.raises(ValueError, match="lookup_corpus extends prompt lookup and needs prompt_lookup_tokens > 0"):
        _generate(model, path, prompt_lookup_tokens=0)
    with pytest.raises(ValueError, match="lookup_corpus must be a file name"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, strategy="target_confidence_gated",
                       lookup_corpus=3, **LOOKUP)


def test_a_rewritten_corpus_is_read_again(tmp_path):
    """The index is kept per process, keyed by the file's modification time."""
    model = tiny_model("llama")
    path = save_lookup_corpus([[1, 2, 3]], tmp_path / "c", 96, "")
    assert load_lookup_corpus(model, path).continuation(torch.tensor([1, 2]), 1, 2, 4) == [3]
    save_lookup_corpus([[1, 2, 5]], path, 96, "")
    os.utime(path, ns=(1, 1))
    assert load_lookup_corpus(model, path).continuation(torch.tensor([1, 2]), 1, 2, 4) == [5]


def test_a_profile_names_its_corpus_relative_to_its_config(tiny_llama_dir, tmp_path):
    from hf_selfspec.loading import load_model_and_tokenizer
    from hf_selfspec.profiles import use_generation_config_file

    model, tokenizer = load_model_and_tokenizer(str(tiny_llama_dir))
    save_lookup_corpus([[1, 2, 3]], tmp_path / "own-text", model.config.vocab_size, "")
    config = GenerationConfig(eos_token_id=model.config.eos_token_id)
    write_profile(config, device_profile_key("cpu", torch.float32),
                  TunedProfile("target_confidence_gated", {"lookup_corpus": "own-text.safetensors", **LOOKUP}))
    config.save_pretrained(tmp_path)
    use_generation_config_file(model, tmp_path / "generation_config.json")
    assert anchor_profile_files(model, {"lookup_corpus": "own-text.safetensors"}) == {
        "lookup_corpus": str(tmp_path / "own-text.safetensors")
    }
    inputs = tokenizer("def add(a, b):", return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    assert output.strategy_stats.strategy == "target_confidence_gated"
    assert output.sequences.tolist() == model.generate(**inputs, max_new_tokens=10, do_sample=False, strategy="plain").tolist()
    (tmp_path / "own-text.safetensors").unlink()
    with pytest.raises(ValueError, match="own-text.safetensors is missing"):
        model.generate(**inputs, max_new_tokens=4)
