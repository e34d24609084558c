"""`hf-selfspec bench`: files, identity flags and errors. No test here asserts on speed: timings on
a shared CI machine say nothing, and a tiny random model is not meant to be fast."""

from __future__ import annotations

import json
import math

import pytest
import torch

import hf_selfspec
from hf_selfspec.bench.benchmark import run_benchmark
from hf_selfspec.bench.cli import prompt_source
from hf_selfspec.bench.contenders import (
    BASELINE,
    PLAIN,
    PLAIN_OUR_KERNELS,
    PROMPT_LOOKUP,
    PROMPT_LOOKUP_OUR_KERNELS,
    Contender,
    build_contenders,
)
from hf_selfspec.bench.plots import plot_category_speedup
from hf_selfspec.bench.report import diverged, results_document
from hf_selfspec.bench.runner import Measurements, measure
from hf_selfspec.bench.sampling import Sampling
from hf_selfspec.bench.table import RED, RESET, render
from hf_selfspec.cli import build_parser, main
from hf_selfspec.hub.package import package
from hf_selfspec.loading import load_model_and_tokenizer
from hf_selfspec.measure import TimedRun, timed
from hf_selfspec.profiles import PROFILE_KEY
from hf_selfspec.prompts import HELD_OUT_SPLIT, TUNE_SPLIT, WORKLOAD, Prompt, encode_prompt, load_prompts
from hf_selfspec.strategies import resolve_strategy
from hf_selfspec.stats import StrategyStats

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BENCH_FLAGS = ["--n-prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--device", "cpu"]


@pytest.fixture
def prompt_file(tmp_path):
    """One code prompt and one chat prompt, so the run also exercises categories and chat templates."""
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"id": "add", "prompt": 'def add(a, b):\n    """Return a + b."""\n', "category": "code"},
        {"id": "sea", "messages": [{"role": "user", "content": "Tell me about the sea."}], "category": "chat"},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    return load_model_and_tokenizer(str(tiny_llama_dir), device="cpu")


def assert_valid_png(path):
    from matplotlib.image import imread
    from PIL import Image

    assert path.read_bytes().startswith(PNG_SIGNATURE)
    with Image.open(path) as image:
        image.verify()
    assert imread(path).ndim == 3


def _untrained_strategies() -> list[str]:
    """The strategies the bench runs without a draft adapter: all but kangaroo."""
    return [s for s in hf_selfspec.available_strategies() if not resolve_strategy(s).needs_draft_adapter]


def test_run_writes_results_with_every_contender_and_plots(tiny_llama_dir, prompt_file, tmp_path, capsys):
    output = tmp_path / "out"
    status = main(
        ["bench", "--model", str(tiny_llama_dir), "--prompts", str(prompt_file), "--output", str(output), *BENCH_FLAGS]
    )
    assert status == 0
    results = json.loads((output / "results.json").read_text())
    by_name = {contender["name"]: contender for contender in results["contenders"]}
    expected = [BASELINE, PLAIN_OUR_KERNELS, "prompt_lookup", PROMPT_LOOKUP_OUR_KERNELS, "early_exit",
                *_untrained_strategies()]
    assert list(by_name) == expected
    # Every contender runs plainly unless it is one of ours: a tuned profile must not leak in.
    for contender in results["contenders"]:
        strategy = contender["generate_kwargs"]["strategy"]
        assert (strategy == "plain") == (contender["family"] != "hf_selfspec")
        assert contender["per_prompt"][0]["new_tokens"] == [8]
        assert isinstance(contender["identical"], bool)
        assert contender["identical"] == all(p["consistency"] == "identical" for p in contender["per_prompt"])
    # float32: nothing short of identity is consistent
    assert results["consistency_tolerance_ulps"] == 0
    assert by_name[BASELINE]["consistency"]["verdict"] == "identical"
    for name in _untrained_strategies():
        assert by_name[name]["consistency"]["verdict"] == "identical", f"{name} changed the greedy output"
        assert by_name[name]["verifications"] is not None
        assert by_name[name]["params_label"] == "default"
    assert by_name["prompt_lookup"]["verifications"] is None
    assert by_name[BASELINE]["speedup"]["per_repeat"] == [1.0]
    assert set(results["categories"]) == {"code", "chat"}
    assert set(results["categories"]["chat"]["contenders"]) == set(expected)
    machine = results["machine"]
    assert {"device_name", "dtype", "torch", "transformers", "hf_selfspec"} <= set(machine)
    assert results["command"]["max_new_tokens"] == 8
    assert results["skip_sets"]["tuned_profile"] is None
    assert results["settings"]["sampling"] is None and results["settings"]["speedup_metric"] == "seconds_per_token"
    assert results["lookup"] == PROMPT_LOOKUP
    assert_valid_png(output / "speedup.png")
    assert_valid_png(output / "speedup_by_category.png")
    assert_valid_png(output / "acceptance.png")
    table = capsys.readouterr().out
    for name in expected:
        assert name in table
    assert "median speedup over plain by prompt category" in table
    assert "x lookup: median ratio to transformers' prompt lookup" in table
    assert RED not in table  # captured output is not a terminal


def test_broken_contender_is_flagged(tiny_model, prompt_file, tmp_path):
    model, tokenizer = tiny_model
    prompts = load_prompts(prompt_file)
    kept = {BASELINE, "self_speculative"}
    contenders = [c for c in build_contenders(model, hf_selfspec.available_strategies()) if c.name in kept]
    # Forbidding the baseline's first token on each prompt guarantees different output.
    first_tokens = sorted({_first_greedy_token(model, tokenizer, prompt) for prompt in prompts})
    broken = Contender(
        "broken",
        {"strategy": "plain", "do_sample": False, "suppress_tokens": first_tokens},
        family="transformers",
        params_label="suppresses the baseline's first token",
    )
    results = run_benchmark(
        model,
        tokenizer,
        prompts,
        [*contenders, broken],
        max_new_tokens=8,
        repeats=1,
        output_dir=tmp_path,
        progress=False,
    )
    by_name = {contender["name"]: contender for contender in results["contenders"]}
    assert by_name["self_speculative"]["identical"]
    assert not by_name["broken"]["identical"]
    assert by_name["broken"]["consistency"]["divergent_prompts"] == ["add", "sea"]
    assert [p["first_difference"] for p in by_name["broken"]["per_prompt"]] == [0, 0]
    broken_line = next(line for line in render(results, color=True).splitlines() if line.startswith("broken"))
    assert RED in broken_line and broken_line.rstrip().endswith(f"NO{RESET}")
    plain_table = render(results, color=False)
    assert RED not in plain_table
    assert "broken: tokens diverge from plain greedy beyond a near-tie on 2 prompt(s): add, sea" in plain_table
    assert_valid_png(tmp_path / "speedup.png")


def _first_greedy_token(model, tokenizer, prompt) -> int:
    inputs = encode_prompt(tokenizer, prompt)
    output = model.generate(
        **inputs, max_new_tokens=1, do_sample=False, strategy="plain", pad_token_id=tokenizer.pad_token_id
    )
    return int(output[0, -1])


def _run(tokens, seconds, accepted_lengths=None, logits=None):
    """A fabricated run; with `accepted_lengths`, one of ours that drafted two tokens per verification."""
    if accepted_lengths is None:
        return TimedRun(new_tokens=tokens, seconds=seconds, stats=None, logits=logits)
    stats = StrategyStats(
        drafted_tokens=2 * len(accepted_lengths),
        accepted_tokens=sum(accepted_lengths),
        accepted_lengths=accepted_lengths,
    )
    return TimedRun(new_tokens=tokens, seconds=seconds, stats=stats)


def test_report_pairs_repeats_and_checks_every_prompt_in_every_repeat():
    """Fabricated timings, so the arithmetic is checked without measuring anything."""
    prompts = [Prompt(id="a", text="x", category="code"), Prompt(id="b", text="y")]
    baseline = [[_run([1, 2, 3, 4], 1.0), _run([5, 6], 1.0)] for _ in range(3)]
    # Speedups per repeat: 2/1, 2/0.5, 2/4 -> median 2.0, min 0.5, max 4.0.
    fast = [
        [_run([1, 2, 3, 4], 0.5, [1, 2]), _run([5, 6], 0.5, [0])],
        [_run([1, 2, 3, 4], 0.25, [2]), _run([5, 6], 0.25, [])],
        # Wrong only on prompt b of the last repeat, from its second token on.
        [_run([1, 2, 3, 4], 2.0, [1]), _run([5, 7], 2.0, [1])],
    ]
    measurements = Measurements(
        prompts=prompts,
        contenders=[
            Contender(BASELINE, {}, family="baseline", params_label="greedy"),
            Contender("fast", {}, family="hf_selfspec", params_label="default"),
        ],
        runs={BASELINE: baseline, "fast": fast},
        max_new_tokens=4,
        repeats=3,
        references=[_run([1, 2, 3, 4], 1.0, logits=_one_hot_logits([1, 2, 3, 4])),
                    _run([5, 6], 1.0, logits=_one_hot_logits([5, 6]))],
        logit_dtype=torch.float32,
    )
    results = results_document(measurements, machine={}, skip_sets={}, command={})
    fast_figures = results["contenders"][1]
    assert fast_figures["speedup"] == {"median": 2.0, "min": 0.5, "max": 4.0, "per_repeat": [2.0, 4.0, 0.5]}
    assert fast_figures["identical"] is False
    assert fast_figures["consistency"]["divergent_prompts"] == ["b"]
    assert [p["first_difference"] for p in fast_figures["per_prompt"]] == [None, 1]
    assert fast_figures["accepted_length_counts"] == {"0": 1, "1": 3, "2": 2}
    assert fast_figures["mean_accepted_length"] == pytest.approx(7 / 6)
    assert fast_figures["acceptance_rate"] == pytest.approx(7 / 12)
    assert results["contenders"][0]["acceptance_rate"] is None
    assert set(results["categories"]) == {"code", "uncategorized"}
    assert results["categories"]["code"]["contenders"]["fast"]["identical"] is True
    assert results["categories"]["uncategorized"]["contenders"]["fast"]["identical"] is False


def _one_hot_logits(tokens, vocab=8, top=20.0):
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = top
    return logits


def _bfloat16_measurements(contender_tokens):
    """One prompt, one repeat: plain greedy chose 3 then 4, and at the second step its logit for
    token 5 was 0.25 below its logit for 4 (two bfloat16 ulps at 20) while token 6 trailed by 10."""
    logits = _one_hot_logits([3, 4])
    logits[1, 5] = 20.0 - 0.25
    logits[1, 6] = 10.0
    return Measurements(
        prompts=[Prompt(id="p", text="x")],
        contenders=[
            Contender(BASELINE, {}, family="baseline", params_label="greedy"),
            Contender("ours", {}, family="hf_selfspec", params_label="default"),
        ],
        runs={BASELINE: [[_run([3, 4], 1.0)]], "ours": [[_run(contender_tokens, 0.5)]]},
        max_new_tokens=2,
        repeats=1,
        references=[_run([3, 4], 1.0, logits=logits)],
        logit_dtype=torch.bfloat16,
    )


def test_reduced_precision_near_tie_is_consistent_and_shows_its_gap():
    results = results_document(_bfloat16_measurements([3, 5]), machine={"dtype": "bfloat16"}, skip_sets={},
                               command={})
    ours = results["contenders"][1]
    assert ours["consistency"] == {"verdict": "near-tie", "max_gap_ulps": 2.0, "near_tie_prompts": ["p"],
                                   "divergent_prompts": []}
    assert ours["identical"] is False
    assert ours["per_prompt"][0]["gap_ulps"] == 2.0
    assert results["consistency_tolerance_ulps"] == 4


def test_greedy_speedup_is_per_generated_token_so_a_near_tie_that_ends_sooner_is_not_credited():
    """Past a near-tie, a consistent contender writes other tokens and may end its answer sooner:
    dividing total seconds would credit it for the tokens it never wrote."""
    logits = _one_hot_logits([3, 4, 7, 7])
    logits[1, 5] = 20.0 - 0.25  # two bfloat16 ulps below plain's choice at the second step
    measurements = Measurements(
        prompts=[Prompt(id="p", text="x")],
        contenders=[
            Contender(BASELINE, {}, family="baseline", params_label="greedy"),
            Contender("ours", {}, family="hf_selfspec", params_label="default"),
        ],
        # plain: 4 tokens in 2 s; ours took the near-tie's other side and ended after 2 tokens in 0.5 s
        runs={BASELINE: [[_run([3, 4, 7, 7], 2.0)]], "ours": [[_run([3, 5], 0.5)]]},
        max_new_tokens=4,
        repeats=1,
        references=[_run([3, 4, 7, 7], 2.0, logits=logits)],
        logit_dtype=torch.bfloat16,
    )
    results = results_document(measurements, machine={**_MACHINE, "dtype": "bfloat16"}, skip_sets=_SKIP_SETS,
                               command={})
    ours = results["contenders"][1]
    assert ours["consistency"]["verdict"] == "near-tie"
    assert ours["speedup"]["median"] == pytest.approx(2.0)  # 0.5 s per token over 0.25; seconds alone say 4
    assert results["settings"]["speedup_metric"] == "seconds_per_token"
    assert "baseline seconds per generated token / contender seconds per generated token" in render(results)


def test_reduced_precision_real_divergence_is_reported_as_one():
    results = results_document(_bfloat16_measurements([3, 6]), machine={"dtype": "bfloat16"}, skip_sets={},
                               command={})
    ours = results["contenders"][1]
    assert ours["consistency"]["verdict"] == "divergent"
    assert ours["consistency"]["divergent_prompts"] == ["p"]
    assert ours["per_prompt"][0]["gap_ulps"] == 80.0  # 10 below the top, in ulps of 0.125


def test_bench_exits_with_status_1_when_one_of_ours_diverges(tiny_llama_dir, prompt_file, tmp_path, monkeypatch,
                                                             capsys):
    """The measuring is faked (a real strategy cannot be made to diverge); what is under test is
    that the command turns a divergence of ours into a failing exit status."""
    import hf_selfspec.bench.benchmark as benchmark

    def diverging_run(model, *args, **kwargs):
        measurements = _bfloat16_measurements([3, 6])
        return results_document(
            measurements,
            machine={"device_name": "cpu", "device": "cpu", "dtype": "bfloat16"},
            skip_sets={"default_params": {"attn_skip_layers": [], "mlp_skip_layers": []}, "tuned_profile": None,
                       "profile_key": "cpu/bfloat16"},
            command={},
        )

    monkeypatch.setattr(benchmark, "run_benchmark", diverging_run)
    status = main(["bench", "--model", str(tiny_llama_dir), "--prompts", str(prompt_file),
                   "--output", str(tmp_path), *BENCH_FLAGS])
    assert status == 1
    captured = capsys.readouterr()
    assert "ours diverged from plain greedy decoding" in captured.err
    assert "ours: tokens diverge from plain greedy beyond a near-tie on 1 prompt(s): p" in captured.out


def _interrupting(at_call: int, interrupt):
    """`timed_generate` that calls `interrupt()` in place of its `at_call`-th call (from 1), to stop
    a bench at a chosen point of its order: warm-ups, then per prompt its reference (greedy, first
    repeat only) and each contender."""
    import hf_selfspec.bench.runner as runner

    real = runner.timed_generate
    calls = 0

    def timed_generate(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == at_call:
            interrupt()
        return real(*args, **kwargs)

    return timed_generate


def _raise_keyboard_interrupt():
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("at_call", "prompts", "repeats"),
    [
        (7, 1, 1),  # prompt 2's first contender, repeat 1: prompt 1 is kept
        (9, 2, 1),  # repeat 2's first call: repeat 1 is kept whole
        (12, 2, 1),  # repeat 2's last call: repeat 1 is kept, the half-done repeat 2 is not
        (13, 2, 2),  # never reached: the run finishes
    ],
)
def test_an_interrupted_run_keeps_what_every_contender_finished(tiny_model, prompt_file, monkeypatch, at_call,
                                                                prompts, repeats):
    import hf_selfspec.bench.runner as runner

    model, tokenizer = tiny_model
    plain = {"strategy": PLAIN, "do_sample": False}
    contenders = [Contender(BASELINE, plain, "baseline", "-"), Contender("twin", plain, "transformers", "-")]
    monkeypatch.setattr(runner, "timed_generate", _interrupting(at_call, _raise_keyboard_interrupt))
    measured = measure(model, tokenizer, load_prompts(prompt_file), contenders, max_new_tokens=4, repeats=2,
                       progress=False, keep_when_interrupted=True)
    assert [prompt.id for prompt in measured.prompts] == ["add", "sea"][:prompts]
    assert measured.repeats == repeats and len(measured.references) == prompts
    assert all(len(done) == prompts for runs in measured.runs.values() for done in runs)
    assert all(len(runs) == repeats for runs in measured.runs.values())
    assert measured.planned == (None if (prompts, repeats) == (2, 2) else (2, 2))
    stopped = results_document(measured, machine={}, skip_sets={}, command={})["settings"]["stopped_early"]
    assert stopped == (None if measured.planned is None else {"planned_prompts": 2, "planned_repeats": 2})


@pytest.mark.parametrize(
    ("seconds_left", "prompts"),
    [
        ((100, 60, 30), 1),  # prompt 1 took 40 s and 30 are left: prompt 2 does not start
        ((100, 60, 40, 0), 2),  # 40 left pay for another 40: both run, though none is left after
    ],
)
def test_a_run_given_its_time_starts_no_prompt_the_time_left_does_not_pay_for(tiny_model, prompt_file, seconds_left,
                                                                           prompts):
    model, tokenizer = tiny_model
    plain = {"strategy": PLAIN, "do_sample": False}
    contenders = [Contender(BASELINE, plain, "baseline", "-"), Contender("twin", plain, "transformers", "-")]
    clock = iter(seconds_left)
    measured = measure(model, tokenizer, load_prompts(prompt_file), contenders, max_new_tokens=4, repeats=1,
                       progress=False, time_left=lambda: next(clock))
    assert [prompt.id for prompt in measured.prompts] == ["add", "sea"][:prompts]
    assert len(measured.references) == prompts
    assert all(len(done) == prompts for runs in measured.runs.values() for done in runs)
    assert measured.planned == (None if prompts == 2 else (2, 1))
    assert next(clock, "read them all") == "read them all"


def test_the_verifiers_layouts_are_chosen_before_anything_is_timed(tiny_model, prompt_file, monkeypatch):
    """Only where one of our strategies runs, and before the first warm-up."""
    import hf_selfspec.bench.runner as runner

    model, tokenizer = tiny_model
    events = []
    monkeypatch.setattr(runner, "choose_layouts", lambda model: events.append("layouts"))
    real = runner.timed_generate
    monkeypatch.setattr(runner, "timed_generate", lambda *args, **kwargs: events.append("decode") or real(*args, **kwargs))
    plain = {"strategy": PLAIN, "do_sample": False}
    theirs = [Contender(BASELINE, plain, "baseline", "-"), Contender("twin", plain, "transformers", "-")]
    ours = [*theirs, Contender("ours", {"strategy": "self_speculative", "do_sample": False}, "hf_selfspec", "-")]
    prompts = load_prompts(prompt_file)[:1]
    measure(model, tokenizer, prompts, theirs, max_new_tokens=4, repeats=1, progress=False)
    assert "layouts" not in events
    events.clear()
    measure(model, tokenizer, prompts, ours, max_new_tokens=4, repeats=1, progress=False)
    assert events[0] == "layouts" and events.count("layouts") == 1


@pytest.mark.parametrize(
    ("at_call", "keep"),
    [
        (3, True),  # prompt 1's baseline run: nothing finished to keep
        (4, False),  # prompt 2's reference: the caller did not ask to keep prompt 1
    ],
)
def test_an_interruption_propagates_with_nothing_to_keep_or_unasked(tiny_model, prompt_file, monkeypatch, at_call,
                                                                    keep):
    import hf_selfspec.bench.runner as runner

    model, tokenizer = tiny_model
    contenders = [Contender(BASELINE, {"strategy": PLAIN, "do_sample": False}, "baseline", "-")]
    monkeypatch.setattr(runner, "timed_generate", _interrupting(at_call, _raise_keyboard_interrupt))
    with pytest.raises(KeyboardInterrupt):
        measure(model, tokenizer, load_prompts(prompt_file), contenders, max_new_tokens=4, repeats=1, progress=False,
                keep_when_interrupted=keep)


def test_sigterm_writes_the_prompts_measured_and_exits_130(tiny_llama_dir, prompt_file, tmp_path, monkeypatch,
                                                           capsys):
    """What a job's time limit does: SIGTERM part-way through the second prompt."""
    import os
    import signal

    import hf_selfspec.bench.runner as runner

    handler_before = signal.getsignal(signal.SIGTERM)
    # warm-ups 1-4 (plain and lookup, each also on our kernels), prompt 1: reference 5, the four
    # contenders 6-9; prompt 2: reference 10
    monkeypatch.setattr(runner, "timed_generate", _interrupting(10, lambda: os.kill(os.getpid(), signal.SIGTERM)))
    output = tmp_path / "out"
    status = main(["bench", "--model", str(tiny_llama_dir), "--prompts", str(prompt_file), "--output", str(output),
                   "--contenders", "prompt_lookup", *BENCH_FLAGS])
    assert status == 130
    assert signal.getsignal(signal.SIGTERM) == handler_before
    results = json.loads((output / "results.json").read_text())
    assert results["settings"]["prompts"] == 1
    assert results["settings"]["stopped_early"] == {"planned_prompts": 2, "planned_repeats": 1}
    assert [prompt["id"] for prompt in results["prompts"]] == ["add"]
    assert all(len(contender["per_prompt"]) == 1 for contender in results["contenders"])
    assert_valid_png(output / "speedup.png")
    captured = capsys.readouterr()
    assert "stopped early: 1 of 2 prompts, 1 of 1 repeat(s) measured" in captured.out
    assert "interrupted; the results cover 1 of 2 prompts" in captured.err


def test_tuned_profile_drives_its_strategy_only(tiny_llama_dir, tmp_path):
    config = tmp_path / "generation_config.json"
    profile = {"strategy": "self_speculative", "params": {"attn_skip_layers": [1], "max_draft_tokens": 3}}
    config.write_text(json.dumps({PROFILE_KEY: {"cpu/float32": profile}}))
    model, _ = load_model_and_tokenizer(str(tiny_llama_dir), device="cpu", generation_config=config)
    by_name = {c.name: c for c in build_contenders(model, hf_selfspec.available_strategies())}
    tuned = by_name["self_speculative"]
    assert tuned.params_label == "tuned"
    assert tuned.generate_kwargs["attn_skip_layers"] == [1]
    assert tuned.generate_kwargs["max_draft_tokens"] == 3
    for name in set(_untrained_strategies()) - {"self_speculative"}:
        assert by_name[name].params_label == "default"
        assert by_name[name].generate_kwargs["attn_skip_layers"] == [2]
        assert by_name[name].generate_kwargs["max_draft_tokens"] != 3
    assert by_name[BASELINE].generate_kwargs["strategy"] == "plain"


def test_custom_generate_contender_runs_the_tuned_profile_through_the_package(tiny_llama_dir, prompt_file, tmp_path):
    config = tmp_path / "generation_config.json"
    profile = {"strategy": "self_speculative", "params": {"attn_skip_layers": [1], "draft_exit_threshold": 0.0}}
    config.write_text(json.dumps({PROFILE_KEY: {"cpu/float32": profile}}))
    folder = package(config, tmp_path / "package").folder
    output = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_llama_dir), "--prompts", str(prompt_file), "--output", str(output)]
    # Asked for by --custom-generate, the packaged contender runs without being named in --contenders.
    argv += ["--config", str(config), "--custom-generate", str(folder), "--contenders", "self_speculative"]
    assert main([*argv, *BENCH_FLAGS]) == 0
    results = {c["name"]: c for c in json.loads((output / "results.json").read_text())["contenders"]}
    assert set(results) == {BASELINE, PLAIN_OUR_KERNELS, "custom_generate", "self_speculative"}
    packaged, installed = results["custom_generate"], results["self_speculative"]
    assert packaged["identical"] is True and packaged["verifications"] > 0
    assert packaged["generate_kwargs"]["custom_generate"] == str(folder)
    shared = {k: v for k, v in packaged["generate_kwargs"].items() if k not in ("custom_generate", "trust_remote_code")}
    assert shared == installed["generate_kwargs"]


def test_custom_generate_needs_a_package_and_a_profile(tiny_llama_dir, tmp_path, capsys):
    argv = ["bench", "--model", str(tiny_llama_dir), "--custom-generate", str(tmp_path), *BENCH_FLAGS]
    assert main(argv) == 2
    assert f"--custom-generate {tmp_path}: no custom_generate/generate.py" in capsys.readouterr().err
    config = tmp_path / "generation_config.json"
    config.write_text(json.dumps({PROFILE_KEY: {"cpu/float32": {"strategy": "self_speculative"}}}))
    folder = package(config, tmp_path / "package").folder
    assert main(["bench", "--model", str(tiny_llama_dir), "--custom-generate", str(folder), *BENCH_FLAGS]) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--custom-generate runs the tuned profile for cpu/float32, and neither --config nor" in last_line


@pytest.mark.parametrize("model", ["/nope/model", "./nope-model", "~/nope-model-xyz", "{tmp}/no-such-model"])
def test_a_path_like_model_that_does_not_exist_is_no_such_directory(tmp_path, capsys, model):
    model = model.format(tmp=tmp_path)
    assert main(["bench", "--model", model, *BENCH_FLAGS]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"hf-selfspec bench: error: --model {model}: no such directory; give a model directory, a Hub id or 'embedded'"
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "ok"}\n{"prompt": "unterminated\n', ":2: not valid JSON"),
        ('{"prompt": "ok"}\n\n["a list"]\n', ":3: expected a JSON object"),
        ('{"prompt": "ok"}\n{"category": "code"}\n', ":2: needs a 'prompt' string or a 'messages' list"),
    ],
)
def test_malformed_prompt_file_names_its_line(tmp_path, capsys, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    status = main(["bench", "--prompts", str(path), "--output", str(tmp_path / "out")])
    assert status == 2
    err = capsys.readouterr().err
    assert f"{path}{message}" in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "{tmp}/broken.json"], "--model {tmp}/broken.json: not a directory"),
        (["--config", "{tmp}/missing.json"], "--config {tmp}/missing.json: no such file"),
        (["--config", "{tmp}/broken.json"], "--config {tmp}/broken.json: not valid JSON"),
        (["--output", "{tmp}/broken.json"], "--output {tmp}/broken.json: cannot create it"),
    ],
)
def test_bad_model_config_or_output_is_one_line(tmp_path, capsys, flags, message):
    (tmp_path / "broken.json").write_text("{not json")
    argv = ["bench", *(flag.format(tmp=tmp_path) for flag in flags), *BENCH_FLAGS]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message.format(tmp=tmp_path) in err
    assert len(err.splitlines()) == 1


def test_contenders_option_runs_the_named_ones_and_the_baseline(tiny_llama_dir, prompt_file, tmp_path):
    output = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_llama_dir), "--prompts", str(prompt_file), "--output", str(output)]
    assert main([*argv, "--contenders", "prompt_lookup, target_confidence_gated", *BENCH_FLAGS]) == 0
    results = json.loads((output / "results.json").read_text())
    assert [c["name"] for c in results["contenders"]] == [
        BASELINE, PLAIN_OUR_KERNELS, "prompt_lookup", PROMPT_LOOKUP_OUR_KERNELS, "target_confidence_gated"
    ]


def test_tuned_names_the_strategy_the_tuned_profile_runs(tiny_llama_dir, prompt_file, tmp_path, capsys):
    config = tmp_path / "generation_config.json"
    profile = {"strategy": "adaptive_draft_exit", "params": {"attn_skip_layers": [1], "max_draft_tokens": 3}}
    config.write_text(json.dumps({PROFILE_KEY: {"cpu/float32": profile}}))
    output = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_llama_dir), "--prompts", str(prompt_file), "--output", str(output)]
    assert main([*argv, "--config", str(config), "--contenders", "prompt_lookup,tuned", *BENCH_FLAGS]) == 0
    results = json.loads((output / "results.json").read_text())
    assert [(c["name"], c["params_label"]) for c in results["contenders"]] == [
        (BASELINE, "plain"), (PLAIN_OUR_KERNELS, "our kernels"), ("prompt_lookup", "10 tokens"),
        (PROMPT_LOOKUP_OUR_KERNELS, "10 tokens, our kernels"), ("adaptive_draft_exit", "tuned")
    ]
    # Without a profile there is nothing for `tuned` to name: one line, before any timing.
    assert main([*argv, "--contenders", "tuned", *BENCH_FLAGS]) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line == (
        "hf-selfspec bench: error: --contenders tuned: no tuned profile for this device and dtype to run as "
        "'tuned'; pass --config with one"
    )


def test_unknown_contender_is_one_line_listing_the_choices(tiny_llama_dir, capsys):
    assert main(["bench", "--model", str(tiny_llama_dir), "--contenders", "early_exit,warp", *BENCH_FLAGS]) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading bar
    assert last_line.startswith("hf-selfspec bench: error: --contenders early_exit,warp: unknown warp; choose from")
    assert "prompt_lookup" in last_line


def test_chat_alias_is_the_packaged_chat_set():
    prompts = load_prompts(prompt_source("chat"))
    assert len(prompts) == 20
    assert len({p.id for p in prompts}) == 20
    assert all(p.category == "chat" and p.messages and p.messages[0]["role"] == "user" for p in prompts)


def test_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in [
        "--model", "--gguf-file", "--config", "--compare-config", "--prompts", "--n-prompts", "--prompt-offset",
        "--max-new-tokens", "--repeats", "--assistant", "--custom-generate", "--contenders", "--device", "--dtype", "--output",
        "--split", "--do-sample", "--temperature", "--top-p", "--seed", "workload", "geometric mean",
        "results.json", "speedup.png", "speedup_by_category.png", "acceptance.png",
    ]:  # fmt: skip
        assert option in text


def test_a_draft_adapter_adds_the_kangaroo_contender(tiny_llama_dir, prompt_file, tmp_path):
    from hf_selfspec.adapter import AdapterShape, DraftAdapter, save_adapter

    model, _ = load_model_and_tokenizer(str(tiny_llama_dir), device="cpu")
    adapter = save_adapter(DraftAdapter(model, AdapterShape.for_model(model, 2)), tmp_path / "draft")
    assert "kangaroo" not in {c.name for c in build_contenders(model, hf_selfspec.available_strategies())}
    output = tmp_path / "out"
    status = main(["bench", "--model", str(tiny_llama_dir), "--prompts", str(prompt_file), "--output", str(output),
                   "--draft-adapter", str(adapter), "--contenders", "kangaroo", *BENCH_FLAGS])
    assert status == 0
    [*_, kangaroo] = json.loads((output / "results.json").read_text())["contenders"]
    assert kangaroo["name"] == "kangaroo" and kangaroo["identical"]
    assert kangaroo["generate_kwargs"]["draft_adapter"] == str(adapter)


def test_compare_config_runs_another_tuned_profile_in_the_same_run(tiny_llama_dir, prompt_file, tmp_path, capsys):
    """Two tuned profiles for one device and dtype, one interleaved run; the compared profile's
    adapter resolves beside its own config, not the model's."""
    from helpers.adapters import random_adapter

    config = tmp_path / "generation_config.json"
    config.write_text(json.dumps({PROFILE_KEY: {"cpu/float32": {
        "strategy": "self_speculative", "params": {"attn_skip_layers": [1], "draft_exit_threshold": 0.0}}}}))
    other_dir = tmp_path / "elsewhere"
    model, _ = load_model_and_tokenizer(str(tiny_llama_dir), device="cpu")
    adapter = random_adapter(model, 1, other_dir)
    other = other_dir / "kangaroo-generation_config.json"
    other.write_text(json.dumps({PROFILE_KEY: {"cpu/float32": {
        "strategy": "kangaroo", "params": {"draft_adapter": "adapter-1-1.safetensors", "max_draft_tokens": 3,
                                           "draft_exit_threshold": 0.0, "backoff_probe_interval": 0}}}}))
    output = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_llama_dir), "--prompts", str(prompt_file), "--output", str(output),
            "--config", str(config), "--contenders", "self_speculative", "--compare-config", str(other)]
    assert main([*argv, *BENCH_FLAGS]) == 0
    results = {c["name"]: c for c in json.loads((output / "results.json").read_text())["contenders"]}
    assert list(results) == ["baseline", PLAIN_OUR_KERNELS, "self_speculative", "kangaroo@kangaroo-generation_config"]
    compared = results["kangaroo@kangaroo-generation_config"]
    assert compared["generate_kwargs"]["draft_adapter"] == adapter and compared["generate_kwargs"]["max_draft_tokens"] == 3
    assert compared["identical"] is True and compared["verifications"] > 0
    assert results["self_speculative"]["generate_kwargs"]["attn_skip_layers"] == [1]

    (other_dir / "bfloat16-only.json").write_text(json.dumps({PROFILE_KEY: {"cpu/bfloat16": {"strategy": "kangaroo"}}}))
    capsys.readouterr()
    assert main([*argv[:-1], str(other_dir / "bfloat16-only.json"), *BENCH_FLAGS]) == 2
    assert "--compare-config " + str(other_dir / "bfloat16-only.json") + " has no profile for cpu/float32" in capsys.readouterr().err


def test_timing_waits_for_the_gpu_queue_on_both_sides(monkeypatch):
    """A GPU runs what Python queued after Python has moved on: a clock read without synchronising
    would time the launches (the bench's and the tuner's calibration's)."""
    events: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("synchronize", str(device))))
    result, seconds = timed(lambda: events.append("run") or 7, torch.device("cuda:0"))
    assert result == 7 and seconds >= 0
    assert events == [("synchronize", "cuda:0"), "run", ("synchronize", "cuda:0")]
    events.clear()
    timed(lambda: events.append("run"), torch.device("cpu"))
    assert events == ["run"]


def _contender(name, family="hf_selfspec"):
    return Contender(name, {}, family=family, params_label="-")


def _category_measurements(sampling=None):
    """Three prompts in two categories, two repeats; the second repeat is twice as slow for
    everybody (drift), which pairing per repeat cancels. Per prompt, in seconds:

    translation (t1, t2): baseline 1 + 1, lookup 0.25 + 0.25, ours 0.5 + 0.5
    qa (q1):              baseline 1,     lookup 1,           ours 0.25
    """
    prompts = [Prompt(id="t1", text="x", category="translation"), Prompt(id="t2", text="y", category="translation"),
               Prompt(id="q1", text="z", category="qa")]
    tokens = [1, 2]

    def runs(seconds):
        return [[_run(tokens, drift * s) for s in seconds] for drift in (1.0, 2.0)]

    return Measurements(
        prompts=prompts,
        contenders=[_contender(BASELINE, "baseline"), _contender(PROMPT_LOOKUP, "transformers"), _contender("ours")],
        runs={BASELINE: runs([1.0, 1.0, 1.0]), PROMPT_LOOKUP: runs([0.25, 0.25, 1.0]), "ours": runs([0.5, 0.5, 0.25])},
        max_new_tokens=2,
        repeats=2,
        references=[_run(tokens, 1.0, logits=_one_hot_logits(tokens)) for _ in prompts],
        logit_dtype=torch.float32,
        sampling=sampling,
    )


_MACHINE = {"device_name": "cpu", "device": "cpu", "dtype": "float32"}
_SKIP_SETS = {"default_params": {"attn_skip_layers": [], "mlp_skip_layers": []}, "tuned_profile": None,
              "profile_key": "cpu/float32"}


def _table_row(table: str, heading: str, name: str) -> list[str]:
    """The cells of contender `name`'s row in the table under the line starting with `heading`."""
    lines = table.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    row = next(line for line in lines[start:] if line.split() and line.split()[0] == name)
    return row.split()[1:]


def test_per_category_speedups_ratios_to_lookup_and_geomeans():
    results = results_document(_category_measurements(), machine=_MACHINE, skip_sets=_SKIP_SETS, command={})
    by_name = {c["name"]: c for c in results["contenders"]}
    ours, lookup = by_name["ours"], by_name[PROMPT_LOOKUP]
    translation, qa = (results["categories"][name]["contenders"] for name in ("translation", "qa"))
    # translation: 2 / 1 = 2x for ours, 2 / 0.5 = 4x for lookup, so ours is 0.5x lookup
    assert translation["ours"]["speedup"] == {"median": 2.0, "min": 2.0, "max": 2.0, "per_repeat": [2.0, 2.0]}
    assert translation[PROMPT_LOOKUP]["speedup"]["median"] == 4.0
    assert translation["ours"]["ratio_to_lookup"]["per_repeat"] == [0.5, 0.5]
    # qa: 1 / 0.25 = 4x for ours, 1x for lookup
    assert qa["ours"]["speedup"]["median"] == 4.0 and qa["ours"]["ratio_to_lookup"]["median"] == 4.0
    assert qa[PROMPT_LOOKUP]["ratio_to_lookup"]["median"] == 1.0
    # all prompts pooled: 3 / 1.25 = 2.4x, and lookup's 1.5 s / 1.25 s = 1.2x lookup
    assert ours["speedup"]["median"] == pytest.approx(2.4)
    assert ours["ratio_to_lookup"]["per_repeat"] == pytest.approx([1.2, 1.2])
    # geometric means over the two categories, each counted once
    assert ours["category_geomean_speedup"] == pytest.approx(math.sqrt(2.0 * 4.0))
    assert ours["category_geomean_ratio_to_lookup"] == pytest.approx(math.sqrt(0.5 * 4.0))
    assert lookup["category_geomean_speedup"] == pytest.approx(2.0)
    assert by_name[BASELINE]["category_geomean_speedup"] == pytest.approx(1.0)
    assert results["lookup"] == PROMPT_LOOKUP

    table = render(results)
    # main table: ... speedup min max x-lookup ...
    assert _table_row(table, "contender", "ours")[2:6] == ["2.40x", "2.40x", "2.40x", "1.20x"]
    speedups = "median speedup over plain by prompt category"
    assert _table_row(table, speedups, "contender") == ["translation", "(2)", "qa", "(1)", "all", "geomean"]
    assert _table_row(table, speedups, "ours") == ["2.00x", "4.00x", "2.40x", "2.83x"]
    assert _table_row(table, speedups, PROMPT_LOOKUP) == ["4.00x", "1.00x", "2.00x", "2.00x"]
    ratios = "x lookup: median ratio to transformers' prompt lookup"
    assert _table_row(table, ratios, "ours") == ["0.50x", "4.00x", "1.20x", "1.41x"]
    ratio_table = table[table.index(ratios):]
    assert f"\n{PROMPT_LOOKUP} " not in ratio_table and f"\n{BASELINE} " not in ratio_table


def test_equal_kernel_ratios_stand_beside_the_ratios_to_transformers_as_it_runs():
    """With plain decoding and lookup also run on our kernels, each ratio gets its equal-kernel
    counterpart, by category too: our kernels make plain 1.25x and lookup 2x faster here."""
    measurements = _category_measurements()
    runs = measurements.runs
    runs[PLAIN_OUR_KERNELS] = [[_run([1, 2], 0.8 * run.seconds) for run in repeat] for repeat in runs[BASELINE]]
    runs[PROMPT_LOOKUP_OUR_KERNELS] = [[_run([1, 2], 0.5 * run.seconds) for run in repeat] for repeat in runs[PROMPT_LOOKUP]]
    measurements.contenders[2:2] = [_contender(PLAIN_OUR_KERNELS, "transformers"),
                                    _contender(PROMPT_LOOKUP_OUR_KERNELS, "transformers")]
    results = results_document(measurements, machine=_MACHINE, skip_sets=_SKIP_SETS, command={})
    assert results["equal_kernels"] == {"plain": PLAIN_OUR_KERNELS, "lookup": PROMPT_LOOKUP_OUR_KERNELS}
    ours = next(c for c in results["contenders"] if c["name"] == "ours")
    assert ours["speedup_equal_kernels"]["per_repeat"] == pytest.approx([2.4 * 0.8] * 2)
    assert ours["ratio_to_lookup_equal_kernels"]["per_repeat"] == pytest.approx([1.2 * 0.5] * 2)
    assert ours["category_geomean_ratio_to_lookup_equal_kernels"] == pytest.approx(math.sqrt(0.25 * 2.0))
    table = render(results)
    # main table: speedup min max, x plain on equal kernels, x lookup, x lookup on equal kernels
    assert _table_row(table, "contender", "ours")[2:8] == ["2.40x", "2.40x", "2.40x", "1.92x", "1.20x", "0.60x"]
    equal = "x lookup, eq. kernels: median ratio to transformers' prompt lookup on our kernels"
    assert _table_row(table, equal, "ours") == ["0.25x", "2.00x", "0.60x", "0.71x"]
    equal_table = table[table.index(equal):]
    assert all(f"\n{name} " not in equal_table for name in (BASELINE, PROMPT_LOOKUP, PLAIN_OUR_KERNELS))


def test_without_lookup_or_categories_the_report_says_none():
    measurements = _category_measurements()
    del measurements.runs[PROMPT_LOOKUP]
    measurements.contenders = [c for c in measurements.contenders if c.name != PROMPT_LOOKUP]
    measurements.prompts = [Prompt(id=p.id, text=p.text) for p in measurements.prompts]
    results = results_document(measurements, machine=_MACHINE, skip_sets=_SKIP_SETS, command={})
    ours = results["contenders"][1]
    assert results["lookup"] is None and results["categories"] == {}
    assert ours["ratio_to_lookup"] is None
    assert ours["category_geomean_speedup"] is None and ours["category_geomean_ratio_to_lookup"] is None
    table = render(results)
    assert "x lookup" not in table and "by prompt category" not in table


def test_category_plot_is_written_with_and_without_categories(tmp_path):
    results = results_document(_category_measurements(), machine=_MACHINE, skip_sets=_SKIP_SETS, command={})
    plot_category_speedup(results, tmp_path / "by_category.png")
    assert_valid_png(tmp_path / "by_category.png")
    results["categories"] = {}
    plot_category_speedup(results, tmp_path / "pooled_only.png")
    assert_valid_png(tmp_path / "pooled_only.png")


def test_sampled_speedup_is_per_generated_token_pooled_over_the_prompts():
    """Sampled lengths differ: a contender writing twice the tokens in the same time is 2x."""
    prompts = [Prompt(id="a", text="x", category="chat"), Prompt(id="b", text="y", category="chat")]
    measurements = Measurements(
        prompts=prompts,
        contenders=[_contender(BASELINE, "baseline"), _contender("ours")],
        # a: baseline 4 tokens in 1 s, ours 8 in 1 s; b: baseline 4 in 1 s, ours 2 in 0.5 s
        runs={BASELINE: [[_run([1] * 4, 1.0), _run([1] * 4, 1.0)]], "ours": [[_run([1] * 8, 1.0), _run([1] * 2, 0.5)]]},
        max_new_tokens=8,
        repeats=1,
        references=[],
        logit_dtype=torch.float32,
        sampling=Sampling(temperature=0.7, top_p=0.9, seed=4),
    )
    results = results_document(measurements, machine=_MACHINE, skip_sets=_SKIP_SETS, command={})
    ours = results["contenders"][1]
    # pooled: baseline 2 s / 8 tokens = 0.25, ours 1.5 s / 10 tokens = 0.15, so 5/3; the seconds alone
    # would say 2 / 1.5 = 4/3 and the mean of per-prompt ratios (2 + 1) / 2 = 1.5
    assert ours["speedup"]["median"] == pytest.approx(5 / 3)
    assert results["categories"]["chat"]["contenders"]["ours"]["speedup"]["median"] == pytest.approx(5 / 3)
    assert results["settings"]["speedup_metric"] == "seconds_per_token"
    assert results["settings"]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "seed": 4}
    assert ours["consistency"]["verdict"] == "sampled" and ours["identical"] is None
    assert [p["consistency"] for p in ours["per_prompt"]] == ["sampled", "sampled"]
    assert diverged(results, "hf_selfspec") == []
    table = render(results)
    assert "sampling at temperature 0.7, top-p 0.9, seed 4 + repeat" in table.splitlines()[0]
    assert _table_row(table, "contender", "ours")[-2:] == ["n/a", "(sampled)"]
    assert "baseline seconds per generated token / contender seconds per generated token" in table
    assert "not applicable to sampling" in table


def test_sampling_gives_every_contender_the_repeats_seed(tiny_model, prompt_file):
    """A contender decoding exactly as the baseline samples exactly its tokens: the seed is reset
    before every timed call, to the setting's seed plus the repeat."""
    model, tokenizer = tiny_model
    prompts = load_prompts(prompt_file)
    plain = {"strategy": PLAIN, "do_sample": False}
    ours = next(c for c in build_contenders(model, ["self_speculative"]) if c.name == "self_speculative")
    contenders = [Contender(BASELINE, plain, "baseline", "-"), Contender("twin", plain, "transformers", "-"), ours]
    sampled = measure(model, tokenizer, prompts, contenders, max_new_tokens=8, repeats=2,
                      sampling=Sampling(temperature=1.0, top_p=0.9, seed=3), progress=False)
    tokens = {name: [[run.new_tokens for run in repeat] for repeat in runs] for name, runs in sampled.runs.items()}
    assert tokens["twin"] == tokens[BASELINE]
    assert tokens[BASELINE][0] != tokens[BASELINE][1]  # a new seed each repeat
    assert all(len(run) == 8 for repeat in tokens["self_speculative"] for run in repeat)
    assert sampled.references == []
    for contender in sampled.contenders:
        assert contender.generate_kwargs["do_sample"] is True
        assert (contender.generate_kwargs["temperature"], contender.generate_kwargs["top_p"]) == (1.0, 0.9)
    # repeat 1 of seed 3 is repeat 0 of seed 4
    again = measure(model, tokenizer, prompts, contenders[:1], max_new_tokens=8, repeats=1,
                    sampling=Sampling(temperature=1.0, top_p=0.9, seed=4), progress=False)
    assert [run.new_tokens for run in again.runs[BASELINE][0]] == tokens[BASELINE][1]


def test_bench_samples_with_the_flags_and_reports_no_consistency(tiny_llama_dir, prompt_file, tmp_path, capsys):
    output = tmp_path / "out"
    status = main(["bench", "--model", str(tiny_llama_dir), "--prompts", str(prompt_file), "--output", str(output),
                   "--contenders", "prompt_lookup,self_speculative", "--do-sample", "--temperature", "0.7",
                   "--top-p", "0.9", "--seed", "5", *BENCH_FLAGS])
    assert status == 0
    results = json.loads((output / "results.json").read_text())
    assert results["settings"]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "seed": 5}
    assert results["settings"]["speedup_metric"] == "seconds_per_token"
    for contender in results["contenders"]:
        assert contender["generate_kwargs"]["do_sample"] is True and contender["generate_kwargs"]["top_p"] == 0.9
        assert contender["consistency"]["verdict"] == "sampled"
    assert_valid_png(output / "speedup_by_category.png")
    assert "n/a (sampled)" in capsys.readouterr().out


def _bench_args(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_workload_is_its_held_out_split_whole_unless_told(tmp_path):
    from hf_selfspec.bench.cli import bench_prompts

    held_out = bench_prompts(_bench_args("--prompts", "workload"))
    assert held_out == load_prompts(WORKLOAD, split=HELD_OUT_SPLIT)
    assert {p.split for p in held_out} == {HELD_OUT_SPLIT}
    tune = bench_prompts(_bench_args("--prompts", "workload", "--split", "tune"))
    assert tune == load_prompts(WORKLOAD, split=TUNE_SPLIT)
    assert not {p.id for p in tune} & {p.id for p in held_out}
    assert len(bench_prompts(_bench_args("--prompts", "workload", "--n-prompts", "3"))) == 3
    assert len(bench_prompts(_bench_args())) == 20  # HumanEval keeps its 20
    path = tmp_path / "split.jsonl"
    rows = [{"id": f"p{i}", "prompt": "x", "split": split} for i, split in enumerate(["tune", "held_out", "tune"])]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    assert [p.id for p in bench_prompts(_bench_args("--prompts", str(path), "--split", "tune"))] == ["p0", "p2"]
    assert [p.id for p in bench_prompts(_bench_args("--prompts", str(path)))] == ["p0", "p1", "p2"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompts", "humaneval", "--split", "tune"],
         "--split tune: humaneval has no prompt marked with a split; use --prompts workload or a file"),
        (["--prompts", "{prompts}", "--split", "held_out"], "--split held_out: {prompts} has no prompt marked"),
        (["--temperature", "0.7", "--seed", "1"], "--temperature, --seed only apply with --do-sample; add it or"),
    ],
)
def test_split_without_splits_and_sampling_flags_without_sampling_are_one_line(prompt_file, tmp_path, capsys,
                                                                               flags, message):
    argv = ["bench", *(flag.format(prompts=prompt_file) for flag in flags), "--output", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-selfspec bench: error: ")
    assert message.format(prompts=prompt_file) in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_per_category_report_of_plain_and_lookup_alone_has_no_ratio_to_lookup_section():
    """With no contender besides plain and lookup there is nothing to compare with lookup per
    category; the speedups by category are still reported."""
    measurements = _category_measurements()
    keep = {measurements.contenders[0].name, PROMPT_LOOKUP}
    for name in [c.name for c in measurements.contenders if c.name not in keep]:
        del measurements.runs[name]
    measurements.contenders = [c for c in measurements.contenders if c.name in keep]
    results = results_document(measurements, machine=_MACHINE, skip_sets=_SKIP_SETS, command={})
    table = render(results)
    assert "by prompt category" in table
    assert "x lookup: median ratio" not in table


def test_the_streams_are_held_out_whole_unless_told_each_in_order_from_position_one():
    from hf_selfspec.bench.cli import bench_prompts
    from hf_selfspec.prompts import STREAMS

    held_out = bench_prompts(_bench_args("--prompts", "streams"))
    assert held_out == load_prompts(STREAMS, split=HELD_OUT_SPLIT)
    tune = load_prompts(STREAMS, split=TUNE_SPLIT)
    for prompts in (held_out, tune):
        streams: dict[str, list[int]] = {}
        for prompt in prompts:
            streams.setdefault(prompt.stream, []).append(prompt.position)
        # each stream comes whole and in order, once, and goes on past the first ten requests
        assert [p.stream for p in prompts] == [s for s, positions in streams.items() for _ in positions]
        assert all(positions == list(range(1, len(positions) + 1)) and len(positions) > 10 for positions in streams.values())
    assert {p.category for p in held_out} == {p.category for p in tune} == {"tool_calls", "code_edits", "answer_format"}
    assert not {p.stream for p in held_out} & {p.stream for p in tune}


def test_a_stream_runs_with_a_fresh_online_corpus_and_is_reported_by_position(tiny_llama_dir, tmp_path, capsys):
    from hf_selfspec.bench.report import POSITION_GROUPS

    path = tmp_path / "streams.jsonl"
    rows = [{"id": f"{s}/{i}", "prompt": f"{s} request {i % 3}:", "category": s, "stream": s, "position": i}
            for s in ("a", "b") for i in range(1, 13)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    config = tmp_path / "generation_config.json"
    profile = {"strategy": "self_speculative", "params": {"attn_skip_layers": [1], "prompt_lookup_tokens": 3}}
    config.write_text(json.dumps({PROFILE_KEY: {"cpu/float32": profile}}))
    output = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_llama_dir), "--prompts", str(path), "--output", str(output), "--config",
            str(config), "--contenders", "prompt_lookup,tuned", "--n-prompts", "24", "--max-new-tokens", "6",
            "--repeats", "1", "--device", "cpu"]
    assert main(argv) == 0
    results = json.loads((output / "results.json").read_text())
    online = next(c for c in results["contenders"] if c["name"] == "self_speculative+online")
    assert online["generate_kwargs"]["online_corpus"] == "bench/self_speculative+online"
    assert online["consistency"]["verdict"] == "identical"
    assert list(results["positions"]) == list(POSITION_GROUPS)
    assert results["positions"]["1-10"]["prompt_ids"] == [f"{s}/{i}" for s in "ab" for i in range(1, 11)]
    assert "self_speculative+online" in results["positions"]["11+"]["contenders"]
    assert "by position in the stream" in capsys.readouterr().out


def test_each_stream_starts_its_contenders_online_corpus_empty(tiny_model, monkeypatch):
    from hf_selfspec.bench.contenders import online_contenders

    model, tokenizer = tiny_model
    prompts = [Prompt(id=f"{s}/{i}", text=f"{s} {i}", stream=s, position=i) for s in ("a", "b") for i in (1, 2, 3)]
    tuned = Contender("self_speculative", {"strategy": "self_speculative", "attn_skip_layers": [1],
                                           "prompt_lookup_tokens": 3, "do_sample": False}, "hf_selfspec", "tuned")
    contenders = [Contender(BASELINE, {"strategy": PLAIN, "do_sample": False}, "baseline", PLAIN), tuned]
    contenders += online_contenders(contenders)
    corpus = hf_selfspec.online_corpus(model, contenders[-1].generate_kwargs["online_corpus"])
    seen = []
    original = corpus.continuation

    def counting(text, *args):
        seen.append(corpus.texts)
        return original(text, *args)

    monkeypatch.setattr(corpus, "continuation", counting)
    measure(model, tokenizer, prompts, contenders, max_new_tokens=4, repeats=2, progress=False)
    # Each stream's first request finds the corpus empty; the third has learned from two.
    assert 0 in seen and max(seen) == 2 and corpus.texts == 3


def test_batch_sizes_measure_whole_batches_per_category_against_plain_batched(tiny_llama_dir, tmp_path, capsys):
    """`--batch-size 1,2`: each category's prompts a batch at a time, ours against plain batched
    generate, on its kernels and on ours, and against themselves at batch one; transformers'
    lookup refuses a batch and is left out."""
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": f"{kind}{i}", "prompt": f"{kind} number {i}: " + "one two three " * (i + 1), "category": kind}
            for kind in ("code", "chat") for i in range(3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    output = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_llama_dir), "--prompts", str(path), "--output", str(output),
            "--contenders", "prompt_lookup,self_speculative", "--batch-size", "1,2", "--max-new-tokens", "8",
            "--repeats", "1", "--device", "cpu"]
    assert main(argv) == 0
    results = json.loads((output / "batches.json").read_text())
    assert sorted(results["sizes"]) == ["1", "2"]
    two = results["sizes"]["2"]
    assert two["batches"] == 4  # two categories of three prompts: a batch of two and one of one each
    assert sorted(two["contenders"]) == [BASELINE, PLAIN_OUR_KERNELS, "self_speculative"]
    ours, equal = two["contenders"]["self_speculative"], two["contenders"][PLAIN_OUR_KERNELS]
    assert ours["consistency"] == "identical" and ours["speedup"] > 0 and ours["vs_batch_one"] > 0
    assert ours["equal_kernels"] == pytest.approx(ours["speedup"] / equal["speedup"])  # one repeat
    assert equal["consistency"] == "identical" and "vs_batch_one" not in equal and equal["equal_kernels"] == 1.0
    assert sorted(ours["categories"]) == ["chat", "code"]
    assert "vs_batch_one" not in results["sizes"]["1"]["contenders"]["self_speculative"]
    printed = capsys.readouterr().out
    assert "batch size 2: 4 batches" in printed and "x plain batched" in printed and "x plain, our kernels" in printed


def test_batch_sizes_refuse_sampling_and_a_bad_list(tiny_llama_dir, tmp_path, capsys):
    argv = ["bench", "--model", str(tiny_llama_dir), "--output", str(tmp_path / "out")]
    assert main([*argv, "--batch-size", "4", "--do-sample"]) == 2
    assert "--batch-size measures greedy decoding" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--batch-size", "4,0"])
