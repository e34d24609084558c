"""Training one exit layer's draft adapter by self-distillation from the teacher pass.

Determinism: the adapter starts as a copy of the exit layer, batches are drawn from a generator
seeded by (seed, epoch), and a checkpoint holds the adapter, the optimizer and the step, so a run
killed at any moment and resumed ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_selfspec.tuner_api import AdapterShape, DraftAdapter, save_adapter, timed

from .. import progress
from .model_text import atomic_save
from .teacher import TEACHER_BATCH, TeacherOutputs

logger = logging.getLogger(__name__)

_TIMED_STEPS = 3


@dataclass(frozen=True)
class TrainingConfig:
    steps: int = 1000
    batch_chunks: int = 4
    lr: float = 3e-4
    seed: int = 0
    # The KL is taken over the lowest `vocab_size` token ids (0: all): the draft head is usually
    # restricted to them anyway, and the head dominates a training step's cost.
    vocab_size: int = 0
    eval_every: int = 100
    checkpoint_every: int = 100


# Above this many bytes the teacher's logits over the training vocabulary are not kept for the
# whole corpus but computed again for each batch: a large vocabulary over a long corpus would
# not fit in host memory (tokens x vocabulary x 4 bytes).
_KEPT_TARGET_BYTES = 2 * 2**30


class _DistillationHead:
    """The model's LM head over the training vocabulary, in float32, frozen."""

    def __init__(self, model, vocab_size: int):
        weight = model.get_output_embeddings().weight
        self.weight = weight[: vocab_size or weight.shape[0]].detach().float()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden.float() @ self.weight.T  # under autocast, in its reduced precision
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits


def covering_vocabulary(chunks: torch.Tensor, share: float, vocab_size: int, multiple: int = 1024) -> int:
    """The fewest lowest token ids, rounded up to `multiple`, that cover `share` of `chunks`'
    tokens; 0 (the whole vocabulary) where that takes all `vocab_size`. A vocabulary whose
    frequent tokens have high ids (single characters at the end of it) needs nearly all of it."""
    ordered = chunks.flatten().sort().values
    needed = int(ordered[min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1)]) + 1
    rounded = -(-needed // multiple) * multiple
    return 0 if rounded >= vocab_size else rounded


def _batch_indices(train_count: int, step: int, batch: int, seed: int) -> torch.Tensor:
    """The chunks of step `step`: epoch-wise permutations from a generator seeded by (seed, epoch),
    so a resumed run draws exactly what an uninterrupted one would."""
    per_epoch = max(train_count // batch, 1)
    epoch, position = divmod(step, per_epoch)
    order = torch.randperm(train_count, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[position * batch : position * batch + batch]


def _reduced_precision(model) -> torch.autocast:
    """Matrix products in the model's own reduced precision where it has one (faster than float32
    wherever the hardware supports it), for the student's step and for the teacher's logits alike."""
    return torch.autocast(model.device.type, dtype=model.dtype, enabled=model.dtype != torch.float32)


@torch.no_grad()
def teacher_logits(model, head: _DistillationHead, final: torch.Tensor) -> torch.Tensor:
    """The teacher's logits over the training vocabulary for `final`'s chunks, in the autocast
    precision the step computes the student's in."""
    with _reduced_precision(model):
        return torch.cat([head(part.to(model.device)).cpu() for part in final.split(TEACHER_BATCH)])


def teacher_targets(model, head: _DistillationHead, final: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The teacher's logits for a batch of chunk indices. Computed once for the whole corpus,
    rather than at every step that draws a chunk again (the head's product is a large part of a
    step), where they fit in `_KEPT_TARGET_BYTES` of host memory; else per batch."""
    kept_bytes = final.shape[0] * final.shape[1] * head.weight.shape[0] * torch.finfo(torch.float32).bits // 8
    if kept_bytes <= _KEPT_TARGET_BYTES:
        kept = teacher_logits(model, head, final)
        return lambda batch: kept[batch]
    return lambda batch: teacher_logits(model, head, final[batch])


def distillation_step(
    model, adapter: DraftAdapter, head: _DistillationHead, optimizer: torch.optim.Optimizer,
    shallow: torch.Tensor, target: torch.Tensor, positions: torch.Tensor,
) -> float:
    """One optimizer step of the KL from the teacher's logits `target` to the draft's over a batch
    of chunks whose states entering the exit layer are `shallow`; the loss."""
    with _reduced_precision(model):
        student = head(adapter(shallow.to(model.device).float(), positions.expand(shallow.shape[0], -1)))
    # The loss and the optimizer stay in float32.
    student, target = torch.log_softmax(student.float(), dim=-1), torch.log_softmax(target.to(model.device).float(), dim=-1)
    loss = torch.nn.functional.kl_div(student.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def _trainable_adapter(model, exit_layer: int, mlp: bool, lr: float) -> tuple[DraftAdapter, torch.optim.Optimizer]:
    """A new adapter for `exit_layer`, a copy of that (frozen) layer, in training mode with its
    master weights in float32, and its optimizer."""
    adapter = DraftAdapter(model, AdapterShape.for_model(model, exit_layer, mlp)).float().train()
    adapter.requires_grad_(True)
    return adapter, torch.optim.AdamW(adapter.parameters(), lr=lr)


def time_training_step(model, exit_layer: int, mlp: bool, vocab_size: int, batch_chunks: int, chunk_tokens: int) -> float:
    """Median seconds of a training step for `exit_layer` over the lowest `vocab_size` ids (0: all),
    the teacher's logits for the batch included, on random states (the cost depends on shapes,
    not values) and a throwaway adapter."""
    adapter, optimizer = _trainable_adapter(model, exit_layer, mlp, lr=1e-4)
    head = _DistillationHead(model, vocab_size)
    hidden_size = head.weight.shape[1]
    generator = torch.Generator().manual_seed(0)
    shallow, final = (torch.randn(batch_chunks, chunk_tokens, hidden_size, generator=generator) for _ in range(2))
    positions = torch.arange(chunk_tokens, device=model.device)[None]

    def step() -> None:
        distillation_step(model, adapter, head, optimizer, shallow, teacher_logits(model, head, final), positions)

    step()  # untimed: the first step pays for allocation
    return statistics.median(timed(step, model.device)[1] for _ in range(_TIMED_STEPS))


@torch.no_grad()
def heldout_agreement(adapter: DraftAdapter, head: _DistillationHead, shallow: torch.Tensor, final: torch.Tensor) -> float:
    """Top-1 agreement of the draft (adapter, then the training head) with the full model."""
    agree = total = 0
    device = head.weight.device
    positions = torch.arange(shallow.shape[1], device=device)[None]
    for index in range(shallow.shape[0]):
        student = head(adapter(shallow[index : index + 1].to(device).float(), positions)).argmax(-1)
        teacher = head(final[index : index + 1].to(device)).argmax(-1)
        agree += int((student == teacher).sum())
        total += teacher.numel()
    return agree / total


def train_exit_layer(
    model, teacher: TeacherOutputs, exit_layer: int, mlp: bool, training: TrainingConfig, heldout_fraction: float,
    checkpoint: Path, output: Path, show_progress: bool,
) -> tuple[Path, float]:
    """Train the adapter for one exit layer (resuming from `checkpoint` if it exists) on all but
    the last `heldout_fraction` of the chunks, which measure it, and write it to `output`;
    `(written file, held-out agreement)`."""
    torch.manual_seed(training.seed)
    adapter, optimizer = _trainable_adapter(model, exit_layer, mlp, training.lr)
    head = _DistillationHead(model, training.vocab_size)
    shallow, final = teacher.shallow[exit_layer], teacher.final
    heldout = max(1, round(shallow.shape[0] * heldout_fraction))
    train_count = shallow.shape[0] - heldout
    # The teacher's outputs stay in host memory (the whole corpus's), a batch at a time on the model's device.
    targets = teacher_targets(model, head, final[:train_count])
    positions = torch.arange(shallow.shape[1], device=model.device)[None]

    step, agreement, loss_value = 0, float("nan"), float("nan")
    if checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu")  # loading the state copies it to the adapter's device
        adapter.load_state_dict(state["adapter"])
        optimizer.load_state_dict(state["optimizer"])
        step, agreement = state["step"], state["agreement"]

    bar = tqdm(total=training.steps, initial=step, desc=f"exit layer {exit_layer}", unit="step",
               disable=None if show_progress else True)
    with progress.task(f"training exit layer {exit_layer}", total=training.steps - step, unit="steps"):
        while step < training.steps:
            batch = _batch_indices(train_count, step, training.batch_chunks, training.seed)
            loss_value = distillation_step(model, adapter, head, optimizer, shallow[batch], targets(batch), positions)
            step += 1
            if step % training.eval_every == 0 or step == training.steps:
                adapter.eval()
                agreement = heldout_agreement(adapter, head, shallow[train_count:], final[train_count:])
                adapter.train()
                logger.info("exit layer %d, step %d: loss %.4f, top-1 agreement %.4f on the corpus's held-out chunks", exit_layer, step, loss_value, agreement)
            if step % training.checkpoint_every == 0 or step == training.steps:
                atomic_save({"adapter": adapter.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                              "agreement": agreement}, checkpoint)
            bar.set_postfix(loss=f"{loss_value:.3f}", heldout_top1=f"{agreement:.3f}")
            bar.update(1)
            progress.advance()
    bar.close()
    path = save_adapter(adapter, output, dtype=model.dtype)
    return path, agreement
