"""`hf-selfspec quickstart`: the whole loop in one command, on the embedded model and the CPU.

A short estimated tune whose best trials are confirmed by real decoding, an export of the best
measured trial, then a held-out workload prompt decoded plainly, with that fresh profile, and
with the profile shipped in the package (what `load_embedded()` applies).

It searches what pays on this model: Kangaroo with the shipped exit-1 adapters, composed with a
prompt lookup that continues into the shipped lookup corpus. Skipping layers alone cannot pay on
a model this shallow, so a short tune of it would only show the tuner finding nothing. The
ranges are those of the study behind the shipped bfloat16 default
(studies/smollm2-135m-workload-general-bf16.toml), so the short tune searches where it did;
the command still says plainly when no trial beat plain.

It fits in `QUICKSTART_SECONDS` on any CPU: a few plain steps are timed first, and the study is
sized from them as `optimize` sizes its stages (`budget`), so a slow float32-only machine runs
fewer trials, on shorter and fewer prompts, with its cost model timed in fewer rounds and a
shorter demo; it says how long it will take before it starts.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import optuna

from hf_selfspec.tuner_api import (
    EMBEDDED,
    HELD_OUT_SPLIT,
    TUNE_SPLIT,
    WORKLOAD,
    WORKLOAD_CATEGORIES,
    Prompt,
    TimedRun,
    load_prompts,
    output_directory,
    timed_generate,
)

from . import TuningError, progress
from .budget import CALIBRATION_ROUNDS, MIN_TRIALS, TUNE_NEW_TOKENS, StepCosts, TunePlan, plan_tune, tune_costs
from .studies.config import PromptConfig, SearchConfig, StudyConfig, StudySettings
from .studies.export import ExportResult, export_profile
from .studies.storage import estimated_study_name, open_storage, resolve_storage_url
from .tune import format_summary, run_tune

_SHIPPED = Path(str(resources.files("hf_selfspec").joinpath("data/tuned/smollm2-135m-instruct")))
# A fixed study name, started afresh on every run: a resumed study would skip the warm-start
# trials (the likeliest good ones) and spend a short budget on random draws.
QUICKSTART_CONFIG = StudyConfig(
    # One prompt of each workload category: the profile is judged on all of them, as a shipped one.
    prompts=PromptConfig(source=WORKLOAD, split=TUNE_SPLIT, per_category=1, max_new_tokens=64),
    search=SearchConfig(
        strategy="kangaroo",
        ranges={
            "max_draft_tokens": (2, 8),
            "draft_exit_threshold": (0.3, 0.8),
            "draft_vocab_size": (2048, 8192),
            "prompt_lookup_tokens": (2, 10),
            "prompt_lookup_max_tokens": (10, 32),
            "prompt_lookup_min_ngram": (1, 2),
            "draft_source_probe_interval": (0, 16),
        },
        draft_adapters={
            name: str(_SHIPPED / f"{name}.safetensors") for name in ("kangaroo-exit1", "general-exit1")
        },
        lookup_corpus=str(_SHIPPED / "own-general.safetensors"),
    ),
    # One prompt a category: each decoded twice in confirmation, so one decode a neighbour slowed
    # is not a category's whole measurement.
    study=StudySettings(name="quickstart", objective="estimated", confirm_top=2, confirm_rounds=2),
)
# The whole command, from the first timed step to the demo's verdict: with the set-up of a fresh
# clone and the first imports (a minute or two), `make run` stays within five minutes, with room
# for a host that runs slower than when it was timed.
QUICKSTART_SECONDS = 165
# New tokens per tune prompt and the cost model's timing rounds, most to fewest: a slow machine
# judges its few trials on shorter text with rougher prices, and its confirmation decides.
QUICKSTART_NEW_TOKENS = (*TUNE_NEW_TOKENS, 16)
QUICKSTART_CALIBRATION_ROUNDS = (*CALIBRATION_ROUNDS, 1)
DEMO_NEW_TOKENS = 64
# A contender's untimed first decode: what it builds once (packed weights, a drafter) is built.
DEMO_WARM_UP_TOKENS = 8
_WIDTHS = (1, 8, 32)


@dataclasses.dataclass(frozen=True)
class QuickstartSize:
    """How much the quickstart measures: its tune prompts (one per category, the first this many
    categories), its confirmation, and its demo's timed repeats per contender."""

    prompts: int
    confirm_top: int
    confirm_rounds: int
    demo_repeats: int

    def demo_seconds(self, costs: StepCosts) -> float:
        """The demo at plain's pace: three contenders' warm-ups and repeats, and a reference."""
        contender = costs.decode(DEMO_WARM_UP_TOKENS) + self.demo_repeats * costs.decode(DEMO_NEW_TOKENS)
        return 3 * contender + costs.decode(DEMO_NEW_TOKENS)


# Largest first; each later size gives up what matters least to a slower machine's user: demo
# repeats and confirmation rounds, then a confirmed trial, then half the categories in the tune
# (its trials are still judged by real decoding on those).
QUICKSTART_SIZES = (
    QuickstartSize(len(WORKLOAD_CATEGORIES), 2, 2, 3),
    QuickstartSize(len(WORKLOAD_CATEGORIES), 2, 1, 2),
    QuickstartSize(len(WORKLOAD_CATEGORIES), 1, 1, 1),
    QuickstartSize(len(WORKLOAD_CATEGORIES) // 2, 1, 1, 1),
)


@dataclasses.dataclass(frozen=True)
class QuickstartPlan:
    config: StudyConfig
    size: QuickstartSize
    tune: TunePlan
    trial_seconds: float  # the window the trials run in
    demo_seconds: float

    @property
    def total(self) -> float:
        return self.tune.before_trials + self.trial_seconds + self.tune.confirmation + self.demo_seconds


def quickstart_plan(costs: StepCosts, seconds: float = QUICKSTART_SECONDS) -> QuickstartPlan:
    """The largest quickstart (`QUICKSTART_SIZES`, then the most new tokens and timing rounds)
    that fits `seconds` at `costs`, with time for trials; on a machine too slow for even the
    smallest, the smallest, which then takes longer."""
    for size in QUICKSTART_SIZES:
        demo = size.demo_seconds(costs)
        plan = plan_tune(seconds - demo, costs, size.prompts, size.confirm_top, size.confirm_rounds,
                         QUICKSTART_NEW_TOKENS, QUICKSTART_CALIBRATION_ROUNDS)
        if not isinstance(plan, str):
            break
    else:
        plan = tune_costs(costs, size.prompts, QUICKSTART_NEW_TOKENS[-1], QUICKSTART_CALIBRATION_ROUNDS[-1],
                          size.confirm_top, size.confirm_rounds)
    config = dataclasses.replace(
        QUICKSTART_CONFIG,
        prompts=dataclasses.replace(QUICKSTART_CONFIG.prompts, max_new_tokens=plan.max_new_tokens,
                                    n_prompts=size.prompts),
        study=dataclasses.replace(QUICKSTART_CONFIG.study, confirm_top=size.confirm_top,
                                  confirm_rounds=size.confirm_rounds, calibration_rounds=plan.calibration_rounds),
    )
    window = max(seconds - demo - plan.before_trials - plan.confirmation, MIN_TRIALS * plan.trial)
    return QuickstartPlan(config, size, plan, window, demo)


def _measure_costs() -> StepCosts:
    """A few plain steps of the embedded model, and its verification at a few widths, timed here."""
    from .default_study import time_plain_step, time_verification

    model, tokenizer = QUICKSTART_CONFIG.model.load()
    step, prefill = time_plain_step(model, tokenizer, demo_prompt())
    return StepCosts.of(step, time_verification(model, _WIDTHS, rounds=1), prefill)


def demo_prompt() -> Prompt:
    """The workload's first held-out prompt: no study, the quickstart's included, tunes on it."""
    return load_prompts(WORKLOAD, 1, split=HELD_OUT_SPLIT)[0]


def demo_rate(runs: Sequence[TimedRun]) -> float:
    """A contender's tokens per second over its demo runs: the median of each run's own rate.
    Past a reduced-precision near-tie a decode may end sooner than plain's, and the repeats of
    one profile need not meet the same near-ties (the back-off's timed choices change a
    verification's width, so its rounding), so a run's seconds count only against its own tokens."""
    return statistics.median(run.tokens_per_second for run in runs)


def run_quickstart(output: Path, n_trials: int, storage_url: str | None, show_progress: bool = True) -> int:
    output = output_directory(output, "--output")  # refused now, not after minutes of tuning
    storage_url = resolve_storage_url(storage_url)
    storage = open_storage(storage_url)  # a bad storage too, before the model loads to be timed
    started = progress.clock()
    with progress.task("timing a few plain steps"):
        costs = _measure_costs()
    plan = quickstart_plan(costs, QUICKSTART_SECONDS - (progress.clock() - started))
    progress.say(
        f"A plain step of the embedded model takes {costs.step:.3f} s here: the quickstart takes about "
        f"{progress.minutes(progress.clock() - started + plan.total)} in all."
    )
    with progress.task("the quickstart", planned_seconds=plan.total):
        result = _tune_and_export(output, plan, n_trials, storage_url, storage, show_progress)
        return _demo(result, plan.size)


def _tune_and_export(output: Path, plan: QuickstartPlan, n_trials: int, storage_url: str, storage,
                     show_progress: bool) -> ExportResult:
    """Steps 1 and 2: a short estimated study on the embedded model, its best trial exported."""
    config = plan.config
    print(
        f"1/3  Tuning Kangaroo and prompt lookup on the embedded model: estimated trials for "
        f"{progress.minutes(plan.trial_seconds)} (at most {n_trials}) on one workload prompt in each of "
        f"{plan.size.prompts} categories, {config.prompts.max_new_tokens} new tokens each, then measuring the best "
        f"{config.study.confirm_top} by real decoding, {config.study.confirm_rounds} round(s) (the full search is "
        "`hf-selfspec tune studies/smollm2-135m-workload-general-bf16.toml`).",
        flush=True,
    )
    existing = optuna.get_all_study_names(storage)
    for name in (QUICKSTART_CONFIG.study.name, estimated_study_name(QUICKSTART_CONFIG.study.name)):
        if name in existing:
            optuna.delete_study(study_name=name, storage=storage)
    deadline = progress.clock() + plan.tune.before_trials + plan.trial_seconds
    outcome = run_tune(config, storage_url, n_trials=n_trials, show_progress=show_progress, deadline=deadline)
    print(format_summary(outcome))
    best = outcome.best
    if best is None:
        raise TuningError(
            "no trial completed, so there is nothing to export; run quickstart again with more --n-trials"
        )
    if best.value <= 1:
        print(
            f"\nNo trial beat plain decoding in this short tune (best {best.value:.2f}x); exporting the best "
            "anyway. The full search, `hf-selfspec tune studies/smollm2-135m-workload-general-bf16.toml`, tries far more."
        )

    print(f"\n2/3  Exporting trial {best.number} to {output}/generation_config.json", flush=True)
    return export_profile(outcome.storage_url, outcome.export_study.study_name, output)


def _demo(result: ExportResult, size: QuickstartSize) -> int:
    """Step 3: the held-out prompt decoded plainly, with the new profile and with the shipped one,
    timed and checked against plain greedy decoding; the exit status."""
    from hf_selfspec.tuner_api import (
        NEAR_TIE,
        PLAIN,
        check_greedy_consistency,
        encode_prompt,
        load_embedded,
        load_model_and_tokenizer,
    )

    print(f"\n3/3  Decoding the first held-out workload prompt: plain, with {result.path}, and with the "
          "profile shipped in the package (what `hf_selfspec.load_embedded()` applies)", flush=True)
    fresh_model, tokenizer = load_model_and_tokenizer(EMBEDDED, generation_config=result.path)
    shipped_model, _ = load_embedded()
    prompt = demo_prompt()
    inputs = encode_prompt(tokenizer, prompt)
    kwargs = {"max_new_tokens": DEMO_NEW_TOKENS, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    # No strategy for the tuned rows: the profile in each model's generation config decides.
    contenders = {
        "plain generate": lambda **length: timed_generate(fresh_model, inputs, strategy=PLAIN, **(kwargs | length)),
        "this tune": lambda **length: timed_generate(fresh_model, inputs, **(kwargs | length)),
        "shipped profile": lambda **length: timed_generate(shipped_model, inputs, **(kwargs | length)),
    }
    runs: dict[str, list] = {name: [] for name in contenders}
    # the first pass warms every contender up on a short decode, uncounted
    for repeat in progress.counting(range(size.demo_repeats + 1), "the demo", "rounds of its three decodes"):
        for name, decode in contenders.items():
            if repeat:
                runs[name].append(decode())
            else:
                decode(max_new_tokens=DEMO_WARM_UP_TOKENS)
    if runs["this tune"][0].stats is None:
        raise TuningError(f"the model did not pick up the profile {result.key!r} from {result.path}")
    plain = runs["plain generate"]
    print(f"\n--- {prompt.id}, {len(plain[0].new_tokens)} new tokens ---")
    print(
        tokenizer.decode(inputs["input_ids"][0], skip_special_tokens=True)
        + tokenizer.decode(plain[0].new_tokens, skip_special_tokens=True)
    )
    print(f"--- median of {size.demo_repeats} interleaved runs each, {fresh_model.dtype} ---")
    # One untimed plain decode with its logits: what a reduced-precision near-tie is judged by.
    reference = timed_generate(fresh_model, inputs, strategy=PLAIN, output_logits=True, **kwargs)
    verdicts = []
    rates = {name: demo_rate(timed) for name, timed in runs.items()}
    for name, timed in runs.items():
        line = f"{name:<16} {rates[name]:6.1f} tokens/s"
        stats = timed[0].stats
        if name != "plain generate":
            if stats is None:  # only the shipped profile can be missing: it covers one device
                line += "  (no tuned profile for this device: it decoded plainly)"
            else:
                speedup = rates[name] / rates["plain generate"]
                line += f"  {speedup:.2f}x, acceptance {stats.acceptance_rate:.0%}, strategy {stats.strategy}"
        print(line)
        verdicts += [
            check_greedy_consistency(run.new_tokens, reference.new_tokens, reference.logits, fresh_model.dtype)
            for run in timed
        ]
    if not all(verdict.consistent for verdict in verdicts):
        print("The tokens DIFFER from plain greedy decoding: that is a bug in the strategy, please report it.")
        return 1
    near_ties = [verdict for verdict in verdicts if verdict.verdict == NEAR_TIE]
    if near_ties:
        widest = max(verdict.gap_ulps for verdict in near_ties)
        print(
            f"The tokens are plain greedy decoding's up to a {fresh_model.dtype} near-tie: where they first differ, "
            f"plain's own logits for the two tokens were within {widest:g} ulp (see hf_selfspec.consistency)."
        )
    else:
        print("The tokens are identical to plain greedy decoding: the speedup is lossless.")
    return 0
