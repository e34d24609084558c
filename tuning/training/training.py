"""Training a draft by self-distillation from the teacher pass: one exit layer's adapter, or
draft heads on the final hidden state.

Both are a student that reads states of the teacher pass and gives logits to match the
teacher's own at fixed offsets (`Student`): the adapter reads what enters its exit layer and
matches the next token's distribution (offset 0), head `k` reads the final state and matches
the distribution `k + 1` tokens further on. A chain of heads reads the corpus's tokens too, and
each of its steps is trained on the state its step before gave, as it drafts.

Determinism: the adapter starts as a copy of the exit layer and the heads as the identity (a
chain's first layer drawn from the seed), batches are drawn from a generator seeded by (seed,
epoch), and a checkpoint holds the student, the optimizer and the step, so a run killed at any
moment and resumed ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from hf_selfspec.tuner_api import AdapterShape, DraftAdapter, DraftChain, HeadsShape, heads_for, save_adapter, timed

from .. import progress
from .model_text import atomic_save
from .teacher import TEACHER_BATCH

logger = logging.getLogger(__name__)

_TIMED_STEPS = 3
# Untimed steps first: the first few in a process pay for allocating the optimizer's state and
# the kernels' buffers, and a step timed among them prices the whole run at their rate.
_WARM_UP_STEPS = 3


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


@dataclass
class Student:
    """A draft in training: `module` maps a batch of `inputs` chunks `[b, T, hidden]` and their
    token ids `[b, T]` to hidden states `[b, T, len(offsets), hidden]` for the training head;
    output `k` at position `t` learns the teacher's logits at `t + offsets[k]`."""

    name: str
    module: nn.Module
    inputs: torch.Tensor  # [n, T, hidden], the teacher pass's, for every chunk
    offsets: tuple[int, ...]
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def outputs(self, batch: torch.Tensor | slice, chunks: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The student's outputs for the chunks `batch` of the corpus `chunks`."""
        return self.forward(self.inputs[batch].to(device).float(), chunks[batch].to(device))


def _paired(student: torch.Tensor, teacher: torch.Tensor, offsets: tuple[int, ...]):
    """`(student's output k, the teacher's logits it learns)` over the positions both have."""
    length = teacher.shape[1]
    for k, offset in enumerate(offsets):
        yield student[:, : length - offset, k], teacher[:, offset:]


def distillation_step(
    model, student: Student, head: _DistillationHead, optimizer: torch.optim.Optimizer,
    batch: torch.Tensor, chunks: torch.Tensor, target: torch.Tensor,
) -> float:
    """One optimizer step of the KL from the teacher's logits `target` to the student's over the
    chunks `batch` of `chunks`, averaged over the student's outputs; the loss."""
    with _reduced_precision(model):
        logits = head(student.outputs(batch, chunks, model.device))
    # The loss and the optimizer stay in float32.
    logits, target = torch.log_softmax(logits.float(), dim=-1), torch.log_softmax(target.to(model.device).float(), dim=-1)
    loss = sum(
        torch.nn.functional.kl_div(mine.flatten(0, 1), theirs.flatten(0, 1), log_target=True, reduction="batchmean")
        for mine, theirs in _paired(logits, target, student.offsets)
    ) / len(student.offsets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def _trainable(module: nn.Module, device: torch.device, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """`module` on `device` (the model's: the states it reads are moved there) in training mode,
    with its master weights in float32, and its optimizer."""
    module = module.to(device=device, dtype=torch.float32).train().requires_grad_(True)
    return module, torch.optim.AdamW(module.parameters(), lr=lr)


def adapter_student(model, exit_layer: int, mlp: bool, shallow: torch.Tensor, lr: float) -> tuple[Student, torch.optim.Optimizer]:
    """A new adapter for `exit_layer`, a copy of that (frozen) layer, reading `shallow`: what
    enters that layer."""
    adapter, optimizer = _trainable(DraftAdapter(model, AdapterShape.for_model(model, exit_layer, mlp)), model.device, lr)
    positions = torch.arange(shallow.shape[1], device=model.device)[None]
    forward = lambda hidden, _: adapter(hidden, positions.expand(hidden.shape[0], -1))[:, :, None]  # noqa: E731
    return Student(f"exit layer {exit_layer}", adapter, shallow, (0,), forward), optimizer


def heads_student(
    model, heads: int, final: torch.Tensor, lr: float, chained: bool = False
) -> tuple[Student, torch.optim.Optimizer]:
    """New draft heads (a chain of them where `chained`), the identity, reading `final`: the
    states the LM head reads."""
    module, optimizer = _trainable(heads_for(HeadsShape.for_model(model, heads, chained)), model.device, lr)
    offsets = tuple(range(1, heads + 1))
    if not isinstance(module, DraftChain):
        return Student(f"{heads} draft heads", module, final, offsets, lambda hidden, _: module(hidden)), optimizer
    embeddings = model.get_input_embeddings()

    def forward(hidden: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        # Step k at position t reads token t + k + 1; past a chunk's end, any token (the
        # outputs there have no teacher logits to learn and are dropped).
        following = torch.stack([chunks.roll(-ahead, dims=1) for ahead in offsets], dim=-1)
        with torch.no_grad():
            embedded = embeddings(following).float()
        return module(hidden, embedded)

    return Student(f"a chain of {heads} draft heads", module, final, offsets, forward), optimizer


def time_training_step(
    model, make_student: Callable[[torch.Tensor], tuple[Student, torch.optim.Optimizer]], vocab_size: int,
    batch_chunks: int, chunk_tokens: int,
) -> float:
    """Median seconds of a training step of the student `make_student` builds from the states it
    reads, over the lowest `vocab_size` ids (0: all), the teacher's logits for the batch included,
    on random states (the cost depends on shapes, not values)."""
    head = _DistillationHead(model, vocab_size)
    generator = torch.Generator().manual_seed(0)
    inputs, final = (torch.randn(batch_chunks, chunk_tokens, head.weight.shape[1], generator=generator) for _ in range(2))
    chunks = torch.randint(head.weight.shape[0], (batch_chunks, chunk_tokens), generator=generator)
    student, optimizer = make_student(inputs)
    batch = torch.arange(batch_chunks)

    def step() -> None:
        distillation_step(model, student, head, optimizer, batch, chunks, teacher_logits(model, head, final))

    for _ in range(_WARM_UP_STEPS):
        step()
    return statistics.median(timed(step, model.device)[1] for _ in range(_TIMED_STEPS))


@torch.no_grad()
def heldout_agreement(
    student: Student, head: _DistillationHead, heldout: range, final: torch.Tensor, chunks: torch.Tensor
) -> float:
    """Top-1 agreement of the student's first output (through the training head) with the full
    model, over the chunks `heldout`."""
    agree = total = 0
    device = head.weight.device
    for index in heldout:
        logits = head(student.outputs(slice(index, index + 1), chunks, device))
        teacher = head(final[index : index + 1].to(device))
        mine, theirs = next(_paired(logits.argmax(-1), teacher.argmax(-1), student.offsets))
        agree += int((mine == theirs).sum())
        total += theirs.numel()
    return agree / total


def train_student(
    model, student: Student, optimizer: torch.optim.Optimizer, final: torch.Tensor, tokens: torch.Tensor,
    training: TrainingConfig, heldout_fraction: float, checkpoint: Path, output: Path, show_progress: bool,
) -> tuple[Path, float]:
    """Train `student` (resuming from `checkpoint` if it exists) on all but the last
    `heldout_fraction` of the chunks `tokens`, which measure it, against the teacher's logits
    from `final`, and write it to `output`; `(written file, held-out agreement)`."""
    torch.manual_seed(training.seed)
    head = _DistillationHead(model, training.vocab_size)
    chunks = final.shape[0]
    heldout = max(1, round(chunks * heldout_fraction))
    train_count = chunks - heldout
    # The teacher's outputs stay in host memory (the whole corpus's), a batch at a time on the model's device.
    targets = teacher_targets(model, head, final[:train_count])

    step, agreement, loss_value = 0, float("nan"), float("nan")
    if checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu")  # loading the state copies it to the student's device
        student.module.load_state_dict(state["adapter"])
        optimizer.load_state_dict(state["optimizer"])
        step, agreement = state["step"], state["agreement"]

    bar = tqdm(total=training.steps, initial=step, desc=student.name, unit="step", disable=None if show_progress else True)
    with progress.task(f"training {student.name}", total=training.steps - step, unit="steps"):
        while step < training.steps:
            batch = _batch_indices(train_count, step, training.batch_chunks, training.seed)
            loss_value = distillation_step(model, student, head, optimizer, batch, tokens, targets(batch))
            step += 1
            if step % training.eval_every == 0 or step == training.steps:
                student.module.eval()
                agreement = heldout_agreement(student, head, range(train_count, chunks), final, tokens)
                student.module.train()
                logger.info("%s, step %d: loss %.4f, top-1 agreement %.4f on the corpus's held-out chunks", student.name, step, loss_value, agreement)
            if step % training.checkpoint_every == 0 or step == training.steps:
                atomic_save({"adapter": student.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                              "agreement": agreement}, checkpoint)
            bar.set_postfix(loss=f"{loss_value:.3f}", heldout_top1=f"{agreement:.3f}")
            bar.update(1)
            progress.advance()
    bar.close()
    path = save_adapter(student.module, output, dtype=model.dtype)
    return path, agreement
