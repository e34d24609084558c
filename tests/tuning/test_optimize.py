"""`hf-selfspec optimize` end to end on the tiny model, its resumption, the ranges it derives from a
model's shape and costs, its refusals, and `tune --model` without a study TOML."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
from types import SimpleNamespace

import optuna
import pytest
from helpers import REPO_ROOT
from helpers.tuning import OPTIMIZE_BUDGET, cli_command, cli_env, sigkill_when
from optuna.trial import TrialState

from hf_selfspec.adapter import read_adapter_shape
from hf_selfspec.cli import main
from hf_selfspec.loading import load_model_and_tokenizer
from hf_selfspec.profiles import read_profiles, read_profiles_file
from hf_selfspec.tuning import budget as budget_module
from hf_selfspec.tuning import optimize as optimize_module
from hf_selfspec.tuning.budget import adapter_plan, adapter_text, corpus_plan
from hf_selfspec.tuning.studies.categories import is_feasible
from hf_selfspec.tuning.studies.config import load_study_config
from hf_selfspec.tuning.default_study import derive_space
from hf_selfspec.tuning.optimize import STAGES, STUDY_FILE, tune_prompts
from hf_selfspec.tuning.optimize_state import STATE_FILE, WORK_DIR, Run

BUDGET = OPTIMIZE_BUDGET



def _optimize(model_dir, output, *extra):
    return main(["optimize", "--model", str(model_dir), "--output", str(output), "--budget", BUDGET, "--no-progress",
                 *map(str, extra)])


def _state(output) -> dict:
    return json.loads((output / WORK_DIR / STATE_FILE).read_text())


@pytest.fixture(scope="module")
def optimized(tiny_llama_dir, tmp_path_factory, one_thread):
    """A run killed in its last stage (an error raised there), then the rerun that finishes it."""
    directory = tmp_path_factory.mktemp("optimize")
    output = directory / "out"
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_SELFSPEC_CACHE", str(directory / "cache"))

    def killed(run):
        raise KeyboardInterrupt  # as a Ctrl-C or a kill would end it, mid-stage

    patch.setattr(optimize_module, "_export", killed)
    interrupted = _optimize(tiny_llama_dir, output)
    state_after_kill = _state(output)
    patch.undo()
    patch.setenv("HF_SELFSPEC_CACHE", str(directory / "cache"))
    yield SimpleNamespace(output=output, interrupted=interrupted, state_after_kill=state_after_kill,
                          model_dir=tiny_llama_dir, patch=patch)
    patch.undo()


@pytest.fixture(scope="module")
def finished(optimized):
    status = _optimize(optimized.model_dir, optimized.output)
    return SimpleNamespace(**vars(optimized), status=status)


def test_a_killed_run_keeps_its_finished_stages(optimized):
    assert optimized.interrupted == 130
    assert list(optimized.state_after_kill["stages"]) == list(STAGES[:-1])
    assert not (optimized.output / "generation_config.json").exists()


def test_the_rerun_finishes_only_what_was_left(finished, monkeypatch, capsys):
    assert finished.status == 0
    state = _state(finished.output)
    assert list(state["stages"]) == list(STAGES)
    # Finished stages kept their records: nothing before export ran again.
    for stage in STAGES[:-1]:
        assert state["stages"][stage] == finished.state_after_kill["stages"][stage]
    assert state["spent_seconds"] > finished.state_after_kill["spent_seconds"]


def test_a_sigkilled_run_resumes_where_it_was_cut(tiny_llama_dir, tmp_path):
    """SIGKILL (no handler runs, as in a power cut) once the adapter stage is recorded, i.e. while
    the study tunes; the rerun keeps every recorded stage and finishes the rest."""
    output, env = tmp_path / "out", cli_env(HF_SELFSPEC_CACHE=str(tmp_path / "cache"))
    command = cli_command("optimize", "--model", tiny_llama_dir, "--output", output, "--budget", BUDGET, "--no-progress")
    recorded: dict = {}

    def adapter_recorded() -> bool:
        nonlocal recorded
        if (output / WORK_DIR / STATE_FILE).is_file():
            recorded = _state(output)["stages"]  # replaced whole, never read half-written
        return "adapter" in recorded

    assert sigkill_when(command, env, adapter_recorded, timeout=300) == -signal.SIGKILL, "it ended before the kill"
    assert list(recorded) == list(STAGES[:3])
    assert not (output / "generation_config.json").exists()

    resumed = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.count("done in an earlier run") == 3
    state = _state(output)
    assert list(state["stages"]) == list(STAGES)
    assert {stage: state["stages"][stage] for stage in recorded} == recorded
    assert (output / "generation_config.json").is_file()


def test_it_writes_a_loadable_profile_and_a_rerunnable_study(finished):
    output = finished.output
    config = output / "generation_config.json"
    profiles = read_profiles_file(config)
    assert list(profiles) == ["cpu/float32"]
    profile = profiles["cpu/float32"]
    assert profile.measured["trial"] == _state(output)["stages"]["confirm"]["winner"]
    assert (output / profile.params["lookup_corpus"]).is_file()  # the corpus travels with the config
    if profile.params["draft_adapter"]:
        assert (output / profile.params["draft_adapter"]).is_file()
    model, _ = load_model_and_tokenizer(str(finished.model_dir), generation_config=config)
    assert read_profiles(model.generation_config)["cpu/float32"].params == profile.params
    study = load_study_config(output / STUDY_FILE)
    assert study.search.lookup_corpus  # the corpus the study tuned with
    assert study.study.objective == "estimated"
    assert study.prompts.source == "workload"


def test_the_held_out_prompts_confirm_the_trial_fastest_on_the_tune_prompts(finished):
    """Chosen before the held-out prompts are decoded, so that their figure is not a best of several."""
    stages = _state(finished.output)["stages"]
    study = optuna.load_study(study_name=stages["tune"]["study"], storage=stages["tune"]["storage"])
    fastest = max((trial for trial in study.get_trials(states=(TrialState.COMPLETE,)) if is_feasible(trial)),
                  key=lambda trial: trial.value)
    confirmed = json.loads((finished.output / WORK_DIR / "confirm.json").read_text())["contenders"]
    assert [row["name"] for row in confirmed if row["name"].startswith("trial ")] == [f"trial {fastest.number}"]
    assert stages["confirm"]["winner"] == fastest.number


def test_a_finished_run_is_not_run_again(finished, monkeypatch, capsys):
    for stage in STAGES:
        monkeypatch.setattr(optimize_module, f"_{stage}", lambda run: pytest.fail("a finished stage ran again"))
    assert _optimize(finished.model_dir, finished.output) == 0
    out = capsys.readouterr().out
    assert out.count("done in an earlier run") == len(STAGES)
    assert "vs lookup" in out and "overall" in out
    # beside the ratio to lookup as transformers runs it, the ratio on equal kernels, a figure
    header = next(line for line in out.splitlines() if "vs lookup" in line)
    overall = next(line for line in out.splitlines() if line.startswith("overall"))
    assert header.rstrip().endswith("vs lookup, equal kernels")
    assert len(overall.split()) == 5 and overall.split()[-1].endswith("x")


def test_a_run_for_another_model_into_the_same_output_is_refused(finished, tmp_path, capsys):
    other = tmp_path / "other-model"
    other.mkdir()
    assert _optimize(other, finished.output) == 2
    assert "another model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--model", "/no/such/model", "--output", "{tmp}/out"], "no such directory"),
        (["--model", "{model}", "--output", "{tmp}/out", "--budget", "0"], "positive number of minutes"),
        (["--model", "{model}", "--output", "{tmp}/file"], "is a file"),
        (["--model", "{model}", "--gguf-file", "none.gguf", "--output", "{tmp}/out"], "none.gguf: no such file"),
    ],
)
def test_bad_inputs_fail_in_one_line(arguments, message, tiny_llama_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    filled = [a.format(tmp=tmp_path, model=tiny_llama_dir) for a in arguments]
    assert main(["optimize", *filled]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_ranges_follow_the_shape_and_the_verification_cost():
    # A device where verifying 16 tokens costs about one (a GPU), and one where it grows linearly.
    flat = {1: 1.0, 2: 1.0, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.6}
    linear = {width: float(width) for width in (1, 2, 4, 8, 16, 32)}
    deep_wide = derive_space(32, 128_000, flat)
    shallow_small = derive_space(6, 4096, linear)
    assert deep_wide.ranges["max_draft_tokens"][1] > shallow_small.ranges["max_draft_tokens"][1]
    assert deep_wide.ranges["prompt_lookup_max_tokens"][1] > shallow_small.ranges["prompt_lookup_max_tokens"][1]
    for space in (deep_wide, shallow_small):  # lookups grow from where they may start, shrink no lower
        assert space.ranges["prompt_lookup_tokens"][1] == space.ranges["prompt_lookup_max_tokens"][0]
        assert space.ranges["prompt_lookup_min_tokens"] == (1, space.ranges["prompt_lookup_tokens"][1])
    # Where a wide verification is cheap, runner-ups fill it beside a drafted token.
    assert deep_wide.ranges["draft_alternatives"] == (0, 14) and shallow_small.ranges["draft_alternatives"] == (0, 0)
    assert deep_wide.ranges["draft_vocab_size"] == (0, 64_000)  # a big head is worth restricting
    assert shallow_small.ranges["draft_vocab_size"] == (0, 0)
    assert len(deep_wide.warm_start_skip_ratios) > len(shallow_small.warm_start_skip_ratios)
    for space in (deep_wide, shallow_small):
        low, high = space.ranges["max_draft_tokens"]
        assert low == 0 < 1 < high  # lookup alone, and drafts of more than one token
    with pytest.raises(ValueError, match="width 1"):
        derive_space(8, 1000, {2: 1.0})


def test_a_costly_step_to_two_tokens_does_not_hide_cheap_wide_verifications():
    # A CPU whose matrix kernel changes between one token and two: two cost twice one, and every
    # width after that comes nearly free, so long lookups pay where a draft is taken whole.
    kernel_change = {1: 1.0, 2: 1.96, 4: 2.15, 8: 2.2, 16: 2.5, 32: 3.25}
    space = derive_space(18, 262_144, kernel_change)
    assert space.ranges["max_draft_tokens"] == (0, 16)
    assert space.ranges["prompt_lookup_tokens"] == (1, 10) and space.ranges["prompt_lookup_max_tokens"] == (10, 31)
    # Where each added token costs more than half of one, the reach stops there.
    steep = {1: 1.0, 2: 1.9, 4: 2.2, 8: 5.0, 16: 9.0, 32: 17.0}
    assert derive_space(18, 262_144, steep).ranges["prompt_lookup_max_tokens"] == (1, 3)


def test_the_tune_stage_judges_trials_on_as_many_prompts_as_its_time_pays_for():
    from hf_selfspec.tuning.default_study import default_prompts

    workload = default_prompts(None)
    # Eight categories, six decodes a prompt, half of the stage: 10 s decodes pay for one prompt
    # a category in 960 s, for two in twice that, and no more than the split's six however long.
    assert tune_prompts(workload, 960, 10).per_category == 1
    assert tune_prompts(workload, 1920, 10).per_category == 2
    assert tune_prompts(workload, 10**6, 10).per_category == 6
    assert tune_prompts(workload, 1, 10).per_category == 1  # never none
    a_file = dataclasses.replace(workload, source="prompts.jsonl", per_category=None, n_prompts=5)
    assert tune_prompts(a_file, 10**6, 10) == a_file  # its own selection, as the user asked


def test_a_base_model_without_a_chat_template_gets_a_corpus(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, base)
    for template in base.glob("chat_template*"):
        template.unlink()
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(base)
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache"))

    def stop(run):
        raise KeyboardInterrupt  # the stages after the corpus are tested on the chat model

    monkeypatch.setattr(optimize_module, "_adapter", stop)
    assert _optimize(base, tmp_path / "out") == 130
    state = _state(tmp_path / "out")["stages"]
    assert state["measure"]["chat"] is False
    table = state["corpus"]["table"]
    assert "self_prompted" not in table and table["stdlib_prompts"] > 0
    assert (tmp_path / "out" / WORK_DIR / "lookup-corpus.safetensors").is_file()



# A verification of 32 tokens costing two of one: a batch of rows writes far faster than one text.
FLAT = {1: 0.01, 8: 0.012, 32: 0.02}


def test_budgets_size_the_corpus_and_the_adapter():
    small, large = corpus_plan(10, FLAT, 1e-4), corpus_plan(200, FLAT, 1e-4)
    assert small["self_prompted"] >= 1 and large["self_prompted"] > small["self_prompted"]
    assert large["stdlib_functions"] > small["stdlib_functions"]
    # A base model cannot be prompted into a conversation: it continues standard-library text instead.
    base = corpus_plan(200, FLAT, 1e-4, chat=False)
    assert "self_prompted" not in base and base["stdlib_prompts"] > 0 and base["generated_tokens"] > 0
    assert base["stdlib_functions"] == large["stdlib_functions"]


def test_the_corpus_is_written_in_batches_and_planned_so():
    """Rows side by side cost a step priced as a verification of as many tokens, so a batch of
    requests costs little more than one where wide verifications are flat: the corpus's seconds
    buy many more requests than one text at a time would, and each half fits its seconds."""
    assert budget_module.batch_step_seconds(5, FLAT) == FLAT[8]
    assert budget_module.batch_step_seconds(64, FLAT) == 2 * FLAT[32]
    plan = corpus_plan(8, FLAT, 1e-4)  # 4 seconds for each half
    one_at_a_time = 4 / (FLAT[1] * (budget_module.ANSWER_TOKENS + 4 * budget_module.REQUEST_TOKENS))
    assert plan["self_prompted"] > 4 * one_at_a_time

    def functions(count: int) -> float:
        return budget_module.writing_seconds(count, budget_module.CONTINUATION_TOKENS, FLAT, 1e-4)

    assert functions(plan["stdlib_functions"]) <= 4 < functions(plan["stdlib_functions"] + 1)
    # No more than a batch of each, however long the corpus has.
    long = corpus_plan(3600, FLAT, 1e-4)
    assert long["self_prompted"] == budget_module.GENERATION_BATCH // budget_module.CANDIDATES_PER_REQUEST
    assert long["stdlib_functions"] == budget_module.GENERATION_BATCH


def test_the_sampled_requests_pay_for_choosing_their_tokens():
    """Sampling at a top-p below one sorts each row's vocabulary every step: where that choice
    costs as much as the batch's step, fewer requests fit the same seconds, and the ones that fit
    still fit once their choice is counted; greedy continuations choose by argmax and are not
    charged."""
    free, priced = corpus_plan(8, FLAT, 1e-4), corpus_plan(8, FLAT, 1e-4, sampled_row_choice=FLAT[32] / 8)
    assert 1 <= priced["self_prompted"] < free["self_prompted"]
    assert priced["stdlib_functions"] == free["stdlib_functions"]
    requests = priced["self_prompted"]
    candidates = budget_module.CANDIDATES_PER_REQUEST * requests
    spent = (budget_module.writing_seconds(candidates, budget_module.REQUEST_TOKENS, FLAT, 1e-4, FLAT[32] / 8)
             + budget_module.writing_seconds(requests, budget_module.ANSWER_TOKENS, FLAT, 1e-4))
    assert spent <= 4
    assert (budget_module.writing_seconds(8, 10, FLAT, 0.0, 0.5)
            == budget_module.writing_seconds(8, 10, FLAT, 0.0) + 8 * 10 * 0.5)


def test_the_adapter_text_of_a_chat_model_is_half_reference_answers():
    small, large = adapter_text(10, 0.5), adapter_text(600, 0.5)
    assert 0 < small["stdlib_tokens"] < large["stdlib_tokens"]
    passage_tokens = large["reference_passages"] * budget_module.REFERENCE_ANSWER_TOKENS
    assert 0 < passage_tokens <= large["stdlib_tokens"] < passage_tokens + 2 * budget_module.REFERENCE_ANSWER_TOKENS
    assert large["stdlib_tokens"] + passage_tokens <= budget_module._MAX_ADAPTER_TEXT_TOKENS
    # A base model's drafts continue text, not answer a chat: all of it is code.
    assert adapter_text(600, 0.5, chat=False) == {"stdlib_tokens": large["stdlib_tokens"] + passage_tokens}


def test_tune_with_a_model_and_no_study_file(tiny_llama_dir, tmp_path, capsys, one_thread):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    status = main(["tune", "--model", str(tiny_llama_dir), "--storage", storage, "--n-trials", "2", "--no-progress",
                   "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"default:{tiny_llama_dir.name}" in out and "best estimate" in out


def test_tune_needs_a_study_or_a_model(capsys):
    assert main(["tune"]) == 2
    assert "--model" in capsys.readouterr().err


def test_a_trained_adapter_makes_a_kangaroo_study(tiny_llama_dir, tmp_path, monkeypatch, one_thread):
    """Where the budget pays for training (here: the floor lowered, and the stage's share fixed so
    that a slow machine cannot spend it in the stages before), the adapter stage trains draft
    heads and the study drafts with them, no further than they have heads; stopped before
    confirming, to stay short."""
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache"))
    share = Run.share
    monkeypatch.setattr(Run, "share",
                        lambda run, stage: 60.0 if stage == "adapter" else share(run, stage))
    monkeypatch.setattr(budget_module, "MIN_ADAPTER_STEPS", 1)
    monkeypatch.setattr(budget_module, "_MAX_ADAPTER_STEPS", 2)
    monkeypatch.setattr(budget_module, "_MAX_ADAPTER_TEXT_TOKENS", 2048)

    def stop(run):
        raise KeyboardInterrupt

    monkeypatch.setattr(optimize_module, "_confirm", stop)
    assert _optimize(tiny_llama_dir, tmp_path / "out") == 130
    stages = _state(tmp_path / "out")["stages"]
    assert list(stages["adapter"]["agreement"]) == ["draft-heads"]
    assert read_adapter_shape(stages["adapter"]["adapters"]["draft-heads"]).heads == optimize_module.DRAFT_HEADS
    study = load_study_config(tmp_path / "out" / STUDY_FILE)
    assert study.search.strategy == "kangaroo"
    assert list(study.search.draft_adapters.values()) == list(stages["adapter"]["adapters"].values())
    assert study.search.range_of("max_draft_tokens") == (0, optimize_module.DRAFT_HEADS)


def test_a_corpus_without_two_chunks_skips_the_adapter_and_says_why(tiny_llama_dir, tmp_path, monkeypatch, one_thread):
    """Nothing to train on and measure with is a skipped stage, not a traceback from the trainer,
    and it leaves no training config behind that would train nothing."""
    import torch

    from hf_selfspec.tuning.training import train_adapter

    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(train_adapter, "training_chunks", lambda *args: torch.zeros((1, 256), dtype=torch.long))

    def stop(run):
        raise KeyboardInterrupt

    monkeypatch.setattr(optimize_module, "_tune", stop)
    assert _optimize(tiny_llama_dir, tmp_path / "out") == 130
    adapter = _state(tmp_path / "out")["stages"]["adapter"]
    assert adapter["adapters"] == {} and "1 chunk(s)" in adapter["reason"]
    assert not (tmp_path / "out" / "work" / "train-adapter.toml").exists()



def test_on_request_streams_it_tunes_the_online_corpus_and_ships_what_it_learned(tiny_llama_dir, tmp_path,
                                                                                 monkeypatch, one_thread):
    """Trials choose whether to learn across the streams; the winner's profile names the corpus
    its trial learned where it learned with one, and the file is beside the config."""
    from hf_selfspec.prompts import streams_path
    from hf_selfspec.tuning.studies.space import uses_online_corpus
    import optuna

    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache"))
    output = tmp_path / "out"
    assert _optimize(tiny_llama_dir, output, "--prompts", streams_path()) == 0
    study = load_study_config(output / STUDY_FILE)
    assert study.search.online_corpus == (False, True)
    assert study.prompts.per_category >= 1 and study.search.ranges["online_corpus_min_context"] == (1, 12)
    tuned = _state(output)["stages"]["tune"]
    trials = optuna.load_study(study_name=tuned["study"], storage=tuned["storage"]).get_trials()
    assert any(uses_online_corpus(trial.params) for trial in trials)
    profile = read_profiles_file(output / "generation_config.json")["cpu/float32"]
    winner = next(t for t in trials if t.number == profile.measured["trial"])
    assert bool(profile.params["online_corpus_file"]) == uses_online_corpus(winner.params)
    if profile.params["online_corpus_file"]:
        assert (output / profile.params["online_corpus_file"]).is_file()


def test_where_runner_ups_are_searched_a_warm_start_verifies_the_widest():
    from hf_selfspec.tuning.studies.config import SearchConfig
    from hf_selfspec.tuning.studies.space import warm_start_trials

    ranges = {"max_draft_tokens": (0, 1), "draft_alternatives": (0, 14)}
    search = SearchConfig(strategy="kangaroo", ranges=ranges, draft_adapters={"draft-heads": "draft-heads.safetensors"})
    trials = warm_start_trials(search, num_layers=4)
    assert [(t["max_draft_tokens"], t["draft_alternatives"]) for t in trials] == [(1, 0), (0, 0), (1, 14)]
    narrow = dataclasses.replace(search, ranges={"max_draft_tokens": (0, 1)})
    assert [t["draft_alternatives"] for t in warm_start_trials(narrow, num_layers=4)] == [0, 0]
