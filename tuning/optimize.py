"""`hf-selfspec optimize`: from a model to a tuned profile in one command, within a time budget.

Stages, each recorded in `OUTPUT/work/optimize.json` when it finishes, so that a run killed at any
point resumes at the stage it was in (whose own work resumes too: generated text and training
checkpoints live in the user cache, trials in the study's SQLite file beside the state):

  measure  the model's shape, the cost of a verification at several widths, seconds per token
  corpus   a lookup corpus of text the model writes itself, sized to its share of the budget
  adapter  draft heads (`draft_heads`), if its share of the budget pays for enough training steps
  tune     an estimated study over ranges derived from the measurements (`default_study`)
  confirm  the best trials, plain and transformers' prompt lookup, decoded on held-out prompts
  export   the held-out winner as `OUTPUT/generation_config.json`, with its adapter and corpus

The budget is wall time across runs, a killed stage's seconds included (`optimize_state`). The
measure stage times a few plain steps first; every later stage sizes its work (tokens to write,
steps to train, the cost model's rounds and the tune prompts' tokens, the tuner's window, prompts
to decode) from them and from what is left (`budget`), and a stage that cannot pay back in it is
skipped with one line saying why. While a stage runs, a line at least every 30 seconds says
where it is (`progress`).
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path
from typing import Any, Callable

from hf_selfspec.tuner_api import (
    HELD_OUT_SPLIT,
    WORKLOAD,
    InputError,
    load_prompts,
    output_directory,
    read_jsonl_prompts,
)

from . import TuningError, progress
from .budget import (
    BATCH_CHUNKS, CHUNK_TOKENS, SHARES, StepCosts, adapter_plan, adapter_text, confirm_prompts, corpus_plan,
    plan_study, plan_tune,
)
from .optimize_state import OptimizeRequest, Run, load_state
from .studies.config import PromptConfig
from .default_study import (
    CONFIRM_TOP,
    VERIFY_WIDTHS,
    DerivedSpace,
    default_prompts,
    default_study_config,
    derive_space,
    has_streams,
    objective_for,
    time_plain_step,
    time_verification,
)
from .studies.storage import resolve_storage_url
from .studies.study_prompts import prompts_by_category, select_study_prompts
from .studies.study_toml import model_entries, study_toml, toml_tables

STUDY_FILE = "study.toml"
STAGES = ("measure", "corpus", "adapter", "tune", "confirm", "export")
# The share of the corpus's tokens that the training vocabulary (the lowest ids) covers: the
# draft head keeps the lowest ids too, and on a large vocabulary the head is most of a step's cost.
_TRAINING_COVERAGE = 0.9
_MAX_CONFIRM_PER_CATEGORY = 4
# Whole decodes a tune prompt costs whatever the trials: its reference, the loop's calibration (a
# decode by the loop and a plain one) and the confirmation of the best estimates (one by each,
# beside a plain one); the teacher-forced pass and the cost model's timing come on top.
_DECODES_PER_TUNE_PROMPT = 3 + CONFIRM_TOP + 1
# The share of the tuning stage those decodes may take, the rest left to the trials.
_PROMPT_SHARE = 0.5
_MAX_TRIALS = 500
_PLANNED_AT_SHARE = ("measure", "corpus", "adapter")
# The adapter stage trains draft heads: they run no layer, so a draft costs a small part of a
# step wherever the model is deep, and their runner-ups widen a verification that is cheap where
# drafting pays at all. One head: a later head guesses from a state a token older, and the
# lookup, not the heads, carries a draft past one token. Zero-initialised residual blocks learn
# within the few hundred steps a budget pays for at this rate.
DRAFT_HEADS = 1
_HEADS_LR = 1e-3


def check_request(request: OptimizeRequest) -> OptimizeRequest:
    """Refuse what would only fail after minutes of work."""
    if not request.budget_seconds > 0:
        raise TuningError(f"--budget {request.budget_seconds / 60:g}: give a positive number of minutes")
    try:
        output_directory(request.output, "--output")
    except InputError as error:
        raise TuningError(str(error)) from None
    if request.prompts is not None:
        read_jsonl_prompts(request.prompts)  # a PromptFileError names the file and line
    if request.storage is not None:
        resolve_storage_url(request.storage)
    return request


def run_optimize(request: OptimizeRequest) -> str:
    """Run (or resume) every stage; returns the closing table."""
    check_request(request)
    run = Run(request, load_state(request))
    steps: dict[str, Callable[[Run], dict[str, Any]]] = {
        "measure": _measure, "corpus": _corpus, "adapter": _adapter, "tune": _tune, "confirm": _confirm,
        "export": _export,
    }
    for number, stage in enumerate(STAGES, start=1):
        if stage in run.stages:
            print(f"{number}/{len(STAGES)}  {stage}: done in an earlier run", flush=True)
            continue
        left = max(run.remaining(), 0)
        progress.say(f"{number}/{len(STAGES)}  {stage} ({left / 60:.1f} min of the budget left)")
        # a line at least every interval while it runs; the stages sized at their share planned so
        with progress.task(stage, planned_seconds=run.share(stage) if stage in _PLANNED_AT_SHARE else None), \
                run.keeping_time():
            result = steps[stage](run)
        run.finish(stage, result)
    return format_table(run.stages["confirm"], run.stages["export"])


def _space(run: Run) -> DerivedSpace:
    measured = run.stages["measure"]
    verify = {int(width): seconds for width, seconds in measured["verify_seconds"].items()}
    return derive_space(measured["num_layers"], measured["vocab_size"], verify)


def _measure(run: Run) -> dict[str, Any]:
    """The model's shape, and what one token and one verification cost, timed once for every
    stage's sizing (and kept, so a resumed run sizes the same way). A few plain steps are timed
    first, and the rest of the stage is sized from them."""
    import torch

    from hf_selfspec.tuner_api import decoder_layers, timed

    from .training.corpus import CorpusConfig
    from .training.self_prompted import time_sampled_choice

    model, tokenizer = run.request.model.load()
    seconds_per_token, prefill_seconds = time_plain_step(model, tokenizer, load_prompts(WORKLOAD, 1)[0])
    progress.say(f"     a plain step takes {seconds_per_token:.3f} s here, after a prompt's prefill of "
                 f"{prefill_seconds:.1f} s")
    # One chunk's forward pass, after one untimed, stands for a batch of them: the teacher's pass
    # over the adapter's corpus is sized from it.
    chunk = torch.zeros((1, CHUNK_TOKENS), dtype=torch.long, device=model.device)
    with torch.inference_mode():
        forward = [timed(lambda: model(chunk, use_cache=False), model.device)[1] for _ in range(2)]
    rounds = verification_rounds(run.share("measure"), seconds_per_token)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    result = {
        "num_layers": len(decoder_layers(model)),
        "vocab_size": vocab_size,
        "verify_seconds": time_verification(model, rounds=rounds),
        "seconds_per_token": seconds_per_token,
        "prefill_seconds": prefill_seconds,
        "batch_forward_seconds": BATCH_CHUNKS * forward[-1],
        # the corpus stage samples its requests with the [corpus] defaults
        "sampled_row_choice_seconds": time_sampled_choice(vocab_size, model.device, CorpusConfig()),
        "objective": objective_for(model),
        "chat": bool(getattr(tokenizer, "chat_template", None)),
    }
    space = derive_space(result["num_layers"], result["vocab_size"], result["verify_seconds"])
    for reason in space.reasons:
        print(f"     {reason}", flush=True)
    return result


def _step_costs(measured: dict[str, Any]) -> StepCosts:
    """The measure stage's prices (a run measured before prefills were timed apart has none)."""
    return StepCosts.of(measured["seconds_per_token"], measured["verify_seconds"], measured.get("prefill_seconds", 0.0))


def verification_rounds(seconds: float, seconds_per_token: float) -> int:
    """Rounds of `time_verification` that fit in half of `seconds`, a round of its widths costing
    about twice as many plain steps as it has widths (the wider ones cost more than a step); one
    at least, three at most."""
    per_round = 2 * len(VERIFY_WIDTHS) * seconds_per_token
    return max(1, min(3, int(seconds / 2 / per_round) - 1))  # one more round warms up, uncounted


def _corpus(run: Run) -> dict[str, Any]:
    from .training.write_lookup_corpus import describe_result, load_lookup_corpus_config, run_write_lookup_corpus

    measured = run.stages["measure"]
    prompt_token = measured["batch_forward_seconds"] / (BATCH_CHUNKS * CHUNK_TOKENS)
    # A run measured before the sampling's choice was timed prices it at nothing, as it did then.
    plan = _tune_first(run) or corpus_plan(run.share("corpus"), measured["verify_seconds"], prompt_token,
                                           measured["chat"], measured.get("sampled_row_choice_seconds", 0.0))
    if isinstance(plan, str):
        print(f"     corpus: {plan}", flush=True)
        return {"corpus": "", "table": None, "reason": plan}
    # The text the adapter reads is part of [corpus], and the model's text is generated once for
    # every command given the same [corpus]: so the adapter's text is planned here too, whether
    # or not the adapter stage finds that training pays.
    table = {
        **adapter_text(SHARES["adapter"] * run.request.budget_seconds, measured["batch_forward_seconds"], measured["chat"]),
        "chunk_tokens": CHUNK_TOKENS,
        **plan,
    }
    path = run.request.work / "lookup-corpus.toml"
    path.write_text(
        toml_tables({
            "model": model_entries(run.request.model),
            "corpus": table,
            "output": {"name": "lookup-corpus", "output_dir": "."},
        }),
        encoding="utf-8",
    )
    written, description = run_write_lookup_corpus(load_lookup_corpus_config(path), run.request.show_progress)
    print(f"     {describe_result(written, description)}", flush=True)
    return {"corpus": str(written), "table": table}


def _tune_first(run: Run) -> str | None:
    """Why the corpus, and with it the adapter, is skipped: the study fits the time left only
    without them (a draft they would train is worth nothing untuned). None where it fits beside
    them; where it fits neither way, the run stops now, not after the corpus's minutes."""
    costs = _step_costs(run.stages["measure"])
    prompts = len(select_study_prompts(default_prompts(run.request.prompts)))
    alone = run.remaining() - SHARES["confirm"] * run.request.budget_seconds
    if not isinstance(plan_tune(alone - run.share("corpus") - run.share("adapter"), costs, prompts, CONFIRM_TOP), str):
        return None
    planned = plan_study(alone, costs, prompts, CONFIRM_TOP)
    if isinstance(planned, str):
        raise TuningError(f"no profile: the tune stage would be {planned}")
    return (f"skipped: the study fits the {progress.minutes(alone)} left only without a corpus and an adapter; give a "
            "larger --budget for them")


def _adapter(run: Run) -> dict[str, Any]:
    from .training.train_adapter import describe_result, load_train_config, run_train_adapter, training_chunks
    from .training.training import covering_vocabulary, heads_student, time_training_step
    from .training.write_lookup_corpus import load_lookup_corpus_config

    print(f"     adapter: {DRAFT_HEADS} draft head(s) on the final hidden state, read through the model's own head: "
          "no layer runs to draft, so the cheapest draft to train and to run", flush=True)
    if run.stages["corpus"]["table"] is None:
        return _no_adapter("skipped: there is no corpus to train on")
    # The corpus stage's own config, so that the text it generated is read back, not generated again.
    corpus_config = load_lookup_corpus_config(run.request.work / "lookup-corpus.toml")
    model, tokenizer = run.request.model.load()
    model.requires_grad_(False)
    chunks = training_chunks(corpus_config.corpus, corpus_config.model, model, tokenizer, run.request.show_progress)
    if len(chunks) < 2:  # one to train on and one to measure it
        return _no_adapter(f"skipped: the corpus holds {len(chunks)} chunk(s) of {CHUNK_TOKENS} tokens; give a larger --budget")
    full_vocabulary = model.get_output_embeddings().weight.shape[0]
    vocab_size = covering_vocabulary(chunks, _TRAINING_COVERAGE, full_vocabulary)
    print(f"     adapter: the KL is taken over the lowest {vocab_size or full_vocabulary} of {full_vocabulary} token ids, "
          f"which cover {_TRAINING_COVERAGE:.0%} of the corpus's tokens", flush=True)
    make_student = partial(heads_student, model, DRAFT_HEADS, lr=_HEADS_LR)
    steps, reason = adapter_plan(run.share("adapter"), time_training_step(model, make_student, vocab_size, BATCH_CHUNKS,
                                                                          CHUNK_TOKENS))
    if not steps:
        return _no_adapter(reason)
    print(f"     adapter: {reason}", flush=True)
    path = run.request.work / "train-adapter.toml"
    path.write_text(
        toml_tables({
            "model": model_entries(run.request.model),
            "corpus": run.stages["corpus"]["table"],
            "adapter": {"draft_heads": DRAFT_HEADS, "output_dir": "."},
            "training": {"steps": steps, "batch_chunks": BATCH_CHUNKS, "vocab_size": vocab_size, "lr": _HEADS_LR,
                         "eval_every": max(1, steps // 4), "checkpoint_every": max(1, steps // 10)},
        }),
        encoding="utf-8",
    )
    config = load_train_config(path)
    results = run_train_adapter(config, run.request.show_progress, loaded=(model, tokenizer))
    print(f"     {describe_result(results)}", flush=True)
    return {"adapters": {p.stem: str(p) for _, p, _ in results}, "agreement": {p.stem: a for _, p, a in results},
            "reason": reason}


def _no_adapter(reason: str) -> dict[str, Any]:
    print(f"     adapter: {reason}", flush=True)
    return {"adapters": {}, "reason": reason}


def _study_config(run: Run):
    request = run.request
    storage = request.storage or f"sqlite:///{(request.work / 'optuna.db').resolve()}"
    name = f"optimize:{Path(request.model.name).name}"
    space = _space(run)
    if run.stages["adapter"]["adapters"]:  # the heads draft no further than they have heads
        low, high = space.ranges["max_draft_tokens"]
        space = dataclasses.replace(space, ranges={**space.ranges, "max_draft_tokens": (low, min(high, DRAFT_HEADS))})
    return default_study_config(
        request.model, space, default_prompts(request.prompts), name=name,
        objective=run.stages["measure"]["objective"], storage=storage,
        draft_adapters=run.stages["adapter"]["adapters"], lookup_corpus=run.stages["corpus"]["corpus"],
        online_corpus=has_streams(request.prompts),
    )


def tune_prompts(prompts: PromptConfig, seconds: float, decode_seconds: float) -> PromptConfig:
    """`prompts` with as many of the workload's tune prompts per category as spend at most
    `_PROMPT_SHARE` of the tuning stage's `seconds` on the decodes each costs whatever the trials
    (`_DECODES_PER_TUNE_PROMPT`, at `decode_seconds` each): more prompts judge each trial on more
    of each kind of text, and the rest of the stage runs trials. At least one per category, at
    most what the split holds; a prompt file's selection is kept as it is."""
    if prompts.per_category is None:
        return prompts
    groups = prompts_by_category(load_prompts(prompts.source, split=prompts.split))
    affordable = int(_PROMPT_SHARE * seconds / (_DECODES_PER_TUNE_PROMPT * decode_seconds * len(groups)))
    per_category = max(1, min(affordable, min(len(group) for group in groups.values())))
    return dataclasses.replace(prompts, per_category=per_category)


def _tune(run: Run) -> dict[str, Any]:
    from .studies.config import load_study_config
    from .tune import format_summary, run_tune

    config = _study_config(run)
    measured = run.stages["measure"]
    costs = _step_costs(measured)
    stage = run.remaining() - SHARES["confirm"] * run.request.budget_seconds
    prompts = tune_prompts(config.prompts, stage, costs.decode(config.prompts.max_new_tokens))
    count = len(select_study_prompts(prompts))
    planned = plan_study(stage, costs, count, CONFIRM_TOP)
    if isinstance(planned, str):
        raise TuningError(f"no profile: the tune stage is {planned}")
    size, plan = planned
    if size < count:
        prompts = dataclasses.replace(prompts, n_prompts=size)
        print(f"     tune: a study of all {count} tune prompts does not fit the {progress.minutes(stage)} left "
              f"({costs.step:.2f} s a token); it takes the first {size}", flush=True)
    # The trials run until the stage's time is spent (a rerun of the TOML too), never past a cap.
    trials = dataclasses.replace(config.study, n_trials=_MAX_TRIALS, timeout=max(round((1 - _PROMPT_SHARE) * stage), 1),
                                 calibration_rounds=plan.calibration_rounds)
    prompts = dataclasses.replace(prompts, max_new_tokens=plan.max_new_tokens)
    config = dataclasses.replace(config, prompts=prompts, study=trials)
    toml_path = run.request.output / STUDY_FILE
    toml_path.write_text(study_toml(config, toml_path), encoding="utf-8")
    config = load_study_config(toml_path)  # what a rerun of the TOML reads, checked now
    print(f"     wrote {toml_path} (rerun it with `hf-selfspec tune {toml_path}`)", flush=True)
    # No trial starts after the deadline, counted after the model load and the cost model's
    # timing; the confirmation of the best estimates that follows is priced in plain decodes of
    # the prompts (one plain decode of each, and one by each confirmed trial, none priced faster).
    count = len(select_study_prompts(config.prompts))
    window = stage - plan.confirmation
    print(f"     {count} tune prompts of {plan.max_new_tokens} new tokens, the cost model timed in "
          f"{plan.calibration_rounds} rounds; tuning until {window / 60:.1f} min from now", flush=True)
    outcome = run_tune(config, n_trials=None, show_progress=run.request.show_progress,
                       deadline=progress.clock() + window)
    print(format_summary(outcome), flush=True)
    if outcome.best is None:
        raise TuningError("no trial completed in the tuning stage; give a larger --budget")
    return {"storage": outcome.storage_url, "study": outcome.export_study.study_name,
            "strategy": config.search.strategy}


def _held_out(request: OptimizeRequest) -> str:
    """Where the held-out prompts come from: the --prompts file if it marks a held-out split,
    else the workload's."""
    if request.prompts and any(p.split == HELD_OUT_SPLIT for p in read_jsonl_prompts(request.prompts)):
        return str(Path(request.prompts).resolve())
    return WORKLOAD


def _confirm(run: Run) -> dict[str, Any]:
    """Decode plain, transformers' prompt lookup (as transformers runs it and on our kernels) and
    the best trial measured on the tune prompts, interleaved, on the held-out prompts (as many per
    category as the budget pays for, no prompt started that the time left does not pay for),
    greedily and checked. The trial is chosen before: a winner chosen on the held-out prompts
    would carry its luck there into the figure they give."""
    import optuna
    from optuna.trial import TrialState

    from hf_selfspec.bench.contenders import (
        BASELINE, HF_SELFSPEC, PROMPT_LOOKUP, PROMPT_LOOKUP_OUR_KERNELS, TUNED, Contender, build_contenders,
    )
    from hf_selfspec.bench.machine import machine_info
    from hf_selfspec.bench.report import results_document
    from hf_selfspec.bench.runner import measure
    from hf_selfspec.tuner_api import DIVERGENT, available_strategies

    from .studies.categories import is_feasible
    from .studies.space import ADAPTER_PARAM, decode_params, uses_online_corpus

    tuned = run.stages["tune"]
    config = _study_config(run)
    study = optuna.load_study(study_name=tuned["study"], storage=tuned["storage"])
    trials = sorted(
        (t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if is_feasible(t)),
        key=lambda t: t.value, reverse=True,
    )[:1]
    max_new_tokens = config.prompts.max_new_tokens
    measured = run.stages["measure"]
    transformers_own = (BASELINE, PROMPT_LOOKUP, PROMPT_LOOKUP_OUR_KERNELS)
    # A warm-up decode by each contender, then per prompt a reference decode and one by each.
    contending = len(transformers_own) + len(trials)
    prompts, reason, planned = _held_out_prompts(run, contending, 1 + contending, max_new_tokens)
    print(f"     confirm: {reason}, {len(trials)} trial(s)", flush=True)
    if not prompts:
        return {"skipped": reason}

    model, tokenizer = run.request.model.load()
    contenders = [c for c in build_contenders(model, available_strategies()) if c.name in transformers_own]
    for trial in trials:
        params = decode_params(trial.params, config.search.strategy, measured["num_layers"])
        if ADAPTER_PARAM in trial.params:
            params["draft_adapter"] = config.search.draft_adapters[trial.params[ADAPTER_PARAM]]
        params["lookup_corpus"] = config.search.lookup_corpus
        if uses_online_corpus(trial.params):  # emptied by the bench at the start of each stream
            params["online_corpus"] = f"optimize/trial-{trial.number}"
        contenders.append(Contender(
            f"trial {trial.number}", {"strategy": config.search.strategy, "do_sample": False, **params},
            family=HF_SELFSPEC, params_label=TUNED,
        ))
    with progress.task("decoding the held-out prompts", planned_seconds=planned):
        measurements = measure(model, tokenizer, prompts, contenders, max_new_tokens=max_new_tokens, repeats=1,
                               progress=run.request.show_progress, time_left=run.remaining)
    results = results_document(measurements, machine=machine_info(model), skip_sets={}, command={"optimize": True})
    (run.request.work / "confirm.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    lossless = [c for c in results["contenders"]
                if c["name"].startswith("trial ") and c["consistency"]["verdict"] != DIVERGENT]
    if not lossless:
        raise TuningError(f"no confirmed trial decoded the held-out prompts as plain does; see {run.request.work}/confirm.json")
    winner = lossless[0]
    return {"winner": int(winner["name"].removeprefix("trial ")), "results": _table_rows(results, winner["name"])}


def _held_out_prompts(run: Run, once: int, decodes: int, max_new_tokens: int) -> tuple[list, str, float]:
    """As many held-out prompts as the time left pays for at `once` decodes before them and
    `decodes` decodes each, taken a category at a time (the first prompt of every category, then
    the second...); what they are, and the seconds they are planned to take."""
    groups = prompts_by_category(load_prompts(_held_out(run.request), split=HELD_OUT_SPLIT))
    costs = _step_costs(run.stages["measure"])
    count, reason = confirm_prompts(max(run.remaining(), 0.0), costs, once, decodes, max_new_tokens, len(groups),
                                    _MAX_CONFIRM_PER_CATEGORY)
    in_turn = [group[i] for i in range(_MAX_CONFIRM_PER_CATEGORY) for group in groups.values() if i < len(group)]
    return in_turn[:count], reason, (once + count * decodes) * costs.decode(max_new_tokens)


def _table_rows(results: dict[str, Any], winner: str) -> list[dict[str, Any]]:
    """Per category, then overall: the speedups of lookup and of the winner, their ratio, and
    the ratio with lookup on our kernels too."""
    from hf_selfspec.bench.contenders import PROMPT_LOOKUP

    def row(label: str, summaries: dict[str, Any]) -> dict[str, Any]:
        return {"label": label, "lookup": summaries[PROMPT_LOOKUP]["speedup"]["median"],
                "profile": summaries[winner]["speedup"]["median"],
                "ratio_to_lookup": summaries[winner]["ratio_to_lookup"]["median"],
                "ratio_to_lookup_equal_kernels": summaries[winner]["ratio_to_lookup_equal_kernels"]["median"]}

    rows = [row(name, block["contenders"]) for name, block in results["categories"].items()]
    return rows + [row("overall", {c["name"]: c for c in results["contenders"]})]


def _export(run: Run) -> dict[str, Any]:
    from .studies.export import export_profile

    # Without a held-out confirmation, the best trial measured on the tune prompts.
    tuned, winner = run.stages["tune"], run.stages["confirm"].get("winner")
    result = export_profile(tuned["storage"], tuned["study"], run.request.output, trial_number=winner)
    number = result.profile.measured["trial"]
    print(f"     wrote profile {result.key!r} ({result.profile.strategy}, trial {number}) to {result.path}", flush=True)
    return {"config": str(result.path), "trial": number, "strategy": result.profile.strategy}


def format_table(confirm: dict[str, Any], export: dict[str, Any]) -> str:
    if "skipped" in confirm:
        return (f"Profile in {export['config']} ({export['strategy']}, trial {export['trial']}), measured on the tune "
                f"prompts only: the held-out confirmation was {confirm['skipped']}")
    lines = [
        f"Profile in {export['config']} ({export['strategy']}, trial {export['trial']}), held-out prompts, "
        "speedup over plain greedy decoding:",
        f"{'':<14}{'lookup':>10}{'profile':>10}{'vs lookup':>11}{'vs lookup, equal kernels':>26}",
    ]
    for row in confirm["results"]:
        # a confirmation resumed from a run before lookup ran on our kernels has no such ratio
        equal = row.get("ratio_to_lookup_equal_kernels")
        lines.append(
            f"{row['label']:<14}{row['lookup']:>9.2f}x{row['profile']:>9.2f}x{row['ratio_to_lookup']:>10.2f}x"
            + (f"{equal:>25.2f}x" if equal is not None else f"{'-':>26}")
        )
    lines.append("equal kernels: transformers' lookup with its forward passes on the kernels our loop takes")
    return "\n".join(lines)
