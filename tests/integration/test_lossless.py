"""Greedy decoding under every strategy gives exactly plain `generate`'s tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_selfspec
from hf_selfspec.consistency import check_greedy_consistency
from hf_selfspec.drafters import LayerSkipDrafter
from helpers.greedy import assert_same_greedy, random_prompts
from helpers.tiny_models import ARCHITECTURES, NUM_LAYERS, SLIDING_WINDOW, tiny_model

pytestmark = pytest.mark.version_sensitive

STRATEGIES = ["self_speculative", "adaptive_draft_exit", "target_confidence_gated"]
SKIP_SETS = {
    "nothing": ([], []),
    "mixed": ([1, 3], [2]),
    "all_but_one_sublayer": (list(range(NUM_LAYERS)), list(range(NUM_LAYERS - 1))),
    "all_but_first_layer": (list(range(1, NUM_LAYERS)), list(range(1, NUM_LAYERS))),
}
# A threshold of 0 drafts until max_draft_tokens, which exercises long drafts and deep rollbacks;
# the default exercises the exit. A gate threshold of 0 keeps the gate open.
STRATEGY_KNOBS = [
    {"draft_exit_threshold": 0.0, "target_confidence_threshold": 0.0},
    {"target_confidence_threshold": 0.05},
    {"draft_exit_threshold": 0.0, "target_confidence_threshold": 0.0, "draft_vocab_size": 24},
]


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("skip_set", sorted(SKIP_SETS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_matches_plain_greedy(architecture, skip_set, strategy):
    attn_skip_layers, mlp_skip_layers = SKIP_SETS[skip_set]
    for sharpness in (None, 0.3):  # sharper weights give long accepted runs across the window
        model = tiny_model(architecture, initializer_range=sharpness)
        for prompt, knobs in zip(random_prompts(model.config.vocab_size), STRATEGY_KNOBS):
            output = assert_same_greedy(
                model,
                prompt,
                strategy=strategy,
                attn_skip_layers=attn_skip_layers,
                mlp_skip_layers=mlp_skip_layers,
                max_draft_tokens=5,
                **knobs,
            )
            if skip_set == "nothing" and knobs.get("draft_exit_threshold") == 0.0 and "draft_vocab_size" not in knobs:
                # The draft *is* the full model: everything it proposes must be accepted. (A
                # restricted draft head cannot propose tokens outside its subset, so not there.)
                assert output.strategy_stats.acceptance_rate == 1.0


REDUCED_PRECISION_KNOBS = [
    *STRATEGY_KNOBS,
    {"prompt_lookup_tokens": 4, "prompt_lookup_min_ngram": 1, "target_confidence_threshold": 0.0},
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_is_consistent_with_plain_greedy_in_reduced_precision(architecture, strategy, dtype):
    """Identical, or first differing where plain's own logits tie within the stated rounding."""
    drafted = 0
    for sharpness in (None, 0.3):
        model = tiny_model(architecture, initializer_range=sharpness).to(dtype)
        prompts = random_prompts(model.config.vocab_size) * 2
        for prompt, knobs in zip(prompts, REDUCED_PRECISION_KNOBS):
            new_tokens, length = 3 * SLIDING_WINDOW + 5, prompt.shape[1]
            plain = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, strategy="plain",
                                   return_dict_in_generate=True, output_logits=True)
            ours = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, strategy=strategy,
                                  attn_skip_layers=[1, 3], mlp_skip_layers=[2], max_draft_tokens=5,
                                  return_dict_in_generate=True, **knobs)
            check = check_greedy_consistency(
                ours.sequences[0, length:].tolist(), plain.sequences[0, length:].tolist(), plain.logits, dtype
            )
            assert check.consistent, (knobs, check)
            drafted += ours.strategy_stats.drafted_tokens
    assert drafted > 0


def test_drafts_are_really_exercised():
    """Guard against a loop that silently stops drafting and passes every equality test."""
    model = tiny_model("gemma2")
    output = assert_same_greedy(
        model, random_prompts(96)[1], strategy="self_speculative", attn_skip_layers=[1, 3], mlp_skip_layers=[2],
        draft_exit_threshold=0.0,
    )
    stats = output.strategy_stats
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0
    assert stats.accepted_tokens < stats.drafted_tokens  # and some were rejected, so rollback ran
    assert len(output.sequences[0]) - 9 > SLIDING_WINDOW * 2


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", initializer_range=0.3)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    "settings",
    [
        {"repetition_penalty": 1.5},
        {"no_repeat_ngram_size": 2},
        {"min_new_tokens": 20, "eos_token_id": [5, 7, 11]},
        {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "min_new_tokens": 4},
    ],
    ids=["repetition_penalty", "no_repeat_ngram", "min_new_tokens_multi_eos", "combined"],
)
def test_config_processors_apply_at_every_verified_position(llama, strategy, settings):
    for prompt in random_prompts(96):
        plain = llama.generate(prompt, max_new_tokens=30, do_sample=False, strategy="plain", **settings)
        ours = llama.generate(
            prompt, max_new_tokens=30, do_sample=False, strategy=strategy, draft_exit_threshold=0.0,
            target_confidence_threshold=0.0, attn_skip_layers=[2], mlp_skip_layers=[3], **settings
        )
        assert ours.tolist() == plain.tolist()


def _eos_inside_plain_output(model, prompt) -> int:
    plain = model.generate(prompt, max_new_tokens=30, do_sample=False, strategy="plain")
    return int(plain[0, prompt.shape[1] + 12])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stops_at_eos_inside_an_accepted_draft(llama, strategy):
    prompt = random_prompts(96)[2]
    eos = _eos_inside_plain_output(llama, prompt)
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=[eos, 95], pad_token_id=0)
    plain = llama.generate(prompt, strategy="plain", **kwargs)
    ours = llama.generate(prompt, strategy=strategy, draft_exit_threshold=0.0, target_confidence_threshold=0.0,
                          attn_skip_layers=[], mlp_skip_layers=[], **kwargs)
    assert ours.tolist() == plain.tolist()
    assert plain.shape[1] < prompt.shape[1] + 30  # it really stopped early


class _StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class _BanToken(LogitsProcessor):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        scores[:, self.token] = -float("inf")
        return scores


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_user_stopping_criteria_and_logits_processor(llama, strategy):
    prompt = random_prompts(96)[1]
    stop_token = _eos_inside_plain_output(llama, prompt)
    first_plain = int(llama.generate(prompt, max_new_tokens=1, do_sample=False, strategy="plain")[0, -1])
    common = dict(max_new_tokens=30, do_sample=False)

    def run(**extra):
        return llama.generate(
            prompt,
            stopping_criteria=StoppingCriteriaList([_StopAfterToken(stop_token)]),
            logits_processor=LogitsProcessorList([_BanToken(first_plain)]),
            **common,
            **extra,
        )

    plain = run(strategy="plain")
    ours = run(strategy=strategy, attn_skip_layers=[1], mlp_skip_layers=[1], draft_exit_threshold=0.0,
               target_confidence_threshold=0.0)
    assert ours.tolist() == plain.tolist()
    assert first_plain not in plain[0, prompt.shape[1]:].tolist()


class _Recorder(BaseStreamer):
    def __init__(self):
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_streamer_receives_the_same_tokens(llama, strategy):
    prompt = random_prompts(96)[0]
    plain_stream, our_stream = _Recorder(), _Recorder()
    llama.generate(prompt, max_new_tokens=25, do_sample=False, strategy="plain", streamer=plain_stream)
    llama.generate(prompt, max_new_tokens=25, do_sample=False, strategy=strategy, streamer=our_stream,
                   attn_skip_layers=[], mlp_skip_layers=[], draft_exit_threshold=0.0, target_confidence_threshold=0.0)
    assert our_stream.ended and plain_stream.ended
    assert sum(our_stream.chunks, []) == sum(plain_stream.chunks, [])
    assert our_stream.chunks[0] == prompt[0].tolist()
    assert any(len(chunk) > 1 for chunk in our_stream.chunks[1:])  # tokens arrive as drafts are accepted


def test_stop_strings_with_tokenizer(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = hf_selfspec.enable(AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval())
    inputs = tokenizer("def add(a, b):", return_tensors="pt")
    plain = model.generate(**inputs, max_new_tokens=30, do_sample=False, strategy="plain")
    text = tokenizer.decode(plain[0, inputs["input_ids"].shape[1] + 5 :])
    stop = text.strip()[:2] or text[:2]
    kwargs = dict(max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    expected = model.generate(**inputs, strategy="plain", **kwargs)
    for strategy in STRATEGIES:
        ours = model.generate(**inputs, strategy=strategy, attn_skip_layers=[], mlp_skip_layers=[],
                              draft_exit_threshold=0.0, target_confidence_threshold=0.0, **kwargs)
        assert ours.tolist() == expected.tolist()
    assert expected.shape[1] < plain.shape[1]


def test_scores_and_logits_match_plain(llama):
    prompt = random_prompts(96)[1]
    kwargs = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.2)
    plain = llama.generate(prompt, strategy="plain", **kwargs)
    ours = llama.generate(prompt, strategy="self_speculative", draft_exit_threshold=0.0, **kwargs)
    assert len(ours.scores) == len(plain.scores) == 20
    for mine, theirs in zip(ours.scores + ours.logits, plain.scores + plain.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


# A sliding-window assistant's cache is rolled back before the assistant ever drafts (after the
# prompt's prefill), while its layers are still empty.
@pytest.mark.parametrize("assistant_architecture", ["llama", "gemma2"])
def test_gate_over_assistant_model_matches_plain(assistant_architecture):
    target = tiny_model("qwen2", initializer_range=0.3, seed=3)
    assistant = tiny_model(assistant_architecture, initializer_range=0.3, seed=4)
    for prompt in random_prompts(96):
        for threshold in (0.0, 0.3, 1.0):
            output = assert_same_greedy(target, prompt, strategy="target_confidence_gated",
                                        assistant_model=assistant, target_confidence_threshold=threshold,
                                        draft_exit_threshold=0.0)
            if threshold == 0.0:
                assert output.strategy_stats.drafted_tokens > 0
            if threshold == 1.0:
                assert output.strategy_stats.drafted_tokens == 0


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_adaptive_lookup_and_draft_source_choice_match_plain_greedy(architecture):
    """The lookup length adapting within the request, past the model draft's own bound, and the
    choice between a lookup proposal and the model's draft (probed every other step, so both
    sources run) only change what is proposed: the tokens are plain greedy's."""
    for sharpness in (None, 0.3):
        model = tiny_model(architecture, initializer_range=sharpness)
        for prompt in random_prompts(model.config.vocab_size):
            assert_same_greedy(
                model, prompt, strategy="self_speculative", attn_skip_layers=[1, 3], mlp_skip_layers=[2],
                max_draft_tokens=3, draft_exit_threshold=0.0, prompt_lookup_tokens=2, prompt_lookup_min_ngram=1,
                prompt_lookup_max_tokens=16, prompt_lookup_min_tokens=2, draft_source_probe_interval=2,
            )


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_a_model_that_never_drafts_leaves_lookup_alone_and_matches_plain_greedy(architecture, monkeypatch):
    """`max_draft_tokens=0`: prompt lookup still proposes (the sharp weights' output repeats, so
    it does), the model's draft is never run, and the tokens are plain greedy's; with no lookup
    every step is a plain one."""

    def never(*args, **kwargs):
        raise AssertionError("the model drafted with max_draft_tokens=0")

    monkeypatch.setattr(LayerSkipDrafter, "propose_rows", never)
    model = tiny_model(architecture, initializer_range=0.3)
    for prompt in random_prompts(model.config.vocab_size):
        lookup = assert_same_greedy(model, prompt, strategy="self_speculative", max_draft_tokens=0,
                                    prompt_lookup_tokens=4, prompt_lookup_min_ngram=1, backoff_probe_interval=0)
        assert lookup.strategy_stats.drafted_tokens > 0
        alone = assert_same_greedy(model, prompt, strategy="self_speculative", max_draft_tokens=0)
        assert alone.strategy_stats.drafted_tokens == 0 and alone.strategy_stats.verification_steps == 0
