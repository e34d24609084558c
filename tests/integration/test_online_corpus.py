"""The online corpus through `generate`: it learns from finished calls, plain and speculative,
decoding with it stays lossless on every tiny architecture, threads that feed and read one
corpus at once each decode what they would alone, a saved corpus comes back whole, and one
key's text is never proposed under another key."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import hf_selfspec
from hf_selfspec.lookup_corpus import load_lookup_corpus
from helpers.greedy import assert_same_greedy
from helpers.tiny_models import ARCHITECTURES, tiny_model

# Always propose, never back off, so that every step exercises the online corpus where it matches.
LOOKUP = dict(prompt_lookup_tokens=2, prompt_lookup_min_ngram=1, backoff_probe_interval=0, max_draft_tokens=3,
              online_corpus_min_prob=0.0, online_corpus_min_context=1)
NEW_TOKENS = 24


def _prompts(count: int, vocab_size: int = 96) -> list[torch.Tensor]:
    """Requests that share a head, as a service's do: one fixed preamble, then a short varying part."""
    generator = torch.Generator().manual_seed(7)
    head = torch.randint(0, vocab_size, (6,), generator=generator)
    return [torch.cat([head, torch.randint(0, vocab_size, (3,), generator=generator)])[None] for _ in range(count)]


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_decoding_with_what_earlier_calls_wrote_is_lossless(architecture):
    model = tiny_model(architecture, initializer_range=0.3)
    model.generation_config.eos_token_id = None
    prompts = _prompts(4)
    for prompt in prompts:
        model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, strategy="plain", online_corpus=True)
    corpus = hf_selfspec.online_corpus(model)
    assert corpus.texts == len(prompts)
    for prompt in prompts:
        output = assert_same_greedy(model, prompt, NEW_TOKENS, strategy="self_speculative", online_corpus=True, **LOOKUP)
        # the texts it had already seen: most of each answer comes from the corpus
        assert output.strategy_stats.accepted_tokens >= NEW_TOKENS // 2
    assert corpus.texts == 2 * len(prompts)  # the speculative calls were added too


def test_threads_feeding_and_reading_one_corpus_decode_as_each_call_would_alone():
    model = tiny_model("llama", initializer_range=0.3)
    model.generation_config.eos_token_id = None
    prompts = _prompts(6)
    alone = [model.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False, strategy="plain").tolist() for p in prompts]
    jobs = [(thread, i) for thread in range(4) for i in range(len(prompts))]

    def call(job):
        thread, i = job
        kwargs = {"strategy": "plain"} if thread == 0 else {"strategy": "self_speculative", **LOOKUP}
        output = model.generate(prompts[i], max_new_tokens=NEW_TOKENS, do_sample=False, online_corpus="shared", **kwargs)
        return i, output.tolist()

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(call, jobs))
    assert all(output == alone[i] for i, output in results)
    assert hf_selfspec.online_corpus(model, "shared").texts == len(jobs)


def test_a_saved_corpus_loads_whole_and_serves_as_a_lookup_corpus(tmp_path):
    model = tiny_model("qwen3", initializer_range=0.3)
    model.generation_config.eos_token_id = None
    for prompt in _prompts(3):
        model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, strategy="plain", online_corpus="a")
    corpus = hf_selfspec.online_corpus(model, "a")
    path = corpus.save(tmp_path / "learned")
    restarted = hf_selfspec.OnlineCorpus(corpus.vocab_size)
    restarted.load(path)
    assert (restarted.texts, restarted.tokens, restarted.indexed_occurrences) == (
        corpus.texts, corpus.tokens, corpus.indexed_occurrences)
    probe = _prompts(1)[0][0].tolist()
    assert restarted.continuation(probe, 1, 3, 16, 0.3) == corpus.continuation(probe, 1, 3, 16, 0.3) != []
    # The file is a lookup corpus like any other, for a profile to name.
    assert load_lookup_corpus(model, path).tokens.numel() == corpus.tokens + corpus.texts
    with pytest.raises(ValueError, match="vocabulary"):
        hf_selfspec.OnlineCorpus(vocab_size=10).load(path)


def test_one_keys_text_is_never_proposed_under_another_key():
    model = tiny_model("llama", initializer_range=0.3)
    model.generation_config.eos_token_id = None
    prompt = _prompts(1)[0]
    model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, strategy="plain", online_corpus="tenant-a")
    learned_a = hf_selfspec.online_corpus(model, "tenant-a")

    def read_a(*args, **kwargs):
        raise AssertionError("tenant a's corpus was read under another key")

    learned_a.continuation = read_a
    # Tenant b asks the same: only its own corpus is read, and it learns alone.
    assert_same_greedy(model, prompt, NEW_TOKENS, strategy="self_speculative", online_corpus="tenant-b", **LOOKUP)
    learned_b = hf_selfspec.online_corpus(model, "tenant-b")
    assert learned_a.texts == learned_b.texts == 1
    assert hf_selfspec.online_corpus_keys(model) == ["tenant-a", "tenant-b"]
    # Off (the default, or False): nothing is read or added, under any key.
    model.generate(prompt, max_new_tokens=4, do_sample=False, strategy="plain")
    model.generate(prompt, max_new_tokens=4, do_sample=False, strategy="self_speculative", online_corpus=False, **LOOKUP)
    assert learned_a.texts == learned_b.texts == 1 and hf_selfspec.online_corpus_keys(model) == ["tenant-a", "tenant-b"]
    learned_a.clear()
    assert learned_a.texts == 0 and learned_b.texts == 1
    with pytest.raises(ValueError, match="online_corpus must be"):
        model.generate(prompt, max_new_tokens=4, strategy="plain", online_corpus=3)


def test_the_generation_config_switches_the_corpus_on_and_a_named_file_seeds_it_once(tmp_path):
    model = tiny_model("llama", initializer_range=0.3)
    model.generation_config.eos_token_id = None
    prompts = _prompts(3)
    for prompt in prompts:
        model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, strategy="plain", online_corpus="tuned")
    saved = str(hf_selfspec.online_corpus(model, "tuned").save(tmp_path / "shipped"))
    expected = [model.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False, strategy="plain") for p in prompts]
    model.generation_config.online_corpus = "served"
    served = hf_selfspec.online_corpus(model, "served")

    def decode(prompt, **kwargs):
        return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, strategy="self_speculative",
                              online_corpus_file=saved, **LOOKUP, **kwargs)

    assert decode(prompts[0]).tolist() == expected[0].tolist()
    assert served.texts == 3 + 1, "started from the file's three texts, then learned the call's"
    assert decode(prompts[1]).tolist() == expected[1].tolist()
    assert served.texts == 3 + 2, "the file is read once, not once a call"
    served.clear()
    # The call's keyword wins over the config: off here, so nothing is read or learned.
    assert decode(prompts[2], online_corpus=False).tolist() == expected[2].tolist()
    assert served.texts == 0
    assert decode(prompts[2]).tolist() == expected[2].tolist()
    assert served.texts == 3 + 1, "a cleared corpus starts from the file again"
