"""`optimize` and the quickstart on a model that decodes as slowly as one of billions of parameters
on two cores: the tiny model, its every decoder layer advancing a simulated clock, which every
timing, every budget and every progress line reads. Each stage must be sized from that clock,
skip what cannot pay back and say why, stay within the budget, and never leave the output silent
for more than 30 of its seconds."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import tomllib
from types import SimpleNamespace

import pytest

from hf_selfspec import measure as measure_module
from hf_selfspec import tuner_api
from hf_selfspec.cli import main
from hf_selfspec.tuning import optimize as optimize_module
from hf_selfspec.tuning import progress, quickstart
from hf_selfspec.tuning.budget import (
    MIN_STUDY_PROMPTS, StepCosts, confirm_prompts, corpus_plan, plan_study, plan_tune, tune_costs,
)
from hf_selfspec.tuning.optimize_state import STATE_FILE, WORK_DIR
from hf_selfspec.tuning.studies.config import SearchConfig
from hf_selfspec.tuning.studies.toml_reader import ModelConfig

SILENCE = 30.0


class SimulatedClock:
    """Seconds that pass only when the model computes; each advance lets a progress line fall due."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
        progress.beat()


class StampedOutput(io.TextIOBase):
    """Standard output, each line kept with the simulated second it was printed at."""

    def __init__(self, clock: SimulatedClock) -> None:
        self.clock, self.lines, self.pending = clock, [], ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            self.lines.append((self.clock(), line))
        return len(text)

    def longest_silence(self, start: float) -> float:
        stamps = [start, *(stamp for stamp, _ in self.lines), self.clock()]
        return max(later - earlier for earlier, later in zip(stamps, stamps[1:]))

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _slowed(model, clock: SimulatedClock, seconds_per_token: float):
    """`model`, each decoder layer's pass advancing `clock` as a plain step's share of
    `seconds_per_token`, growing with the tokens it processes (a verification of 64 costs two steps)."""
    layers = tuner_api.decoder_layers(model)

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        clock.advance(seconds_per_token / len(layers) * (1 + hidden.shape[0] * hidden.shape[1] / 64))

    for layer in layers:
        layer.register_forward_pre_hook(hook, with_kwargs=True)
    return model


@pytest.fixture
def slow_machine(monkeypatch, tmp_path):
    """Every model the tuner loads decodes at the test's pace on a simulated clock, and what the
    test runs in `stamped` prints to standard output is stamped with it."""
    clock = SimulatedClock()
    monkeypatch.setattr(progress, "clock", clock)
    monkeypatch.setattr(measure_module, "time", SimpleNamespace(perf_counter=clock))
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = StampedOutput(clock)
    pace = SimpleNamespace(seconds_per_token=1.0)
    load = ModelConfig.load

    def slow_load(self):
        model, tokenizer = load(self)
        return _slowed(model, clock, pace.seconds_per_token), tokenizer

    monkeypatch.setattr(ModelConfig, "load", slow_load)
    return SimpleNamespace(clock=clock, out=out, pace=pace, stamped=lambda: contextlib.redirect_stdout(out),
                           slowed=lambda model: _slowed(model, clock, pace.seconds_per_token))


def _optimize(model_dir, output, minutes: float, machine) -> int:
    with machine.stamped():
        return main(["optimize", "--model", str(model_dir), "--output", str(output), "--budget", str(minutes),
                 "--no-progress"])


def test_a_model_too_slow_for_its_budget_stops_once_measured_and_says_why(tiny_llama_dir, tmp_path, slow_machine,
                                                                        capsys, one_thread):
    """At three seconds a token, 30 minutes pay for no study even of the fewest prompts alone: the
    run stops as soon as the model is measured, in one line saying why, not after a corpus the
    study could never use."""
    slow_machine.pace.seconds_per_token = 3.0
    status = _optimize(tiny_llama_dir, tmp_path / "out", 30, slow_machine)
    out = slow_machine.out
    assert status == 2
    stages = json.loads((tmp_path / "out" / WORK_DIR / STATE_FILE).read_text())["stages"]
    assert set(stages) == {"measure"}
    err = capsys.readouterr().err
    assert f"a study of {MIN_STUDY_PROMPTS} prompt(s) needs at least" in err and "--budget" in err
    assert slow_machine.clock() <= 0.2 * 30 * 60  # the measure stage, not the budget
    assert out.longest_silence(0.0) <= SILENCE, out.text


def test_a_model_too_slow_for_a_prompt_of_every_kind_is_tuned_on_fewer(tiny_llama_dir, tmp_path, slow_machine,
                                                                       monkeypatch, one_thread):
    """At a second a token, 30 minutes pay for no study of the workload's eight tune prompts, one
    per category, but for one of the first few: the run says so, tunes on those and writes a
    profile within its budget."""
    monkeypatch.setattr(optimize_module, "_MAX_TRIALS", 2)
    status = _optimize(tiny_llama_dir, tmp_path / "out", 30, slow_machine)
    out = slow_machine.out
    assert status == 0, out.text
    (said,) = [line for _, line in out.lines if "a study of all 8 tune prompts does not fit" in line]
    taken = int(said.rsplit(" ", 1)[1])
    assert MIN_STUDY_PROMPTS <= taken < 8
    study = tomllib.loads((tmp_path / "out" / optimize_module.STUDY_FILE).read_text())
    assert study["prompts"]["n_prompts"] == taken
    assert (tmp_path / "out" / "generation_config.json").is_file()
    assert slow_machine.clock() <= 30 * 60
    assert out.longest_silence(0.0) <= SILENCE, out.text


def test_a_study_that_fits_only_alone_skips_the_corpus_and_the_adapter_for_it(tiny_llama_dir, tmp_path, slow_machine,
                                                                               monkeypatch, one_thread):
    """Where the study fits the time left only without a corpus and an adapter, both are skipped in
    a line saying so, and the study gets their time."""
    def plan_tune_needing(seconds, *args, **kwargs):
        return plan_tune(seconds, *args, **kwargs) if seconds > 0.7 * 30 * 60 else "skipped: too little time"

    monkeypatch.setattr(optimize_module, "plan_tune", plan_tune_needing)
    monkeypatch.setattr(optimize_module, "_MAX_TRIALS", 2)
    slow_machine.pace.seconds_per_token = 0.1
    _optimize(tiny_llama_dir, tmp_path / "out", 30, slow_machine)
    stages = json.loads((tmp_path / "out" / WORK_DIR / STATE_FILE).read_text())["stages"]
    assert "only without a corpus and an adapter" in stages["corpus"]["reason"]
    assert "no corpus" in stages["adapter"]["reason"]
    assert "tune" in stages


def test_a_slow_model_is_optimized_within_its_budget_and_never_silent(tiny_llama_dir, tmp_path, slow_machine,
                                                                       monkeypatch, one_thread):
    """At a tenth of a second a token, in 15 minutes, every stage runs, sized to the clock, and the profile is
    written before the budget runs out (a few trials stand for the many the window pays for)."""
    from hf_selfspec.tuning.training import training

    monkeypatch.setattr(optimize_module, "_MAX_TRIALS", 6)
    slow_machine.pace.seconds_per_token = 0.1
    # The adapter in training is a copy of a layer the clock does not watch: a step over a batch
    # of four chunks is priced as the model's forward pass over them would be, and paid at once.
    step = 0.1 * (1 + 4 * 256 / 64)
    monkeypatch.setattr(training, "time_training_step", lambda *args: step)
    status = _optimize(tiny_llama_dir, tmp_path / "out", 15, slow_machine)
    out = slow_machine.out
    assert status == 0, out.text
    assert (tmp_path / "out" / "generation_config.json").is_file()
    assert slow_machine.clock() <= 15 * 60
    assert out.longest_silence(0.0) <= SILENCE, out.text
    assert "left" in out.text  # the lines say how long is left where the work is counted or planned


def test_the_quickstart_says_how_long_it_takes_and_is_never_silent(tiny_llama_dir, tmp_path, slow_machine,
                                                                    monkeypatch, one_thread):
    """The quickstart's stages on the tiny model at a tenth of a second a token: it says how long
    it will take before it starts, and takes about that, with a line at least every 30 seconds."""
    config = dataclasses.replace(
        quickstart.QUICKSTART_CONFIG, model=ModelConfig(str(tiny_llama_dir)), search=SearchConfig()
    )
    monkeypatch.setattr(quickstart, "QUICKSTART_CONFIG", config)
    loader = tuner_api.load_model_and_tokenizer

    def load_tiny(name=None, *args, generation_config=None, **kwargs):
        model, tokenizer = loader(str(tiny_llama_dir), generation_config=generation_config)
        return slow_machine.slowed(model), tokenizer

    monkeypatch.setattr(tuner_api, "load_model_and_tokenizer", load_tiny)
    monkeypatch.setattr(tuner_api, "load_embedded", lambda: load_tiny(generation_config=None))
    slow_machine.pace.seconds_per_token = 0.1
    with slow_machine.stamped():
        status = quickstart.run_quickstart(tmp_path / "out", 40, f"sqlite:///{tmp_path / 'optuna.db'}", False)
    out = slow_machine.out
    assert status == 0, out.text
    (said,) = [line for _, line in out.lines if "the quickstart takes about" in line]
    assert out.lines.index(next(entry for entry in out.lines if entry[1] == said)) < 3
    assert slow_machine.clock() <= quickstart.QUICKSTART_SECONDS * 1.2
    assert out.longest_silence(0.0) <= SILENCE, out.text


def test_a_study_that_cannot_pay_back_is_skipped_with_its_reason():
    big = StepCosts(step=1.0, widest=2.4)  # a second a token, 32 tokens verified in 2.4 steps
    reason = plan_tune(20 * 60, big, prompts=8, confirm_top=2)
    assert isinstance(reason, str) and reason.startswith("skipped") and "--budget" in reason
    plan = plan_tune(3 * 60 * 60, big, prompts=8, confirm_top=2)
    assert plan.least <= 3 * 60 * 60 and plan.max_new_tokens == 64
    # A tighter budget buys a smaller study before none: fewer new tokens, fewer timing rounds.
    tight = plan_tune(plan.least * 0.8, big, prompts=8, confirm_top=2)
    assert not isinstance(tight, str)
    assert (tight.max_new_tokens, tight.calibration_rounds) < (plan.max_new_tokens, plan.calibration_rounds)
    # Costs grow with the step: the same study at a tenth of the step costs a tenth.
    small = tune_costs(StepCosts(0.1, 0.24), 8, 64, 7, 2, 1)
    assert small.least == pytest.approx(tune_costs(big, 8, 64, 7, 2, 1).least / 10)


def test_a_study_too_large_for_its_time_takes_fewer_prompts_before_none():
    big = StepCosts(step=1.0, widest=2.4, prefill=4.0)
    everything = plan_tune(3 * 60 * 60, big, prompts=8, confirm_top=2)
    assert plan_study(3 * 60 * 60, big, 8, 2) == (8, everything)
    least = {count: tune_costs(big, count, 32, 3, 2, 1).least for count in (8, 4, 3, 2)}
    assert least[2] < least[3] < least[4] < least[8]
    assert plan_study((least[4] + least[8]) / 2, big, 8, 2)[0] == 4
    assert plan_study((least[2] + least[4]) / 2, big, 8, 2)[0] == 2
    assert plan_study((least[2] + least[3]) / 2, big, 3, 2)[0] == 2
    reason = plan_study(least[2] * 0.9, big, 8, 2)
    assert isinstance(reason, str) and f"a study of {MIN_STUDY_PROMPTS} prompt(s)" in reason and "--budget" in reason


def test_a_corpus_that_cannot_pay_back_is_skipped_with_its_reason():
    reason = corpus_plan(270, {1: 1.0, 32: 1.5}, 0.01)
    assert reason.startswith("skipped") and "--budget" in reason
    assert corpus_plan(270, {1: 0.01, 32: 0.015}, 0.001)["self_prompted"] >= 1


@pytest.mark.parametrize("seconds_per_token", [0.005, 0.02, 0.05, 0.15])
def test_the_quickstart_fits_its_time_wherever_its_study_can(seconds_per_token):
    """A fast machine and a slow float32-only one alike (the embedded model's step there is a
    tenth of a second and more): the plan, demo included, fits."""
    costs = StepCosts(seconds_per_token, 2 * seconds_per_token)
    plan = quickstart.quickstart_plan(costs)
    assert plan.total <= quickstart.QUICKSTART_SECONDS
    assert plan.trial_seconds > 0
    assert plan.config.prompts.n_prompts == plan.size.prompts
    assert plan.config.study.confirm_top == plan.size.confirm_top


def test_a_slower_machine_gets_a_smaller_quickstart_and_the_slowest_the_smallest():
    sizes = [quickstart.quickstart_plan(StepCosts(step, 2 * step)).size for step in (0.005, 0.05, 0.1, 0.15, 1.0)]
    order = [quickstart.QUICKSTART_SIZES.index(size) for size in sizes]
    assert order == sorted(order) and order[0] == 0
    assert sizes[-1] == quickstart.QUICKSTART_SIZES[-1]
    # too slow for even the smallest: that one, which then takes longer than asked
    assert quickstart.quickstart_plan(StepCosts(1.0, 2.0)).total > quickstart.QUICKSTART_SECONDS


def test_a_plain_step_is_timed_apart_from_its_prompts_prefill(tiny_llama_dir, slow_machine, one_thread):
    """On the simulated clock a forward pass over n tokens costs (1 + n/64) tenths of a second: a
    step of one token, and a prefill of the prompt's length, which a per-token price over a
    short decode would have spread over its few tokens."""
    from hf_selfspec.tuning.default_study import time_plain_step

    model, tokenizer = tuner_api.load_model_and_tokenizer(str(tiny_llama_dir))
    slow_machine.pace.seconds_per_token = 0.1
    prompt = quickstart.demo_prompt()
    step, prefill = time_plain_step(slow_machine.slowed(model), tokenizer, prompt)
    prompt_tokens = tuner_api.encode_prompt(tokenizer, prompt)["input_ids"].shape[1]
    assert step == pytest.approx(0.1 * (1 + 1 / 64))
    assert prefill == pytest.approx(0.1 * (1 + prompt_tokens / 64) - step, rel=1e-6)
    costs = StepCosts.of(step, {1: step, 32: 2 * step}, prefill)
    assert costs.decode(32) == pytest.approx(prefill + 32 * step)


def test_a_step_timed_below_a_one_token_forward_pass_is_priced_as_that_pass():
    """Jitter on a shared host can make the difference of two timed decodes smaller than one
    forward pass; sized from it, every stage would overrun."""
    costs = StepCosts.of(0.44, {"1": 0.66, "32": 1.4}, prefill=6.9)  # as read back from optimize.json
    assert (costs.step, costs.widest, costs.prefill) == (0.66, 1.4, 6.9)
    assert StepCosts.of(0.8, {1: 0.66, 32: 1.4}).step == 0.8


def test_a_confirmation_pays_its_warm_ups_once_and_then_as_many_prompts_as_fit():
    costs = StepCosts(step=1.0, widest=2.4, prefill=4.0)
    decode = costs.decode(64)
    warm_ups, per_prompt = 4, 5  # four contenders; a reference and one decode by each a prompt
    for prompts in (1, 2, 3):
        seconds = (warm_ups + per_prompt * (prompts + 0.5)) * decode
        count, said = confirm_prompts(seconds, costs, warm_ups, per_prompt, 64, categories=8, most_per_category=4)
        assert count == prompts and said.startswith(f"{prompts} held-out prompt(s)")
    count, said = confirm_prompts(1e9, costs, warm_ups, per_prompt, 64, categories=8, most_per_category=4)
    assert count == 32  # four of each category at most
    count, said = confirm_prompts((warm_ups + per_prompt) * decode * 0.99, costs, warm_ups, per_prompt, 64, 8, 4)
    assert count == 0 and said.startswith("skipped") and "best trial measured on the tune prompts" in said
