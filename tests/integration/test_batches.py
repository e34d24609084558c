"""A batch under a strategy: left-padded rows of ragged lengths, each drafted, verified and
committed on its own, each row exactly what plain batched greedy `generate` gives for it in the
same batch, rows stopping where plain decoding stops them while the others go on."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer
from transformers.generation.streamers import BaseStreamer

import hf_selfspec
from hf_selfspec.adapter import AdapterShape, DraftAdapter, save_adapter
from hf_selfspec.lookup_corpus import save_lookup_corpus
from hf_selfspec.policies import Backoff
from hf_selfspec.strategies import Strategy
from helpers.adapters import random_adapter
from helpers.greedy import PAD, RAGGED_LENGTHS, assert_same_batched_greedy, ragged_batch
from helpers.tiny_models import ARCHITECTURES, NUM_LAYERS, tiny_model

pytestmark = pytest.mark.version_sensitive

STRATEGIES = ["self_speculative", "adaptive_draft_exit", "target_confidence_gated"]
BATCH_SIZES = (1, 2, 3, 8)
SKIP = dict(attn_skip_layers=[1, 3], mlp_skip_layers=[2], max_draft_tokens=5)
# Drafting at every step, long drafts and deep rollbacks; then prompt lookup beside the draft with
# the exit and the gate as they come, so that rows propose from different sources in one step.
KNOBS = [
    {"draft_exit_threshold": 0.0, "target_confidence_threshold": 0.0},
    {"prompt_lookup_tokens": 3, "prompt_lookup_min_ngram": 1, "target_confidence_threshold": 0.05},
]


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_row_is_plain_batched_greedys(architecture, strategy):
    drafted = 0
    for sharpness in (None, 0.3):  # sharper weights give long accepted runs across the window
        model = tiny_model(architecture, initializer_range=sharpness)
        for rows in BATCH_SIZES:
            input_ids, attention_mask = ragged_batch(model.config.vocab_size, rows)
            for knobs in KNOBS:
                output, _ = assert_same_batched_greedy(
                    model, input_ids, attention_mask, strategy=strategy, **SKIP, **knobs
                )
                drafted += output.strategy_stats.drafted_tokens
    assert drafted > 0


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_the_adapter_draft_keeps_each_row_plain_batched_greedys(architecture, tmp_path):
    """The adapter's own cache moves with the batch's rows, its backlog of the verifier's states
    with it."""
    for sharpness in (None, 0.3):
        model = tiny_model(architecture, initializer_range=sharpness)
        for exit_layer in (1, NUM_LAYERS - 1):
            adapter = random_adapter(model, exit_layer, tmp_path, mlp=exit_layer == 1)
            for rows in BATCH_SIZES[1:]:
                input_ids, attention_mask = ragged_batch(model.config.vocab_size, rows)
                for knobs in ({"draft_exit_threshold": 0.0}, {"prompt_lookup_tokens": 3, "prompt_lookup_min_ngram": 1}):
                    assert_same_batched_greedy(model, input_ids, attention_mask, strategy="kangaroo", draft_adapter=adapter,
                                               max_draft_tokens=5, backoff_probe_interval=0, **knobs)


@pytest.fixture
def every_step_speculates(monkeypatch):
    """A batch weighs speculating against plain steps by wall time (`build_batch_backoff`);
    tests that count what was drafted and accepted need every step to speculate."""
    monkeypatch.setattr(Strategy, "build_batch_backoff", lambda self, params: Backoff())


def test_an_exact_adapter_is_accepted_whole_in_every_row(tmp_path, every_step_speculates):
    """An untouched copy of the last layer, exiting before it, is the full model: every drafted
    token of every row must be accepted, which holds only if the adapter's KV of each row lines
    up with that row's text, column by column, as the rows move."""
    model = tiny_model("llama", initializer_range=0.3)
    path = save_adapter(DraftAdapter(model, AdapterShape.for_model(model, NUM_LAYERS - 1)), tmp_path / "exact")
    for rows in (2, 3, 8):
        input_ids, attention_mask = ragged_batch(96, rows)
        output, _ = assert_same_batched_greedy(model, input_ids, attention_mask, strategy="kangaroo",
                                               draft_adapter=str(path), draft_exit_threshold=0.0, max_draft_tokens=4,
                                               backoff_probe_interval=0, prompt_lookup_tokens=2)
        assert output.strategy_stats.drafted_tokens > 0 and output.strategy_stats.acceptance_rate == 1.0


def test_a_lookup_corpus_serves_every_row(tmp_path):
    model = tiny_model("gemma3", initializer_range=0.3)
    input_ids, attention_mask = ragged_batch(96, 3, seed=11)
    texts = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=30, do_sample=False,
                           pad_token_id=PAD, strategy="plain").tolist()
    corpus = str(save_lookup_corpus(texts, tmp_path / "corpus", 96, "the batch's own texts"))
    for rows in (3, 8):
        input_ids, attention_mask = ragged_batch(96, rows, seed=11)
        output, _ = assert_same_batched_greedy(model, input_ids, attention_mask, lookup_corpus=corpus,
                                               prompt_lookup_tokens=4, prompt_lookup_min_ngram=2, backoff_probe_interval=0)
        assert output.strategy_stats.accepted_tokens > 0


def test_the_online_corpus_learns_each_rows_text_and_serves_a_batch():
    """Each row of a batch goes into the online corpus as its own text, without its padding; a
    later batch reads it, every row lossless."""
    model = tiny_model("qwen2", initializer_range=0.3)
    input_ids, attention_mask = ragged_batch(96, 3, seed=5)
    eos = _eos_of_first_row(model, input_ids, attention_mask, at=4)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    first = model.generate(input_ids, strategy="plain", online_corpus="batch", **kwargs)
    corpus = hf_selfspec.online_corpus(model, "batch")
    generated = first[:, input_ids.shape[1] :].tolist()
    lengths = [row.index(eos) + 1 if eos in row else len(row) for row in generated]
    assert corpus.texts == 3 and corpus.tokens == sum(RAGGED_LENGTHS[:3]) + sum(lengths)
    output, _ = assert_same_batched_greedy(model, input_ids, attention_mask, new_tokens=20, eos_token_id=eos,
                                           online_corpus="batch", prompt_lookup_tokens=3, online_corpus_min_context=2,
                                           backoff_probe_interval=0)
    assert output.strategy_stats.accepted_tokens > 10
    assert corpus.texts == 9  # and the check's plain and speculative calls added theirs


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", initializer_range=0.3)


def _eos_of_first_row(model, input_ids, attention_mask, at=5) -> int:
    plain = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=30, do_sample=False,
                           pad_token_id=PAD, strategy="plain")
    return int(plain[0, input_ids.shape[1] + at])


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("rows", [3, 8])
def test_rows_that_reach_eos_stop_and_the_others_go_on(architecture, rows):
    model = tiny_model(architecture, initializer_range=0.3)
    input_ids, attention_mask = ragged_batch(model.config.vocab_size, rows, seed=rows)
    eos = _eos_of_first_row(model, input_ids, attention_mask)
    for strategy in STRATEGIES:
        # runner-ups are drafted where one row is left, and a batch verifies none
        output, plain = assert_same_batched_greedy(
            model, input_ids, attention_mask, new_tokens=30, eos_token_id=[eos, 95], strategy=strategy,
            prompt_lookup_tokens=3, draft_exit_threshold=0.0, target_confidence_threshold=0.0, draft_alternatives=2,
            **SKIP,
        )
    generated = plain[:, input_ids.shape[1] :]
    stopped = (generated == eos).any(dim=1)
    assert stopped[0] and plain.shape[1] > input_ids.shape[1] + 6  # row 0 stopped early, another went on
    assert (generated[0, 6:] == PAD).all()


class _StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_without_an_eos_a_stopped_row_runs_on_until_the_last_stops(llama, strategy):
    """Plain decoding pads a stopped row only where its criteria hold an EOS; without one, every
    row decodes on until every row has stopped, and so must a strategy's."""
    input_ids, attention_mask = ragged_batch(96, 3, seed=3)
    stop = _eos_of_first_row(llama, input_ids, attention_mask)
    criteria = StoppingCriteriaList([_StopAfterToken(stop)])
    _, plain = assert_same_batched_greedy(
        llama, input_ids, attention_mask, new_tokens=30, eos_token_id=None, stopping_criteria=criteria,
        strategy=strategy, prompt_lookup_tokens=3, draft_exit_threshold=0.0, target_confidence_threshold=0.0,
    )
    assert plain.shape[1] > input_ids.shape[1] + 6 and (plain[0, input_ids.shape[1] + 6 :] != PAD).any()


def test_repetition_penalty_reads_each_rows_own_padding(llama):
    """transformers' repetition penalty holds each row's prompt padding, which it ignores."""
    input_ids, attention_mask = ragged_batch(96, 3)
    for strategy in STRATEGIES:
        assert_same_batched_greedy(llama, input_ids, attention_mask, strategy=strategy, repetition_penalty=1.5,
                                   no_repeat_ngram_size=3, draft_exit_threshold=0.0, target_confidence_threshold=0.0)


def test_scores_and_logits_under_a_batch(llama):
    """Each row's scores and logits are plain's while it decodes; after it stops, where plain
    scores the padding it appends, the padding is certain."""
    input_ids, attention_mask = ragged_batch(96, 3, seed=3)
    eos = _eos_of_first_row(llama, input_ids, attention_mask, at=3)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=20, do_sample=False, return_dict_in_generate=True,
                  output_scores=True, output_logits=True, repetition_penalty=1.2, eos_token_id=eos, pad_token_id=PAD)
    plain = llama.generate(input_ids, strategy="plain", **kwargs)
    ours = llama.generate(input_ids, strategy="self_speculative", draft_exit_threshold=0.0, prompt_lookup_tokens=2,
                          **kwargs)
    assert ours.sequences.tolist() == plain.sequences.tolist()
    assert len(ours.scores) == len(plain.scores) == len(ours.logits) == plain.sequences.shape[1] - input_ids.shape[1]
    generated = plain.sequences[:, input_ids.shape[1] :].tolist()
    stops = [row.index(eos) if eos in row else len(row) for row in generated]
    assert min(stops) < len(plain.scores) - 1
    for step, (mine, theirs) in enumerate(zip(ours.scores, plain.scores)):
        for row in range(3):
            if step > stops[row]:
                assert mine[row, PAD] == 0 and torch.isinf(mine[row]).sum() == mine.shape[1] - 1
                continue
            torch.testing.assert_close(mine[row], theirs[row], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ours.logits[step][row], plain.logits[step][row], rtol=1e-4, atol=1e-4)


class _Recorder(BaseStreamer):
    def __init__(self):
        self.puts: list[list] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


def test_a_streamer_gets_plain_batched_decodings_puts(llama):
    """Plain batched decoding puts the prompt, then one token of every row per step; a strategy
    puts the same, each column once every row still going has reached it."""
    input_ids, attention_mask = ragged_batch(96, 3, seed=3)
    eos = _eos_of_first_row(llama, input_ids, attention_mask)
    common = dict(attention_mask=attention_mask, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    plain_stream, our_stream = _Recorder(), _Recorder()
    llama.generate(input_ids, strategy="plain", streamer=plain_stream, **common)
    llama.generate(input_ids, strategy="self_speculative", streamer=our_stream, draft_exit_threshold=0.0,
                   prompt_lookup_tokens=3, **common)
    assert our_stream.ended and our_stream.puts == plain_stream.puts


def test_a_text_streamer_refuses_a_batch_as_plain_decoding_does(llama, tiny_llama_dir):
    from transformers import AutoTokenizer

    streamer = TextStreamer(AutoTokenizer.from_pretrained(tiny_llama_dir))
    input_ids, attention_mask = ragged_batch(96, 2)
    for strategy in ("plain", "self_speculative"):
        with pytest.raises(ValueError, match="only supports batch size 1"):
            llama.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, streamer=streamer,
                           strategy=strategy, pad_token_id=PAD)


def test_a_batch_is_no_longer_declined_to_plain_decoding(llama):
    input_ids, attention_mask = ragged_batch(96, 8)
    output = llama.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False,
                            pad_token_id=PAD, strategy="self_speculative", draft_exit_threshold=0.0,
                            return_dict_in_generate=True)
    assert isinstance(output, hf_selfspec.SelfSpecGenerateOutput)
    assert output.strategy_stats.drafted_tokens > 0


def _bad_masks():
    input_ids, attention_mask = ragged_batch(96, 3)
    right = attention_mask.flip(1)
    zero_row = attention_mask.clone()
    zero_row[1] = 0
    inner = torch.ones_like(attention_mask)
    inner[2, 4] = 0
    return input_ids, {
        "wrong shape": (attention_mask[:, 1:], "shape"),
        "right padding": (right, "pad on the left"),
        "inner padding": (inner, "pad on the left"),
        "all-zero row": (zero_row, "row 1 is all zeros"),
        "not 0 or 1": (attention_mask * 2, "values other than 0 and 1"),
    }


@pytest.mark.parametrize("case", sorted(_bad_masks()[1]))
def test_a_bad_attention_mask_gets_one_clear_line(llama, case):
    input_ids, masks = _bad_masks()
    mask, phrase = masks[case]
    with pytest.raises(ValueError) as raised:
        llama.generate(input_ids, attention_mask=mask, max_new_tokens=5, strategy="self_speculative",
                       pad_token_id=PAD)
    message = str(raised.value)
    assert len(message.splitlines()) == 1 and "attention_mask" in message and phrase in message, message


def test_a_batch_larger_than_max_batch_size_decodes_plainly_on_the_loops_kernel(llama, monkeypatch):
    """Beyond `max_batch_size` a batch decodes as plain batched greedy does, token for token,
    its few-row products on the kernel the loop would choose (`narrow_linear`)."""
    from hf_selfspec import narrow_linear
    from hf_selfspec.profiles import PROFILE_KEY

    transposed = []
    monkeypatch.setattr(narrow_linear, "fastest_layout", lambda weight, band, packable=False: narrow_linear.TRANSPOSED)
    original = narrow_linear._transposed
    monkeypatch.setattr(narrow_linear, "_transposed",
                        lambda weight, rows: transposed.append(rows.shape[0]) or original(weight, rows))
    profile = {"strategy": "self_speculative", "params": {"max_batch_size": 2, "draft_exit_threshold": 0.0}}
    setattr(llama.generation_config, PROFILE_KEY, {"cpu/float32": profile})
    try:
        for rows, speculates in ((1, True), (2, True), (3, False)):
            input_ids, attention_mask = ragged_batch(96, rows)
            plain = llama.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False,
                                   pad_token_id=PAD, strategy="plain")
            transposed.clear()
            output = llama.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False,
                                    pad_token_id=PAD, return_dict_in_generate=True)
            assert isinstance(output, hf_selfspec.SelfSpecGenerateOutput) == speculates, rows
            assert output.sequences.tolist() == plain.tolist(), rows
            assert transposed, rows
            if not speculates:  # plain steps: one token a row, every step after the prefill's
                assert transposed.count(rows) >= 7 and set(transposed) <= {rows, input_ids.numel()}
        input_ids, attention_mask = ragged_batch(96, 3)
        explicit = llama.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False,
                                  pad_token_id=PAD, return_dict_in_generate=True, strategy="self_speculative",
                                  max_batch_size=3)
        assert isinstance(explicit, hf_selfspec.SelfSpecGenerateOutput)
    finally:
        delattr(llama.generation_config, PROFILE_KEY)


def test_the_quorum_shortens_a_batchs_proposals_and_a_batch_of_one_keeps_its_own(llama, every_step_speculates):
    """With a quorum of half the rows, a step proposes only as far as half its rows' proposals
    reach: fewer tokens drafted than with no quorum, the same rows."""
    input_ids, attention_mask = ragged_batch(96, 8)
    drafted = {}
    for quorum in (0.0, 0.5):
        output, _ = assert_same_batched_greedy(llama, input_ids, attention_mask, batch_quorum=quorum,
                                               prompt_lookup_tokens=4, prompt_lookup_min_ngram=1, draft_exit_threshold=0.0,
                                               backoff_probe_interval=0)
        drafted[quorum] = output.strategy_stats.drafted_tokens
    assert 0 < drafted[0.5] < drafted[0.0]
    one = {quorum: assert_same_batched_greedy(llama, input_ids[:1], attention_mask[:1], batch_quorum=quorum,
                                              draft_exit_threshold=0.0)[0].strategy_stats.drafted_tokens
           for quorum in (0.0, 1.0)}
    assert one[0.0] == one[1.0] > 0


@pytest.mark.parametrize("assistant_architecture", ["llama", "gemma2"])
def test_an_assistant_model_drafts_for_every_row(assistant_architecture):
    """The assistant's own cache moves with the rows; a sliding-window assistant keeps the keys
    a row moved right still needs."""
    target = tiny_model("qwen2", initializer_range=0.3, seed=3)
    assistant = tiny_model(assistant_architecture, initializer_range=0.3, seed=4)
    for rows in (2, 3, 8):
        input_ids, attention_mask = ragged_batch(96, rows)
        for knobs in ({"target_confidence_threshold": 0.0}, {"target_confidence_threshold": 0.3,
                                                               "prompt_lookup_tokens": 3}):
            output, _ = assert_same_batched_greedy(target, input_ids, attention_mask, strategy="target_confidence_gated",
                                                   assistant_model=assistant, draft_exit_threshold=0.0, **knobs)
            assert output.strategy_stats.drafted_tokens > 0


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_in_bfloat16_each_row_is_consistent_with_plain_batched_greedy(architecture):
    """Identical, or first differing where plain batched decoding's own logits for that row tie
    within the stated rounding."""
    from hf_selfspec.consistency import check_greedy_consistency

    model = tiny_model(architecture, initializer_range=0.3).to(torch.bfloat16)
    input_ids, attention_mask = ragged_batch(96, 8)
    common = dict(attention_mask=attention_mask, max_new_tokens=29, do_sample=False, pad_token_id=PAD,
                  return_dict_in_generate=True)
    plain = model.generate(input_ids, strategy="plain", output_logits=True, **common)
    for knobs in KNOBS:
        for strategy in STRATEGIES:
            ours = model.generate(input_ids, strategy=strategy, **SKIP, **knobs, **common)
            for row in range(8):
                check = check_greedy_consistency(
                    ours.sequences[row, input_ids.shape[1] :].tolist(), plain.sequences[row, input_ids.shape[1] :].tolist(),
                    [step[row] for step in plain.logits], torch.bfloat16,
                )
                assert check.consistent, (strategy, knobs, row, check)
