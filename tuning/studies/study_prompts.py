"""Which prompts a study decodes, and in which order.

HumanEval and a JSONL file give a plain slice (`offset`, `n_prompts`). The workload, or any
source with `per_category`, gives the first prompts of each category, ordered round-robin over
the categories: a trial's first prompts then span every kind of text, so the pruner's early
comparisons, made after a prompt or two, already see each category rather than only the first.
A study at a batch size above one decodes them in batches of one category (`batch_prompts`), so
that every category keeps a speedup of its own, as at batch one.
"""

from __future__ import annotations

from itertools import chain, zip_longest

from hf_selfspec.tuner_api import WORKLOAD, Prompt, load_prompts

from .config import DEFAULT_N_PROMPTS, PromptConfig


def by_category(prompts: PromptConfig) -> bool:
    """Whether the study selects its prompts per category (rather than as one slice)."""
    return prompts.source == WORKLOAD or prompts.per_category is not None


def prompts_by_category(prompts: list[Prompt]) -> dict[str | None, list[Prompt]]:
    """The prompts by category, categories in order of first appearance, each in its own order."""
    groups: dict[str | None, list[Prompt]] = {}
    for prompt in prompts:
        groups.setdefault(prompt.category, []).append(prompt)
    return groups


def _round_robin(groups: dict[str | None, list[Prompt]]) -> list[Prompt]:
    return [prompt for prompt in chain.from_iterable(zip_longest(*groups.values())) if prompt is not None]


def select_study_prompts(prompts: PromptConfig) -> list[Prompt]:
    """The study's prompts; a ValueError names the source when it cannot supply them."""
    if not by_category(prompts):
        return load_prompts(prompts.source, prompts.n_prompts or DEFAULT_N_PROMPTS, prompts.offset, prompts.split)
    groups = prompts_by_category(load_prompts(prompts.source, split=prompts.split))
    if prompts.per_category is not None:
        short = {category: len(group) for category, group in groups.items() if len(group) < prompts.per_category}
        if short:
            counts = ", ".join(f"{category or 'no category'}: {count}" for category, count in short.items())
            raise ValueError(
                f"{prompts.source}: per_category = {prompts.per_category}, but some categories have fewer "
                f"{prompts.split + ' ' if prompts.split else ''}prompts ({counts}); lower per_category"
            )
        groups = {category: group[: prompts.per_category] for category, group in groups.items()}
    return _round_robin(groups)[: prompts.n_prompts]


def batch_prompts(prompts: list[Prompt], size: int) -> list[list[Prompt]]:
    """The prompts in batches of up to `size` of one category: each batch opened by the first
    prompt not yet in one and filled with the next of its category, in order. A round-robin
    selection so keeps its categories interleaved batch by batch, and at size one every prompt
    is its own batch, in the order it was selected."""
    batches: list[list[Prompt]] = []
    filling: dict[str | None, list[Prompt]] = {}
    for prompt in prompts:
        batch = filling.get(prompt.category)
        if batch is None or len(batch) == size:
            batch = filling[prompt.category] = []
            batches.append(batch)
        batch.append(prompt)
    return batches
