"""The teacher pass: the model itself, teacher-forced once over the whole corpus.

Its final hidden states give the distributions a draft adapter learns to match, and the hidden
states entering each exit layer are the adapter's inputs. Both come from one pass that every exit
layer shares and that is cached on disk, so training several exit layers, or resuming one, never
re-runs the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_selfspec.tuner_api import decoder_layers

from .. import progress
from .model_text import atomic_save

TEACHER_BATCH = 8


@dataclass
class TeacherOutputs:
    chunks: torch.Tensor  # [n, T] token ids
    shallow: dict[int, torch.Tensor]  # exit layer -> [n, T, hidden]: what enters that layer
    final: torch.Tensor  # [n, T, hidden]: the normed hidden state the LM head reads


@torch.no_grad()
def teacher_outputs(model, chunks: torch.Tensor, exit_layers: tuple[int, ...], cache_file: Path, show_progress: bool) -> TeacherOutputs:
    """One forward pass of the model over the corpus, kept on disk (as the model computed it,
    in its dtype) so other exit layers and resumed runs reuse it."""
    if cache_file.is_file():
        stored = torch.load(cache_file, map_location="cpu")
        if set(exit_layers) <= set(stored["shallow"]) and torch.equal(stored["chunks"], chunks):
            return TeacherOutputs(stored["chunks"], {e: stored["shallow"][e] for e in exit_layers}, stored["final"])
    layers = decoder_layers(model)
    shallow = {e: [] for e in exit_layers}
    hooks = [
        layers[e - 1].register_forward_hook(
            lambda m, a, out, e=e: shallow[e].append((out[0] if isinstance(out, tuple) else out).cpu())
        )
        for e in exit_layers
    ]
    final = []
    try:
        batches = chunks.split(TEACHER_BATCH)
        bar = tqdm(batches, desc="teacher pass", unit="batch", disable=None if show_progress else True)
        for batch in progress.counting(bar, "teacher pass", "batches"):
            final.append(model.get_decoder()(input_ids=batch.to(model.device), use_cache=False).last_hidden_state.cpu())
    finally:
        for hook in hooks:
            hook.remove()
    outputs = TeacherOutputs(chunks, {e: torch.cat(v) for e, v in shallow.items()}, torch.cat(final))
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_save({"chunks": chunks, "shallow": outputs.shallow, "final": outputs.final}, cache_file)
    return outputs
