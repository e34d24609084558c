"""Prompt lookup in the model's own earlier writing: an n-gram index over text it generated.

Prompt lookup proposes only what the prompt and the answer so far already contain. A model
also repeats itself *across* answers: the same idioms, the same way of turning a docstring
into a body, the same closing lines. Its greedy continuations of other prompts are therefore
a second place to look when the current text has no match, still at no model cost, and the
verifier decides as for any proposal, so output stays lossless.

Among the many earlier occurrences of a short n-gram the proposal follows the majority, token
by token, among the occurrences that agree so far, and stops where no continuation holds more
than half of them: a contested token is more often rejected than not, and a rejected proposal
still widens the verification.

On disk a corpus is `<name>.safetensors` (one int32 tensor, the texts joined by -1) plus
`<name>.json` (what it was made from), laid out like a draft adapter so that every place a
profile's files travel through treats both alike.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from torch import nn

from .files import adapter_files, existing_adapter_files, save_tensor_file_pair
from .inputs import read_text_file
from .profile_files import local_file

CORPUS_FORMAT = "hf-selfspec-lookup-corpus/1"
SEPARATOR = -1
# n-grams are hashed modulo a prime below 2**31, so hash * base stays inside int64; a collision
# is caught by comparing the tokens themselves.
_MODULUS = 2_147_483_647
_BASE = 1_000_003


class LookupCorpus:
    """Token texts of one tokenizer, indexed by n-gram on first use of each n."""

    def __init__(self, texts: list[list[int]] | torch.Tensor):
        # Every text closed by a separator, so no n-gram or continuation crosses into the next
        # and every continuation ends inside the tensor.
        if isinstance(texts, torch.Tensor):
            tokens = texts.to(torch.int64).flatten()
            ends_text = tokens.numel() and int(tokens[-1]) == SEPARATOR
            self.tokens = tokens if ends_text else torch.cat([tokens, torch.tensor([SEPARATOR])])
        else:
            self.tokens = torch.tensor([t for text in texts for t in [*text, SEPARATOR]], dtype=torch.int64)
        self._index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _hash(self, windows: torch.Tensor) -> torch.Tensor:
        hashed = torch.zeros(windows.shape[0], dtype=torch.int64)
        for column in windows.unbind(dim=1):
            hashed = (hashed * _BASE + column + 1) % _MODULUS
        return hashed

    def _ngram_index(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(sorted hashes, where each occurrence's continuation starts)` for the n-grams that
        lie inside one text and are followed by at least one of its tokens."""
        if n not in self._index:
            windows = self.tokens[:-1].unfold(0, n, 1)
            follows = self.tokens[n:]
            keep = (windows != SEPARATOR).all(dim=1) & (follows != SEPARATOR)
            starts = torch.nonzero(keep).flatten()
            hashes, order = torch.sort(self._hash(windows[starts]), stable=True)
            self._index[n] = (hashes, starts[order] + n)
        return self._index[n]

    def continuation(self, text: torch.Tensor, min_ngram: int, max_ngram: int, max_tokens: int) -> list[int]:
        """The majority continuation of the longest suffix n-gram of the 1-D `text` (from
        `max_ngram` down to `min_ngram` tokens) found in the corpus; empty if none is."""
        text = text.to(torch.int64).cpu()
        for n in range(min(max_ngram, text.shape[0]), min_ngram - 1, -1):
            hashes, follow = self._ngram_index(n)
            suffix = text[-n:]
            key = self._hash(suffix[None])
            low, high = torch.searchsorted(hashes, key), torch.searchsorted(hashes, key, right=True)
            candidates = follow[int(low) : int(high)]
            if candidates.numel():
                offsets = torch.arange(-n, 0)
                candidates = candidates[(self.tokens[candidates[:, None] + offsets] == suffix).all(dim=1)]
            if candidates.numel():
                return self._majority_path(candidates, max_tokens)
        return []

    def _majority_path(self, candidates: torch.Tensor, max_tokens: int) -> list[int]:
        path: list[int] = []
        for _ in range(max_tokens):
            following = self.tokens[candidates + len(path)]
            values, counts = torch.unique(following, return_counts=True)
            best = int(torch.argmax(counts))
            token = int(values[best])
            if token == SEPARATOR or 2 * int(counts[best]) <= candidates.numel():
                break
            path.append(token)
            candidates = candidates[following == token]
        return path


def save_lookup_corpus(texts: list[list[int]], path: str | Path, vocab_size: int, description: str) -> Path:
    """Write the texts and what they are, each through a temporary file renamed into place."""
    if not any(texts):
        # Nothing to look up in: a profile naming such a file would only fail to decode.
        raise ValueError(f"{path}: no text to write as a lookup corpus; give its config prompts to continue")
    tokens_path, about_path = adapter_files(path)
    about = {"format": CORPUS_FORMAT, "vocab_size": vocab_size, "texts": len(texts),
             "tokens": sum(len(t) for t in texts), "description": description}
    return save_tensor_file_pair(tokens_path, {"token_ids": LookupCorpus(texts).tokens.to(torch.int32)}, about_path, about)


def read_corpus_description(path: str | Path) -> dict:
    """What a corpus file declares, read without a model: enough to reject a file that is not a
    lookup corpus at all before a model is loaded."""
    _, about_path = existing_adapter_files(path, what="lookup corpus")
    try:
        about = json.loads(read_text_file(about_path))
    except json.JSONDecodeError as error:
        raise ValueError(f"{about_path}: not valid JSON ({error})") from None
    if not isinstance(about, dict) or about.get("format") != CORPUS_FORMAT:
        raise ValueError(f"{about_path}: not a lookup corpus description (expected format {CORPUS_FORMAT!r})")
    return about


@functools.lru_cache(maxsize=4)
def _read_lookup_corpus(tokens_path: str, modified_ns: int, vocab_size: int) -> LookupCorpus:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    about = read_corpus_description(tokens_path)
    if about.get("vocab_size") != vocab_size:
        raise ValueError(
            f"{adapter_files(tokens_path)[1]}: written for a vocabulary of {about.get('vocab_size')} tokens, "
            f"the model has {vocab_size}"
        )
    try:
        tokens = load_file(tokens_path)["token_ids"]
    except (SafetensorError, OSError, KeyError) as error:
        raise ValueError(f"{tokens_path}: cannot read the corpus's token ids ({error})") from None
    if tokens.dim() != 1 or tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{tokens_path}: token_ids must be one row of integers, got {tokens.dtype} of shape {tuple(tokens.shape)}")
    if not bool((tokens != SEPARATOR).any()):
        raise ValueError(f"{tokens_path}: holds no tokens; write the corpus again from a config with prompts")
    if int(tokens.max()) >= vocab_size or int(tokens.min()) < SEPARATOR:
        bad = int(tokens.max()) if int(tokens.max()) >= vocab_size else int(tokens.min())
        raise ValueError(f"{tokens_path}: holds token id {bad}, outside the model's vocabulary")
    return LookupCorpus(tokens)


def load_lookup_corpus(model: nn.Module, path: str | Path) -> LookupCorpus:
    """The corpus at `path` (a Hub address is fetched first), checked against the model's
    vocabulary; read and indexed once a process for as long as the file is unchanged."""
    return read_lookup_corpus(local_file(path, "lookup corpus"), model.get_output_embeddings().weight.shape[0])


def read_lookup_corpus(path: str | Path, vocab_size: int) -> LookupCorpus:
    """The corpus file at `path`, checked against a vocabulary of `vocab_size` tokens."""
    tokens_path, _ = existing_adapter_files(path, what="lookup corpus")
    return _read_lookup_corpus(str(tokens_path.resolve()), tokens_path.stat().st_mtime_ns, vocab_size)
