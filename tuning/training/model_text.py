"""Text the model writes for a corpus: its greedy continuations of many prompts, generated in
batches and kept on disk as they finish, so a killed run resumes where it stopped."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import progress

# Wider batches generate more tokens a second on a CPU until the matrix products saturate it;
# with prompts sorted by length a batch of 128 rows also beats two of 64.
GENERATION_BATCH = 128


def atomic_save(obj, path: Path) -> None:
    """`torch.save` that a kill never leaves half-written: a resumed run reads the old file or the new."""
    staging = path.with_name(path.name + ".tmp")
    torch.save(obj, staging)
    os.replace(staging, path)


def padded_batch(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` for prompts of unequal length, left-padded as generation needs."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return input_ids, attention_mask


def generated_texts(
    model, tokenizer, prompts: list[list[int]], max_new_tokens: int, cache_file: Path, show_progress: bool,
    description: str = "generating corpus",
) -> list[list[int]]:
    """Each prompt followed by the model's greedy continuation (up to EOS or `max_new_tokens`).

    Prompts go in left-padded batches: on a CPU or GPU a batch costs far less than its sequences
    one by one. The batches are cut from the prompts sorted by length, since a batch's prefill
    runs every row at its longest prompt's width: unsorted, padding was most of the work (prompts
    of 10 to 395 tokens, median 37). Finished batches are saved as they complete, in the order
    they are generated, so a killed run resumes generating where it stopped.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    by_length = [prompts[i] for i in order]
    done: list[list[int]] = torch.load(cache_file) if cache_file.is_file() else []
    done = done if by_length[: len(done)] == [text[: len(p)] for p, text in zip(by_length, done)] else []
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = range(len(done), len(by_length), GENERATION_BATCH)
    bar = tqdm(batches, desc=description, unit="batch", disable=None if show_progress else True)
    for start in progress.counting(bar, description, "batches"):
        batch = by_length[start : start + GENERATION_BATCH]
        input_ids, attention_mask = padded_batch(batch, pad_id, model.device)
        with torch.no_grad():
            output = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id,
            )
        for prompt, row in zip(batch, output[:, input_ids.shape[1] :].tolist()):
            end = row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else len(row)
            done.append(prompt + row[:end])
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_save(done, cache_file)
    texts: list[list[int]] = [[] for _ in prompts]
    for position, text in zip(order, done):
        texts[position] = text
    return texts
