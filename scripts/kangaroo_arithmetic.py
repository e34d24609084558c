"""What `kangaroo` alone would gain with each trained adapter, on a host whose own timings are not
the ones that matter: the acceptance is estimated, the prices are given.

    .venv/bin/python scripts/kangaroo_arithmetic.py [--model embedded] [--dtype float32] [--prompts 20] [--workload]
        ADAPTER.safetensors [...]

Acceptance: the tuner's estimate, the decoding loop run (`tuning/estimate.py`) over each adapter's
teacher-forced drafts on HumanEval 20-39 or, with `--workload`, on the workload's held-out split
(neither trained nor tuned on). Under greedy decoding an adapter's drafts are exact there, so the
counts are what a real decode drafts and accepts, on any machine and in float32 as well as
bfloat16 (up to near-ties). With `--workload` a setting's figure is the geometric mean of its
per-category speedups, as the tuner's value is, and each category's own best setting is listed
too: no choice of these knobs, even one made per category after the fact, does better.

Prices, in units of one plain decoding step, default to what a native-bfloat16 CPU measured
(docs/results/): a verification of two or more tokens costs `--verify-cost` steps, and a
draft token `--draft-base + exit_layer * --draft-per-layer` steps. The prompt's prefill is left out of both sides. With `--draft-alternatives`,
the draft's runner-ups are verified beside its chain; only settings whose widest verification
stays within `--max-verify-rows` (what the verification price was measured for) are listed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os

import torch

from hf_selfspec.adapter import read_adapter_shape
from hf_selfspec.loading import EMBEDDED, load_model_and_tokenizer
from hf_selfspec.measure import timed_generate
from hf_selfspec.params import resolve_params
from hf_selfspec.prompts import Prompt, encode_prompt, load_prompts
from hf_selfspec.stats import StrategyStats, geometric_mean
from hf_selfspec.tuning.costmodel.predictions import draft_predictions
from hf_selfspec.tuning.costmodel.priced_decode import estimate_decode, plain_seconds
from hf_selfspec.tuning.costmodel.prices import CostModel
from hf_selfspec.tuning.costmodel.teacher_forcing import teacher_force
from hf_selfspec.tuning.studies.objective import PreparedPrompt

NEW_TOKENS = 64
MAX_DRAFT_TOKENS = (1, 2, 3, 4, 6)
EXIT_THRESHOLDS = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8)


def step_priced_cost(num_layers: int, verify_cost: float, draft_base: float, draft_per_layer: float) -> CostModel:
    """A cost model in steps: an adapter's draft runs `exit_layer + 1` layers (its own block
    included), so half a layer's price per sub-layer and the base less one layer as the constant."""
    return CostModel(
        num_layers=num_layers,
        verify_seconds=(0.0, 1.0) + (verify_cost,) * (max(MAX_DRAFT_TOKENS) + 1),
        plain_step_overhead=0.0,
        draft_constant=draft_base - draft_per_layer,
        attention_seconds=draft_per_layer / 2,
        mlp_seconds=draft_per_layer / 2,
        restricted_head_constant=0.0,
        restricted_head_per_row=0.0,
    )


def agreement(forced: list, drafts: list) -> tuple[float, float]:
    """The draft's first choice against plain greedy's next token at every committed position,
    and how often its runner-ups hold that token where the first choice misses it."""
    right = missed = rescued = 0
    for data, draft in zip(forced, drafts):
        for token, runner_ups, expected in zip(draft.tokens, draft.alternatives, data.reference[1:]):
            right += token == expected
            missed += token != expected
            rescued += token != expected and expected in runner_ups
    return right / max(right + missed, 1), rescued / max(missed, 1)


def prompt_groups(n_prompts: int, workload: bool) -> list[tuple[str, Prompt]]:
    """`(group, prompt)`: the workload's held-out split by category, or HumanEval from 20 on as one group."""
    if workload:
        return [(prompt.category, prompt) for prompt in load_prompts("workload", split="held_out")]
    return [(f"HumanEval 20-{19 + n_prompts}", prompt) for prompt in load_prompts("humaneval", n=n_prompts, offset=20)]


def report(model_name: str, adapters: list[str], n_prompts: int, workload: bool, dtype: torch.dtype,
           args: argparse.Namespace) -> None:
    model, tokenizer = load_model_and_tokenizer(model_name, dtype=dtype)
    num_layers = model.config.num_hidden_layers
    forced, groups = [], []
    for group, prompt in prompt_groups(n_prompts, workload):
        inputs = encode_prompt(tokenizer, prompt)
        run = timed_generate(model, inputs, strategy="plain", max_new_tokens=NEW_TOKENS, do_sample=False)
        prepared = PreparedPrompt(prompt.id, dict(inputs), run.new_tokens, torch.empty(0))
        forced.append(dataclasses.replace(teacher_force(model, prepared, NEW_TOKENS), prefill_seconds=0.0))
        groups.append(group)
    categories = list(dict.fromkeys(groups))
    cost = step_priced_cost(num_layers, args.verify_cost, args.draft_base, args.draft_per_layer)
    plain_steps = dict.fromkeys(categories, 0.0)
    for data, group in zip(forced, groups):
        plain_steps[group] += plain_seconds(data, cost)
    for adapter in adapters:
        shape = read_adapter_shape(adapter)
        rows = []
        knobs = {"draft_adapter": adapter, "draft_vocab_size": args.draft_vocab_size, "prompt_lookup_tokens": 0,
                 "draft_alternatives": args.draft_alternatives}
        # The drafts depend on the adapter and the head, not on how many of them are proposed:
        # drafted once, as far past each wrong guess as the longest setting goes.
        adapter_params = resolve_params(num_layers, {**knobs, "max_draft_tokens": max(MAX_DRAFT_TOKENS)})
        drafts = [draft_predictions(model, data, adapter_params) for data in forced]
        for max_draft, threshold in itertools.product(MAX_DRAFT_TOKENS, EXIT_THRESHOLDS):
            if 1 + max_draft * (1 + args.draft_alternatives) > args.max_verify_rows:
                continue
            params = resolve_params(num_layers, {**knobs, "max_draft_tokens": max_draft, "draft_exit_threshold": threshold})
            totals, seconds = StrategyStats(), dict.fromkeys(categories, 0.0)
            for data, predicted, group in zip(forced, drafts, groups):
                spent, stats = estimate_decode(model, data, params, "kangaroo", predicted, cost)
                totals.add(stats)
                seconds[group] += spent
            speedups = {group: plain_steps[group] / seconds[group] for group in categories}
            rows.append((geometric_mean(speedups.values()), max_draft, threshold, totals, speedups))
        print(f"{adapter} (exit layer {shape.exit_layer}, {'with' if shape.mlp else 'no'} MLP): "
              f"a draft token costs {cost.draft_token_seconds(adapter_params):.3f} of a step")
        for group in categories:
            first_choice, runner_up = agreement(
                [data for data, g in zip(forced, groups) if g == group], [d for d, g in zip(drafts, groups) if g == group]
            )
            print(f"  {group}: first choice agrees with plain greedy at {first_choice:.3f} of positions; where it "
                  f"does not, one of {args.draft_alternatives} runner-ups does at {runner_up:.3f}")
        for speedup, max_draft, threshold, totals, speedups in sorted(rows, key=lambda row: row[0], reverse=True)[: args.top]:
            print(f"  max_draft_tokens {max_draft}, draft_exit_threshold {threshold}: {speedup:.3f}x, "
                  f"acceptance {totals.acceptance_rate:.3f}, {totals.mean_accepted_length:.2f} accepted per verification, "
                  f"{totals.drafted_tokens / max(totals.verification_steps, 1):.2f} drafted, "
                  f"{totals.accepted_alternatives} alternatives accepted", flush=True)
            if len(categories) > 1:
                print("    " + ", ".join(f"{group} {value:.3f}x" for group, value in speedups.items()))
        if len(categories) > 1:
            best = {group: max(rows, key=lambda row: row[4][group]) for group in categories}
            print("  each category's best setting: " + ", ".join(
                f"{group} {row[4][group]:.3f}x ({row[1]} tokens, threshold {row[2]})" for group, row in best.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=EMBEDDED, help="'embedded', or a model directory or Hub id")
    parser.add_argument("--prompts", type=int, default=20, help="HumanEval prompts from 20 on (at most 20)")
    parser.add_argument("--workload", action="store_true",
                        help="the workload's held-out split, by category, in place of HumanEval")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--verify-cost", type=float, default=1.1, help="steps a verification of 2-8 tokens costs")
    parser.add_argument("--draft-base", type=float, default=0.063, help="steps a draft token costs beyond its layers")
    parser.add_argument("--draft-per-layer", type=float, default=0.032, help="steps each layer below the exit adds")
    parser.add_argument("--draft-alternatives", type=int, default=0, help="runner-ups verified beside each drafted token")
    parser.add_argument("--max-verify-rows", type=int, default=8,
                        help="widest verification (tokens) the --verify-cost price stands for")
    parser.add_argument("--top", type=int, default=3, help="knob settings to list per adapter")
    parser.add_argument("adapters", nargs="+")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    report(args.model, args.adapters, min(args.prompts, 20), args.workload, getattr(torch, args.dtype), args)


if __name__ == "__main__":
    main()
