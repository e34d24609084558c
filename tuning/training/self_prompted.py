"""A corpus the model writes itself: requests it samples with the chat's user turn opened, and its
greedy answers to them (self-prompting, as in Magpie).

A draft is judged on the text the model writes in answer to users, so that is the text to train
it on; no dataset is needed to get it. Rendering the chat template up to where a user's text
would begin and letting the model continue yields a request in the model's own idea of what users
ask; its greedy answer, in the dtype it will run in, is exactly what a draft must predict.

Steering. Left alone, a small model asks much the same few things. A task seed starts the user
turn with a few words of a kind of request ("Translate into Spanish:", "Solve", "Write a Python
function that") and the model writes the rest. The words go into the user turn rather than into
a system hint because then everything the model is conditioned on is a real conversation: the
template's own system prompt, as at inference, and a user's text that starts with those words.
A system hint would answer each request under a system prompt no user sends, and so teach a
draft text the model does not write for them. `open` leaves the turn empty.

Passages. Summarisation and document questions need a text to work on. They take passages of
prose from the Python language reference that ships with the interpreter (`pydoc_data.topics`,
the text `help()` shows): real, varied, the same on every machine with the same Python, and
free, where passages the model wrote itself would cost a generation each. The passage comes first
and the model writes the request after it, so the request is about that passage.

Filters. A request is kept once (compared without case and spacing), if the model wrote
something after the opening words, it has at least `_MIN_REQUEST_WORDS` words, ends its turn
within `max_request_tokens`, holds no special token, is not a degenerate repetition, and copies
no evaluation text (`EvaluationOverlap`). An answer that
copies an evaluation text drops its request too.

Mix. `self_prompted` is shared out evenly among the task seeds, and each seed is sampled until
it has its share (`_next_candidates`), so the corpus holds each kind of request in proportion
however often the model fumbles one kind.

Determinism. Each batch's candidates follow from what sampling has kept so far, and batch `b`
samples from the random state seeded by (`request_seed`, `b`); candidates are judged in order.
The state after each batch is saved, so a killed run resumes at the next batch and ends with
the same requests as an uninterrupted one.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from tqdm.auto import tqdm

from hf_selfspec.tuner_api import WORKLOAD_CATEGORIES, cache_root

from .. import TuningError
from .. import progress as progress_lines
from .evaluation_texts import EvaluationOverlap, evaluation_texts
from . import model_text
from .model_text import atomic_save, generated_texts, padded_batch

if TYPE_CHECKING:
    from ..studies.toml_reader import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskSeed:
    openings: tuple[str, ...]  # the words a request starts with, in turn; () leaves the turn open
    passage: bool = False  # the request follows a passage


# Named after the workload's categories, so that the mix reads against the bench's.
TASK_SEEDS = {
    "conversation": TaskSeed(("Hi! I", "I'm feeling", "Can you help me", "My friend and I", "I've been thinking about")),
    "writing": TaskSeed(("Write a short story about", "Write a poem about", "Write an email to", "Write a blog post about", "Draft a letter")),
    "translation": TaskSeed(("Translate into French:", "Translate this sentence into Spanish:", "How do you say", "Translate into German:")),
    "summarisation": TaskSeed(("Summarise the text above", "Give me a short summary of", "TL;DR", "Summarize this in"), passage=True),
    "qa": TaskSeed(("What is", "Why do", "How does", "Who was", "Explain")),
    "math": TaskSeed(("Solve", "Calculate", "If a train", "What is the sum of", "A store sells")),
    "document_qa": TaskSeed(("According to the text above,", "Based on this passage,", "In the text above, what", "Question about the text:"), passage=True),
    "code": TaskSeed(("Write a Python function that", "How do I", "Fix this code:", "Write a SQL query that")),
    "open": TaskSeed(()),
}
# Every task seed but `open`: the workload's kinds of text.
DEFAULT_TASK_SEEDS = WORKLOAD_CATEGORIES

_MIN_REQUEST_WORDS = 3
# Workload passages run to about this length; a longer one would make the batch's prefill its cost.
_PASSAGE_CHARACTERS = 1200
# Candidates sampled, at most, per request asked for: a model that keeps writing unusable
# requests stops with fewer, and says so, rather than sampling forever.
_MAX_CANDIDATES_PER_REQUEST = 8
# Placed as the user's text to find where the template puts it; no template alters it.
_SENTINEL = "hf-selfspec-user-text-6d1f"


class SelfPromptedRecipe(Protocol):
    """The [corpus] keys of this source; `corpus.CorpusConfig` holds them, with their defaults."""

    self_prompted: int
    request_temperature: float
    request_top_p: float
    request_seed: int
    max_request_tokens: int
    answer_tokens: int
    task_seeds: tuple[str, ...]


# Their names, `self_prompted` (the one that turns the source on) first.
KEYS = tuple(SelfPromptedRecipe.__annotations__)


@dataclass(frozen=True)
class UserTurn:
    head: str  # the rendered chat up to where the user's text begins
    stop_ids: tuple[int, ...]  # tokens that end the user's turn


def open_user_turn(tokenizer, model_name: str) -> UserTurn:
    """Where the user's text begins and how its turn ends, read off the tokenizer's own template:
    a conversation whose user text is a sentinel, cut at the sentinel. The turn ends at EOS, and
    at the special token the template closes the turn with where it has one."""
    if not getattr(tokenizer, "chat_template", None):
        raise TuningError(
            f"{model_name}: its tokenizer has no chat template, and corpus.self_prompted opens a chat's user "
            "turn: use a chat model, or set self_prompted = 0"
        )
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    if rendered.count(_SENTINEL) != 1:
        raise TuningError(f"{model_name}: its chat template does not place a user's text verbatim, so its user turn cannot be opened")
    head, closing = rendered.split(_SENTINEL)
    closing_ids = tokenizer(closing, add_special_tokens=False)["input_ids"]
    stop_ids = {tokenizer.eos_token_id}
    if closing_ids and closing_ids[0] in tokenizer.all_special_ids:
        stop_ids.add(closing_ids[0])
    return UserTurn(head, tuple(sorted(stop_ids)))


def _prose_paragraph(paragraph: str) -> bool:
    """Running text, not a grammar rule, code sample, heading or list."""
    return (
        len(paragraph) >= 150 and not paragraph[0].isspace() and paragraph.rstrip().endswith(".")
        and "::=" not in paragraph and ">>>" not in paragraph and not re.search(r"^[*=\-]{3,}", paragraph, re.M)
    )


def passages() -> list[str]:
    """Prose passages of the Python language reference (`pydoc_data.topics`): its topics in a
    fixed order (by hash of their names), each topic's prose paragraphs unwrapped and gathered
    while they fit in `_PASSAGE_CHARACTERS`."""
    from pydoc_data.topics import topics

    found = []
    for name in sorted(topics, key=lambda n: hashlib.sha1(n.encode()).hexdigest()):
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", topics[name]) if _prose_paragraph(p)]
        passage = ""
        for paragraph in paragraphs:
            if passage and len(passage) + 2 + len(paragraph) > _PASSAGE_CHARACTERS:
                found.append(passage)
                passage = ""
            if len(paragraph) <= _PASSAGE_CHARACTERS:
                passage = f"{passage}\n\n{paragraph}" if passage else paragraph
        if passage:
            found.append(passage)
    return found


@dataclass(frozen=True)
class Request:
    task_seed: str
    text: str


@dataclass(frozen=True)
class _Candidate:
    task_seed: str
    before: str  # the passage and a blank line, or nothing
    opening: str  # the task seed's opening words
    prompt: list[int]  # the rendered chat up to where the model writes


def _quotas(corpus: SelfPromptedRecipe) -> dict[str, int]:
    """Requests per task seed: `self_prompted` shared out evenly, the first seeds taking the rest."""
    share, rest = divmod(corpus.self_prompted, len(corpus.task_seeds))
    return {name: share + (index < rest) for index, name in enumerate(corpus.task_seeds)}


def _next_candidates(progress: _Progress, corpus: SelfPromptedRecipe, tokenizer, turn: UserTurn, passage_texts: list[str]) -> list[_Candidate]:
    """The next sampling batch: the task seeds short of their quota, in turn, each continuing its
    own count of candidates drawn (which picks its opening words and its passage).

    A batch holds either seeds with a passage or seeds without: a batch prefills every row at its
    widest prompt, and passages of hundreds of tokens among one-line openings would make padding
    most of a batch's work. The kind further from its quotas (as a share of them) goes next. Once
    candidates have been judged, a batch is sized to what is missing at the acceptance seen so far
    (with a margin), so the last requests do not cost a full batch; and no batch draws past the
    candidates the recipe allows in all (the first, judged on nothing yet, included: a large
    model sampling a full batch for one request spent minutes on candidates it never needed).
    """
    quotas = _quotas(corpus)
    kept = collections.Counter(request.task_seed for request in progress.requests)
    short = [name for name in corpus.task_seeds if kept[name] < quotas[name]]
    kinds: dict[bool, list[str]] = {}
    for name in short:
        kinds.setdefault(TASK_SEEDS[name].passage, []).append(name)

    def shortfall(kind: bool) -> float:
        return sum(quotas[n] - kept[n] for n in kinds[kind]) / sum(quotas[n] for n in kinds[kind])

    names = kinds[max(sorted(kinds), key=shortfall)]
    missing = sum(quotas[n] - kept[n] for n in names)
    drawn = sum(progress.drawn.values())
    size = min(model_text.GENERATION_BATCH, corpus.self_prompted * _MAX_CANDIDATES_PER_REQUEST - drawn)
    if drawn:
        rate = max(len(progress.requests) / drawn, 1 / _MAX_CANDIDATES_PER_REQUEST)
        size = min(size, math.ceil(1.25 * missing / rate))
    with_passage = [name for name in corpus.task_seeds if TASK_SEEDS[name].passage]
    candidates = []
    for index in range(size):
        name = names[index % len(names)]
        slot = progress.drawn[name] + index // len(names)
        seed = TASK_SEEDS[name]
        opening = seed.openings[slot % len(seed.openings)] if seed.openings else ""
        # Each seed with a passage takes its own share of them: summarisation and document QA ask about different texts.
        before = passage_texts[(slot * len(with_passage) + with_passage.index(name)) % len(passage_texts)] + "\n\n" if seed.passage else ""
        prompt = tokenizer(turn.head + before + opening, add_special_tokens=False)["input_ids"]
        candidates.append(_Candidate(name, before, opening, prompt))
    return candidates


def _degenerate(text: str) -> bool:
    """A loop: a word four times running, or word triples mostly repeats of each other."""
    words = text.casefold().split()
    if any(len(set(words[i : i + 4])) == 1 for i in range(len(words) - 3)):
        return True
    triples = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    return len(triples) >= 6 and len(set(triples)) < 0.6 * len(triples)


def _key(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.casefold()))


@torch.no_grad()
def _sample_batch(model, prompts: list[list[int]], corpus: SelfPromptedRecipe, turn: UserTurn, pad_id: int, batch: int) -> list[list[int] | None]:
    """Each prompt's sampled continuation up to the end of the user's turn, or None where the turn
    did not end within `max_request_tokens`. Sampled from the random state of (`request_seed`,
    `batch`) alone, on whatever device the model is on, leaving the caller's random state as it was."""
    input_ids, attention_mask = padded_batch(prompts, pad_id, model.device)
    devices = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(corpus.request_seed * 1_000_003 + batch)
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=corpus.max_request_tokens,
            do_sample=True, temperature=corpus.request_temperature, top_p=corpus.request_top_p, top_k=0,
            pad_token_id=pad_id, eos_token_id=list(turn.stop_ids), strategy="plain",
        )
    rows = []
    for row in output[:, input_ids.shape[1] :].tolist():
        ends = [i for i, token in enumerate(row) if token in turn.stop_ids]
        rows.append(row[: ends[0]] if ends else None)
    return rows


def time_sampled_choice(vocab_size: int, device: torch.device, corpus: SelfPromptedRecipe) -> float:
    """Seconds a sampling step spends choosing one request's token from its logits, as
    `_sample_batch` chooses them for a batch of `model_text.GENERATION_BATCH`: below a
    `request_top_p` of one each row's whole vocabulary is sorted, which on a small model costs more
    than the step's forward pass, so a plan that priced the forward pass alone overran. The
    batch's choice is timed once after one untimed."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    from hf_selfspec.tuner_api import timed

    warpers = LogitsProcessorList([TemperatureLogitsWarper(corpus.request_temperature),
                                   TopPLogitsWarper(corpus.request_top_p)])
    logits = torch.randn((model_text.GENERATION_BATCH, vocab_size), device=device)

    def choose() -> torch.Tensor:
        return torch.multinomial(warpers(None, logits).softmax(dim=-1), num_samples=1)

    return [timed(choose, device)[1] for _ in range(2)][-1] / model_text.GENERATION_BATCH


@dataclass
class _Progress:
    """What sampling has done so far; saved after every batch (as plain lists and numbers)."""

    batches: int = 0
    drawn: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # candidates per task seed
    requests: list[Request] = dataclasses.field(default_factory=list)
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @classmethod
    def load(cls, path: Path) -> _Progress:
        if not path.is_file():
            return cls()
        saved = torch.load(path)
        requests = [Request(*request) for request in saved["requests"]]
        return cls(saved["batches"], collections.Counter(saved["drawn"]), requests, collections.Counter(saved["dropped"]))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        requests = [[request.task_seed, request.text] for request in self.requests]
        atomic_save({"batches": self.batches, "drawn": dict(self.drawn), "requests": requests, "dropped": dict(self.dropped)}, path)


def sample_requests(model, tokenizer, corpus: SelfPromptedRecipe, turn: UserTurn, overlap: EvaluationOverlap, cache_file: Path, show_progress: bool) -> tuple[list[Request], collections.Counter]:
    """`corpus.self_prompted` requests, each task seed's quota of them (fewer if the candidates
    run out), and why others were dropped."""
    progress = _Progress.load(cache_file)
    needs_passage = any(TASK_SEEDS[name].passage for name in corpus.task_seeds)
    passage_texts = passages() if needs_passage else [""]
    if not passage_texts:
        raise TuningError("pydoc_data.topics holds no passages here: leave summarisation and document_qa out of corpus.task_seeds")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    special = set(tokenizer.all_special_ids)
    seen = {_key(request.text) for request in progress.requests}
    quotas = _quotas(corpus)
    most = corpus.self_prompted * _MAX_CANDIDATES_PER_REQUEST
    bar = tqdm(total=corpus.self_prompted, initial=len(progress.requests), desc="sampling requests", unit="request",
               disable=None if show_progress else True)
    with progress_lines.task("sampling requests", total=most - sum(progress.drawn.values()), unit="candidates at most"):
        while len(progress.requests) < corpus.self_prompted and sum(progress.drawn.values()) < most:
            candidates = _next_candidates(progress, corpus, tokenizer, turn, passage_texts)
            rows = _sample_batch(model, [candidate.prompt for candidate in candidates], corpus, turn, pad_id, progress.batches)
            kept = collections.Counter(request.task_seed for request in progress.requests)
            for candidate, sampled in zip(candidates, rows):
                progress.drawn[candidate.task_seed] += 1
                progress_lines.advance()
                reason = _rejection(tokenizer, candidate, sampled, special, overlap, seen)
                if reason:
                    progress.dropped[reason] += 1
                elif kept[candidate.task_seed] < quotas[candidate.task_seed]:
                    request = (candidate.before + candidate.opening + tokenizer.decode(sampled)).strip()
                    seen.add(_key(request))
                    kept[candidate.task_seed] += 1
                    progress.requests.append(Request(candidate.task_seed, request))
                    bar.update(1)
            progress.batches += 1
            progress.save(cache_file)
    bar.close()
    if len(progress.requests) < corpus.self_prompted:
        logger.warning("sampled %d usable requests of the %d asked for in %d candidates", len(progress.requests),
                       corpus.self_prompted, sum(progress.drawn.values()))
    return progress.requests, progress.dropped


def _rejection(tokenizer, candidate: _Candidate, sampled: list[int] | None, special: set[int], overlap: EvaluationOverlap, seen: set[str]) -> str | None:
    """Why a sampled request is not kept, or None."""
    if sampled is None:
        return "unfinished"
    if special.intersection(sampled):
        return "special token"
    written = tokenizer.decode(sampled)
    instruction = (candidate.opening + written).strip()
    if not written.strip() or len(instruction.split()) < _MIN_REQUEST_WORDS:
        return "too short"
    if _degenerate(instruction):
        return "repetitive"
    if overlap(candidate.before + instruction):
        return "evaluation text"
    if _key(candidate.before + instruction) in seen:
        return "duplicate"
    return None


def answer_prompt(tokenizer, request: str) -> list[int]:
    """The chat of one user request, rendered for the assistant's answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": request}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class SelfPromptedCorpus:
    texts: list[list[int]]  # each the rendered request followed by the model's greedy answer
    task_seeds: list[str]  # each text's
    answer_tokens: list[int]  # each text's answer length
    dropped: dict[str, int]  # candidates passed over, by reason

    def describe(self) -> str:
        """Its size and its mix, by task seed: what the corpus holds, in one line."""
        per_seed = collections.Counter(self.task_seeds)
        answers = collections.Counter()
        for name, tokens in zip(self.task_seeds, self.answer_tokens):
            answers[name] += tokens
        mix = ", ".join(f"{name} {count} ({answers[name]} answer tokens)" for name, count in sorted(per_seed.items()))
        total = sum(map(len, self.texts))
        dropped = ", ".join(f"{reason} {count}" for reason, count in sorted(self.dropped.items())) or "none"
        return (
            f"{len(self.texts)} self-prompted requests, {total} tokens ({sum(self.answer_tokens)} in answers); "
            f"by task seed: {mix}; candidates dropped: {dropped}"
        )


def self_prompted_dir(model: ModelConfig, corpus: SelfPromptedRecipe) -> Path:
    """Where the requests and answers of one model and self-prompting recipe are kept; the rest of
    the corpus does not enter the key, so other code text reuses them."""
    recipe = {key: getattr(corpus, key) for key in KEYS}
    key = hashlib.sha1(json.dumps([dataclasses.asdict(model), recipe], sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "self-prompted" / key


def self_prompted_texts(model, tokenizer, model_name: str, corpus: SelfPromptedRecipe, cache_dir: Path, show_progress: bool) -> SelfPromptedCorpus:
    """The self-prompted corpus: requests sampled and filtered, then each answered greedily (both
    cached in `cache_dir`, both resumable), its size and mix logged."""
    turn = open_user_turn(tokenizer, model_name)
    overlap = EvaluationOverlap(evaluation_texts())
    requests, dropped = sample_requests(model, tokenizer, corpus, turn, overlap, cache_dir / "requests.pt", show_progress)
    prompts = [answer_prompt(tokenizer, request.text) for request in requests]
    texts = generated_texts(model, tokenizer, prompts, corpus.answer_tokens, cache_dir / "answers.pt", show_progress, "answering requests")
    kept = [i for i, (prompt, text) in enumerate(zip(prompts, texts)) if not overlap(tokenizer.decode(text[len(prompt) :]))]
    dropped = collections.Counter(dropped)
    dropped["evaluation text in the answer"] += len(texts) - len(kept)
    result = SelfPromptedCorpus(
        [texts[i] for i in kept], [requests[i].task_seed for i in kept], [len(texts[i]) - len(prompts[i]) for i in kept],
        {reason: count for reason, count in dropped.items() if count},
    )
    logger.info("%s", result.describe())
    return result
