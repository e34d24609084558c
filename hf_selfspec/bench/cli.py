"""`hf-selfspec bench`: the command line around `run_benchmark`.

Only argparse is imported up front, so `hf-selfspec --help` stays fast; torch, transformers and
matplotlib load when the command runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from importlib import resources
from importlib.util import find_spec
from pathlib import Path

from hf_selfspec.argtypes import non_negative_int, positive_float, positive_int, positive_ints, probability
from hf_selfspec.bench.sampling import DEFAULT_SEED, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, Sampling
from hf_selfspec.prompts import HELD_OUT_SPLIT, SPLITS, STREAMS, TUNE_SPLIT, WORKLOAD, Prompt, load_prompts

# The `bench` extra: without matplotlib the top-level CLI turns this command into an install hint.
if find_spec("matplotlib") is None:
    raise ImportError("hf-selfspec bench draws its plots with matplotlib", name="matplotlib")

CHAT = "chat"
DEFAULT_PROMPTS = "humaneval"
DEFAULT_N_PROMPTS = 20
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_REPEATS = 3
DEFAULT_OUTPUT = "bench-results"

DESCRIPTION = """\
Measure plain generate (the baseline) against transformers' prompt lookup
(prompt_lookup_num_tokens=10), transformers' early exit (assistant_early_exit at half the
layers) and each built-in self-speculative strategy, in one process on the same prompts,
greedily or, with --do-sample, sampling with the same settings and seeds for every contender.
Runs are interleaved (baseline, contender 1, contender 2, ... on each prompt, then the next
prompt) so that machine drift hits every contender alike. One warm-up run per contender comes
first and is not counted. Stopped by Ctrl-C or SIGTERM, it reports and writes the prompts it
finished and exits with status 130.

--prompts workload is the general workload shipped with hf-selfspec: eight kinds of text
(conversation, writing, translation, summarisation, QA, math, document QA, code) in a tune
split, which studies tune on, and a held-out split, which the bench measures by default.

--prompts streams is the request streams shipped with hf-selfspec: tool calls to a fixed set of
functions, successive edits of one file and questions in one answer format, each a stream of
requests in the order a service would get them (held-out split by default). Each of our
contenders with prompt lookup on then runs a second time with an online corpus of its own
("<name>+online"), emptied at each stream's start and learning from its own calls as the
stream goes on, and a table by position in the stream (the first 10 requests, the rest) follows.

Our strategy named by a tuned profile (from --config, or the model's own generation_config)
for this device and dtype runs with that profile's parameters ("tuned" in the table); every
other strategy runs with the default skip set: both sub-layers of every other layer from the
middle one on, never the last ("default"; see docs/strategies.md).
"""

EPILOG = """\
reported per contender:
  tok/s       median over repeats of generated tokens / seconds
  speedup     median over repeats of baseline seconds / contender seconds on the same prompts;
              min and max over repeats as well; with --do-sample, seconds per generated token
              in place of seconds, since sampled lengths differ
  x lookup    the same ratio with transformers' prompt lookup in the baseline's place
  accept      accepted / drafted tokens (our strategies only)
  acc/verify  mean accepted draft tokens per verification (our strategies only)
  consistent  whether its tokens equal plain greedy's on every prompt and repeat ("identical"),
              or first differ only where plain greedy's own logits for the two tokens are
              within a few units in the last place of a reduced-precision dtype ("near-tie",
              with the widest gap seen); anything else is NO (red on a terminal), and the
              command exits with status 1 if one of hf-selfspec's strategies is NO; with
              --do-sample there is no single right output: "n/a (sampled)"
When prompts carry categories, a table per category follows (and when they carry positions in a
stream, one per group of positions): each contender's median speedup
and ratio to prompt lookup in each category, over all prompts, and the geometric mean of the
category medians (each category counts once; the tuner optimises the same geometric mean).

files written to --output:
  results.json             every figure above, per contender, per category and per prompt, the
                           machine (device name, dtype, torch, transformers and hf-selfspec
                           versions), the arguments, the sampling settings and the skip sets used
  speedup.png              speedup bars with min-max whiskers
  speedup_by_category.png  median speedup per category, one bar per contender, plain at 1x
  acceptance.png           distribution of accepted draft lengths per strategy

examples:
  hf-selfspec bench --prompts workload --contenders prompt_lookup,tuned
  hf-selfspec bench --prompts workload --do-sample --temperature 0.7 --top-p 0.9
  hf-selfspec bench --prompts streams --contenders prompt_lookup,tuned
  hf-selfspec bench --n-prompts 10
  hf-selfspec bench --model ./my-model --config tuned/generation_config.json --prompt-offset 20
  hf-selfspec bench --prompts chat --max-new-tokens 128 --output bench-chat
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="measure the strategies' speedup and losslessness against plain generate",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="embedded",
        help="'embedded' (SmolLM2-135M-Instruct shipped as a wheel, offline), a local model "
        "directory or a Hub id (default: %(default)s)",
    )
    parser.add_argument("--gguf-file", metavar="F", help="GGUF file inside --model to load (directory or Hub id only)")
    parser.add_argument(
        "--config",
        metavar="generation_config.json",
        help="generation config whose tuned profile for this device and dtype to benchmark, "
        "for example one written by `hf-selfspec export` (default: the model's own; for the embedded "
        "model, the profiles shipped with hf-selfspec, as load_embedded() applies them)",
    )
    parser.add_argument(
        "--compare-config",
        action="append",
        default=[],
        metavar="generation_config.json",
        help="another generation config whose tuned profile for this device and dtype runs as one more "
        "contender, named <strategy>@<file stem>, in the same interleaved run; repeatable",
    )
    parser.add_argument(
        "--prompts",
        default=DEFAULT_PROMPTS,
        metavar="humaneval|workload|streams|chat|FILE.jsonl",
        help="'humaneval' (the HumanEval code prompts), 'workload' (the general workload shipped with "
        "hf-selfspec, eight categories of text, held-out split unless --split says otherwise), 'streams' (the "
        "request streams shipped with hf-selfspec, in stream order, held-out split unless --split says "
        "otherwise), 'chat' (20 "
        "open-ended chat prompts shipped with hf-selfspec) or a JSONL file with one object a line holding a "
        "'prompt' string or 'messages' list, and optionally 'id', 'category' and 'split' (default: %(default)s)",
    )
    parser.add_argument(
        "--split",
        choices=SPLITS,
        help=f"use only the prompts of this split: '{TUNE_SPLIT}' is what studies tune on, '{HELD_OUT_SPLIT}' what "
        f"nothing was tuned on (default: {HELD_OUT_SPLIT} for the workload and the streams, every prompt otherwise; a source "
        "without splits refuses it)",
    )
    parser.add_argument(
        "--n-prompts",
        type=positive_int,
        metavar="N",
        help=f"number of prompts to use (default: the whole split for the workload and the streams, else {DEFAULT_N_PROMPTS}; "
        "fewer if the set is smaller)",
    )
    parser.add_argument(
        "--prompt-offset",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="skip the first N prompts, to benchmark prompts that tuning did not see; for example "
        "tuning on HumanEval 0-19 and benchmarking with --prompt-offset 20 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=DEFAULT_MAX_NEW_TOKENS,
        metavar="N",
        help="tokens to generate per prompt (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=DEFAULT_REPEATS,
        metavar="R",
        help="timed passes over all prompts, after the uncounted warm-up; min and max need at "
        "least 3 to mean anything (default: %(default)s)",
    )
    parser.add_argument(
        "--do-sample",
        action="store_true",
        help="sample instead of decoding greedily, every contender (the baseline included) with the same "
        "settings; speedups are then per generated token and consistency is not checked",
    )
    parser.add_argument(
        "--temperature",
        type=positive_float,
        metavar="T",
        help=f"sampling temperature, with --do-sample (default: {DEFAULT_TEMPERATURE:g})",
    )
    parser.add_argument(
        "--top-p",
        type=probability,
        metavar="P",
        help=f"nucleus sampling mass, with --do-sample (default: {DEFAULT_TOP_P:g})",
    )
    parser.add_argument(
        "--seed",
        type=non_negative_int,
        metavar="S",
        help=f"with --do-sample, repeat r samples from seed S+r, reset before every timed call so that every "
        f"contender on a prompt draws from the same seed (default: {DEFAULT_SEED})",
    )
    parser.add_argument(
        "--assistant",
        metavar="DIR",
        help="a small draft model sharing the model's tokenizer; adds transformers' assisted "
        "generation and our target_confidence_gated strategy drafting with it",
    )
    parser.add_argument(
        "--custom-generate",
        metavar="DIR",
        help="a folder written by `hf-selfspec package`; adds the contender custom_generate: the tuned "
        "profile's strategy and parameters, run by that folder's code through transformers' own "
        "generate(custom_generate=DIR, trust_remote_code=True), to compare with the installed plugin",
    )
    parser.add_argument(
        "--draft-adapter",
        metavar="FILE",
        help="a draft adapter (from `hf-selfspec train-adapter`) for the kangaroo contender, run with "
        "default parameters; without it kangaroo runs only when the tuned profile names it",
    )
    parser.add_argument(
        "--contenders",
        metavar="NAME[,NAME...]",
        help="run only these contenders besides the baseline and those that --custom-generate and "
        "--compare-config ask for, for example 'prompt_lookup,tuned' for transformers' lookup and the "
        "tuned profile's strategy ('tuned' names it), leaving out the slow early exit (default: all; "
        "names as in the table)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_ints,
        metavar="N[,N...]",
        help="decode the prompts in batches of each of these sizes, each batch of one category, left-padded: "
        "plain batched generate (on its kernels and on ours) against our contenders on the whole batch and at "
        "batch 1 on its prompts, in tokens per second over the batch, per category; writes batches.json "
        "(greedy only)",
    )
    parser.add_argument(
        "--device", help="device to run on, e.g. cpu, cuda or cuda:1 (default: cuda when available, else cpu)"
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weights dtype; auto is the checkpoint's own (bfloat16 for the embedded model), or float32 "
        "on a CPU without native bfloat16 arithmetic (default: %(default)s)",
    )
    parser.add_argument(
        "--output",
        default=DEFAULT_OUTPUT,
        metavar="DIR",
        help="directory for results.json, speedup.png, speedup_by_category.png and acceptance.png, created if "
        "missing (default: %(default)s)",
    )
    parser.set_defaults(func=run)
    return parser


def _fail(message: object) -> int:
    """One line on stderr and exit status 2, like argparse's own usage errors."""
    print(f"hf-selfspec bench: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def prompt_source(name: str) -> str | Path:
    """`chat` is the prompt file shipped with the package; anything else goes to `load_prompts`."""
    if name == CHAT:
        return Path(str(resources.files("hf_selfspec").joinpath("data", "chat_prompts.jsonl")))
    return name


def bench_prompts(args: argparse.Namespace) -> list[Prompt]:
    """The prompts `--prompts`, `--split`, `--n-prompts` and `--prompt-offset` select: the workload's
    and the streams' held-out split and all of it unless told otherwise, `DEFAULT_N_PROMPTS` of
    anything else."""
    source = prompt_source(args.prompts)
    workload = args.prompts in (WORKLOAD, STREAMS)
    if args.split is not None and not any(prompt.split for prompt in load_prompts(source)):
        raise ValueError(
            f"--split {args.split}: {args.prompts} has no prompt marked with a split; use --prompts workload or a "
            "file whose rows carry 'split'"
        )
    split = args.split or (HELD_OUT_SPLIT if workload else None)
    n = args.n_prompts or (None if workload else DEFAULT_N_PROMPTS)
    return load_prompts(source, n=n, offset=args.prompt_offset, split=split)


def bench_sampling(args: argparse.Namespace) -> Sampling | None:
    """The sampling settings of `--do-sample`, or None for greedy decoding; the sampling flags
    without `--do-sample` are refused rather than quietly measuring greedy decoding."""
    given = {
        name: value
        for name, value in {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}.items()
        if value is not None
    }
    if args.do_sample and getattr(args, "batch_size", None):
        raise ValueError("--batch-size measures greedy decoding; drop --do-sample")
    if args.do_sample:
        return Sampling(**given)
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(f"{flags} only apply with --do-sample; add it or drop them")
    return None


def check_config(path: str, flag: str = "--config") -> None:
    """Read a config and validate its tuned profiles before the model loads, so a typo costs
    a second rather than the minutes of loading a large model."""
    from ..profiles import read_config_json, read_profiles

    data = read_config_json(Path(path), flag)
    try:
        read_profiles(data)
    except ValueError as error:
        raise ValueError(f"{flag} {path}: {error}") from None


def _default_config(model_name: str) -> str | None:
    """The embedded model is benchmarked as `load_embedded()` serves it, with the shipped profiles;
    any other model with its own generation config."""
    from ..embedded import TUNED_CONFIG
    from ..loading import EMBEDDED

    return str(TUNED_CONFIG) if model_name == EMBEDDED else None


def _device(args: argparse.Namespace) -> str:
    import torch

    from ..inputs import usable_device

    return usable_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _load_assistant(path: str, tokenizer, device: str, dtype):
    from ..loading import load_model_and_tokenizer

    assistant, assistant_tokenizer = load_model_and_tokenizer(path, dtype=dtype, device=device)
    if assistant_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError("it must use the same tokenizer as the model")
    return assistant


def select_contenders(contenders: list, names: str | None) -> list:
    """The baseline, the packaged profile (there only when `--custom-generate` asked for it) and
    the named contenders, in the bench's own order; every contender when `names` is None. The
    baseline and each named contender bring their twin on our kernels, where they have one, so
    that every ratio has its equal-kernel counterpart beside it.

    `tuned` names whichever strategy the tuned profile runs: the one contender a user comparing
    "the default" with transformers' options means, whose strategy name they would otherwise
    have to read out of the profile."""
    from .contenders import BASELINE, CUSTOM_GENERATE, OUR_KERNELS, PLAIN_OUR_KERNELS, TUNED

    if names is None:
        return contenders
    wanted = {name.strip() for name in names.split(",") if name.strip()}
    known = {contender.name for contender in contenders}
    tuned = {contender.name for contender in contenders if contender.params_label == TUNED}
    if TUNED in wanted:
        if not tuned:
            raise ValueError(
                f"--contenders {names}: no tuned profile for this device and dtype to run as {TUNED!r}; "
                "pass --config with one"
            )
        wanted = (wanted - {TUNED}) | tuned
    unknown = sorted(wanted - known)
    if unknown or not wanted:
        raise ValueError(
            f"--contenders {names}: unknown {', '.join(unknown) or 'empty list'}; "
            f"choose from {', '.join(sorted(known - {BASELINE}) + ([TUNED] if tuned else []))}"
        )
    kept = wanted | {BASELINE, PLAIN_OUR_KERNELS, CUSTOM_GENERATE}
    kept |= {f"{name}{OUR_KERNELS}" for name in wanted}
    return [contender for contender in contenders if contender.name in kept]


def _checked_files(args: argparse.Namespace, model_name: str) -> str | None:
    """The generation config to load, once every file the command names reads as what it must be."""
    from ..adapter import check_adapter_file
    from ..hub.package import check_package_folder

    config = args.config or _default_config(model_name)
    if config:
        check_config(config)
    for compared in args.compare_config:
        check_config(compared, "--compare-config")
    if args.custom_generate:
        check_package_folder(args.custom_generate, "--custom-generate")
    if args.draft_adapter:
        check_adapter_file(args.draft_adapter, "--draft-adapter")
    return config


def run(args: argparse.Namespace) -> int:
    from .. import available_strategies
    from ..adapter import read_adapter
    from ..inputs import model_name as model_name_input
    from ..loading import load_model_and_tokenizer
    from .batched import run_batches
    from .benchmark import run_benchmark
    from .contenders import build_contenders, compared_profile_contender, online_contenders

    # Everything that can be checked cheaply is checked before the model loads.
    try:
        prompts = bench_prompts(args)
        sampling = bench_sampling(args)
        model_name = model_name_input(args.model)
        config = _checked_files(args, model_name)
        device = _device(args)
        Path(args.output).mkdir(parents=True, exist_ok=True)
    except ValueError as error:  # PromptFileError included: its message names the file and line
        return _fail(error)
    except OSError as error:
        return _fail(f"--output {args.output}: cannot create it ({error.strerror or error})")
    try:
        model, tokenizer = load_model_and_tokenizer(
            model_name, gguf_file=args.gguf_file, dtype=args.dtype, device=device, generation_config=config
        )
    except (OSError, ValueError, RuntimeError) as error:  # bad path or id, no embedded wheel, bad files
        return _fail(f"cannot load --model {args.model}: {error}")
    try:
        # the draft model computes in the dtype the model settled on
        assistant = _load_assistant(args.assistant, tokenizer, device, model.dtype) if args.assistant else None
    except (OSError, ValueError, RuntimeError) as error:
        return _fail(f"cannot load --assistant {args.assistant}: {error}")
    try:
        if args.draft_adapter:
            read_adapter(model, args.draft_adapter)  # fits this model, weights finite: before any timing
        contenders = select_contenders(
            build_contenders(
                model,
                available_strategies(),
                assistant=assistant,
                custom_generate=args.custom_generate,
                draft_adapter=str(Path(args.draft_adapter).resolve()) if args.draft_adapter else None,
            ),
            args.contenders,
        ) + [compared_profile_contender(model, path) for path in args.compare_config]
        if any(prompt.stream for prompt in prompts):
            contenders += online_contenders(contenders)
        names = [contender.name for contender in contenders]
        if len(set(names)) != len(names):
            raise ValueError(f"--compare-config: two contenders would be named {max(names, key=names.count)!r}")
    except ValueError as error:  # a tuned profile that does not fit this model, an unknown name
        return _fail(error)
    command = {key: value for key, value in vars(args).items() if key != "func"}
    if args.batch_size:
        return run_batches(model, tokenizer, prompts, contenders, args, command)
    # A scheduler's SIGTERM (a job's time limit, `timeout`) stops the run as Ctrl-C does, so the
    # prompts already measured are written rather than lost.
    previous_handler = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        results = run_benchmark(
            model,
            tokenizer,
            prompts,
            contenders,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            output_dir=args.output,
            sampling=sampling,
            command=command,
        )
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    return _report(results, args.output)


def _report(results: dict, output: str) -> int:
    """Print the table and where the files went; the exit status: 1 where a contender diverged
    from plain greedy decoding, 130 where the run was interrupted, else 0."""
    from .benchmark import OUTPUT_FILES
    from .contenders import HF_SELFSPEC
    from .report import diverged
    from .table import render

    print(render(results, color=sys.stdout.isatty() and "NO_COLOR" not in os.environ))
    written = ", ".join(str(Path(output) / name) for name in OUTPUT_FILES)
    print(f"\nwrote {written}")
    inconsistent = diverged(results, HF_SELFSPEC)
    if inconsistent:
        print(
            f"hf-selfspec bench: {', '.join(inconsistent)} diverged from plain greedy decoding beyond a near-tie; "
            "that is a bug, please report it",
            file=sys.stderr,
        )
        return 1
    stopped = results["settings"]["stopped_early"]
    if stopped:
        print(
            f"hf-selfspec bench: interrupted; the results cover {results['settings']['prompts']} of "
            f"{stopped['planned_prompts']} prompts",
            file=sys.stderr,
        )
        return 130
    return 0
