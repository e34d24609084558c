"""An online lookup corpus: what a model's calls read and wrote, learned across calls.

Prompt lookup copies from the current request, and a lookup corpus from a file written once;
either way each call forgets the calls before it. A service repeats itself across requests (an
agent calling the same tools with the same JSON shapes, one file edited again and again, one
answer format asked a thousand times), so every finished generation's prompt and output are
added here as one text, and later calls look up the continuation of their current n-gram in
them, as suffix decoding does over finished responses.

The context is the text's longest suffix that occurred in the corpus, as a suffix tree finds
it: an n-gram of up to `INDEXED_NGRAM` tokens looked up, then followed back token by token in
each occurrence, up to `MAX_CONTEXT`, and only the occurrences that agree furthest back are
kept. A short context recurs by chance (one token of JSON punctuation), a long one because the
text is going the way an earlier one went. The proposal then follows, token by token, the
continuation most of those occurrences agree on, and stops where the share of occurrences
that still agree with the path falls under `min_prob`: how often a continuation followed this
context decides how long the proposal is, so a context that always led to one tool call's
JSON proposes all of it, and a context seen with many continuations proposes little or
nothing. It proposes no more tokens than its context is long (suffix decoding's
`max_spec_factor` of one): a match of three tokens is weak evidence for sixteen. Only
proposes: the verifier decides, so decoding stays lossless.

Memory is bounded by `max_tokens`: past it, the oldest texts go first, as a service's oldest
traffic is the least like its next. Each n-gram's occurrences are kept oldest first, so
evicting a text removes its occurrences from the fronts of those lists, with no search; an
occurrence is one integer (`_occurrence`), as most n-grams of a text occur only a few times and
a container per n-gram is most of the memory.

One lock guards a corpus: a call's lookup holds it for one proposal, and a text is added
after the call's output is final, so concurrent calls each see a consistent corpus, and what
they decode is what they would decode alone.

Corpora are kept per model and per key (`online_corpus(model, key)`), so one tenant's or one
task's text is never proposed inside another's request; they go with the model.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from .batch import left_padding, why_not_left_padded
from .lookup_corpus import SEPARATOR, read_lookup_corpus, save_lookup_corpus
from .profile_files import local_file

# The n-gram lengths indexed: a call's lookup tries its longest suffix n-gram first, up to this.
INDEXED_NGRAM = 4
# The newest occurrences of a context that a proposal counts: a context as common as `", "` in
# JSON occurs thousands of times, and the recent ones say more of the next request.
COUNTED_OCCURRENCES = 256
# How far back a context is followed: past it, a longer agreement says no more.
MAX_CONTEXT = 32
DEFAULT_KEY = "default"
DEFAULT_MAX_TOKENS = 250_000
_POSITION_BITS = 32


def _occurrence(number: int, end: int) -> int:
    """Text `number`'s n-gram whose continuation starts at `end`, as one integer ordered by text."""
    return number << _POSITION_BITS | end


def _text_and_end(occurrence: int) -> tuple[int, int]:
    return occurrence >> _POSITION_BITS, occurrence & ((1 << _POSITION_BITS) - 1)


class OnlineCorpus:
    """Token texts of one model's calls, indexed by every n-gram of 1 to `INDEXED_NGRAM` tokens,
    the oldest evicted past `max_tokens` tokens in all."""

    def __init__(self, vocab_size: int, max_tokens: int = DEFAULT_MAX_TOKENS):
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._texts: dict[int, list[int]] = {}  # by number, in the order added
        self._next_number = 0
        self._tokens = 0
        # n-gram -> its occurrences (`_occurrence`), oldest first
        self._index: dict[tuple[int, ...], list[int]] = {}
        # The saved corpora started from since this one was made or last cleared (`start_from`).
        self._starts_lock = threading.Lock()
        self._started_from: set[str] = set()
        self.bound(max_tokens)

    @property
    def tokens(self) -> int:
        """Tokens held, at most `max_tokens`."""
        return self._tokens

    @property
    def texts(self) -> int:
        return len(self._texts)

    @property
    def indexed_occurrences(self) -> int:
        """Index entries held: at most `INDEXED_NGRAM` per token held."""
        with self._lock:
            return sum(len(occurrences) for occurrences in self._index.values())

    def add(self, tokens: Iterable[int]) -> None:
        """Add one text (a prompt and what was generated after it); a text longer than the
        bound keeps its last `max_tokens` tokens."""
        text = [int(t) for t in tokens][-self.max_tokens :]
        if len(text) < 2:
            return
        with self._lock:
            number = self._next_number
            self._next_number += 1
            self._texts[number] = text
            self._tokens += len(text)
            for n in range(1, INDEXED_NGRAM + 1):
                for end in range(n, len(text)):  # an n-gram with at least one token after it
                    self._index.setdefault(tuple(text[end - n : end]), []).append(_occurrence(number, end))
            while self._tokens > self.max_tokens:
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        number = next(iter(self._texts))
        text = self._texts.pop(number)
        self._tokens -= len(text)
        for n in range(1, INDEXED_NGRAM + 1):
            for end in range(n, len(text)):
                key = tuple(text[end - n : end])
                occurrences = self._index.get(key)
                if occurrences is None:
                    continue  # an n-gram the text held twice, gone with its first
                newer = next((i for i, o in enumerate(occurrences) if o >> _POSITION_BITS > number), len(occurrences))
                if newer == len(occurrences):
                    del self._index[key]
                else:
                    del occurrences[:newer]

    def bound(self, max_tokens: int) -> None:
        """Hold at most `max_tokens` tokens from now on, evicting the oldest texts down to it."""
        if max_tokens < 1:
            raise ValueError(f"an online corpus needs max_tokens >= 1, got {max_tokens}")
        with self._lock:
            self.max_tokens = max_tokens
            while self._tokens > max_tokens:
                self._evict_oldest()

    def clear(self) -> None:
        """Forget every text, and which saved corpora it started from: a call under a profile
        that ships one starts from it again."""
        with self._starts_lock, self._lock:
            self._texts.clear()
            self._index.clear()
            self._tokens = 0
            self._started_from.clear()

    def continuation(
        self, text: list[int], min_ngram: int, max_ngram: int, max_tokens: int, min_prob: float, longer_than: int = 0
    ) -> list[int]:
        """What most often followed the longest suffix of `text` found in the corpus (looked up
        by its last `max_ngram` tokens, at most `INDEXED_NGRAM`, down to `min_ngram`, then
        followed back), for as long as the share of its occurrences that agree with the whole
        path stays at `min_prob` or above, and no longer than that suffix; empty if no suffix
        occurred, if the longest is not longer than `longer_than` tokens, or if its likeliest
        next token falls short already."""
        text = text[-MAX_CONTEXT:]
        with self._lock:
            for n in range(min(max_ngram, INDEXED_NGRAM, len(text)), min_ngram - 1, -1):
                occurrences = self._index.get(tuple(text[-n:]))
                if occurrences:
                    newest = map(_text_and_end, occurrences[-COUNTED_OCCURRENCES:])
                    candidates, context = self._deepest(list(newest), text, n)
                    if context <= longer_than:
                        return []
                    return self._likeliest_path(candidates, min(max_tokens, context), min_prob)
        return []

    def _deepest(self, candidates: list[tuple[int, int]], text: list[int], n: int) -> tuple[list[tuple[int, int]], int]:
        """The occurrences whose agreement with the end of `text` reaches furthest back, and how far."""
        reaches = []
        for number, start in candidates:
            words, reach = self._texts[number], n
            while reach < min(start, len(text)) and words[start - reach - 1] == text[-reach - 1]:
                reach += 1
            reaches.append(reach)
        deepest = max(reaches)
        return [c for c, reach in zip(candidates, reaches) if reach == deepest], deepest

    def _likeliest_path(self, candidates: list[tuple[int, int]], max_tokens: int, min_prob: float) -> list[int]:
        total = len(candidates)
        path: list[int] = []
        while len(path) < max_tokens:
            counts: dict[int, int] = {}
            for number, start in candidates:
                words = self._texts[number]
                if start + len(path) < len(words):
                    token = words[start + len(path)]
                    counts[token] = counts.get(token, 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)
            if counts[token] < min_prob * total:
                break
            path.append(token)
            candidates = [(n, s) for n, s in candidates if s + len(path) - 1 < len(self._texts[n])
                          and self._texts[n][s + len(path) - 1] == token]
        return path

    def save(self, path: str | Path, description: str = "an online corpus") -> Path:
        """Write the texts held, oldest first, as a lookup-corpus file: a later process starts
        from it (`load`), and a profile can name it as its `lookup_corpus`."""
        with self._lock:
            texts = list(self._texts.values())
        return save_lookup_corpus(texts, path, self.vocab_size, description)

    def load(self, path: str | Path) -> None:
        """Add the texts of a lookup-corpus file (one this corpus saved, or any other), in order."""
        tokens = read_lookup_corpus(path, self.vocab_size).tokens
        ends = torch.nonzero(tokens == SEPARATOR).flatten().tolist()
        start = 0
        for end in ends:
            self.add(tokens[start:end].tolist())
            start = end + 1

    def start_from(self, path: str | Path) -> None:
        """`load` the saved corpus at `path` (a Hub address is fetched first) unless this corpus
        started from it already: a profile ships what its tuning learned, and every call under
        it names that file, which must be read once, not once a call. Concurrent callers wait
        for the one that reads it, so none decodes from half of it twice."""
        with self._starts_lock:
            if str(path) in self._started_from:
                return
            self.load(local_file(path, "online corpus"))
            self._started_from.add(str(path))


_registry_lock = threading.Lock()
_corpora: weakref.WeakKeyDictionary[nn.Module, dict[str, OnlineCorpus]] = weakref.WeakKeyDictionary()


def online_corpus(model: nn.Module, key: str = DEFAULT_KEY, max_tokens: int | None = None) -> OnlineCorpus:
    """The model's online corpus for `key` (one per tenant or per task), made on first use with
    at most `max_tokens` tokens (`DEFAULT_MAX_TOKENS` unless given); `max_tokens` given later
    sets a new bound, evicting down to it."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"an online corpus key must be a non-empty string, got {key!r}")
    with _registry_lock:
        corpora = _corpora.setdefault(model, {})
        if key not in corpora:
            vocab_size = model.get_output_embeddings().weight.shape[0]
            corpora[key] = OnlineCorpus(vocab_size, DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
        corpus = corpora[key]
    if max_tokens is not None:
        corpus.bound(max_tokens)
    return corpus


def online_corpus_keys(model: nn.Module) -> list[str]:
    """The keys of the model's online corpora made so far."""
    with _registry_lock:
        return sorted(_corpora.get(model, {}))


def corpus_for_call(model: nn.Module, choice: object) -> OnlineCorpus | None:
    """The corpus a call's `online_corpus` keyword names: None or False for none, True for the
    model's default one, a string for that key's."""
    if choice is None or choice is False:
        return None
    if choice is True:
        return online_corpus(model)
    if isinstance(choice, str):
        return online_corpus(model, choice)
    raise ValueError(f"online_corpus must be True, False, None or a key (a string), got {choice!r}")


def feed(
    corpus: OnlineCorpus, sequences: torch.Tensor, prompt: torch.Tensor, attention_mask: torch.Tensor | None,
    pad_token_id: int | None = None,
) -> None:
    """Add a finished call's texts: each row's prompt without its left padding, then its output
    without the padding after a row that stopped before the others. A batch whose mask is not
    left padding is skipped: where a row's text starts is then not ours to say."""
    rows = sequences.reshape(-1, sequences.shape[-1])
    starts = [0] * rows.shape[0]
    if attention_mask is not None:
        if why_not_left_padded(attention_mask, prompt) is not None:
            return
        starts = left_padding(attention_mask.repeat_interleave(rows.shape[0] // attention_mask.shape[0], dim=0), 0)
    for row, start in zip(rows.tolist(), starts):
        end = len(row)
        while rows.shape[0] > 1 and pad_token_id is not None and end > prompt.shape[-1] and row[end - 1] == pad_token_id:
            end -= 1
        corpus.add(row[start:end])
