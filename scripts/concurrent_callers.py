"""Throughput of one shared model under 1, 2 and 4 concurrent callers: plain `generate` against
the default profile, with the same callers.

    .venv/bin/python scripts/concurrent_callers.py [--model embedded] [--dtype auto] [--prompts 8] [--new-tokens 64] [--rounds 2]

A chat server shares one loaded model between its users' threads. Each caller thread decodes
its share of the HumanEval prompts (20 onwards, never tuned on), one after another; the callers
start together, and the figure is all new tokens over the wall time until the last one ends.
Plain and profile runs alternate, each caller count `--rounds` times, so drift in the machine's
speed spreads over both. Every output is checked against the same call made alone (exactly in
float32, consistent in reduced precision): concurrency may cost speed, never correctness.
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from hf_selfspec import load_embedded
from hf_selfspec.consistency import check_greedy_consistency
from hf_selfspec.loading import EMBEDDED, load_model_and_tokenizer
from hf_selfspec.measure import timed_generate
from hf_selfspec.prompts import encode_prompt, load_prompts

CALLERS = (1, 2, 4)
MODES = {"plain": {"strategy": "plain"}, "default profile": {}}


def _run(model, prompts, callers: int, kwargs: dict, new_tokens: int) -> tuple[float, list[list[int]]]:
    """Tokens per second of `callers` threads sharing `prompts`, and each prompt's new tokens."""
    outputs: list[list[int] | None] = [None] * len(prompts)
    start = threading.Barrier(callers)

    def caller(index: int) -> None:
        start.wait()
        for prompt in range(index, len(prompts), callers):
            run = timed_generate(model, prompts[prompt], max_new_tokens=new_tokens, do_sample=False, **kwargs)
            outputs[prompt] = run.new_tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        list(pool.map(caller, range(callers)))
    seconds = time.perf_counter() - started
    return sum(len(tokens) for tokens in outputs) / seconds, outputs


def model_parser(description: str) -> argparse.ArgumentParser:
    """The options that choose the model served, `--model` and `--dtype` (see `load_model`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=EMBEDDED,
                        help="'embedded' (with the profiles shipped for it), or a model directory or Hub id (with "
                        "the profile in its own generation config)")
    parser.add_argument("--dtype", default="auto", help="auto (the model's, bfloat16 where native), float32, bfloat16")
    return parser


def load_model(args: argparse.Namespace):
    """The model and tokenizer `--model` and `--dtype` name, with the embedded model's profiles."""
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    if args.model == EMBEDDED:
        return load_embedded(dtype=dtype)
    return load_model_and_tokenizer(args.model, dtype=dtype)


def main(argv: list[str] | None = None) -> None:
    parser = model_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args)
    prompts = [encode_prompt(tokenizer, text) for text in load_prompts("humaneval", n=args.prompts, offset=20)]
    alone = [
        timed_generate(model, inputs, max_new_tokens=args.new_tokens, do_sample=False, strategy="plain",
                       output_logits=True)
        for inputs in prompts
    ]
    figures: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for callers in CALLERS:
            for mode, kwargs in MODES.items():
                tokens_per_second, outputs = _run(model, prompts, callers, kwargs, args.new_tokens)
                figures.setdefault((mode, callers), []).append(tokens_per_second)
                for reference, tokens in zip(alone, outputs):
                    verdict = check_greedy_consistency(tokens, reference.new_tokens, reference.logits, model.dtype)
                    if not verdict.consistent:
                        raise SystemExit(f"{mode}, {callers} callers: an output left plain greedy ({verdict})")
    print(f"{model.dtype}, {len(prompts)} prompts x {args.new_tokens} new tokens, best of {args.rounds} rounds")
    print("| callers | plain tokens/s | default profile tokens/s | speedup |")
    print("| --- | --- | --- | --- |")
    for callers in CALLERS:
        plain, profile = max(figures[("plain", callers)]), max(figures[("default profile", callers)])
        print(f"| {callers} | {plain:.1f} | {profile:.1f} | {profile / plain:.2f}x |")


if __name__ == "__main__":
    main()
