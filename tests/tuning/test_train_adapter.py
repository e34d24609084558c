"""`hf-selfspec train-adapter`: deterministic, resumable after SIGKILL, strict about its config."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from helpers.tuning import kill_once_written

from hf_selfspec.adapter import read_adapter
from hf_selfspec.loading import load_model_and_tokenizer
from hf_selfspec.tuning.studies.config import StudyConfigError
from hf_selfspec.tuning.studies.toml_reader import ModelConfig
from hf_selfspec.tuning.training import model_text
from hf_selfspec.tuning.training.corpus import (
    REFERENCE_REQUEST, CorpusConfig, corpus_chunks, generated_text_file, generation_prompts, humaneval_problems,
    reference_answers, split_stdlib_stream, stdlib_function_prompts,
)
from hf_selfspec.tuning.training.self_prompted import passages
from hf_selfspec.tuning.training.model_text import generated_texts
from hf_selfspec.tuning.training import training as training_module
from hf_selfspec.tuning.training.train_adapter import load_train_config, run_train_adapter
from hf_selfspec.tuning.training.training import (
    adapter_student, covering_vocabulary, heads_student, time_training_step,
)

STEPS = 300


def _config(directory: Path, model_dir: Path, draft_heads: int = 0, chained: bool = False, **overrides) -> Path:
    training = {"steps": STEPS, "batch_chunks": 2, "checkpoint_every": 10, "eval_every": 100, "seed": 3, "vocab_size": 512}
    training.update(overrides)
    lines = [
        "[model]", f'name = "{model_dir}"', "[corpus]", "stdlib_tokens = 2048", "humaneval_from = 150",
        "chunk_tokens = 64", "[adapter]", "exit_layers = [2]", f"draft_heads = {draft_heads}", 'output_dir = "out"',
        'heads_name = "general-heads"', f"chained_heads = {str(chained).lower()}",
        "[training]",
        *(f"{key} = {value}" for key, value in training.items()),
    ]
    path = directory / "train.toml"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "draft_heads, chained, written, checkpoint",
    [(0, False, "kangaroo-exit2", "exit2"), (3, False, "general-heads", "heads3"), (3, True, "general-heads", "chain3")],
)
def test_training_resumes_after_sigkill_and_ends_as_an_uninterrupted_run(
    draft_heads, chained, written, checkpoint, tiny_llama_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache-a"))
    [(exit_layer, uninterrupted, _)] = run_train_adapter(
        load_train_config(_config(tmp_path / "a", tiny_llama_dir, draft_heads, chained)), False
    )

    config = _config(tmp_path / "b", tiny_llama_dir, draft_heads, chained)
    env = {**os.environ, "HF_SELFSPEC_CACHE": str(tmp_path / "cache-b"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "hf_selfspec.cli", "train-adapter", str(config), "--no-progress"]
    checkpoints = kill_once_written(command, env, tmp_path / "cache-b", f"adapter-training/*/{checkpoint}.checkpoint.pt")
    assert checkpoints, "no checkpoint appeared before the run ended"
    assert torch.load(checkpoints[0])["step"] < STEPS  # it really was cut off
    assert not (tmp_path / "b" / "out" / f"{written}.safetensors").exists()

    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "top-1 agreement" in resumed.stdout and "on the corpus's held-out chunks" in resumed.stdout
    first, second = load_file(str(uninterrupted)), load_file(str(tmp_path / "b" / "out" / f"{written}.safetensors"))
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name

    model, _ = load_model_and_tokenizer(str(tiny_llama_dir))
    trained = read_adapter(model, uninterrupted)
    if draft_heads:
        assert exit_layer is None and trained.shape.heads == draft_heads and trained.shape.chained == chained
        assert any(tensor.abs().sum() > 0 for tensor in first.values())  # moved from the identity
    else:
        assert trained.shape.exit_layer == exit_layer == 2


def test_a_corpus_too_large_for_its_logits_trains_on_logits_computed_per_batch(tiny_llama_dir, tmp_path, monkeypatch):
    """Keeping the teacher's logits for a whole corpus over a large vocabulary would not fit in
    memory: past the bound they are computed for each batch, and the adapter comes out the same."""
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache-kept"))
    [(_, kept, _)] = run_train_adapter(load_train_config(_config(tmp_path / "kept", tiny_llama_dir, steps=20)), False)
    computed = []
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache-per-batch"))  # no checkpoint to resume from
    monkeypatch.setattr(training_module, "_KEPT_TARGET_BYTES", 0)
    monkeypatch.setattr(training_module, "teacher_logits", _counting(training_module.teacher_logits, computed))
    [(_, per_batch, _)] = run_train_adapter(load_train_config(_config(tmp_path / "per-batch", tiny_llama_dir, steps=20)), False)
    assert len(computed) == 20  # one batch's logits a step, never the corpus's
    first, second = load_file(str(kept)), load_file(str(per_batch))
    for name in first:
        torch.testing.assert_close(first[name], second[name], msg=name)


def _counting(function, calls: list):
    def counted(*args):
        calls.append(args[-1].shape[0])
        return function(*args)

    return counted


def test_the_training_vocabulary_covers_a_share_of_the_corpus_from_the_lowest_ids():
    chunks = torch.tensor([[5] * 90 + [3000] * 9 + [60000]])
    assert covering_vocabulary(chunks, 0.9, 65536) == 1024  # id 5, rounded up
    assert covering_vocabulary(chunks, 0.99, 65536) == 3072
    assert covering_vocabulary(chunks, 1.0, 65536) == 60416
    assert covering_vocabulary(chunks, 1.0, 60100) == 0  # rounded past the vocabulary: the whole head
    assert covering_vocabulary(chunks, 0.9, 1000) == 0


@pytest.mark.parametrize("student", ["adapter", "heads", "chain"])
def test_a_training_step_is_timed_on_states_of_the_batch_s_shape(tiny_llama_dir, student):
    model, _ = load_model_and_tokenizer(str(tiny_llama_dir))
    model.requires_grad_(False)
    made = []

    def make(states):
        made.append(tuple(states.shape))
        if student != "adapter":
            return heads_student(model, 2, states, lr=1e-4, chained=student == "chain")
        return adapter_student(model, 1, True, states, lr=1e-4)

    seconds = time_training_step(model, make, 64, 2, 16)
    assert made == [(2, 16, model.config.hidden_size)] and seconds > 0


def test_a_chain_learns_each_step_from_the_state_and_token_it_drafts_from(tiny_llama_dir):
    """The state at position t chose the corpus's token t + 1: the chain's first step there
    reads that state and that token, its second step the first step's output and token t + 2,
    as a draft after token t + 1 would."""
    model, _ = load_model_and_tokenizer(str(tiny_llama_dir))
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(2, 8, model.config.hidden_size, generator=generator)
    chunks = torch.randint(model.config.vocab_size, (2, 8), generator=generator)
    student, _ = heads_student(model, 2, states, lr=1e-4, chained=True)
    with torch.no_grad():
        student.module.down.weight.normal_(generator=generator)
        outputs = student.outputs(torch.tensor([1]), chunks, model.device)
        embedded = model.get_input_embeddings()(chunks[1]).float()
        first = student.module.step(states[1, 3], embedded[4])
        second = student.module.step(first, embedded[5])
    torch.testing.assert_close(outputs[0, 3, 0], first)
    torch.testing.assert_close(outputs[0, 3, 1], second)


@pytest.mark.parametrize("student", ["adapter", "heads", "chain"])
def test_a_student_is_made_on_the_model_s_device(tiny_llama_dir, student):
    # The meta device stands in for a GPU: a student left on the CPU would meet the model's
    # states on another device at its first step.
    model, _ = load_model_and_tokenizer(str(tiny_llama_dir))
    model = model.to("meta").requires_grad_(False)
    states = torch.empty(2, 16, model.config.hidden_size, device="meta")
    if student != "adapter":
        made, _ = heads_student(model, 2, states, lr=1e-4, chained=student == "chain")
    else:
        made, _ = adapter_student(model, 1, True, states, lr=1e-4)
    assert {p.device for p in made.module.parameters()} == {model.device}


@pytest.mark.parametrize(
    "change, message",
    [
        ("[corpus]\nhumaneval_from = 39\n", "evaluation prompts"),
        ("[training]\nstepz = 3\n", "unknown key"),
        ("[adapter]\nexit_layers = []\n", "non-empty list"),
        ("[adapter]\nname = \"x{layer}\"\n", "placeholder"),
        ("[optimizer]\n", "unknown section"),
        ("[training]\nlr = -1.0\n", "positive"),
        ("[adapter]\ndraft_heads = -1\n", "draft_heads: must be 0"),
        ("[adapter]\nheads_name = \"out/heads\"\n", "heads_name: must be a file name"),
        ("[corpus]\nstdlib_prompts = 5\n", "needs generated_tokens"),
        ("[corpus]\nstdlib_functions = 5\n", "needs generated_tokens"),
        ("[corpus]\ngenerated_tokens = -2\n", "positive"),
    ],
)
def test_config_errors_name_the_key(tmp_path, change, message):
    path = tmp_path / "bad.toml"
    path.write_text(change)
    with pytest.raises(StudyConfigError, match=message):
        load_train_config(path)


def test_an_exit_layer_out_of_range_is_a_config_error(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache"))
    path = _config(tmp_path, tiny_llama_dir)
    path.write_text(path.read_text().replace("exit_layers = [2]", "exit_layers = [4]"))
    with pytest.raises(StudyConfigError, match="exit layer 4 is out of range 1..3"):
        run_train_adapter(load_train_config(path), False)


def test_help_names_the_corpus_and_the_outputs():
    result = subprocess.run([sys.executable, "-m", "hf_selfspec.cli", "train-adapter", "--help"],
                            capture_output=True, text=True)
    assert result.returncode == 0
    assert "standard library" in result.stdout and "safetensors" in result.stdout


GENERATING = CorpusConfig(stdlib_tokens=0, humaneval_from=160, generated_tokens=6, stdlib_prompts=2, prompt_tokens=12,
                          stdlib_functions=2, chunk_tokens=8)


def test_stdlib_function_prompts_are_a_signature_and_a_docstring_asking_for_a_body():
    prompts = stdlib_function_prompts(30)
    assert len(prompts) == 30 and len(set(prompts)) > 25
    for prompt in prompts:
        (function,) = ast.parse(prompt).body  # dedented: parses at the top level
        assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        assert len(function.body) == 1 and ast.get_docstring(function) is not None  # no body yet


def _greedy_continuation(generate, tokenizer, prompt: list[int]) -> list[int]:
    """The prompt and the model's greedy continuation of it alone, cut before any EOS (as the
    corpus keeps it)."""
    ids = generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                   max_new_tokens=GENERATING.generated_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)[0].tolist()
    eos = tokenizer.eos_token_id
    return ids[: ids.index(eos, len(prompt))] if eos in ids[len(prompt) :] else ids


def test_the_generated_corpus_is_the_models_own_greedy_continuation_of_each_prompt(tiny_llama_dir, tmp_path):
    model, tokenizer = load_model_and_tokenizer(str(tiny_llama_dir))
    chunks = corpus_chunks(tokenizer, GENERATING, model, tmp_path / "generated.pt")
    prompts = generation_prompts(tokenizer, GENERATING, split_stdlib_stream(tokenizer, GENERATING)[1])
    texts = generated_texts(model, tokenizer, prompts, GENERATING.generated_tokens, tmp_path / "generated.pt", False)  # from the cache
    problems = humaneval_problems(160)
    assert len(texts) == len(problems) + GENERATING.stdlib_prompts + GENERATING.stdlib_functions
    for problem, text in zip(problems, texts):
        prompt = tokenizer(problem["prompt"])["input_ids"]
        assert text == _greedy_continuation(model.generate, tokenizer, prompt)  # not the canonical solution
    stdlib_window = texts[len(problems)]
    assert len(stdlib_window) > GENERATING.prompt_tokens
    for function, text in zip(stdlib_function_prompts(2), texts[-2:]):
        prompt = tokenizer(function)["input_ids"]
        assert text[: len(prompt)] == prompt and len(text) > len(prompt)
    stream = [i for text in texts for i in text + [tokenizer.eos_token_id]]
    assert chunks.flatten().tolist() == stream[: len(stream) // 8 * 8]


def test_reference_passages_join_the_corpus_as_a_chats_answers(tiny_llama_dir, monkeypatch):
    """Read, not written: no model is asked for them, each passage stands whole as the assistant's
    answer to the fixed request (bare where the tokenizer has no chat template), and the cache of
    what the model writes does not depend on them."""
    _, tokenizer = load_model_and_tokenizer(str(tiny_llama_dir))
    corpus = CorpusConfig(stdlib_tokens=64, reference_passages=3, chunk_tokens=8)
    answers = reference_answers(tokenizer, 3)
    stream = split_stdlib_stream(tokenizer, corpus)[0] + [i for answer in answers for i in answer + [tokenizer.eos_token_id]]
    assert corpus_chunks(tokenizer, corpus).flatten().tolist() == stream[: len(stream) // 8 * 8]
    for passage, answer in zip(passages(), answers):
        text = tokenizer.decode(answer)
        assert REFERENCE_REQUEST in text and passage in text and text.index(REFERENCE_REQUEST) < text.index(passage)
        assert "assistant" in text[text.index(REFERENCE_REQUEST) : text.index(passage)]
    monkeypatch.setattr(tokenizer, "chat_template", None)
    assert reference_answers(tokenizer, 2) == [tokenizer(passage)["input_ids"] for passage in passages()[:2]]
    assert generated_text_file(ModelConfig(), corpus) == generated_text_file(ModelConfig(), CorpusConfig(stdlib_tokens=64))


def test_generation_resumes_from_the_batches_it_finished(tiny_llama_dir, tmp_path, monkeypatch):
    model, tokenizer = load_model_and_tokenizer(str(tiny_llama_dir))
    monkeypatch.setattr(model_text, "GENERATION_BATCH", 2)
    first = corpus_chunks(tokenizer, GENERATING, model, tmp_path / "generated.pt")
    finished = torch.load(tmp_path / "generated.pt")
    torch.save(finished[:2], tmp_path / "generated.pt")  # as if killed after the first batch
    calls = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kwargs: calls.append(kwargs["input_ids"].shape[0]) or generate(**kwargs))
    assert torch.equal(corpus_chunks(tokenizer, GENERATING, model, tmp_path / "generated.pt"), first)
    assert calls == [2, 2, 2]  # the six prompts left, and nothing already generated


def test_generation_batches_prompts_of_like_length_and_returns_them_in_prompt_order(tiny_llama_dir, tmp_path, monkeypatch):
    """A batch prefills every row at its longest prompt's width, so batches are cut from the
    prompts sorted by length; the texts still come back in the prompts' own order."""
    model, tokenizer = load_model_and_tokenizer(str(tiny_llama_dir))
    monkeypatch.setattr(model_text, "GENERATION_BATCH", 2)
    prompts = [[5] * length for length in (9, 2, 7, 3, 11, 2)]
    widths = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kwargs: widths.append(kwargs["attention_mask"].sum(-1).tolist()) or generate(**kwargs))
    texts = generated_texts(model, tokenizer, prompts, GENERATING.generated_tokens, tmp_path / "generated.pt", False)
    assert widths == [[2, 2], [3, 7], [9, 11]]
    assert [text[: len(prompt)] for prompt, text in zip(prompts, texts)] == prompts
    for prompt, text in zip(prompts, texts):
        assert text == _greedy_continuation(generate, tokenizer, prompt)


GENERATING_TOML = """[corpus]
stdlib_tokens = 0
humaneval_from = 160
generated_tokens = 6
stdlib_prompts = 2
prompt_tokens = 12
stdlib_functions = 2
chunk_tokens = 8
"""


def test_write_lookup_corpus_shares_the_generated_text_with_train_adapter(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """One [model] and [corpus] generate once: the lookup corpus is exactly the text the adapter
    trains on, written beside its config with what it was made from."""
    from hf_selfspec.cli import main
    from hf_selfspec.lookup_corpus import SEPARATOR, read_corpus_description
    from hf_selfspec.tuning.training.corpus import generated_text_file

    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache"))
    model = f'[model]\nname = "{tiny_llama_dir}"\n'
    adapter_config, corpus_config = tmp_path / "adapter.toml", tmp_path / "corpus.toml"
    adapter_config.write_text(model + GENERATING_TOML + '[adapter]\nexit_layers = [2]\noutput_dir = "out"\n'
                              "[training]\nsteps = 2\nbatch_chunks = 2\nvocab_size = 512\n")
    corpus_config.write_text(model + GENERATING_TOML + '[output]\nname = "own-text"\noutput_dir = "out"\n')
    train = load_train_config(adapter_config)
    run_train_adapter(train, False)
    generated = generated_text_file(train.model, train.corpus)
    made = generated.stat().st_mtime_ns

    assert main(["write-lookup-corpus", str(corpus_config), "--no-progress"]) == 0
    assert generated.stat().st_mtime_ns == made  # generated once, for both
    written = tmp_path / "out" / "own-text.safetensors"
    assert f"wrote {written} and own-text.json" in capsys.readouterr().out
    model, tokenizer = load_model_and_tokenizer(str(tiny_llama_dir))
    prompts = generation_prompts(tokenizer, train.corpus, split_stdlib_stream(tokenizer, train.corpus)[1])
    texts = generated_texts(model, tokenizer, prompts, train.corpus.generated_tokens, generated, False)  # from the cache, in prompt order
    assert load_file(str(written))["token_ids"].tolist() == [t for text in texts for t in [*text, SEPARATOR]]
    about = read_corpus_description(written)
    assert about["texts"] == len(texts) == 8 and "HumanEval prompts 160 on" in about["description"]


@pytest.mark.parametrize(
    "corpus, words",
    [("generated_tokens = 0", "corpus.generated_tokens: must be positive, or self_prompted must be: a lookup corpus is text"),
     ("humaneval_from = 20\ngenerated_tokens = 4", "corpus.humaneval_from: HumanEval problems below 40")],
)
def test_a_lookup_corpus_config_keeps_to_the_models_own_text_and_out_of_evaluation(tmp_path, corpus, words):
    from hf_selfspec.tuning.training.write_lookup_corpus import load_lookup_corpus_config

    path = tmp_path / "corpus.toml"
    path.write_text(f'[model]\nname = "embedded"\n[corpus]\n{corpus}\n[output]\nname = "x"\n')
    with pytest.raises(StudyConfigError, match=words):
        load_lookup_corpus_config(path)


def test_write_lookup_corpus_help_says_what_it_writes_and_from_what():
    result = subprocess.run([sys.executable, "-m", "hf_selfspec.cli", "write-lookup-corpus", "--help"],
                            capture_output=True, text=True)
    assert result.returncode == 0
    assert "HumanEval problems 40" in result.stdout and "NAME.safetensors" in result.stdout
    assert "lookup_corpus" in result.stdout
