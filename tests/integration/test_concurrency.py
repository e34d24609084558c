"""One model shared by many threads: every call decodes exactly as it would alone.

A chat server shares one loaded model between its users' threads, and transformers' streaming
idiom runs `generate` in a thread of its own. Plain `generate` is safe there, so every strategy,
a profile, a streamer and the packaged `custom_generate` must be too: nothing a call decides may
live on the shared model.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT
from helpers.adapters import random_adapter
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

import hf_selfspec
from hf_selfspec.hub.package import package
from hf_selfspec.profiles import PROFILE_KEY

pytestmark = pytest.mark.version_sensitive

THREADS = 4
CALLS_PER_THREAD = 12
NEW_TOKENS = 20
# Always draft, never back off: every call exercises drafting and rollback whatever the timings.
EAGER = {"draft_exit_threshold": 0.0, "backoff_probe_interval": 0, "max_draft_tokens": 4}
PROFILE = {
    "strategy": "target_confidence_gated",
    "params": {"attn_skip_layers": [2], "mlp_skip_layers": [1, 2], "target_confidence_threshold": 0.0,
               "prompt_lookup_tokens": 3, **EAGER},
}


@pytest.fixture(scope="module")
def shared(tiny_llama_dir, tmp_path_factory):
    """A sharpened tiny Llama with the real tokenizer (for the streamer), a tuned profile in its
    generation config, a random Kangaroo adapter, and a package of the same profile."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator))
    model.generation_config.eos_token_id = None  # every call decodes all its tokens
    setattr(model.generation_config, PROFILE_KEY, {"cpu/float32": PROFILE})
    directory = tmp_path_factory.mktemp("concurrency")
    adapter = random_adapter(model, 1, directory)
    config = directory / "package-config" / "generation_config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({PROFILE_KEY: {"cpu/float32": PROFILE}}))
    folder = str(package(config, directory / "package").folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    return hf_selfspec.enable(model), tokenizer, adapter, folder


def _calls(adapter: str, folder: str) -> dict[str, dict]:
    """One call of each kind, by name: its `generate` keywords."""
    return {
        "plain": {"strategy": "plain"},
        "self_speculative": {"strategy": "self_speculative", "attn_skip_layers": [1, 3], "mlp_skip_layers": [2], **EAGER},
        "adaptive_draft_exit": {"strategy": "adaptive_draft_exit", "attn_skip_layers": [2], "mlp_skip_layers": [1, 2],
                                **EAGER},
        "target_confidence_gated": {"strategy": "target_confidence_gated", "attn_skip_layers": [0, 2],
                                    "target_confidence_threshold": 0.0, "prompt_lookup_tokens": 3, **EAGER},
        "kangaroo": {"strategy": "kangaroo", "draft_adapter": adapter, "draft_alternatives": 2, **EAGER},
        "profile": {},
        "streamed": {"strategy": "self_speculative", "attn_skip_layers": [3], "mlp_skip_layers": [3], "stream": True,
                     **EAGER},
        "custom_generate": {"custom_generate": folder, "trust_remote_code": True},
        "custom_generate_kangaroo": {"custom_generate": folder, "trust_remote_code": True, "strategy": "kangaroo",
                                     "draft_adapter": adapter, **EAGER},
    }


def _prompt(index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + index)
    return torch.randint(10, 4000, (1, 5 + index % 4), generator=generator)


def _decode(model, tokenizer, prompt: torch.Tensor, kwargs: dict) -> tuple[list[int], str | None]:
    """The call's tokens, and for a streamed call the text its TextIteratorStreamer gave, read
    here while `generate` runs in a thread of its own (transformers' streaming idiom)."""
    kwargs = dict(kwargs)
    common = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "attention_mask": torch.ones_like(prompt)}
    if not kwargs.pop("stream", False):
        return model.generate(prompt, **common, **kwargs)[0].tolist(), None
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    result: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: result.append(model.generate(prompt, **common, **kwargs, streamer=streamer)))
    thread.start()
    text = "".join(streamer)
    thread.join()
    return result[0][0].tolist(), text


def test_threads_sharing_one_model_decode_as_each_call_alone(shared):
    model, tokenizer, adapter, folder = shared
    calls = _calls(adapter, folder)
    names = sorted(calls)
    # Thread t's call c: every kind of call in every thread, each with its own prompt
    jobs = [[(names[(t + c) % len(names)], (t * CALLS_PER_THREAD + c) % 7) for c in range(CALLS_PER_THREAD)]
            for t in range(THREADS)]
    alone = {
        (name, prompt): _decode(model, tokenizer, _prompt(prompt), calls[name])
        for thread_jobs in jobs for name, prompt in thread_jobs
    }
    plain = {prompt: alone[("plain", prompt)][0] for _, prompt in alone if ("plain", prompt) in alone}
    for (name, prompt), (tokens, text) in alone.items():  # the references themselves are lossless
        if prompt in plain:
            assert tokens == plain[prompt], (name, prompt)
        if text is not None:
            assert text == tokenizer.decode(tokens[_prompt(prompt).shape[1]:], skip_special_tokens=True)
    barrier = threading.Barrier(THREADS)

    def run(thread_jobs):
        barrier.wait()  # all threads start decoding together
        return [((name, prompt), _decode(model, tokenizer, _prompt(prompt), calls[name])) for name, prompt in thread_jobs]

    with ThreadPoolExecutor(THREADS) as pool:
        together = [result for results in pool.map(run, jobs) for result in results]
    assert len(together) == THREADS * CALLS_PER_THREAD
    different = [key for key, result in together if result != alone[key]]
    assert not different, f"{len(different)} of {len(together)} calls decoded differently: {different}"


def _batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two to four prompts of ragged lengths, left-padded with token 0."""
    generator = torch.Generator().manual_seed(200 + index)
    lengths = [3 + (index + row * 5) % 9 for row in range(2 + index % 3)]
    width = max(lengths)
    input_ids = torch.zeros((len(lengths), width), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(10, 4000, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def test_threads_each_decoding_a_batch_decode_as_plain_batched_decoding(shared):
    """Concurrent calls, each with its own batch: every row of every call is what plain batched
    decoding gives it, whatever the other threads decode meanwhile."""
    model, tokenizer, adapter, folder = shared
    calls = _calls(adapter, folder)
    kinds = ["self_speculative", "adaptive_draft_exit", "target_confidence_gated", "kangaroo", "profile",
             "custom_generate_kangaroo"]
    batches = 5
    jobs = [[(kinds[(t + c) % len(kinds)], (t * 3 + c) % batches) for c in range(4)] for t in range(THREADS)]

    def decode(name: str, index: int) -> list[list[int]]:
        input_ids, attention_mask = _batch(index)
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0, **calls[name]).tolist()

    plain = {index: decode("plain", index) for index in range(batches)}
    barrier = threading.Barrier(THREADS)

    def run(thread_jobs):
        barrier.wait()
        return [(name, index, decode(name, index)) for name, index in thread_jobs]

    with ThreadPoolExecutor(THREADS) as pool:
        together = [result for results in pool.map(run, jobs) for result in results]
    different = [(name, index) for name, index, rows in together if rows != plain[index]]
    assert not different, f"{len(different)} of {len(together)} batched calls decoded differently: {different}"


def _model_state(model) -> dict[str, dict]:
    """Per module: what its `__dict__` holds (identity of each value, contents of each dict of
    hooks, parameters, buffers and sub-modules), which includes any `forward` set on it."""
    return {
        name: {
            key: (id(value), tuple((k, id(v)) for k, v in value.items()) if isinstance(value, dict) else None)
            for key, value in vars(module).items()
        }
        for name, module in model.named_modules()
    }


class _PauseAfter(StoppingCriteria):
    """Stops nothing; after `steps` calls it signals `reached` and waits for `resume`: the call
    is then in the middle of decoding."""

    def __init__(self, steps: int):
        self.steps, self.reached, self.resume = steps, threading.Event(), threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        self.steps -= 1
        if self.steps == 0:
            self.reached.set()
            assert self.resume.wait(timeout=60)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("name", ["self_speculative", "kangaroo", "profile", "custom_generate_kangaroo"])
def test_a_call_sets_nothing_on_the_model_and_patches_none_of_its_modules(shared, name):
    model, tokenizer, adapter, folder = shared
    kwargs = _calls(adapter, folder)[name]
    _decode(model, tokenizer, _prompt(0), kwargs)  # transformers installs its output hooks once, on first use
    before, class_before = _model_state(model), type(model)
    pause = _PauseAfter(steps=6)
    thread = threading.Thread(target=_decode, args=(model, tokenizer, _prompt(1), {**kwargs, "stopping_criteria": StoppingCriteriaList([pause])}))
    thread.start()
    try:
        assert pause.reached.wait(timeout=60)
        during, class_during = _model_state(model), type(model)
    finally:
        pause.resume.set()
        thread.join()
    assert class_during is class_before
    changed = {module: sorted(set(during[module].items()) ^ set(before[module].items())) for module in before
               if during[module] != before[module]}
    assert not changed, changed


@pytest.mark.real_model
def test_threads_sharing_the_embedded_model_with_its_default_profile(tmp_path):
    """The embedded model in float32, with the shipped profiles (float32's: gated, with the
    lookup corpus) and the shipped Kangaroo adapter, three threads of mixed calls."""
    from hf_selfspec.embedded import TUNED_CONFIG
    from hf_selfspec.prompts import encode_prompt, load_prompts

    model, tokenizer = hf_selfspec.load_embedded(dtype=torch.float32)
    adapter = str(Path(str(TUNED_CONFIG)).with_name("kangaroo-exit1.safetensors"))
    prompts = [encode_prompt(tokenizer, p)["input_ids"] for p in load_prompts("humaneval", n=3, offset=20)]
    kinds = [{"strategy": "plain"}, {}, {"strategy": "kangaroo", "draft_adapter": adapter}]
    jobs = [[(kinds[(t + c) % 3], prompts[(t + 2 * c) % 3]) for c in range(2)] for t in range(3)]

    def decode(kwargs, prompt):
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                              **kwargs)[0].tolist()

    alone = [[decode(kwargs, prompt) for kwargs, prompt in thread_jobs] for thread_jobs in jobs]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda thread_jobs: [decode(k, p) for k, p in thread_jobs], jobs))
    assert together == alone
    plain = {tuple(p[0].tolist()): decode({"strategy": "plain"}, p) for p in prompts}
    for thread_jobs, outputs in zip(jobs, together):
        for (_, prompt), output in zip(thread_jobs, outputs):
            assert output == plain[tuple(prompt[0].tolist())]


def test_the_manual_streams_a_strategy_from_a_thread(shared):
    model, tokenizer, _, _ = shared
    usage = (REPO_ROOT / "docs" / "usage.md").read_text()
    section = usage[usage.index("## Serving from threads") :]
    snippet = section[section.index("```python\n") + len("```python\n") : section.index("\n```", section.index("```python"))]
    namespace = {"model": model, "tokenizer": tokenizer}
    exec(snippet, namespace)
    inputs = namespace["inputs"]
    alone = model.generate(**inputs, max_new_tokens=32, do_sample=False, strategy="plain")
    expected = tokenizer.decode(alone[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert namespace["streamed"] == expected and expected
