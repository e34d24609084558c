"""`hf-selfspec train-adapter`: self-distil a Kangaroo draft adapter for one or more exit layers,
or draft heads on the final hidden state (`[adapter] draft_heads`).

The teacher is the model itself (`teacher`), teacher-forced on a text corpus (`corpus`); each
exit layer's adapter is then trained on its outputs (`training`). This module reads the command's
config file and runs the three in turn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from hf_selfspec.tuner_api import adapter_files, cache_root, check_exit_layer, decoder_layers, file_stem

from .corpus import CorpusConfig, corpus_chunks, generated_text_file, read_corpus
from .teacher import teacher_outputs
from ..studies.toml_reader import ModelConfig, StudyConfigError, read_model_section, read_section, read_toml_config
from .training import TrainingConfig, adapter_student, heads_student, train_student


@dataclass(frozen=True)
class AdapterConfig:
    exit_layers: tuple[int, ...] = (4,)
    mlp: bool = True
    name: str = "kangaroo-exit{exit_layer}"
    output_dir: str = "."
    # Train this many draft heads (`<heads_name>.safetensors`) in place of the exit layers' adapters.
    draft_heads: int = 0
    heads_name: str = "draft-heads"
    # The heads as one chain (`DraftChain`), each step reading the token drafted before it.
    chained_heads: bool = False


@dataclass(frozen=True)
class TrainAdapterConfig:
    path: Path
    model: ModelConfig
    corpus: CorpusConfig
    adapter: AdapterConfig
    training: TrainingConfig

    @property
    def output_dir(self) -> Path:
        return (self.path.parent / self.adapter.output_dir).resolve()

    def adapter_path(self, exit_layer: int) -> Path:
        return self.output_dir / (self.adapter.name.format(exit_layer=exit_layer) + ".safetensors")

    @property
    def heads_path(self) -> Path:
        return self.output_dir / (self.adapter.heads_name + ".safetensors")

    @property
    def exit_layers(self) -> tuple[int, ...]:
        """The exit layers to train adapters for: none where draft heads are trained instead."""
        return () if self.adapter.draft_heads else self.adapter.exit_layers


def load_train_config(path: str | Path) -> TrainAdapterConfig:
    """Parse a train-adapter TOML file strictly (unknown sections and keys are errors)."""
    reader = read_toml_config(path, {"model", "corpus", "adapter", "training"}, "train-adapter config")
    corpus, adapter, training = read_corpus(reader), read_section(reader, "adapter", AdapterConfig), read_section(reader, "training", TrainingConfig)
    for key in ("steps", "batch_chunks", "eval_every", "checkpoint_every"):
        if getattr(training, key) < 1:
            raise reader.error(f"training.{key}", f"must be positive, got {getattr(training, key)}")
    if not training.lr > 0:
        raise reader.error("training.lr", f"must be positive, got {training.lr}")
    if adapter.draft_heads < 0:
        raise reader.error("adapter.draft_heads", f"must be 0 (exit-layer adapters) or positive, got {adapter.draft_heads}")
    if training.vocab_size < 0:
        raise reader.error("training.vocab_size", f"must be 0 (the whole vocabulary) or positive, got {training.vocab_size}")
    try:
        file_stem(adapter.name.format(exit_layer=0), "")
    except (KeyError, IndexError, ValueError):
        raise reader.error(
            "adapter.name", f"must be a file name without a directory, using only the {{exit_layer}} placeholder, got {adapter.name!r}"
        ) from None
    try:
        file_stem(adapter.heads_name, "")
    except ValueError as error:
        raise reader.error("adapter.heads_name", str(error)) from None
    return TrainAdapterConfig(reader.path, read_model_section(reader), corpus, adapter, training)


def work_dir(config: TrainAdapterConfig) -> Path:
    """Where the teacher's outputs and the checkpoints live (hundreds of MB, so in the user
    cache, not beside the adapter): one directory per model, corpus and training recipe (the
    generated text is kept apart, in `generated_text_file`). The
    step count is not part of it, so a finished run can be extended by raising `steps`."""
    recipe = [
        dataclasses.asdict(config.model), dataclasses.asdict(config.corpus), config.adapter.mlp,
        {k: v for k, v in dataclasses.asdict(config.training).items() if k not in ("steps", "eval_every", "checkpoint_every")},
    ]
    key = hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "adapter-training" / key


def training_chunks(
    corpus: CorpusConfig, model_config: ModelConfig, model, tokenizer, show_progress: bool
) -> torch.Tensor:
    """The corpus the adapters train on, the model's text generated (or read back from the cache)."""
    return corpus_chunks(
        tokenizer, corpus, model, generated_text_file(model_config, corpus), show_progress, model_config
    )


def run_train_adapter(config: TrainAdapterConfig, show_progress: bool = True, loaded=None) -> list[tuple[int | None, Path, float]]:
    """Train every exit layer's adapter, or the draft heads; `loaded` is the `(model, tokenizer)`
    the config names, where the caller has already loaded them. `(exit layer, file, held-out
    agreement)` for each, the exit layer None for the heads."""
    model, tokenizer = config.model.load() if loaded is None else loaded
    model.requires_grad_(False)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if config.training.vocab_size > vocab_size:
        raise StudyConfigError(
            f"{config.path}: training.vocab_size: {config.training.vocab_size} exceeds the model's vocabulary of {vocab_size}"
        )
    num_layers = len(decoder_layers(model))
    for exit_layer in config.exit_layers:
        try:
            check_exit_layer(exit_layer, num_layers, f"{config.path}: adapter.exit_layers")
        except ValueError as error:
            raise StudyConfigError(str(error)) from None
    chunks = training_chunks(config.corpus, config.model, model, tokenizer, show_progress)
    teacher = teacher_outputs(model, chunks, config.exit_layers, work_dir(config) / "teacher.pt", show_progress)
    lr = config.training.lr
    # Each student is made only when its turn comes: one draft's float32 weights in memory at a time.
    students = [(e, f"exit{e}", partial(adapter_student, model, e, config.adapter.mlp, teacher.shallow[e], lr),
                 config.adapter_path(e)) for e in config.exit_layers]
    if config.adapter.draft_heads:
        heads, chained = config.adapter.draft_heads, config.adapter.chained_heads
        students.append((None, f"{'chain' if chained else 'heads'}{heads}",
                         partial(heads_student, model, heads, teacher.final, lr, chained), config.heads_path))
    results = []
    for exit_layer, checkpoint, make_student, output in students:
        torch.manual_seed(config.training.seed)  # a student's random start (a chain's first layer) is the seed's
        path, agreement = train_student(
            model, *make_student(), teacher.final, teacher.chunks, config.training, config.corpus.heldout_fraction,
            work_dir(config) / f"{checkpoint}.checkpoint.pt", output, show_progress,
        )
        results.append((exit_layer, path, agreement))
    return results


def describe_result(results: list[tuple[int | None, Path, float]]) -> str:
    lines = [
        f"{'draft heads' if e is None else f'exit layer {e}'}: top-1 agreement {a:.3f} on the corpus's held-out chunks"
        f"{' (first head)' if e is None else ''}, wrote {p} and {adapter_files(p)[1].name}"
        for e, p, a in results
    ]
    return "\n".join(lines)
