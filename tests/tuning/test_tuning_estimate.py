"""The estimated objective: the draft pass, the replay of the decoding loop, and the study that
confirms its best estimates by real decoding."""

from __future__ import annotations

import pytest
import torch
from optuna.trial import TrialState
from transformers import LogitsProcessorList
from helpers.tuning import write_study_config

from hf_selfspec.cache import DraftAwareCache, cache_keyword
from hf_selfspec.decoding_types import DecodingState
from hf_selfspec.drafters import LayerSkipDrafter
from hf_selfspec.layer_skip import SkippingDecoder
from hf_selfspec.params import resolve_params
from hf_selfspec.policies import ExitPolicy, ThroughputBackoff
from hf_selfspec.selection import TokenSelector
from helpers.adapters import random_adapter
from helpers.tiny_models import NUM_LAYERS, tiny_model
from hf_selfspec.tuning.config import StudyConfigError, load_study_config
from hf_selfspec.tuning.estimate import (
    CostModel,
    calibrate,
    check_supported,
    draft_predictions,
    replay_decode,
    teacher_force,
)
from hf_selfspec.tuning.export import export_profile
from hf_selfspec.tuning.objective import PreparedPrompt
from hf_selfspec.tuning.space import decode_params
from hf_selfspec.tuning.tune import format_summary, run_tune

pytestmark = pytest.mark.version_sensitive

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def sharp_llama():
    return _sharp("llama")


def _sharp(architecture: str):
    """Sharp weights make confident, repetitive text: long accepted runs, lookup hits, a gate
    that opens and closes (Gemma's, with its scaled embeddings, repeat so much that a random
    adapter is never wrong; its default weights are sharp enough). No EOS: past it a real
    draft's acceptances are not in the reference."""
    model = tiny_model(architecture, initializer_range=None if architecture.startswith("gemma") else 0.3)
    model.generation_config.eos_token_id = None
    return model


def _prepared(model, length: int, seed: int, new_tokens: int = NEW_TOKENS) -> PreparedPrompt:
    # From id 3 up: no pad token, which transformers would mask in plain decoding's prompt.
    prompt = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    plain = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, strategy="plain",
                           return_dict_in_generate=True, output_logits=True)
    return PreparedPrompt(f"p{seed}", {"input_ids": prompt}, plain.sequences[0, length:].tolist(),
                          torch.cat(plain.logits), plain_seconds=1.0)


def _free(num_layers: int) -> CostModel:
    """Costs do not matter to the counters."""
    return CostModel(num_layers, (0.0,) * 16, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    "strategy, knobs",
    [
        ("self_speculative", {"max_draft_tokens": 3, "draft_exit_threshold": 0.0}),
        ("adaptive_draft_exit", {"max_draft_tokens": 6, "draft_exit_threshold": 0.5}),
        ("target_confidence_gated", {"target_confidence_threshold": 0.6, "prompt_lookup_tokens": 4}),
        ("self_speculative", {"max_draft_tokens": 3, "draft_exit_threshold": 0.0, "prompt_lookup_tokens": 2,
                              "prompt_lookup_min_ngram": 1, "prompt_lookup_max_tokens": 12}),
    ],
)
def test_replay_counts_what_decoding_with_a_full_model_draft_does(sharp_llama, strategy, knobs):
    """With nothing skipped every draft token is accepted, so the replay must match a real
    decode step for step: same drafts, same acceptances, same plain steps."""
    # The back-off decides from real timings, which a replay cannot reproduce.
    params = resolve_params(
        NUM_LAYERS, {"attn_skip_layers": [], "mlp_skip_layers": [], "backoff_probe_interval": 0, **knobs}
    )
    replayed_steps = 0
    for seed, length in enumerate((5, 11, 17)):
        prompt = _prepared(sharp_llama, length, seed)
        data = teacher_force(sharp_llama, prompt, NEW_TOKENS)
        _, replayed = replay_decode(
            data, params, strategy, draft_predictions(sharp_llama, data, params), _free(NUM_LAYERS)
        )
        real = sharp_llama.generate(
            prompt.inputs["input_ids"],
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            strategy=strategy,
            return_dict_in_generate=True,
            **params.as_dict(),
        ).strategy_stats
        assert replayed.accepted_lengths == real.accepted_lengths, seed
        assert (replayed.drafted_tokens, replayed.plain_steps) == (real.drafted_tokens, real.plain_steps), seed
        replayed_steps += replayed.verification_steps
    assert replayed_steps > 0


@pytest.mark.parametrize(
    "architecture, exit_layer, mlp, draft_vocab_size, draft_alternatives, threshold",
    [
        ("llama", 1, True, 0, 0, 0.0), ("llama", 2, False, 24, 0, 0.3), ("llama", 1, True, 24, 1, 0.6),
        ("llama", 2, True, 0, 2, 0.3), ("qwen3", 1, True, 0, 0, 0.3), ("qwen3", 2, True, 0, 0, 0.3),
        # Text longer than the window: the pass keeps every key and masks each layer type.
        ("mistral", 2, True, 0, 2, 0.3), ("qwen2", 2, True, 24, 1, 0.0), ("gemma2", 1, True, 0, 2, 0.6),
        ("gemma3", 2, True, 0, 1, 0.3),
    ],
)
def test_replay_counts_what_decoding_with_a_trained_adapter_does(
    tmp_path, architecture, exit_layer, mlp, draft_vocab_size, draft_alternatives, threshold
):
    """An adapter drafts from the full model's own shallow layers, so as long as its tokens are
    right, the one pass over the text predicts exactly what a real draft proposes next, and its
    runner-ups; past a wrong token, the side branches draft what the real draft goes on to
    propose and how sure it is. So the replay matches a real decode step for step: rejections,
    rescues by an alternative, and where an exit threshold stops each draft."""
    model = _sharp(architecture)
    adapter = random_adapter(model, exit_layer, tmp_path, mlp=mlp)
    params = resolve_params(NUM_LAYERS, {
        "draft_adapter": adapter, "max_draft_tokens": 4, "draft_exit_threshold": threshold,
        "draft_vocab_size": draft_vocab_size, "backoff_probe_interval": 0, "draft_alternatives": draft_alternatives,
    })  # fmt: skip
    accepted = drafted = rescued = 0
    for seed, length in enumerate((5, 11, 17)):
        prompt = _prepared(model, length, seed)
        data = teacher_force(model, prompt, NEW_TOKENS)
        _, replayed = replay_decode(data, params, "kangaroo", draft_predictions(model, data, params), _free(NUM_LAYERS))
        real = model.generate(prompt.inputs["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False,
                                    strategy="kangaroo", return_dict_in_generate=True,
                                    **params.as_dict()).strategy_stats
        assert replayed.accepted_lengths == real.accepted_lengths, seed
        assert (replayed.drafted_tokens, replayed.plain_steps) == (real.drafted_tokens, real.plain_steps), seed
        assert replayed.accepted_alternatives == real.accepted_alternatives, seed
        accepted, drafted = accepted + replayed.accepted_tokens, drafted + replayed.drafted_tokens
        rescued += real.accepted_alternatives
    assert 0 < accepted < drafted  # both acceptances and rejections were replayed
    assert (rescued > 0) == (draft_alternatives > 0)


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
def test_replay_adapts_the_lookup_length_as_decoding_does(tmp_path, architecture):
    """One-token matches proposed at a length that grows while proposals are taken whole and
    shrinks when they are cut, beside an adapter's draft that the verifier sometimes rejects:
    the replay runs the decoding loop's own lookup drafter and length policy, so it matches a
    real decode step for step, and the adaptation changes what is proposed."""
    model = _sharp(architecture)
    fixed = {
        "draft_adapter": random_adapter(model, 1, tmp_path), "max_draft_tokens": 3, "draft_exit_threshold": 0.3,
        "prompt_lookup_tokens": 2, "prompt_lookup_min_ngram": 1, "backoff_probe_interval": 0,
    }  # fmt: skip
    params = resolve_params(NUM_LAYERS, {**fixed, "prompt_lookup_max_tokens": 12})
    changed = 0
    for seed, length in enumerate((5, 11, 17)):
        prompt = _prepared(model, length, seed)
        data = teacher_force(model, prompt, NEW_TOKENS)
        predicted = draft_predictions(model, data, params)
        _, replayed = replay_decode(data, params, "kangaroo", predicted, _free(NUM_LAYERS))
        real = model.generate(prompt.inputs["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False,
                              strategy="kangaroo", return_dict_in_generate=True, **params.as_dict()).strategy_stats
        assert replayed.accepted_lengths == real.accepted_lengths, seed
        assert (replayed.drafted_tokens, replayed.plain_steps) == (real.drafted_tokens, real.plain_steps), seed
        _, at_fixed_length = replay_decode(
            data, resolve_params(NUM_LAYERS, fixed), "kangaroo", predicted, _free(NUM_LAYERS)
        )
        changed += at_fixed_length.drafted_tokens != replayed.drafted_tokens
    assert changed > 0


def test_replay_chooses_the_cheaper_draft_source_by_its_priced_steps(sharp_llama):
    """A full-model draft is always accepted and here costs nothing, while one-token lookups are
    mostly cut: choosing by priced seconds per committed token, the replay turns to the model's
    draft where lookup would have gone first, and commits the text in fewer, longer steps."""
    knobs = {"attn_skip_layers": [], "mlp_skip_layers": [], "max_draft_tokens": 2, "draft_exit_threshold": 0.0,
             "prompt_lookup_tokens": 2, "prompt_lookup_min_ngram": 1, "backoff_probe_interval": 0}  # fmt: skip
    cost = CostModel(NUM_LAYERS, (0.0,) + (1.0,) * 15, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    data = teacher_force(sharp_llama, _prepared(sharp_llama, 11, seed=3, new_tokens=96), 96)

    def replay(draft_source_probe_interval: int):
        params = resolve_params(NUM_LAYERS, {**knobs, "draft_source_probe_interval": draft_source_probe_interval})
        return replay_decode(data, params, "self_speculative", draft_predictions(sharp_llama, data, params), cost)

    lookup_first_seconds, lookup_first = replay(0)
    chosen_seconds, chosen = replay(4)
    assert lookup_first.accepted_tokens < lookup_first.drafted_tokens  # lookups were cut
    assert chosen.verification_steps < lookup_first.verification_steps
    assert chosen.acceptance_rate > lookup_first.acceptance_rate
    assert chosen_seconds < lookup_first_seconds


def test_an_adapter_draft_is_priced_as_the_layers_below_its_exit_and_one_more_block(tmp_path):
    """Attention and MLP priced apart (1 and 10 units), so the sum says which ran: every layer
    below the exit whole, then the adapter's attention and, if it has one, its MLP."""
    model = tiny_model("llama")
    cost = CostModel(NUM_LAYERS, (0.0,) * 16, 0.0, 0.0, 1.0, 10.0, 0.0, 0.0)
    for exit_layer, mlp, units in ((1, True, 2 + 20), (2, False, 3 + 20), (3, True, 4 + 40)):
        params = resolve_params(NUM_LAYERS, {"draft_adapter": random_adapter(model, exit_layer, tmp_path, mlp=mlp)})
        assert cost.draft_token_seconds(params) == units, (exit_layer, mlp)


def test_calibration_times_each_listed_adapter_and_prices_its_trials_with_that(sharp_llama, tmp_path):
    """An adapter's block, mask and rotary set-up are not a decoder layer's, so calibration times
    each listed adapter's real draft; a trial choosing it is priced at that time (the restricted
    head's difference added as for any draft), and the prompt's teacher-forced KV, which every
    trial then reads, is left exactly as it was."""
    data = teacher_force(sharp_llama, _prepared(sharp_llama, 11, seed=3), NEW_TOKENS)
    kept = [(layer.keys.clone(), layer.values.clone()) for layer in data.cache.layers]
    adapters = [random_adapter(sharp_llama, exit_layer, tmp_path) for exit_layer in (1, 3)]
    cost = calibrate(sharp_llama, [data], NUM_LAYERS, 4, adapters)
    assert sorted(cost.adapter_draft_seconds) == sorted(adapters)
    for adapter in adapters:
        timed = cost.adapter_draft_seconds[adapter]
        assert timed > 0
        assert cost.draft_token_seconds(resolve_params(NUM_LAYERS, {"draft_adapter": adapter})) == timed
        restricted = resolve_params(NUM_LAYERS, {"draft_adapter": adapter, "draft_vocab_size": 32})
        head = cost.restricted_head_constant + 32 * cost.restricted_head_per_row
        assert cost.draft_token_seconds(restricted) == pytest.approx(max(timed + head, 0.0))
    assert data.cache.get_seq_length() == data.kv_length
    for (keys, values), layer in zip(kept, data.cache.layers, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_replay_looks_up_in_a_corpus_as_decoding_does(sharp_llama, tmp_path):
    """Lookups only (a closed gate), first in the text, then in the model's own writing: the
    replay proposes exactly what a real decode proposes, with the loop's own lookup."""
    from hf_selfspec.lookup_corpus import load_lookup_corpus, save_lookup_corpus

    texts = [_prepared(sharp_llama, 4, seed).reference_tokens for seed in range(10, 16)]
    path = save_lookup_corpus(texts, tmp_path / "own", sharp_llama.config.vocab_size, "the model's own")
    params = resolve_params(NUM_LAYERS, {
        "target_confidence_threshold": 1.0, "prompt_lookup_tokens": 5, "prompt_lookup_min_ngram": 1,
        "lookup_corpus": str(path), "backoff_probe_interval": 0, "attn_skip_layers": [], "mlp_skip_layers": [],
    })  # fmt: skip
    corpus, drafted = load_lookup_corpus(sharp_llama, path), 0
    for seed, length in enumerate((5, 11, 17)):
        prompt = _prepared(sharp_llama, length, seed)
        data = teacher_force(sharp_llama, prompt, NEW_TOKENS)
        predicted = draft_predictions(sharp_llama, data, params)  # for a gate that opens at 100% sure
        _, replayed = replay_decode(data, params, "target_confidence_gated", predicted, _free(NUM_LAYERS), corpus)
        real = sharp_llama.generate(prompt.inputs["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False,
                                    strategy="target_confidence_gated", return_dict_in_generate=True,
                                    **params.as_dict()).strategy_stats
        assert replayed.accepted_lengths == real.accepted_lengths, seed
        assert (replayed.drafted_tokens, replayed.plain_steps) == (real.drafted_tokens, real.plain_steps), seed
        _, without = replay_decode(data, params, "target_confidence_gated", predicted, _free(NUM_LAYERS))
        drafted += replayed.drafted_tokens - without.drafted_tokens
    assert drafted > 0  # the corpus proposed where the text alone did not


def test_replay_backs_off_where_its_priced_steps_say_drafting_loses(sharp_llama):
    """The replay feeds the back-off priced seconds in place of its clock. Priced so that a
    drafted token costs as much as a plain step, a draft the verifier sometimes rejects loses,
    and the replayed back-off must turn to plain steps and beat drafting at every step; priced
    free, drafting wins and the back-off keeps drafting."""
    knobs = {"attn_skip_layers": [1, 3], "mlp_skip_layers": [2], "max_draft_tokens": 4, "draft_exit_threshold": 0.0}
    pricey = CostModel(NUM_LAYERS, (0.0,) + (1.0,) * 15, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0)
    free_draft = CostModel(NUM_LAYERS, (0.0,) + (1.0,) * 15, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    data = teacher_force(sharp_llama, _prepared(sharp_llama, 11, seed=3), NEW_TOKENS)

    def replay(cost: CostModel, backoff_probe_interval: int):
        params = resolve_params(NUM_LAYERS, {**knobs, "backoff_probe_interval": backoff_probe_interval})
        predictions = draft_predictions(sharp_llama, data, params)
        return replay_decode(data, params, "self_speculative", predictions, cost)

    always_seconds, always = replay(pricey, 0)
    assert always.plain_steps <= 1 and always.accepted_tokens < always.drafted_tokens  # rejections happen
    backoff_seconds, backed_off = replay(pricey, 4)
    # drafting steps: the back-off's first measurement of drafting, then one probe
    assert backed_off.verification_steps == ThroughputBackoff._FIRST_SPECULATIVE_STEPS + 1
    assert backed_off.plain_steps > always.plain_steps + 1
    assert backoff_seconds < always_seconds
    _, kept = replay(free_draft, 4)
    # plain steps: the one measuring step, two probes (after 4 and 8 drafting steps), and the last
    # step, which has no room to draft
    assert kept.plain_steps <= 4 and kept.verification_steps > kept.plain_steps


@pytest.mark.parametrize("architecture, draft_vocab_size", [("llama", 0), ("llama", 24), ("mistral", 0), ("gemma2", 24)])
def test_draft_pass_predicts_what_a_real_draft_proposes_first(architecture, draft_vocab_size):
    """Row j of the masked pass is the draft after j + 1 committed tokens, reading the full
    model's KV for all of them, exactly like the first token of a real draft there."""
    model = _sharp(architecture)
    params = resolve_params(
        NUM_LAYERS, {"attn_skip_layers": [1, 3], "mlp_skip_layers": [2], "draft_vocab_size": draft_vocab_size}
    )
    prompt = _prepared(model, 9, seed=7)
    data = teacher_force(model, prompt, NEW_TOKENS)
    predicted = draft_predictions(model, data, params)
    tokens, confidence = predicted.tokens, predicted.confidence
    assert len(tokens) == len(prompt.reference_tokens) - 1
    selector = TokenSelector(LogitsProcessorList(), do_sample=False)
    cache = DraftAwareCache(model.config)
    decoder = SkippingDecoder(model, params.attn_skip_layers, params.mlp_skip_layers)
    # One drafter throughout, first asked after one committed token: a restricted head picks its
    # rows then, from the text so far, as in a real decode.
    drafter = LayerSkipDrafter(model, cache, decoder, draft_vocab_size)
    kv_length = 0
    for committed in (1, 5, 12, len(prompt.reference_tokens) - 1):
        length = data.prompt_length + committed
        with torch.no_grad():
            # The cache grows as a decode's does (a windowed one cannot start over).
            model(input_ids=data.full_text[None, kv_length : length - 1], **cache_keyword(cache), use_cache=True,
                  position_ids=torch.arange(kv_length, length - 1)[None])
            kv_length = length - 1
            sequence = torch.zeros((1, length + 1), dtype=torch.long)
            sequence[0, :length] = data.full_text[:length]
            state = DecodingState(sequence, torch.arange(length + 1)[None], length)
            draft = drafter.propose(state, 1, ExitPolicy(0.0), selector)
            cache.rollback(kv_length)
        assert draft.tokens[0] == tokens[committed - 1], committed
        assert float(draft.distributions[0].max()) == pytest.approx(confidence[committed - 1], rel=1e-4)


def test_attention_a_hand_built_mask_cannot_express_is_refused_with_the_reason():
    model = tiny_model("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="objective = \"estimated\" needs attn_implementation 'eager' or 'sdpa'"):
        check_supported(model)


@pytest.mark.parametrize(
    "line, message",
    [
        ('objective = "fastest"', "study.objective: must be one of measured, estimated"),
        ("confirm_top = -1", "study.confirm_top: must be at least 0"),
    ],
)
def test_bad_objective_settings_name_the_key(tmp_path, tiny_llama_dir, line, message):
    path = write_study_config(tmp_path / "bad.toml", tiny_llama_dir, "sqlite://", study=line)
    with pytest.raises(StudyConfigError, match=message):
        load_study_config(path)


def test_estimated_study_confirms_its_best_trials_by_real_decoding(tmp_path, tiny_llama_dir):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    path = write_study_config(
        tmp_path / "study.toml",
        tiny_llama_dir,
        storage,
        strategy="target_confidence_gated",
        max_new_tokens=10,
        study='objective = "estimated"\nconfirm_top = 2',
    )
    outcome = run_tune(load_study_config(path), n_trials=6, show_progress=False)

    estimated = outcome.study.get_trials(states=(TrialState.COMPLETE,))
    assert outcome.study.study_name.endswith(":estimated") and len(estimated) == 6
    assert all(trial.user_attrs["objective"] == "estimated" for trial in estimated)
    top = sorted(estimated, key=lambda trial: trial.value, reverse=True)[:2]
    confirmed = outcome.confirmed.get_trials(states=(TrialState.COMPLETE,))
    assert outcome.confirmed.study_name == outcome.study.study_name.removesuffix(":estimated")
    assert [trial.params for trial in confirmed] == [trial.params for trial in top]
    assert [trial.user_attrs["estimated_speedup"] for trial in confirmed] == [trial.value for trial in top]
    assert "Measured by real decoding" in format_summary(outcome)

    result = export_profile(storage, outcome.export_study.study_name, tmp_path / "export")
    best = max(confirmed, key=lambda trial: trial.value)
    assert result.profile.measured["trial"] == best.number
    assert result.profile.params == decode_params(best.params, "target_confidence_gated", NUM_LAYERS)


def test_a_study_that_spent_its_budget_runs_nothing_and_times_nothing(tmp_path, tiny_llama_dir, monkeypatch):
    path = write_study_config(
        tmp_path / "study.toml",
        tiny_llama_dir,
        f"sqlite:///{tmp_path / 'optuna.db'}",
        max_new_tokens=6,
        study='objective = "estimated"\nconfirm_top = 0\nn_trials = 2',
    )
    first = run_tune(load_study_config(path), show_progress=False)
    assert sum(first.this_run.values()) == 2

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated a cost model for a study with no trials left to run")

    monkeypatch.setattr("hf_selfspec.tuning.tune.calibrate", no_calibration)
    again = run_tune(load_study_config(path), show_progress=False)
    assert sum(again.this_run.values()) == 0
    assert len(again.study.get_trials(states=(TrialState.COMPLETE,))) == 2
