"""Per exit layer: what a Kangaroo draft token costs relative to a plain decoding step, and how
often the draft agrees with the full model on its own greedy continuations of HumanEval 20-39
(never trained or tuned on), bfloat16.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/measure_kangaroo.py [--model embedded] [--prompts N] [--workload]
        [--dtype bfloat16] [--device cuda] ADAPTER.safetensors [...]

Cost: one-token forwards of the full model, verifications (forwards of the full model over 2, 4
and 8 tokens: what a draft of 1, 3 or 7 tokens costs to check) and one-token draft steps
(shallow layers, adapter, head restricted to 8,192 ids plus the prompt's), interleaved, at the
end of a prompt's prefill; medians. How cheap a wide verification is depends on the machine,
and the speedup a draft can give depends on it as much as on the draft's agreement.
Agreement: the draft's argmax at each position of plain greedy's 64 new tokens, fed the full
model's own shallow states (what a draft's first token sees), split by the draft's
confidence: the share of positions at or above each exit threshold and the agreement there.
`--workload` takes the shipped workload's held-out split instead (never trained or tuned on
either) and reports agreement per category, where free text and code part ways.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from transformers import LogitsProcessorList

from hf_selfspec.adapter import load_adapter
from hf_selfspec.cache import DraftAwareCache, cache_keyword
from hf_selfspec.decoding_types import DecodingState
from hf_selfspec.drafters import RestrictedDraftHead, ShallowExitDrafter
from hf_selfspec.layer_skip import decoder_layers
from hf_selfspec.loading import EMBEDDED, load_model_and_tokenizer
from hf_selfspec.measure import timed
from hf_selfspec.policies import ExitPolicy
from hf_selfspec.prompts import encode_prompt, load_prompts
from hf_selfspec.selection import TokenSelector

NEW_TOKENS = 64
DRAFT_VOCAB = 8192
THRESHOLDS = (0.0, 0.3, 0.5, 0.7, 0.9)
VERIFY_WIDTHS = (2, 4, 8)  # beside width 1, the plain step every cost is measured in
REPEATS = 15


@torch.no_grad()
def step_costs(model, adapters, input_ids) -> dict[str | int, float]:
    """Median seconds of a forward of the full model over 1 and each of `VERIFY_WIDTHS` tokens
    (keyed by the width) and of each adapter's one-token draft (after a first, untimed draft that
    feeds the adapter the prefill's shallow states)."""
    widths = (1, *VERIFY_WIDTHS)
    times: dict[str | int, list[float]] = {**{w: [] for w in widths}, **{a: [] for a in adapters}}
    length = input_ids.shape[1]
    sequence = torch.cat([input_ids, input_ids.new_zeros((1, 16))], dim=1)
    positions = torch.arange(sequence.shape[1], device=sequence.device)[None]
    state = DecodingState(sequence, positions, length)
    cache = DraftAwareCache(model.config)
    drafters = {a: ShallowExitDrafter(model, cache, load_adapter(model, a), DRAFT_VOCAB) for a in adapters}
    model(input_ids=input_ids[:, :-1], position_ids=positions[:, : length - 1], **cache_keyword(cache), use_cache=True)
    for drafter in drafters.values():
        # As after a cache hit: the prefill computed no shallow states for the adapter, so the
        # drafter computes them once, and the first (untimed) draft feeds them to the adapter.
        drafter.continue_from(state, length - 1)
    selector, never_exit = TokenSelector(LogitsProcessorList(), do_sample=False), ExitPolicy(0.0)
    for repeat in range(REPEATS + 1):
        for width in widths:
            _, seconds = timed(lambda: model(
                input_ids=sequence[:, length - 1 : length - 1 + width],
                position_ids=positions[:, length - 1 : length - 1 + width],
                **cache_keyword(cache), use_cache=True, logits_to_keep=width,
            ), model.device)
            if repeat:  # the first pass of each is a warm-up
                times[width].append(seconds)
            cache.rollback(length - 1)
        for a, drafter in drafters.items():
            drafter.rollback(length - 1)
            _, seconds = timed(lambda: drafter.propose(state, 1, never_exit, selector), model.device)
            if repeat:
                times[a].append(seconds)
            cache.rollback(length - 1)
    return {k: statistics.median(v) for k, v in times.items()}


@torch.no_grad()
def agreement(model, tokenizer, adapters, encoded, groups) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """Per adapter and group of prompts (`groups[i]` names prompt i's): for each threshold, the
    share of positions the draft is that confident at and its agreement there."""
    layers = decoder_layers(model)
    loaded = {a: load_adapter(model, a) for a in adapters}
    hits = {(a, g): {t: [0, 0] for t in THRESHOLDS} for a in adapters for g in groups}
    total = dict.fromkeys(groups, 0)
    for inputs, group in zip(encoded, groups):
        out = model.generate(**inputs, strategy="plain", max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        prompt_length = inputs["input_ids"].shape[1]
        shallow = {}
        hooks = [layers[loaded[a].shape.exit_layer - 1].register_forward_hook(
            lambda m, args, output, a=a: shallow.__setitem__(a, output)) for a in adapters]
        try:
            model.get_decoder()(input_ids=out, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        targets = out[0, prompt_length:]
        total[group] += len(targets)
        for a, adapter in loaded.items():
            head = RestrictedDraftHead(model, DRAFT_VOCAB, inputs["input_ids"])
            hidden = adapter(shallow[a], torch.arange(out.shape[1], device=out.device)[None])[0, prompt_length - 1 : -1]
            scores = torch.stack([head(h[None])[0] for h in hidden]).float().softmax(-1)
            confidence, guess = scores.max(-1)
            for t in THRESHOLDS:
                kept = confidence >= t
                hits[a, group][t][0] += int(kept.sum())
                hits[a, group][t][1] += int((guess[kept] == targets[kept]).sum())
    return {
        (a, g): [(hits[a, g][t][0] / total[g], hits[a, g][t][1] / max(hits[a, g][t][0], 1)) for t in THRESHOLDS]
        for a in adapters for g in total
    }


def report(model_name: str, adapters: list[str], n_prompts: int, workload: bool, dtype: torch.dtype, device: str) -> None:
    model, tokenizer = load_model_and_tokenizer(model_name, dtype=dtype, device=device)
    if workload:
        prompts = load_prompts("workload", split="held_out")
        groups = [f"the workload's held-out {p.category}" for p in prompts]
    else:
        prompts = load_prompts("humaneval", n=n_prompts, offset=20)
        groups = [f"HumanEval 20-{19 + n_prompts}"] * len(prompts)
    encoded = [encode_prompt(tokenizer, p).to(model.device) for p in prompts]
    costs = step_costs(model, adapters, encoded[0]["input_ids"])
    step = costs[1]
    print(f"full one-token step: {1000 * step:.1f} ms (median of {REPEATS})")
    for width in VERIFY_WIDTHS:
        print(f"verification of {width} tokens: {1000 * costs[width]:.1f} ms = {costs[width] / step:.2f} steps")
    for a in adapters:
        print(f"{a}: draft token {1000 * costs[a]:.1f} ms = {costs[a] / step:.3f} of a step")
    for (a, group), rows in agreement(model, tokenizer, adapters, encoded, groups).items():
        cells = ", ".join(f">={t}: share {share:.2f} agree {agree:.3f}" for t, (share, agree) in zip(THRESHOLDS, rows))
        print(f"{a} on plain greedy's tokens for {group}: {cells}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=EMBEDDED, help="'embedded', or a model directory or Hub id")
    parser.add_argument("--prompts", type=int, default=20, help="HumanEval prompts from 20 on (at most 20)")
    parser.add_argument("--workload", action="store_true",
                        help="the workload's held-out split, by category, in place of HumanEval")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="float32 on a CPU without native bfloat16, where bfloat16 is emulated")
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    parser.add_argument("adapters", nargs="+")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    report(args.model, args.adapters, min(args.prompts, 20), args.workload, getattr(torch, args.dtype), args.device)


if __name__ == "__main__":
    main()
