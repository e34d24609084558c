"""Argument wiring for `hf-selfspec tune | dashboard | export | push | train-adapter | write-lookup-corpus | optimize |
quickstart`.

Only argparse lives here; each command's work is in its own module, imported when the command
runs, so the tuner's dependencies (optuna, optuna-dashboard, the Hub client) load only then.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys
from pathlib import Path

from hf_selfspec.tuner_api import positive_float, positive_int

from . import TuningError

STORAGE_HELP = (
    "SQLAlchemy URL of the Optuna storage, e.g. sqlite:///studies/optuna.db or "
    "postgresql+psycopg2://user:pass@host/db (default: sqlite:///studies/optuna.db, relative to the "
    "current directory)"
)
TUNE_STORAGE_HELP = STORAGE_HELP.replace("(default: ", "(default: the config's [study] storage, else ")


def _reporting(command: str):
    """Run a command with the tuner's log lines shown, and user errors printed without a traceback."""

    def wrap(func):
        @functools.wraps(func)
        def run(args: argparse.Namespace) -> int:
            from hf_selfspec.hub.package import PackageError
            from hf_selfspec.tuner_api import EmbeddedModelMissing, InputError, PromptFileError

            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
            tuning_logger = logging.getLogger(__package__)
            tuning_logger.addHandler(handler)
            tuning_logger.setLevel(logging.INFO)
            try:
                return func(args)
            except (TuningError, PackageError, PromptFileError, InputError, EmbeddedModelMissing) as error:
                print(f"hf-selfspec {command}: error: {error}", file=sys.stderr)
                return 2
            except ModuleNotFoundError as error:
                # The tuner's dependencies load when a command runs, so a missing extra shows here.
                print(
                    f"hf-selfspec {command} needs {error.name}: pip install 'hf-selfspec[tuning]'",
                    file=sys.stderr,
                )
                return 2
            finally:
                tuning_logger.removeHandler(handler)

        return run

    return wrap


def _model_config(args: argparse.Namespace):
    """The [model] section a command's --model, --dtype and --device stand for, checked now."""
    from hf_selfspec.tuner_api import model_name, usable_device

    from .studies.toml_reader import ModelConfig

    return ModelConfig(
        name=model_name(args.model), gguf_file=args.gguf_file, dtype=args.dtype or "auto",
        device=usable_device(args.device or "cpu"),
    )


def _with_model_flags(config, args: argparse.Namespace):
    """A study config with the [model] settings that `--dtype` and `--device` name in its place:
    a study tuned for another dtype or device is another study (its name says which)."""
    from hf_selfspec.tuner_api import usable_device

    changes = {name: value for name, value in (("dtype", args.dtype), ("device", args.device)) if value is not None}
    if "device" in changes:
        changes["device"] = usable_device(changes["device"])
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **changes)) if changes else config


@_reporting("tune")
def _tune(args: argparse.Namespace) -> int:
    from .studies.config import load_study_config
    from .tune import format_summary, run_tune

    if (args.study is None) == (args.model is None):
        raise TuningError("give either a STUDY.toml or --model DIR|HUB_ID (which tunes with the derived defaults)")
    if args.study is not None:
        if args.gguf_file is not None:
            raise TuningError("--gguf-file goes with --model; a STUDY.toml names its file in [model] gguf_file")
        config = _with_model_flags(load_study_config(args.study), args)
    else:
        from .default_study import study_for_model

        config = study_for_model(_model_config(args), args.storage)
    config = config.with_overrides(args.n_prompts, args.max_new_tokens)
    outcome = run_tune(config, args.storage, args.n_trials, args.timeout, show_progress=not args.no_progress)
    print(format_summary(outcome))
    return 0


@_reporting("dashboard")
def _dashboard(args: argparse.Namespace) -> int:
    from .studies.dashboard import serve
    from .studies.storage import resolve_storage_url

    if not 0 < args.port < 65536:
        raise TuningError(f"--port {args.port}: not a port number; give one from 1 to 65535")
    serve(resolve_storage_url(args.storage, create=False), args.host, args.port)
    return 0


@_reporting("export")
def _export(args: argparse.Namespace) -> int:
    from hf_selfspec.tuner_api import read_profiles_file

    from .studies.export import export_profile
    from .studies.storage import resolve_storage_url

    result = export_profile(resolve_storage_url(args.storage, create=False), args.study, args.output)
    profiles = read_profiles_file(result.path)
    measured = result.profile.measured
    print(
        f"Wrote profile {result.key!r} ({result.profile.strategy}, {measured['speedup']:.2f}x, "
        f"acceptance {measured['acceptance_rate']:.0%}, trial {measured['trial']}) to {result.path}"
    )
    adapter = result.profile.params["draft_adapter"]
    if adapter:
        print(f"Copied its draft adapter {adapter} (and its .json) beside it")
    for key, what in (("lookup_corpus", "its lookup corpus"), ("online_corpus_file", "what its online corpus learned")):
        if result.profile.params[key]:
            print(f"Copied {what}, {result.profile.params[key]} (and its .json), beside it")
    if result.profile.params["online_corpus_file"]:
        print("Its online corpus starts from it once switched on (online_corpus=, or the config's online_corpus)")
    if result.infeasible_trials:
        print(
            "Passed over trials below the study's category floor: "
            + ", ".join(str(number) for number in result.infeasible_trials)
        )
    print(f"It now holds profiles for: {', '.join(sorted(profiles))}")
    if args.custom_generate:
        from hf_selfspec.hub.package import package, summary

        print(summary(package(result.path, args.output)))
    return 0


@_reporting("push")
def _push(args: argparse.Namespace) -> int:
    from .studies.hub import push_config, push_folder

    if args.folder is not None:
        url = push_folder(args.folder, args.repo, create_pr=args.create_pr, endpoint=args.endpoint)
    else:
        url = push_config(args.config, args.repo, create_pr=args.create_pr, endpoint=args.endpoint)
    print(f"{'Opened pull request' if args.create_pr else 'Committed'}: {url}")
    return 0


@_reporting("train-adapter")
def _train_adapter(args: argparse.Namespace) -> int:
    from .training.train_adapter import describe_result, load_train_config, run_train_adapter

    config = load_train_config(args.config)
    print(describe_result(run_train_adapter(config, show_progress=not args.no_progress)))
    return 0


@_reporting("write-lookup-corpus")
def _write_lookup_corpus(args: argparse.Namespace) -> int:
    from .training.write_lookup_corpus import describe_result, load_lookup_corpus_config, run_write_lookup_corpus

    config = load_lookup_corpus_config(args.config)
    print(describe_result(*run_write_lookup_corpus(config, show_progress=not args.no_progress)))
    return 0


@_reporting("optimize")
def _optimize(args: argparse.Namespace) -> int:
    from .optimize import OptimizeRequest, check_request, run_optimize

    request = check_request(OptimizeRequest(
        model=_model_config(args), output=args.output, budget_seconds=args.budget * 60,
        prompts=args.prompts, storage=args.storage, show_progress=not args.no_progress,
    ))
    print(run_optimize(request))
    return 0


@_reporting("quickstart")
def _quickstart(args: argparse.Namespace) -> int:
    from .quickstart import run_quickstart

    return run_quickstart(args.output, args.n_trials, args.storage, show_progress=not args.no_progress)


def _add_model_arguments(parser: argparse.ArgumentParser, model_help: str, required: bool) -> None:
    parser.add_argument("--model", required=required, metavar="DIR|HUB_ID", help=model_help)
    parser.add_argument(
        "--gguf-file", metavar="F", help="GGUF file inside --model to load; a local one is dequantised once, "
        "into the user cache, and every later load reads that copy",
    )
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"],
        help="weights dtype; auto is the checkpoint's own; with a STUDY.toml, in place of its [model] dtype "
        "(default: auto, or the study's)",
    )
    parser.add_argument(
        "--device", help="device to run on, e.g. cpu or cuda; with a STUDY.toml, in place of its [model] device "
        "(default: cpu, or the study's)",
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    tune = subparsers.add_parser(
        "tune",
        help="search skip sets and thresholds for a model with Optuna (resumable, shareable)",
        description="Run an Optuna study described by a study config (TOML). Each trial measures its speedup "
        "over plain greedy generate on the study's prompts, interleaved with it, and fails if its tokens "
        "differ (in bfloat16 or float16: beyond a near-tie of plain's own logits). Trials are stored as they finish: re-running the same config resumes the study, and "
        "several processes or machines given the same --storage share it.",
    )
    tune.add_argument(
        "study", type=Path, nargs="?", metavar="STUDY.toml", help="study config, e.g. studies/smollm2-135m.toml"
    )
    _add_model_arguments(
        tune, "instead of a STUDY.toml: tune this model with the ranges `optimize` derives from its shape and "
        "this device's timings (no lookup corpus, no adapter)", required=False,
    )
    tune.add_argument(
        "--n-trials",
        type=positive_int,
        metavar="N",
        help="run N trials in this process (default: until the study holds the config's [study] n_trials)",
    )
    tune.add_argument("--timeout", type=positive_float, metavar="S", help="stop starting new trials after S seconds")
    tune.add_argument("--storage", metavar="URL", help=TUNE_STORAGE_HELP)
    tune.add_argument(
        "--n-prompts",
        type=positive_int,
        metavar="N",
        help="override [prompts] n_prompts (a different prompt set makes a different study)",
    )
    tune.add_argument(
        "--max-new-tokens",
        type=positive_int,
        metavar="N",
        help="override [prompts] max_new_tokens (a different value makes a different study)",
    )
    tune.add_argument("--no-progress", action="store_true", help="no progress bar (one line per trial remains)")
    tune.set_defaults(func=_tune)

    dashboard = subparsers.add_parser(
        "dashboard",
        help="browse the studies with optuna-dashboard",
        description="Serve optuna-dashboard on the study storage. Each study tuned here carries a note with "
        "the model, device, prompts, plain tokens/s and its best trial in words.",
    )
    dashboard.add_argument("--storage", metavar="URL", help=STORAGE_HELP)
    dashboard.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    dashboard.add_argument("--port", type=int, default=8080, help="port to listen on (default: %(default)s)")
    dashboard.set_defaults(func=_dashboard)

    export = subparsers.add_parser(
        "export",
        help="write a study's best trial as a tuned profile into DIR/generation_config.json",
        description="Add (or replace) the tuned profile for the study's device and dtype in "
        "DIR/generation_config.json, starting from the file already there, else from the model's own "
        "generation config. Profiles for other devices are kept and nothing else in DIR changes, so DIR "
        "may be the model's directory. List study names with `optuna studies --storage URL`.",
    )
    export.add_argument("--study", required=True, metavar="NAME", help="study name, as printed by tune")
    export.add_argument("--storage", metavar="URL", help=STORAGE_HELP)
    export.add_argument("--output", required=True, type=Path, metavar="DIR", help="directory to write into")
    export.add_argument(
        "--custom-generate",
        action="store_true",
        help="then package DIR as `hf-selfspec package --config DIR/generation_config.json --output DIR` does, "
        "so that transformers alone runs the profiles (custom_generate/ and a README.md section)",
    )
    export.set_defaults(func=_export)

    push = subparsers.add_parser(
        "push",
        help="upload a tuned generation_config.json, or a packaged folder, to a Hub repository "
        "(a pull request by default)",
        description="Upload to a repository on the Hugging Face Hub, in one commit, and print the pull "
        "request's (or commit's) URL: either one file, as generation_config.json, or a folder written by "
        "`hf-selfspec package` (into the model's repository, its users get the speed-up from transformers "
        "alone; into a repository of its own, anyone can pass it as custom_generate). Needs a token "
        "(`hf auth login` or HF_TOKEN) and HF_HUB_OFFLINE unset. Local files are only read.",
    )
    what = push.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", type=Path, metavar="FILE", help="the generation_config.json to upload")
    what.add_argument(
        "--folder", type=Path, metavar="DIR", help="a folder written by `hf-selfspec package`, uploaded whole"
    )
    push.add_argument("--repo", required=True, metavar="ORG/NAME", help="model repository id")
    push.add_argument(
        "--create-pr",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="open a pull request (the default); --no-create-pr commits to the main branch directly",
    )
    push.add_argument("--endpoint", metavar="URL", help="Hub endpoint (default: huggingface_hub's, or HF_ENDPOINT)")
    push.set_defaults(func=_push)

    train = subparsers.add_parser(
        "train-adapter",
        help="train a Kangaroo draft adapter (for strategy='kangaroo'), or draft heads, by self-distillation",
        description="Self-distil a draft adapter for each exit layer of the config: one decoder block that maps "
        "the hidden state after the model's first exit_layer layers to the full model's next-token distribution "
        "(or, with draft_heads = N, N draft heads on the final hidden state, head k learning the distribution k "
        "tokens further on), "
        "teacher-forced on a corpus of text that ships with the installed packages (the standard library's "
        "sources, optionally HumanEval problems 40 onwards) and, with generated_tokens, on the model's own "
        "greedy continuations of HumanEval prompts and standard-library windows or functions; with self_prompted, "
        "on conversations it writes itself (requests it samples with the chat's user turn opened, and its greedy "
        "answers). Writes NAME.safetensors and NAME.json into the "
        "config's output_dir, beside the generation_config.json whose profile will name the file. The generated "
        "text, the model's pass over the corpus and a checkpoint every checkpoint_every steps are kept in the user cache, so a "
        "killed run resumes where it stopped and ends exactly as an uninterrupted one with the same seed.",
        epilog="Config sections (all optional): [model] name, dtype, device; [corpus] stdlib_tokens, "
        "humaneval_from, generated_tokens, stdlib_prompts, stdlib_functions, prompt_tokens, chunk_tokens, heldout_fraction, "
        "self_prompted, request_temperature, request_top_p, request_seed, max_request_tokens, answer_tokens, task_seeds, reference_passages; [adapter] exit_layers, mlp, name (may use {exit_layer}), "
        "output_dir (relative to the config), draft_heads; [training] steps, batch_chunks, lr, seed, vocab_size, eval_every, "
        "checkpoint_every. Example: studies/smollm2-135m-instruct/kangaroo-train.toml",
    )
    train.add_argument("config", type=Path, metavar="CONFIG.toml", help="training config")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    train.set_defaults(func=_train_adapter)

    corpus = subparsers.add_parser(
        "write-lookup-corpus",
        help="write a lookup corpus (the model's own continuations) for prompt lookup to continue into",
        description="Let the model continue prompts that ship with the installed packages (HumanEval problems 40 "
        "onwards, standard-library windows and functions cut after their docstring) greedily, and answer requests it "
        "writes itself (self_prompted), and write what it wrote as NAME.safetensors and NAME.json into the config's output_dir. A profile naming the file with "
        "lookup_corpus (or a study with [search] lookup_corpus) then proposes, where the current text has no "
        "matching n-gram, what the model wrote after that n-gram elsewhere. The generated text is kept in the user "
        "cache batch by batch, so a killed run resumes, and a train-adapter config with the same [model] and "
        "[corpus] generates it once for both.",
        epilog="Config sections: [model] name, dtype, device; [corpus] as for train-adapter (generated_tokens "
        "or self_prompted must be positive); [output] name, output_dir (relative to the config). Example: "
        "studies/smollm2-135m-instruct/lookup-corpus.toml",
    )
    corpus.add_argument("config", type=Path, metavar="CONFIG.toml", help="corpus config")
    corpus.add_argument("--no-progress", action="store_true", help="no progress bars")
    corpus.set_defaults(func=_write_lookup_corpus)

    optimize = subparsers.add_parser(
        "optimize",
        help="from a model to a tuned profile in one command, within a time budget",
        description="Write a lookup corpus of the model's own text, train a draft head on it if the budget "
        "allows, tune on the workload's tune split over ranges derived from the model's shape and this device's "
        "verification cost, confirm the best trials against plain decoding and transformers' prompt lookup on "
        "held-out prompts, and export the winner into DIR/generation_config.json with its files, and the study "
        "it used as DIR/study.toml. Each stage is recorded in DIR/work/optimize.json as it finishes: run the "
        "same command again to resume after a kill.",
    )
    _add_model_arguments(optimize, "the model to optimize", required=True)
    optimize.add_argument(
        "--budget", type=float, default=30.0, metavar="MINUTES",
        help="wall time for all stages together, across resumed runs (default: %(default)s)",
    )
    optimize.add_argument("--output", required=True, type=Path, metavar="DIR", help="directory to write into")
    optimize.add_argument(
        "--prompts", metavar="FILE.jsonl", help="tune on this JSONL file (its tune split, if it marks one) instead "
        "of the general workload; its held_out split, if any, is the one confirmed on",
    )
    optimize.add_argument("--storage", metavar="URL", help=STORAGE_HELP.replace(
        "sqlite:///studies/optuna.db, relative to the current directory", "DIR/work/optuna.db"))
    optimize.add_argument("--no-progress", action="store_true", help="no progress bars")
    optimize.set_defaults(func=_optimize)

    quickstart = subparsers.add_parser(
        "quickstart",
        help="tune the embedded model briefly, export the profile and generate with it",
        description="The whole loop on the CPU: a short estimated tune of the embedded SmolLM2-135M (Kangaroo "
        "with the shipped exit-1 adapters and prompt lookup into the shipped corpus) on one prompt per category "
        "of the workload's tune split, whose best trials are then measured by real decoding, an export of the "
        "best one, then a held-out workload prompt decoded plainly, with the exported profile and with the "
        "profile shipped in the package, each timed. It times a few steps first and sizes the tune to fit the "
        "whole in five minutes, and says how long it will take before it starts.",
    )
    quickstart.add_argument(
        "--output",
        type=Path,
        default=Path("studies/out/quickstart"),
        metavar="DIR",
        help="where to write generation_config.json (default: %(default)s)",
    )
    quickstart.add_argument(
        "--n-trials", type=positive_int, default=40, metavar="N",
        help="estimated trials to run at most, within the time its plan leaves them (default: %(default)s)",
    )
    quickstart.add_argument("--storage", metavar="URL", help=STORAGE_HELP)
    quickstart.add_argument("--no-progress", action="store_true", help="no progress bar")
    quickstart.set_defaults(func=_quickstart)
