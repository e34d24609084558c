"""The self-prompted corpus: requests the model samples with the user turn opened, and its greedy
answers. Deterministic with a seed, clear of every evaluation text, resumable after SIGKILL,
strict about its config, shared by train-adapter and write-lookup-corpus."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from helpers.tuning import kill_once_written

from hf_selfspec.loading import load_model_and_tokenizer
from hf_selfspec.lookup_corpus import SEPARATOR
from hf_selfspec.prompts import HELD_OUT_SPLIT, WORKLOAD, WORKLOAD_CATEGORIES, load_prompts
from hf_selfspec.tuning.training import model_text, self_prompted
from hf_selfspec.tuning.studies.config import StudyConfigError
from hf_selfspec.tuning.training.evaluation_texts import EvaluationOverlap, chat_prompts_path, evaluation_texts
from hf_selfspec.tuning.training.self_prompted import answer_prompt, open_user_turn, passages, self_prompted_texts
from hf_selfspec.tuning.training.corpus import CorpusConfig, interleave
from hf_selfspec.tuning.training.train_adapter import load_train_config
from hf_selfspec.tuning.training.write_lookup_corpus import load_lookup_corpus_config, run_write_lookup_corpus

SMALL = CorpusConfig(self_prompted=8, max_request_tokens=24, answer_tokens=8)


@pytest.fixture(scope="module")
def talkative_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with its EOS logit read off one hidden dimension. A random model spreads its
    samples over 49k tokens and would end no request within a few dozen; this one ends its turns
    within a few tokens. The dimension is one that is negative where an answer begins, so that an
    answer is not empty from the start."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        start = model.model(torch.tensor([answer_prompt(tokenizer, "Hi")])).last_hidden_state[0, -1]
        eos = model.lm_head.weight[tokenizer.eos_token_id]
        eos.zero_()
        eos[int(start.argmin())] = 20.0
    directory = tmp_path_factory.mktemp("talkative")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def talkative(talkative_dir):
    return load_model_and_tokenizer(str(talkative_dir))


@pytest.fixture
def small_batches(monkeypatch):
    monkeypatch.setattr(model_text, "GENERATION_BATCH", 4)


def _run(talkative, corpus, cache_dir):
    model, tokenizer = talkative
    return self_prompted_texts(model, tokenizer, "tiny", corpus, cache_dir, False)


def _request(tokenizer, text: list[int]) -> str:
    """The user's text of a rendered chat."""
    return tokenizer.decode(text).split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


def test_a_seed_gives_the_same_corpus_and_another_seed_another(talkative, small_batches, tmp_path):
    first = _run(talkative, SMALL, tmp_path / "a")
    again = _run(talkative, SMALL, tmp_path / "b")
    other = _run(talkative, CorpusConfig(**{**SMALL.__dict__, "request_seed": 1}), tmp_path / "c")
    assert len(first.texts) == SMALL.self_prompted
    assert first.texts == again.texts and first.task_seeds == again.task_seeds
    assert first.texts != other.texts
    # The task seeds take turns and each request starts with its seed's opening words.
    _, tokenizer = talkative
    for name, text in zip(first.task_seeds, first.texts):
        request = _request(tokenizer, text)
        openings = self_prompted.TASK_SEEDS[name].openings
        assert any(opening in request for opening in openings)
        if self_prompted.TASK_SEEDS[name].passage:
            assert any(request.startswith(passage + "\n\n") for passage in passages())
    assert collections.Counter(first.task_seeds) == {name: 1 for name in SMALL.task_seeds}  # each seed its share


def test_each_text_is_the_request_and_the_models_greedy_answer(talkative, small_batches, tmp_path):
    model, tokenizer = talkative
    result = _run(talkative, SMALL, tmp_path)
    assert any(result.answer_tokens)
    for text, answer_tokens in zip(result.texts, result.answer_tokens):
        prompt = answer_prompt(tokenizer, _request(tokenizer, text))
        assert text[: len(prompt)] == prompt and len(text) == len(prompt) + answer_tokens
        greedy = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=SMALL.answer_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)[0].tolist()
        greedy = greedy[: greedy.index(tokenizer.eos_token_id, len(prompt))] if tokenizer.eos_token_id in greedy[len(prompt) :] else greedy
        assert text == greedy


def test_a_request_that_copies_an_evaluation_prompt_is_dropped(talkative, small_batches, tmp_path, monkeypatch):
    """Forced among the sampled candidates: a held-out workload prompt word for word, and one of
    its sentences inside a request of other words. Neither reaches the corpus."""
    _, tokenizer = talkative
    held_out = load_prompts(WORKLOAD, split=HELD_OUT_SPLIT)[0].messages[0]["content"]
    sentence = " ".join(held_out.split()[:12])
    forced = [tokenizer(held_out, add_special_tokens=False)["input_ids"],
              tokenizer(f" so, {sentence} and more", add_special_tokens=False)["input_ids"]]
    sample = self_prompted._sample_batch

    def with_forced(model, prompts, corpus, turn, pad_id, batch):
        rows = sample(model, prompts, corpus, turn, pad_id, batch)
        return forced + rows[len(forced) :] if batch == 0 else rows

    monkeypatch.setattr(self_prompted, "_sample_batch", with_forced)
    open_turn = CorpusConfig(**{**SMALL.__dict__, "task_seeds": ("qa", "writing")})
    result = _run(talkative, open_turn, tmp_path)
    assert result.dropped["evaluation text"] == 2
    requests = [_request(tokenizer, text) for text in result.texts]
    assert len(requests) == SMALL.self_prompted
    assert not any(sentence in request or held_out in request for request in requests)


def test_the_overlap_check_catches_copies_not_common_phrases():
    overlap = EvaluationOverlap(["Summarise this news report in one short paragraph, please, for my grandmother today."])
    assert overlap("SUMMARISE this news report in one short paragraph please for my grandmother today!")
    assert overlap("Hello. Summarise this news report in one short paragraph, please, for my cat.")  # ten words shared
    assert not overlap("Summarise this news report in one short paragraph, please.")  # nine words
    texts = evaluation_texts()
    chat = load_prompts(str(chat_prompts_path()))
    assert chat[0].messages[0]["content"] in texts
    assert all(prompt.messages[-1]["content"] in texts for prompt in load_prompts(WORKLOAD))
    assert any("def has_close_elements" in text for text in texts)  # HumanEval/0


def _lookup_config(directory: Path, model_dir: Path, corpus: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "corpus.toml"
    path.write_text(f'[model]\nname = "{model_dir}"\n[corpus]\n{corpus}\n[output]\nname = "own"\noutput_dir = "out"\n')
    return path


SELF_PROMPTED_TOML = "self_prompted = 8\nmax_request_tokens = 24\nanswer_tokens = 8\n"
# The CLI with generation batches of two, so that sampling takes several batches to kill between.
_CLI = ("import sys; from hf_selfspec.tuning.training import model_text; model_text.GENERATION_BATCH = 2; "
        "from hf_selfspec.cli import main; sys.exit(main(sys.argv[1:]))")


def test_sampling_resumes_after_sigkill_and_ends_as_an_uninterrupted_run(talkative_dir, tmp_path):
    def command(directory):
        return [sys.executable, "-c", _CLI, "write-lookup-corpus", str(_lookup_config(directory, talkative_dir, SELF_PROMPTED_TOML)), "--no-progress"]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    uninterrupted = subprocess.run(command(tmp_path / "a"), env={**env, "HF_SELFSPEC_CACHE": str(tmp_path / "cache-a")},
                                   capture_output=True, text=True, timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stderr

    env["HF_SELFSPEC_CACHE"] = str(tmp_path / "cache-b")
    saved = kill_once_written(command(tmp_path / "b"), env, tmp_path / "cache-b", "self-prompted/*/requests.pt")
    assert saved, "no sampling progress appeared before the run ended"
    assert len(torch.load(saved[0])["requests"]) < 8  # it really was cut off while sampling
    resumed = subprocess.run(command(tmp_path / "b"), env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "8 self-prompted requests" in resumed.stderr and "by task seed:" in resumed.stderr
    first, second = (load_file(str(tmp_path / d / "out" / "own.safetensors"))["token_ids"] for d in ("a", "b"))
    assert torch.equal(first, second)


def test_write_lookup_corpus_interleaves_code_and_conversations(talkative, talkative_dir, small_batches, tmp_path, monkeypatch):
    """One function gives both commands the model's text: code continuations and conversations,
    each kind spread over the whole corpus."""
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache"))
    code = "humaneval_from = 162\ngenerated_tokens = 4\n"
    config = load_lookup_corpus_config(_lookup_config(tmp_path, talkative_dir, code + SELF_PROMPTED_TOML))
    path, description = run_write_lookup_corpus(config, False)
    conversations = _run(talkative, config.corpus, self_prompted.self_prompted_dir(config.model, config.corpus)).texts
    stored = load_file(str(path))["token_ids"].tolist()
    texts = _split(stored)
    code = [text for text in texts if text not in conversations]
    assert len(code) == 2 and len(texts) == 2 + 8
    assert texts == interleave(code, conversations)
    assert "HumanEval prompts 162 on" in description and "up to 8 requests the model wrote itself" in description


def _split(ids: list[int]) -> list[list[int]]:
    texts, current = [], []
    for token in ids:
        if token == SEPARATOR:
            texts.append(current)
            current = []
        else:
            current.append(token)
    return texts


def test_the_timed_choice_samples_a_token_for_every_row_of_a_batch(monkeypatch):
    """What the corpus plan prices is one step's choice for a whole batch of requests."""
    import hf_selfspec.tuner_api

    monkeypatch.setattr(model_text, "GENERATION_BATCH", 3)
    chosen = []

    def timed(run, device):
        chosen.append(run())
        return chosen[-1], 0.25 * len(chosen)

    monkeypatch.setattr(hf_selfspec.tuner_api, "timed", timed)
    seconds = self_prompted.time_sampled_choice(50, torch.device("cpu"), CorpusConfig())
    assert seconds == 0.5 / 3  # the second of two, warmed up, shared among the batch's rows
    assert [tokens.shape for tokens in chosen] == [(3, 1), (3, 1)]
    assert all(0 <= token < 50 for tokens in chosen for token in tokens.flatten().tolist())


def test_every_workload_category_has_a_task_seed_and_they_are_the_default():
    assert CorpusConfig().task_seeds == WORKLOAD_CATEGORIES
    assert all(self_prompted.TASK_SEEDS[name].openings for name in WORKLOAD_CATEGORIES)


def test_interleaving_spreads_each_list_in_order():
    assert interleave([1, 2], ["a", "b", "c", "d"]) == ["a", 1, "b", "c", 2, "d"]
    assert interleave([], ["a"]) == ["a"] and interleave([1], []) == [1]


@pytest.mark.parametrize(
    "change, message",
    [
        ("self_prompted = -1", "corpus.self_prompted: must be positive"),
        ("self_prompted = 4\ntask_seeds = [\"poetry\"]", "unknown task seed 'poetry'; known: conversation"),
        ("self_prompted = 4\ntask_seeds = []", "non-empty list of strings"),
        ("self_prompted = 4\ntask_seeds = [3]", "non-empty list of strings"),
        ("self_prompted = 4\ntask_seeds = [\"qa\", \"qa\"]", "names a task seed twice"),
        ("self_prompted = 4\nrequest_top_p = 1.5", r"corpus.request_top_p: must lie in \(0, 1\]"),
        ("self_prompted = 4\nrequest_temperature = 0.0", "corpus.request_temperature: must be positive"),
        ("self_prompted = 4\nanswer_tokens = 0", "corpus.answer_tokens: must be positive"),
        ("self_prompted = 4\nmax_request_tokens = 0", "corpus.max_request_tokens: must be positive"),
        ("answer_tokens = 64", "corpus.answer_tokens: needs self_prompted > 0"),
        ("task_seeds = [\"qa\"]", "corpus.task_seeds: needs self_prompted > 0"),
        ("self_prompted = 4\nhumaneval_from = 39", "HumanEval problems below 40"),
    ],
)
def test_config_errors_name_the_key(tmp_path, change, message):
    path = tmp_path / "bad.toml"
    path.write_text(f"[corpus]\n{change}\n")
    with pytest.raises(StudyConfigError, match=message):
        load_train_config(path)


def test_a_lookup_corpus_may_be_self_prompted_alone(tmp_path):
    config = load_lookup_corpus_config(_lookup_config(tmp_path, Path("embedded"), "generated_tokens = 0\nself_prompted = 5\ntask_seeds = [\"open\"]"))
    assert config.corpus.self_prompted == 5 and config.corpus.task_seeds == ("open",)


def test_the_user_turn_is_cut_from_the_tokenizers_own_template(talkative):
    _, tokenizer = talkative
    turn = open_user_turn(tokenizer, "tiny")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False)
    assert rendered.startswith(turn.head) and rendered[len(turn.head) :].startswith("Hello there")
    assert tokenizer.eos_token_id in turn.stop_ids


def test_a_tokenizer_without_a_chat_template_is_a_clear_error(talkative_dir, tmp_path, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(talkative_dir)
    tokenizer.chat_template = None
    with pytest.raises(self_prompted.TuningError, match="tiny: its tokenizer has no chat template"):
        open_user_turn(tokenizer, "tiny")
    # From the command line: one line on stderr, exit status 2.
    model = AutoModelForCausalLM.from_pretrained(talkative_dir)
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    for template in (tmp_path / "base").glob("chat_template*"):
        template.unlink()
    config = _lookup_config(tmp_path, tmp_path / "base", SELF_PROMPTED_TOML)
    result = subprocess.run([sys.executable, "-m", "hf_selfspec.cli", "write-lookup-corpus", str(config), "--no-progress"],
                            env={**os.environ, "HF_SELFSPEC_CACHE": str(tmp_path / "cache")}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == [f"hf-selfspec write-lookup-corpus: error: {tmp_path / 'base'}: its tokenizer has no chat template, "
                      "and corpus.self_prompted opens a chat's user turn: use a chat model, or set self_prompted = 0"]


def test_the_report_gives_size_and_mix(talkative, small_batches, tmp_path):
    result = _run(talkative, SMALL, tmp_path)
    line = result.describe()
    counts = collections.Counter(result.task_seeds)
    assert line.startswith(f"8 self-prompted requests, {sum(map(len, result.texts))} tokens ({sum(result.answer_tokens)} in answers)")
    for name, count in counts.items():
        assert f"{name} {count} (" in line
