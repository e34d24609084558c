"""`hf-selfspec write-lookup-corpus`: the model's own greedy continuations as a lookup corpus.

The model continues prompts that ship with the installed packages (HumanEval problems from 40
on, standard-library windows and functions) and answers requests it wrote itself (self_prompted):
the [corpus] section of a train-adapter config, whose rules keep every evaluation prompt out.
What it wrote becomes the corpus that prompt lookup continues into when the current text has no
match. A config that also trains an
adapter generates this text once for both (see `generated_text_file`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hf_selfspec.tuner_api import adapter_files, file_stem, save_lookup_corpus

from .corpus import CorpusConfig, generated_text_file, model_written_texts, read_corpus, split_stdlib_stream
from .self_prompted import self_prompted_dir
from ..studies.toml_reader import ModelConfig, StudyConfigError, read_model_section, read_section, read_toml_config


@dataclass(frozen=True)
class OutputConfig:
    name: str = "lookup-corpus"
    output_dir: str = "."


@dataclass(frozen=True)
class LookupCorpusConfig:
    path: Path
    model: ModelConfig
    corpus: CorpusConfig
    output: OutputConfig

    @property
    def corpus_path(self) -> Path:
        return (self.path.parent / self.output.output_dir / f"{self.output.name}.safetensors").resolve()


def load_lookup_corpus_config(path: str | Path) -> LookupCorpusConfig:
    reader = read_toml_config(path, {"model", "corpus", "output"}, "lookup corpus config")
    corpus, output = read_corpus(reader), read_section(reader, "output", OutputConfig)
    if not corpus.generated_tokens and not corpus.self_prompted:
        raise reader.error(
            "corpus.generated_tokens",
            "must be positive, or self_prompted must be: a lookup corpus is text the model wrote itself",
        )
    if corpus.humaneval_from is None and not corpus.stdlib_prompts and not corpus.stdlib_functions and not corpus.self_prompted:
        raise reader.error(
            "corpus",
            "gives the model no prompts to continue: set humaneval_from, stdlib_prompts, stdlib_functions or self_prompted",
        )
    try:
        file_stem(output.name, "")
    except ValueError as error:
        raise reader.error("output.name", str(error)) from None
    return LookupCorpusConfig(reader.path, read_model_section(reader), corpus, output)


def _describe(config: LookupCorpusConfig, texts: int) -> str:
    corpus = config.corpus
    parts = []
    if corpus.generated_tokens:
        sources = []
        if corpus.humaneval_from is not None:
            sources.append(f"HumanEval prompts {corpus.humaneval_from} on")
        if corpus.stdlib_prompts:
            sources.append(f"{corpus.stdlib_prompts} standard-library windows of {corpus.prompt_tokens} tokens")
        if corpus.stdlib_functions:
            sources.append(f"{corpus.stdlib_functions} standard-library functions cut after their docstring")
        parts.append(f"prompts each followed by the greedy continuation (up to {corpus.generated_tokens} tokens): {'; '.join(sources)}")
    if corpus.self_prompted:
        parts.append(
            f"up to {corpus.self_prompted} requests the model wrote itself with the chat's user turn opened (task seeds "
            f"{', '.join(corpus.task_seeds)}), each followed by its greedy answer (up to {corpus.answer_tokens} tokens)"
        )
    return f"{texts} texts written by {config.model.name} in {config.model.dtype}: {'; and '.join(parts)}"


def run_write_lookup_corpus(config: LookupCorpusConfig, show_progress: bool = True) -> tuple[Path, str]:
    """Generate (or reuse) the model's text and write the corpus; `(file written, description)`."""
    model, tokenizer = config.model.load()
    _, windows = split_stdlib_stream(tokenizer, config.corpus)
    texts = model_written_texts(
        model, tokenizer, config.model.name, config.corpus, windows, generated_text_file(config.model, config.corpus),
        self_prompted_dir(config.model, config.corpus), show_progress,
    )
    description = _describe(config, len(texts))
    vocab_size = model.get_output_embeddings().weight.shape[0]
    try:
        return save_lookup_corpus(texts, config.corpus_path, vocab_size, description), description
    except ValueError as error:
        raise StudyConfigError(str(error)) from None


def describe_result(path: Path, description: str) -> str:
    return f"wrote {path} and {adapter_files(path)[1].name}: {description}"
