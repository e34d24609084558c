"""How far can drafts that cost no forward pass go? A replay over plain greedy's own output.

In float32 greedy decoding is deterministic, so whether a proposal is accepted depends only on
plain greedy's tokens: replaying a drafter over them counts exactly the verifications a real
run needs (for 10-token prompt lookup it gives transformers' own count). Each verification is then priced with a measured bfloat16 cost curve (a forward over n
new tokens, relative to one token), which turns counts into the speedup they allow over all
prompts, before any per-step overhead.

Drafters replayed, alone and together:
- prompt lookup (the earliest occurrence of the longest matching suffix n-gram), as shipped;
- prompt lookup, then where the text has no match the shipped lookup corpus (the model's own
  continuations of other prompts, `studies/tuned/smollm2-135m-instruct/own-code.safetensors`);
- lookup *trees*: the distinct continuations of every earlier occurrence, verified together
  (as a tree-attention verifier would, one forward pass over all their tokens);
- token recycling: the model's own top-k next tokens, remembered per token id from every
  position it has verified (and from the prompt's prefill), chained or branched into a tree.

    OMP_NUM_THREADS=2 .venv/bin/python studies/replay_free_drafters.py --prompt-offset 20 --n-prompts 20
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hf_selfspec.drafters import lookup_continuation, lookup_proposal
from hf_selfspec.embedded import TUNED_CONFIG, load_embedded
from hf_selfspec.lookup_corpus import load_lookup_corpus
from hf_selfspec.prompts import load_prompts, encode_prompt

# One forward over n new tokens relative to one token: SmolLM2-135M, bfloat16, ~250 tokens of
# context, this project's 2-core CPU (medians of 12; 2026-11-23).
VERIFY_COST = {1: 1.0, 2: 1.0, 4: 1.09, 8: 1.21, 12: 1.39, 16: 1.5, 24: 1.61, 32: 1.78, 48: 2.39}


def verify_cost(width: int) -> float:
    known = sorted(VERIFY_COST)
    for low, high in zip(known, known[1:]):
        if low <= width <= high:
            return VERIFY_COST[low] + (VERIFY_COST[high] - VERIFY_COST[low]) * (width - low) / (high - low)
    return VERIFY_COST[known[-1]] * width / known[-1]


def lookup(text: list[int], max_tokens: int = 10) -> list[list[int]]:
    tokens = lookup_continuation(torch.tensor(text), 1, 2, max_tokens)
    return [tokens] if tokens else []


def lookup_then_corpus(text: list[int], corpus, max_ngram: int, max_tokens: int = 8) -> list[list[int]]:
    tokens = lookup_proposal(torch.tensor(text), 2, max_ngram, max_tokens, corpus)
    return [tokens] if tokens else []


def lookup_tree(text: list[int], branches: int = 4, max_tokens: int = 10) -> list[list[int]]:
    """The continuations of every earlier occurrence of the suffix 3-, 2- and 1-grams, at most
    one per distinct first token."""
    found, first_tokens = [], set()
    for ngram in (3, 2, 1):
        suffix = text[-ngram:]
        for start in range(len(text) - ngram):
            if text[start : start + ngram] == suffix:
                continuation = text[start + ngram : start + ngram + max_tokens]
                if continuation and continuation[0] not in first_tokens and len(found) < branches:
                    first_tokens.add(continuation[0])
                    found.append(continuation)
    return found


def recycled_tree(successors: dict[int, list[int]], last: int, widths: list[int]) -> list[list[int]]:
    """Branches of a tree grown from `last`: at depth d, each node's `widths[d]` best successors."""
    paths, frontier = [], [[]]
    for width in widths:
        frontier = [path + [nxt] for path in frontier for nxt in successors.get(path[-1] if path else last, [])[:width]]
        paths += frontier
    return paths


def replay(text: list[int], prompt_length: int, top: list[list[int]], propose, prefill_successors: bool) -> tuple[int, float]:
    """(verifications, cost in one-token steps) to reproduce `text` after its prompt."""
    successors: dict[int, list[int]] = {}
    if prefill_successors:
        successors.update({text[i]: top[i] for i in range(prompt_length - 1)})
    length, count, cost = prompt_length, 0, 0.0
    while length < len(text):
        branches = propose(text[:length], successors)
        nodes = {tuple(branch[: depth + 1]) for branch in branches for depth in range(len(branch))}
        accepted = max((_common_prefix(branch, text[length:]) for branch in branches), default=0)
        cost += verify_cost(len(nodes) + 1) if count else 0.0  # the prefill is paid by every contender
        count += 1
        for position in range(length - 1, length + accepted):
            successors[text[position]] = top[position]
        length += accepted + 1
    return count, cost


def _common_prefix(branch: list[int], truth: list[int]) -> int:
    accepted = 0
    while accepted < min(len(branch), len(truth)) and branch[accepted] == truth[accepted]:
        accepted += 1
    return accepted


DRAFTERS = {
    "prompt lookup (shipped, = transformers')": (lambda t, s: lookup(t), False),
    "lookup tree, 4 branches": (lambda t, s: lookup_tree(t), False),
    "recycling chain of 4, prefill-seeded": (lambda t, s: recycled_tree(s, t[-1], [1] * 4), True),
    "recycling tree 4-2-1-1, prefill-seeded": (lambda t, s: recycled_tree(s, t[-1], [4, 2, 1, 1]), True),
    "lookup + recycling tree 4-2-1": (lambda t, s: lookup(t) + recycled_tree(s, t[-1], [4, 2, 1]), True),
    "lookup tree + recycling tree 4-2-1": (lambda t, s: lookup_tree(t) + recycled_tree(s, t[-1], [4, 2, 1]), True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="humaneval", help="'humaneval' or a prompt file (.jsonl)")
    parser.add_argument("--prompt-offset", type=int, default=20)
    parser.add_argument("--n-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    model, tokenizer = load_embedded(dtype=torch.float32, generation_config=None)
    corpus = load_lookup_corpus(model, Path(str(TUNED_CONFIG)).parent / "own-code.safetensors")
    first, *rest = DRAFTERS.items()
    with_corpus = {
        f"lookup, then the corpus, 2-{n}-grams": (lambda t, s, n=n: lookup_then_corpus(t, corpus, n), False) for n in (3, 6)
    }
    drafters = dict([first, *with_corpus.items(), *rest])
    texts = []
    for prompt in load_prompts(args.prompts, args.n_prompts, offset=args.prompt_offset):
        inputs = encode_prompt(tokenizer, prompt)
        output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        with torch.no_grad():
            top = model(output).logits[0].topk(8, dim=-1).indices.tolist()
        texts.append((output[0].tolist(), inputs["input_ids"].shape[1], top))

    print(f"{'drafter':42s} {'verifications':>13s} {'tokens each':>11s} {'speedup bound':>13s}")
    for name, (propose, seeded) in drafters.items():
        runs = [replay(text, length, top, propose, seeded) for text, length, top in texts]
        new_tokens = [len(text) - length for text, length, _ in texts]
        count = sum(c for c, _ in runs)
        # Plain greedy pays one step for each token after the one the prefill gives; the ratio
        # of totals, as the bench's speedup is over all prompts' time.
        bound = sum(n - 1 for n in new_tokens) / sum(cost for _, cost in runs)
        print(f"{name:42s} {count:13d} {sum(new_tokens) / count:11.2f} {bound:12.2f}x")


if __name__ == "__main__":
    main()
