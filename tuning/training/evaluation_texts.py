"""The texts that measure this project's decoding, and a check that a generated training text
stays clear of them.

A corpus the model writes itself is sampled, so nothing but a check keeps an evaluation prompt
out of it: a request the model happens to phrase like one would make the adapter or lookup corpus
trained on it look better on that prompt than it is. The protected texts are every message of the
workload (both splits: the tuner picks exit layers and knobs on the tune split, the bench measures
the held-out one), every chat prompt of the chat bench, and HumanEval problems 0-39 (the code
bench's and the tuner's).
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from hf_selfspec.tuner_api import HUMANEVAL, WORKLOAD, load_prompts, read_jsonl_prompts

# HumanEval problems 0-39 are what the bench and the tuner score on.
FIRST_TRAINABLE_HUMANEVAL = 40
# A run of this many words shared with an evaluation text counts as a copy of it: long enough that
# ordinary phrases ("what is the best way to ...") do not trip it, short enough to catch a
# sentence of a prompt reworded around.
OVERLAP_WORDS = 10

_WORD = re.compile(r"\w+")


def chat_prompts_path() -> Path:
    return Path(str(resources.files("hf_selfspec").joinpath("data", "chat_prompts.jsonl")))


def evaluation_texts() -> list[str]:
    """Every text an evaluation prompt is made of: its messages' contents, or its plain text."""
    prompts = [
        *load_prompts(WORKLOAD), *read_jsonl_prompts(chat_prompts_path()),
        *load_prompts(HUMANEVAL, n=FIRST_TRAINABLE_HUMANEVAL),
    ]
    texts = []
    for prompt in prompts:
        texts += [message["content"] for message in prompt.messages] if prompt.messages else [prompt.text]
    return texts


def _words(text: str) -> list[str]:
    return _WORD.findall(text.casefold())


class EvaluationOverlap:
    """Whether a text copies an evaluation text: equal to one up to case, punctuation and
    spacing, or sharing a run of `run_words` words with one."""

    def __init__(self, texts: list[str], run_words: int = OVERLAP_WORDS):
        self.run_words = run_words
        self.whole = {" ".join(_words(text)) for text in texts}
        self.runs = {run for text in texts for run in self._runs(_words(text))}

    def _runs(self, words: list[str]) -> set[tuple[str, ...]]:
        return {tuple(words[i : i + self.run_words]) for i in range(len(words) - self.run_words + 1)}

    def __call__(self, text: str) -> bool:
        words = _words(text)
        return " ".join(words) in self.whole or not self.runs.isdisjoint(self._runs(words))
