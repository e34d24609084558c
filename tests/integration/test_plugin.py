"""How users attach the plugin: subclassing, enable(), the registry, and real layer skipping."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteriaList
from transformers.generation.stopping_criteria import ConfidenceCriteria

import hf_selfspec
from hf_selfspec import ExitPolicy, SelfSpecMixin, Strategy
from helpers.tiny_models import tiny_model

PROMPT = torch.tensor([[5, 6, 7, 8]])


class MyLlama(SelfSpecMixin, LlamaForCausalLM):
    pass


def test_subclassing_the_mixin_works():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1)
    model = MyLlama(config).eval()
    plain = model.generate(PROMPT, max_new_tokens=12, do_sample=False)
    ours = model.generate(PROMPT, max_new_tokens=12, do_sample=False, strategy="self_speculative",
                          attn_skip_layers=[1], mlp_skip_layers=[])
    assert ours.tolist() == plain.tolist()


def test_enable_swaps_the_class_in_place_and_caches_it():
    first, second = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                                 num_attention_heads=2, vocab_size=64)), None
    second = LlamaForCausalLM(first.config)
    enabled = hf_selfspec.enable(first)
    assert enabled is first and isinstance(first, LlamaForCausalLM) and isinstance(first, SelfSpecMixin)
    assert type(hf_selfspec.enable(second)) is type(first)
    assert hf_selfspec.enable(first) is first


def test_without_strategy_generate_is_plain_transformers():
    model = tiny_model("qwen3")
    output = model.generate(PROMPT, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert type(output).__name__ == "GenerateDecoderOnlyOutput"


def test_user_strategy_registers_and_instances_are_accepted():
    built = []

    @hf_selfspec.register_strategy("one_token_drafts")
    class OneTokenDrafts(Strategy):
        def build_exit_policy(self, params):
            built.append(params)
            return ExitPolicy(threshold=1.0)  # every draft token trips the exit: drafts of one

    assert "one_token_drafts" in hf_selfspec.available_strategies()
    model = tiny_model("llama", initializer_range=0.3)
    plain = model.generate(PROMPT, max_new_tokens=15, do_sample=False)
    for strategy in ("one_token_drafts", OneTokenDrafts()):
        output = model.generate(PROMPT, max_new_tokens=15, do_sample=False, strategy=strategy,
                                return_dict_in_generate=True, attn_skip_layers=[], mlp_skip_layers=[])
        assert output.sequences.tolist() == plain.tolist()
        assert set(output.strategy_stats.accepted_lengths) == {1}
    assert len(built) == 2


def test_skipped_sublayers_do_not_run_while_drafting():
    model = tiny_model("llama", initializer_range=0.3)
    calls = {}
    hooks = [
        module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
        for name, module in [
            ("skipped_attn", model.model.layers[2].self_attn.q_proj),
            ("skipped_mlp", model.model.layers[3].mlp.up_proj),
            ("skipped_layer_norm", model.model.layers[1].input_layernorm),
            ("kept_attn", model.model.layers[0].self_attn.q_proj),
        ]
    ]
    try:
        output = model.generate(PROMPT, max_new_tokens=20, do_sample=False, strategy="self_speculative",
                                attn_skip_layers=[1, 2], mlp_skip_layers=[1, 3], draft_exit_threshold=0.0,
                                return_dict_in_generate=True)
    finally:
        for hook in hooks:
            hook.remove()
    stats = output.strategy_stats
    full_forwards = 1 + stats.verification_steps + stats.plain_steps  # prefill + verifications
    draft_forwards = calls["kept_attn"] - full_forwards
    assert draft_forwards > 0
    assert calls["skipped_attn"] == calls["skipped_mlp"] == calls["skipped_layer_norm"] == full_forwards


def test_strategy_stats_accumulate_counts_not_rates():
    total = hf_selfspec.StrategyStats(drafted_tokens=4, accepted_tokens=4, verification_steps=1, accepted_lengths=[4])
    total.add(hf_selfspec.StrategyStats(drafted_tokens=6, accepted_tokens=0, verification_steps=2,
                                        accepted_lengths=[0, 0]))
    assert total.acceptance_rate == 0.4  # 4 of 10 drafted, not the mean of 100% and 0%
    assert total.mean_accepted_length == 4 / 3
    assert total.verification_steps == 3


def test_a_stopping_criterion_that_reads_scores_stops_where_plain_stops():
    model = tiny_model("llama", initializer_range=0.3)
    kept = dict(max_new_tokens=24, do_sample=False, return_dict_in_generate=True, output_scores=True)
    full = model.generate(PROMPT, **kept)
    new_tokens = full.sequences[0, PROMPT.shape[1]:]
    chosen = [float(scores[0].softmax(-1)[token]) for scores, token in zip(full.scores, new_tokens)][:16]
    lowest, next_lowest = sorted(chosen)[:2]
    # The newest token's probability falls under this first at the least likely of the first 16.
    criterion = ConfidenceCriteria((lowest + next_lowest) / 2)
    stops = dict(kept, stopping_criteria=StoppingCriteriaList([criterion]))
    plain = model.generate(PROMPT, **stops)
    ours = model.generate(PROMPT, **stops, strategy="self_speculative", attn_skip_layers=[1], mlp_skip_layers=[])
    assert plain.sequences.shape[1] == PROMPT.shape[1] + chosen.index(lowest) + 1
    assert ours.sequences.tolist() == plain.sequences.tolist()
    assert ours.strategy_stats.drafted_tokens > 0


def test_a_prompt_on_another_device_than_the_model_moves_there_and_the_output_back():
    """Plain decoding takes a CPU prompt for a GPU model and returns CPU tensors; our loop runs
    where the model is. No second device here, so the meta device stands in for the GPU."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    from hf_selfspec.mixin import output_on_device, prompt_on_device

    gpu = torch.device("meta")
    mask = torch.ones_like(PROMPT)
    args, kwargs, caller = prompt_on_device(gpu, (PROMPT,), {"attention_mask": mask, "max_new_tokens": 4})
    assert caller == torch.device("cpu")
    assert args[0].device == gpu and kwargs["attention_mask"].device == gpu and kwargs["max_new_tokens"] == 4
    args, kwargs, caller = prompt_on_device(gpu, (), {"input_ids": PROMPT})
    assert caller == torch.device("cpu") and kwargs["input_ids"].device == gpu
    same = {"input_ids": PROMPT, "attention_mask": mask}
    assert prompt_on_device(torch.device("cpu"), (), same) == ((), same, None)

    output = GenerateDecoderOnlyOutput(sequences=PROMPT, scores=(torch.zeros(1, 8),), logits=None)
    moved = output_on_device(output, gpu)
    assert moved.sequences.device == gpu and moved.scores[0].device == gpu and moved.logits is None
    assert output_on_device(PROMPT, gpu).device == gpu
    assert output_on_device(PROMPT, None) is PROMPT


def test_a_pipeline_takes_an_enabled_model_silently(tiny_llama_dir, capfd):
    """transformers' pipelines check a model's class name against their task's models; an enabled
    model keeps its class's name, so nothing is logged or printed, as for the original model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    from transformers.utils import logging as transformers_logging

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    transformers_logging.set_verbosity_info()  # anything logged at all would show
    try:
        capfd.readouterr()
        model = hf_selfspec.enable(AutoModelForCausalLM.from_pretrained(tiny_llama_dir))
        capfd.readouterr()  # loading's own progress output
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
        output = generator("def add(a, b):", max_new_tokens=6, do_sample=False, strategy="self_speculative",
                           attn_skip_layers=[1], mlp_skip_layers=[], return_full_text=False)
        printed = capfd.readouterr()
    finally:
        transformers_logging.set_verbosity_warning()
    assert isinstance(output[0]["generated_text"], str)
    assert (printed.out, printed.err) == ("", "")
    assert type(model).__name__ == "LlamaForCausalLM" and isinstance(model, SelfSpecMixin)
