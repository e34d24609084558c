"""`hf-selfspec optimize`: from a model to a tuned profile in one command, within a time budget.

Stages, each recorded in `OUTPUT/work/optimize.json` when it finishes, so that a run killed at any
point resumes at the stage it was in (whose own work resumes too: generated text and training
checkpoints live in the user cache, trials in the study's SQLite file beside the state):

  measure  the model's shape, the cost of a verification at several widths, seconds per token
  corpus   a lookup corpus of text the model writes itself, sized to its share of the budget
  adapter  a Kangaroo draft adapter, if its share of the budget pays for enough training steps
  tune     an estimated study over ranges derived from the measurements (`default_study`)
  confirm  the best trials, plain and transformers' prompt lookup, decoded on held-out prompts
  export   the held-out winner as `OUTPUT/generation_config.json`, with its adapter and corpus

The budget is wall time across runs: each finished stage adds what it took to the state, and
each stage sizes its work (tokens to write, steps to train, the tuner's timeout, prompts to
decode) to its share of what is left, from the timings of the measure stage.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
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

from . import TuningError
from .studies.config import PromptConfig
from .default_study import (
    CONFIRM_TOP,
    DerivedSpace,
    default_prompts,
    default_study_config,
    derive_space,
    has_streams,
    objective_for,
    time_verification,
)
from .studies.storage import resolve_storage_url
from .studies.study_prompts import prompts_by_category, select_study_prompts
from .studies.study_toml import model_entries, study_toml, toml_tables
from .studies.toml_reader import ModelConfig

STATE_FILE = "optimize.json"
STUDY_FILE = "study.toml"
WORK_DIR = "work"
STAGES = ("measure", "corpus", "adapter", "tune", "confirm", "export")
# Each stage's share of the whole budget; the tuner takes whatever the others leave.
SHARES = {"corpus": 0.15, "adapter": 0.25, "confirm": 0.15}
# Tokens per self-prompted request and answer, and per continued function. A request kept costs
# several sampled candidates (some run out of tokens unfinished, some are judged unusable).
_REQUEST_TOKENS, _ANSWER_TOKENS, _CONTINUATION_TOKENS = 64, 128, 128
_CANDIDATES_PER_REQUEST = 4
_CHUNK_TOKENS, _BATCH_CHUNKS = 256, 4
# The share of the corpus's tokens that the training vocabulary (the lowest ids) covers: the
# draft head keeps the lowest ids too, and on a large vocabulary the head is most of a step's cost.
_TRAINING_COVERAGE = 0.9
MIN_ADAPTER_STEPS = 100
_MAX_ADAPTER_STEPS = 2000
_MAX_STDLIB_TOKENS = 100_000
_MAX_CONFIRM_PER_CATEGORY = 4
# Whole decodes a tune prompt costs whatever the trials: its reference, the loop's calibration (a
# decode by the loop and a plain one) and the confirmation of the best estimates (one by each,
# beside a plain one); the teacher-forced pass and the cost model's timing come on top.
_DECODES_PER_TUNE_PROMPT = 3 + CONFIRM_TOP + 1
# The share of the tuning stage those decodes may take, the rest left to the trials.
_PROMPT_SHARE = 0.5
_MAX_TRIALS = 500


@dataclass(frozen=True)
class OptimizeRequest:
    model: ModelConfig
    output: Path
    budget_seconds: float
    prompts: str | None = None  # a JSONL file to tune on instead of the workload
    storage: str | None = None
    show_progress: bool = True

    @property
    def work(self) -> Path:
        return self.output / WORK_DIR


@dataclass
class _Run:
    """The state file's contents, and the clock of this run."""

    request: OptimizeRequest
    state: dict[str, Any]
    started: float = field(default_factory=time.monotonic)

    @property
    def stages(self) -> dict[str, Any]:
        return self.state["stages"]

    def remaining(self) -> float:
        return self.request.budget_seconds - self.state["spent_seconds"] - (time.monotonic() - self.started)

    def share(self, stage: str) -> float:
        return min(SHARES[stage] * self.request.budget_seconds, max(self.remaining(), 0.0))

    def finish(self, stage: str, result: dict[str, Any]) -> None:
        now = time.monotonic()
        self.state["spent_seconds"] += now - self.started
        self.started = now
        self.stages[stage] = result
        _write_json(self.request.work / STATE_FILE, self.state)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    temporary.replace(path)  # a kill never leaves half a state file


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


def _load_state(request: OptimizeRequest) -> dict[str, Any]:
    path = request.work / STATE_FILE
    recipe = {**model_entries(request.model), "prompts": request.prompts}
    if not path.is_file():
        request.work.mkdir(parents=True, exist_ok=True)
        return {"recipe": recipe, "spent_seconds": 0.0, "stages": {}}
    state = json.loads(path.read_text(encoding="utf-8"))
    if state["recipe"] != recipe:
        raise TuningError(
            f"--output {request.output} holds an optimize run of another model or prompts ({state['recipe']}); "
            "give another --output, or delete it to start over"
        )
    return state


def run_optimize(request: OptimizeRequest) -> str:
    """Run (or resume) every stage; returns the closing table."""
    check_request(request)
    run = _Run(request, _load_state(request))
    steps: dict[str, Callable[[_Run], dict[str, Any]]] = {
        "measure": _measure, "corpus": _corpus, "adapter": _adapter, "tune": _tune, "confirm": _confirm,
        "export": _export,
    }
    for number, stage in enumerate(STAGES, start=1):
        if stage in run.stages:
            print(f"{number}/{len(STAGES)}  {stage}: done in an earlier run", flush=True)
            continue
        print(f"{number}/{len(STAGES)}  {stage} ({max(run.remaining(), 0) / 60:.1f} min of the budget left)", flush=True)
        run.finish(stage, steps[stage](run))
    return format_table(run.stages["confirm"], run.stages["export"])


def _space(run: _Run) -> DerivedSpace:
    measured = run.stages["measure"]
    verify = {int(width): seconds for width, seconds in measured["verify_seconds"].items()}
    return derive_space(measured["num_layers"], measured["vocab_size"], verify)


def _measure(run: _Run) -> dict[str, Any]:
    """The model's shape, and what one token and one verification cost, timed once for every
    stage's sizing (and kept, so a resumed run sizes the same way)."""
    import torch

    from hf_selfspec.tuner_api import decoder_layers, encode_prompt, timed, timed_generate

    model, tokenizer = run.request.model.load()
    prompt = encode_prompt(tokenizer, load_prompts(WORKLOAD, 1)[0])
    kwargs = {"strategy": "plain", "do_sample": False, "max_new_tokens": 16, "pad_token_id": tokenizer.pad_token_id}
    timed_generate(model, prompt, **kwargs)  # warm-up
    decode = timed_generate(model, prompt, **kwargs)
    batch = torch.zeros((_BATCH_CHUNKS, _CHUNK_TOKENS), dtype=torch.long, device=model.device)
    with torch.inference_mode():
        forward = [timed(lambda: model(batch, use_cache=False), model.device)[1] for _ in range(2)]
    batch_seconds = forward[-1]  # the first pays for warming up
    result = {
        "num_layers": len(decoder_layers(model)),
        "vocab_size": model.get_output_embeddings().weight.shape[0],
        "verify_seconds": time_verification(model),
        "seconds_per_token": decode.seconds / max(len(decode.new_tokens), 1),
        "batch_forward_seconds": batch_seconds,
        "objective": objective_for(model),
        "chat": bool(getattr(tokenizer, "chat_template", None)),
    }
    space = derive_space(result["num_layers"], result["vocab_size"], result["verify_seconds"])
    for reason in space.reasons:
        print(f"     {reason}", flush=True)
    return result


def corpus_plan(seconds: float, seconds_per_token: float, chat: bool = True) -> dict[str, int]:
    """The [corpus] counts that make the model write for about `seconds`: half on standard-library
    functions it continues (code), half on conversations it prompts itself (the workload's kinds
    of text; at least one). A model without a chat template cannot be prompted into a
    conversation, so that half goes to pieces of standard-library text it continues instead."""
    half = seconds / 2 / seconds_per_token  # tokens the model writes in half the time
    if chat:
        plan = {
            "self_prompted": max(1, int(half / (_ANSWER_TOKENS + _CANDIDATES_PER_REQUEST * _REQUEST_TOKENS))),
            "max_request_tokens": _REQUEST_TOKENS,
            "answer_tokens": _ANSWER_TOKENS,
        }
    else:
        plan = {"stdlib_prompts": max(1, int(half / _CONTINUATION_TOKENS))}
    functions = int(half / _CONTINUATION_TOKENS)
    if functions:
        plan["stdlib_functions"] = functions
    if functions or not chat:
        plan["generated_tokens"] = _CONTINUATION_TOKENS
    return plan


def _corpus(run: _Run) -> dict[str, Any]:
    from .training.write_lookup_corpus import describe_result, load_lookup_corpus_config, run_write_lookup_corpus

    measured = run.stages["measure"]
    # The adapter's standard-library text is part of [corpus], and the model's text is generated
    # once for every command given the same [corpus]: so the adapter's text is planned here too,
    # whether or not the adapter stage finds that training pays.
    table = {
        "stdlib_tokens": adapter_text_tokens(SHARES["adapter"] * run.request.budget_seconds, measured["batch_forward_seconds"]),
        "chunk_tokens": _CHUNK_TOKENS,
        **corpus_plan(run.share("corpus"), measured["seconds_per_token"], measured["chat"]),
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


def adapter_text_tokens(seconds: float, batch_forward_seconds: float) -> int:
    """Standard-library tokens whose teacher pass takes a third of the adapter stage's `seconds`."""
    return min(_MAX_STDLIB_TOKENS, int(seconds / 3 / batch_forward_seconds * _CHUNK_TOKENS * _BATCH_CHUNKS))


def adapter_plan(seconds: float, step_seconds: float, exit_layers: tuple[int, ...]) -> tuple[int, str]:
    """Training steps per exit layer that fit in two thirds of `seconds` (the rest is the teacher's
    pass over the corpus) at `step_seconds` a step, or 0 and why not."""
    steps = min(_MAX_ADAPTER_STEPS, int(seconds * 2 / 3 / step_seconds / len(exit_layers)))
    if steps < MIN_ADAPTER_STEPS:
        return 0, (
            f"skipped: {seconds / 60:.1f} min pays for {steps} training steps per exit layer "
            f"({step_seconds:.2f} s each), fewer than the {MIN_ADAPTER_STEPS} an adapter needs; give a larger --budget"
        )
    return steps, f"{steps} steps per exit layer ({step_seconds:.2f} s each)"


def _adapter(run: _Run) -> dict[str, Any]:
    from .training.train_adapter import describe_result, load_train_config, run_train_adapter, training_chunks
    from .training.training import covering_vocabulary, time_training_step
    from .training.write_lookup_corpus import load_lookup_corpus_config

    space = _space(run)
    print(f"     {space.reasons[-1]}", flush=True)
    # The corpus stage's own config, so that the text it generated is read back, not generated again.
    corpus_config = load_lookup_corpus_config(run.request.work / "lookup-corpus.toml")
    model, tokenizer = run.request.model.load()
    model.requires_grad_(False)
    chunks = training_chunks(corpus_config.corpus, corpus_config.model, model, tokenizer, run.request.show_progress)
    if len(chunks) < 2:  # one to train on and one to measure it
        reason = f"skipped: the corpus holds {len(chunks)} chunk(s) of {_CHUNK_TOKENS} tokens; give a larger --budget"
        print(f"     adapter: {reason}", flush=True)
        return {"adapters": {}, "reason": reason}
    full_vocabulary = model.get_output_embeddings().weight.shape[0]
    vocab_size = covering_vocabulary(chunks, _TRAINING_COVERAGE, full_vocabulary)
    print(f"     adapter: the KL is taken over the lowest {vocab_size or full_vocabulary} of {full_vocabulary} token ids, "
          f"which cover {_TRAINING_COVERAGE:.0%} of the corpus's tokens", flush=True)
    step_seconds = time_training_step(model, max(space.exit_layers), True, vocab_size, _BATCH_CHUNKS, _CHUNK_TOKENS)
    steps, reason = adapter_plan(run.share("adapter"), step_seconds, space.exit_layers)
    print(f"     adapter: {reason}", flush=True)
    if not steps:
        return {"adapters": {}, "reason": reason}
    path = run.request.work / "train-adapter.toml"
    path.write_text(
        toml_tables({
            "model": model_entries(run.request.model),
            "corpus": run.stages["corpus"]["table"],
            "adapter": {"exit_layers": list(space.exit_layers), "output_dir": "."},
            "training": {"steps": steps, "batch_chunks": _BATCH_CHUNKS, "vocab_size": vocab_size,
                         "eval_every": max(1, steps // 4), "checkpoint_every": max(1, steps // 10)},
        }),
        encoding="utf-8",
    )
    config = load_train_config(path)
    results = run_train_adapter(config, run.request.show_progress, loaded=(model, tokenizer))
    print(f"     {describe_result(results)}", flush=True)
    return {"adapters": {p.stem: str(p) for _, p, _ in results}, "agreement": {str(e): a for e, _, a in results},
            "reason": reason}


def _study_config(run: _Run):
    request = run.request
    storage = request.storage or f"sqlite:///{(request.work / 'optuna.db').resolve()}"
    name = f"optimize:{Path(request.model.name).name}"
    return default_study_config(
        request.model, _space(run), default_prompts(request.prompts), name=name,
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


def _tune(run: _Run) -> dict[str, Any]:
    from .studies.config import load_study_config
    from .tune import format_summary, run_tune

    config = _study_config(run)
    measured = run.stages["measure"]
    decode = config.prompts.max_new_tokens * measured["seconds_per_token"]
    stage = run.remaining() - SHARES["confirm"] * run.request.budget_seconds
    prompts = tune_prompts(config.prompts, stage, decode)
    # The trials run until the stage's time is spent (a rerun of the TOML too), never past a cap.
    trials = dataclasses.replace(config.study, n_trials=_MAX_TRIALS, timeout=max(round((1 - _PROMPT_SHARE) * stage), 1))
    config = dataclasses.replace(config, prompts=prompts, study=trials)
    toml_path = run.request.output / STUDY_FILE
    toml_path.write_text(study_toml(config, toml_path), encoding="utf-8")
    config = load_study_config(toml_path)  # what a rerun of the TOML reads, checked now
    print(f"     wrote {toml_path} (rerun it with `hf-selfspec tune {toml_path}`)", flush=True)
    # No trial starts after the deadline, counted after the model load and the cost model's
    # timing; the confirmation of the best estimates that follows is priced in plain decodes of
    # the prompts (one plain decode of each, and one by each confirmed trial, none priced faster).
    count = len(select_study_prompts(config.prompts))
    window = stage - (CONFIRM_TOP + 1) * count * decode
    print(f"     {count} tune prompts; tuning until {max(window, 0) / 60:.1f} min from now", flush=True)
    outcome = run_tune(config, n_trials=None, show_progress=run.request.show_progress,
                       deadline=time.monotonic() + window)
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


def _confirm(run: _Run) -> dict[str, Any]:
    """Decode plain, transformers' prompt lookup (as transformers runs it and on our kernels) and
    the best measured trials, interleaved, on the held-out prompts (as many per category as the
    budget pays for), greedily and checked."""
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
    )[:CONFIRM_TOP]
    groups = prompts_by_category(load_prompts(_held_out(run.request), split=HELD_OUT_SPLIT))
    max_new_tokens = config.prompts.max_new_tokens
    measured = run.stages["measure"]
    transformers_own = (BASELINE, PROMPT_LOOKUP, PROMPT_LOOKUP_OUR_KERNELS)
    # Per prompt: a reference decode, and a warm-up plus one timed decode of each contender.
    per_prompt = (1 + 2 * (len(transformers_own) + len(trials))) * max_new_tokens * measured["seconds_per_token"]
    per_category = max(1, min(_MAX_CONFIRM_PER_CATEGORY, int(run.share("confirm") / (per_prompt * len(groups)))))
    prompts = [prompt for group in groups.values() for prompt in group[:per_category]]
    print(f"     {len(prompts)} held-out prompts ({per_category} per category), {len(trials)} trial(s)", flush=True)

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
    measurements = measure(model, tokenizer, prompts, contenders, max_new_tokens=max_new_tokens, repeats=1,
                           progress=run.request.show_progress)
    results = results_document(measurements, machine=machine_info(model), skip_sets={}, command={"optimize": True})
    (run.request.work / "confirm.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    lossless = [c for c in results["contenders"]
                if c["name"].startswith("trial ") and c["consistency"]["verdict"] != DIVERGENT]
    if not lossless:
        raise TuningError(f"no confirmed trial decoded the held-out prompts as plain does; see {run.request.work}/confirm.json")
    winner = max(lossless, key=lambda c: c["speedup"]["median"])
    return {"winner": int(winner["name"].removeprefix("trial ")), "results": _table_rows(results, winner["name"])}


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


def _export(run: _Run) -> dict[str, Any]:
    from .studies.export import export_profile

    tuned, winner = run.stages["tune"], run.stages["confirm"]["winner"]
    result = export_profile(tuned["storage"], tuned["study"], run.request.output, trial_number=winner)
    print(f"     wrote profile {result.key!r} ({result.profile.strategy}, trial {winner}) to {result.path}", flush=True)
    return {"config": str(result.path), "trial": winner, "strategy": result.profile.strategy}


def format_table(confirm: dict[str, Any], export: dict[str, Any]) -> str:
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
