"""Each research script in scripts/ runs end to end on the tiny Llama with the smallest arguments.

The scripts measure and print, so these tests run them as a user would (a subprocess from the
repository root) and check what they print and that their own checks pass; the figures
themselves are the machine's and are never asserted.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM
from helpers import REPO_ROOT

from hf_selfspec.adapter import AdapterShape, DraftAdapter, save_adapter
from hf_selfspec.profiles import PROFILE_KEY
from hf_selfspec.prompts import load_prompts


def _run_script(name: str, *args: str) -> str:
    """The script's stdout; a failure shows its stderr."""
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / name), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def exit1_adapter(tiny_llama_dir, tmp_path_factory) -> str:
    """An exit-layer-1 adapter for the tiny Llama: its second layer's weights, untrained."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    adapter = DraftAdapter(model, AdapterShape.for_model(model, 1, True))
    return str(save_adapter(adapter, tmp_path_factory.mktemp("adapter") / "exit1"))


def test_concurrent_callers_checks_every_output_against_the_call_alone(tiny_llama_dir, tmp_path):
    """With a profile in the model's generation config, so the profile's calls draft and verify
    from threads sharing the model; the script exits non-zero if any output left plain greedy."""
    model_dir = tmp_path / "tiny-with-profile"
    shutil.copytree(tiny_llama_dir, model_dir)
    config_file = model_dir / "generation_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config[PROFILE_KEY] = {"cpu/float32": {"strategy": "self_speculative", "params": {
        "attn_skip_layers": [1, 2], "mlp_skip_layers": [2], "draft_exit_threshold": 0.0, "backoff_probe_interval": 0,
    }}}
    config_file.write_text(json.dumps(config), encoding="utf-8")
    out = _run_script("concurrent_callers.py", "--model", str(model_dir), "--dtype", "float32",
                      "--prompts", "4", "--new-tokens", "6", "--rounds", "1")
    assert "torch.float32, 4 prompts x 6 new tokens, best of 1 rounds" in out
    rows = re.findall(r"^\| (\d) \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", out, re.MULTILINE)
    assert rows == ["1", "2", "4"]


def test_kangaroo_arithmetic_prices_the_replayed_drafts(tiny_llama_dir, exit1_adapter):
    out = _run_script("kangaroo_arithmetic.py", "--model", str(tiny_llama_dir), "--dtype", "float32",
                      "--prompts", "1", "--top", "2", exit1_adapter)
    assert f"{exit1_adapter} (exit layer 1, with MLP): a draft token costs" in out
    agreement = re.search(r"first choice agrees with plain greedy at ([\d.]+) of positions", out)
    assert agreement and 0.0 <= float(agreement.group(1)) <= 1.0
    settings = re.findall(r"^  max_draft_tokens (\d+), draft_exit_threshold ([\d.]+): [\d.]+x, acceptance ([\d.]+)", out, re.MULTILINE)
    assert len(settings) == 2
    assert all(0.0 <= float(acceptance) <= 1.0 for _, _, acceptance in settings)


def test_kangaroo_arithmetic_prices_each_workload_category(tiny_llama_dir, exit1_adapter):
    out = _run_script("kangaroo_arithmetic.py", "--model", str(tiny_llama_dir), "--dtype", "float32", "--workload",
                      "--top", "1", exit1_adapter)
    categories = sorted({prompt.category for prompt in load_prompts("workload", split="held_out")})
    agreed = re.findall(r"^  (\w+): first choice agrees with plain greedy at [\d.]+ of positions", out, re.MULTILINE)
    assert sorted(agreed) == categories
    best_row = re.search(r"^  max_draft_tokens \d+, draft_exit_threshold [\d.]+: ([\d.]+)x.*\n    (.*)$", out, re.MULTILINE)
    assert best_row
    in_best_row = dict(re.findall(r"(\w+) ([\d.]+)x", best_row.group(2)))
    assert sorted(in_best_row) == categories
    # The row's figure is the geometric mean of its categories' speedups.
    product = 1.0
    for value in in_best_row.values():
        product *= float(value)
    assert float(best_row.group(1)) == pytest.approx(product ** (1 / len(categories)), abs=2e-3)
    # A category's own best setting is at least what the setting best over all of them gives it.
    own_best = re.search(r"^  each category's best setting: (.*)$", out, re.MULTILINE)
    assert own_best
    per_category = dict(re.findall(r"(\w+) ([\d.]+)x \(\d+ tokens", own_best.group(1)))
    assert sorted(per_category) == categories
    assert all(float(per_category[c]) >= float(in_best_row[c]) for c in categories)


def test_measure_kangaroo_reports_costs_and_agreement_by_threshold(tiny_llama_dir, exit1_adapter):
    out = _run_script("measure_kangaroo.py", "--model", str(tiny_llama_dir), "--prompts", "1", exit1_adapter)
    assert re.search(r"^full one-token step: [\d.]+ ms \(median of \d+\)$", out, re.MULTILINE)
    for width in (2, 4, 8):
        assert re.search(rf"^verification of {width} tokens: [\d.]+ ms = [\d.]+ steps$", out, re.MULTILINE)
    assert re.search(rf"^{re.escape(exit1_adapter)}: draft token [\d.]+ ms = [\d.]+ of a step$", out, re.MULTILINE)
    agreement = re.search(rf"^{re.escape(exit1_adapter)} on plain greedy's tokens for HumanEval 20-20: (.*)$", out, re.MULTILINE)
    assert agreement
    # Every draft is at least 0 confident: the lowest threshold keeps every position.
    assert agreement.group(1).startswith(">=0.0: share 1.00 agree ")


def test_measure_kangaroo_reports_agreement_per_workload_category(tiny_llama_dir, exit1_adapter):
    out = _run_script("measure_kangaroo.py", "--model", str(tiny_llama_dir), "--workload", "--dtype", "float32", exit1_adapter)
    rows = re.findall(rf"^{re.escape(exit1_adapter)} on plain greedy's tokens for the workload's held-out (\w+): (.*)$",
                      out, re.MULTILINE)
    categories = {prompt.category for prompt in load_prompts("workload", split="held_out")}
    assert sorted(category for category, _ in rows) == sorted(categories)
    assert all(cells.startswith(">=0.0: share 1.00 agree ") for _, cells in rows)


def test_online_corpus_server_checks_every_output_with_the_corpus_against_the_one_without(tiny_llama_dir, tmp_path):
    """With a profile that looks up, so the calls with the corpus read it from threads that feed it."""
    model_dir = tmp_path / "tiny-with-lookup"
    shutil.copytree(tiny_llama_dir, model_dir)
    config_file = model_dir / "generation_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config[PROFILE_KEY] = {"cpu/float32": {"strategy": "self_speculative", "params": {
        "attn_skip_layers": [1, 2], "prompt_lookup_tokens": 3, "backoff_probe_interval": 0,
    }}}
    config_file.write_text(json.dumps(config), encoding="utf-8")
    out = _run_script("online_corpus_server.py", "--model", str(model_dir), "--dtype", "float32",
                      "--threads", "2", "--requests", "8", "--new-tokens", "6")
    assert "torch.float32, 8 requests x up to 6 new tokens, 2 threads" in out
    assert re.search(r"^\| on \| [\d.]+ \| [\d.]+x \|$", out, re.MULTILINE)
    assert re.search(r"corpus at the end: 8 texts, \d+ tokens \(bound 250000\)", out)
