"""The shipped workload (`hf_selfspec/data/workload.jsonl`): its schema, its fixed tune and held-out
splits, and how its chats are rendered for instruct and base models."""

from __future__ import annotations

import copy
import json
import re
from collections import Counter

import pytest

from hf_selfspec.prompts import (
    HELD_OUT_SPLIT,
    HUMANEVAL,
    SPLITS,
    TUNE_SPLIT,
    WORKLOAD,
    WORKLOAD_CATEGORIES,
    PromptFileError,
    encode_prompt,
    load_prompts,
    render_raw,
    workload_path,
)

MIN_PER_CATEGORY = 10
MIN_PER_SPLIT = 5
# A run of this many words shared by two prompts means they share a passage, not a turn of phrase.
SHARED_RUN_WORDS = 10
# Rendered with the embedded tokenizer's chat template, no workload prompt may exceed this: the
# bench and studies budget context for the prompt plus what they generate.
MAX_PROMPT_TOKENS = 768

WORKLOAD_PROMPTS = load_prompts(WORKLOAD)


def texts(prompt) -> list[str]:
    return [message["content"] for message in prompt.messages] if prompt.messages else [prompt.text]


def word_runs(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + SHARED_RUN_WORDS]) for i in range(len(words) - SHARED_RUN_WORDS + 1)}


def write_rows(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


@pytest.fixture(scope="module")
def chat_tokenizer():
    """The embedded model's tokenizer, which has a chat template (read from disk, no network)."""
    from transformers import AutoTokenizer

    from hf_selfspec.embedded import converted_model_dir

    return AutoTokenizer.from_pretrained(converted_model_dir())


def test_every_row_has_an_id_a_known_category_a_split_and_a_chat_ending_with_the_user():
    raw_rows = [json.loads(line) for line in workload_path().read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(WORKLOAD_PROMPTS) == len(raw_rows)
    assert len({prompt.id for prompt in WORKLOAD_PROMPTS}) == len(WORKLOAD_PROMPTS)
    for prompt in WORKLOAD_PROMPTS:
        assert prompt.category in WORKLOAD_CATEGORIES, prompt.id
        assert prompt.split in SPLITS, prompt.id
        assert prompt.messages, prompt.id
        roles = [message["role"] for message in prompt.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], prompt.id
        assert all(message["content"].strip() for message in prompt.messages), prompt.id


def test_every_category_and_only_those_has_enough_prompts_in_both_splits():
    per_category = Counter(prompt.category for prompt in WORKLOAD_PROMPTS)
    assert set(per_category) == set(WORKLOAD_CATEGORIES)
    assert min(per_category.values()) >= MIN_PER_CATEGORY
    per_split = Counter((prompt.category, prompt.split) for prompt in WORKLOAD_PROMPTS)
    for category in WORKLOAD_CATEGORIES:
        for split in SPLITS:
            assert per_split[category, split] >= MIN_PER_SPLIT, (category, split)


def test_conversation_prompts_continue_a_chat_with_earlier_assistant_turns():
    conversations = [prompt for prompt in WORKLOAD_PROMPTS if prompt.category == "conversation"]
    assert conversations
    for prompt in conversations:
        assert any(message["role"] == "assistant" for message in prompt.messages[:-1]), prompt.id


def test_the_two_splits_share_no_prompt_text():
    held_out_runs = set()
    for prompt in load_prompts(WORKLOAD, split=HELD_OUT_SPLIT):
        for text in texts(prompt):
            held_out_runs |= word_runs(text)
    for prompt in load_prompts(WORKLOAD, split=TUNE_SPLIT):
        for text in texts(prompt):
            assert not word_runs(text) & held_out_runs, prompt.id


def test_no_workload_prompt_comes_from_the_chat_set_or_humaneval():
    from hf_selfspec.bench.cli import prompt_source

    other_runs = set()
    for prompt in [*load_prompts(prompt_source("chat")), *load_prompts(HUMANEVAL)]:
        for text in texts(prompt):
            other_runs |= word_runs(text)
    for prompt in WORKLOAD_PROMPTS:
        for text in texts(prompt):
            assert not word_runs(text) & other_runs, prompt.id


@pytest.mark.parametrize("split", SPLITS)
def test_a_split_selects_only_its_own_prompts(split):
    selected = load_prompts(WORKLOAD, split=split)
    assert {prompt.split for prompt in selected} == {split}
    assert [prompt.id for prompt in selected] == [prompt.id for prompt in WORKLOAD_PROMPTS if prompt.split == split]


def test_an_unknown_split_is_refused_in_one_line_naming_it():
    with pytest.raises(ValueError, match="'train'") as error:
        load_prompts(WORKLOAD, split="train")
    assert "\n" not in str(error.value)


def test_a_split_no_row_has_is_refused_in_one_line_naming_it(tmp_path):
    path = tmp_path / "tune_only.jsonl"
    write_rows(path, [{"id": "a", "prompt": "Say hello.", "split": TUNE_SPLIT}])
    assert [prompt.id for prompt in load_prompts(path, split=TUNE_SPLIT)] == ["a"]
    with pytest.raises(ValueError, match=HELD_OUT_SPLIT) as error:
        load_prompts(path, split=HELD_OUT_SPLIT)
    assert "\n" not in str(error.value)


def test_a_row_with_a_bad_split_names_the_file_and_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    write_rows(path, [
        {"id": "a", "prompt": "Say hello.", "split": TUNE_SPLIT},
        {"id": "b", "prompt": "Say goodbye.", "split": "validation"},
    ])
    with pytest.raises(PromptFileError, match=re.escape(f"{path}:2")) as error:
        load_prompts(path)
    assert "'validation'" in str(error.value)


def test_without_a_chat_template_a_chat_is_rendered_as_plain_text(chat_tokenizer):
    base_tokenizer = copy.deepcopy(chat_tokenizer)
    base_tokenizer.chat_template = None
    prompt = next(prompt for prompt in WORKLOAD_PROMPTS if prompt.category == "conversation")
    raw = render_raw(prompt.messages)
    assert raw.startswith(f"User: {prompt.messages[0]['content']}")
    assert f"Assistant: {prompt.messages[1]['content']}" in raw
    assert raw.endswith(f"User: {prompt.messages[-1]['content']}\n\nAssistant:")
    ids = encode_prompt(base_tokenizer, prompt)["input_ids"][0].tolist()
    assert base_tokenizer.decode(ids) == raw


def test_with_a_chat_template_a_chat_is_rendered_with_it(chat_tokenizer):
    prompt = next(prompt for prompt in WORKLOAD_PROMPTS if prompt.category == "conversation")
    ids = encode_prompt(chat_tokenizer, prompt)["input_ids"][0].tolist()
    expected = chat_tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True, tokenize=False)
    assert chat_tokenizer.decode(ids) == expected
    assert expected != render_raw(prompt.messages)
    assert all(message["content"] in expected for message in prompt.messages)


def test_every_workload_prompt_fits_the_token_budget_with_the_embedded_tokenizer(chat_tokenizer):
    lengths = {prompt.id: encode_prompt(chat_tokenizer, prompt)["input_ids"].shape[-1] for prompt in WORKLOAD_PROMPTS}
    too_long = {prompt_id: length for prompt_id, length in lengths.items() if length > MAX_PROMPT_TOKENS}
    assert not too_long
