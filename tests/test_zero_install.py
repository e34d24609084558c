"""A folder written by `hf-selfspec package` works with transformers alone.

Each case runs tests/zero_install_check.py in an interpreter started with `-I -S` that sees this
venv's torch and transformers but cannot import hf_selfspec: a fresh venv would prove the same,
but installing torch into one takes minutes and a network.
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from test_kangaroo import _random_adapter
from tiny_models import tiny_transformers_model

from hf_selfspec.hub.package import package
from hf_selfspec.profiles import PROFILE_KEY

pytestmark = pytest.mark.version_sensitive

CHECK_SCRIPT = Path(__file__).with_name("zero_install_check.py")
# The tiny model's profile: always draft, never back off, so every call drafts whatever the timings.
TINY_PROFILE = {
    "strategy": "self_speculative",
    "params": {
        "attn_skip_layers": [2],
        "mlp_skip_layers": [1, 2],
        "draft_exit_threshold": 0.0,
        "max_draft_tokens": 4,
        "backoff_probe_interval": 0,
    },
    "measured": {"speedup": 1.1, "acceptance_rate": 0.5, "study": "tiny"},
}


def run_isolated(tmp_path: Path, **spec) -> dict:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"site_packages": site.getsitepackages(), **spec}))
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-I", "-S", str(CHECK_SCRIPT), str(spec_file)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def with_package(model_dir: Path, package_dir: Path, destination: Path) -> Path:
    """A model repository: the model's files (linked, not copied) plus the package's."""
    destination.mkdir()
    for item in model_dir.iterdir():
        if item.name != "generation_config.json":
            (destination / item.name).symlink_to(item.resolve())
    shutil.copytree(package_dir, destination, dirs_exist_ok=True)
    return destination


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A sharpened random Llama without end-of-sequence token, so every prompt decodes in full."""
    model = tiny_transformers_model("llama", initializer_range=0.3)
    model.generation_config.eos_token_id = None
    directory = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(directory)
    return directory


def test_tiny_model_drafts_and_matches_greedy_without_hf_selfspec(tiny_model_dir, tmp_path):
    config = tmp_path / "generation_config.json"
    config.write_text(json.dumps({PROFILE_KEY: {"cpu/float32": TINY_PROFILE}}))
    package_dir = package(config, tmp_path / "package").folder
    facts = run_isolated(
        tmp_path,
        package=str(package_dir),
        model=str(tiny_model_dir),
        model_repo=str(with_package(tiny_model_dir, package_dir, tmp_path / "model-repo")),
        prompts=[[5, 17, 42, 8, 9], [60, 1, 33]],
        max_new_tokens=24,
        check_other_dtype=True,
    )
    assert facts["hf_selfspec_importable"] is False
    for path in ("custom_generate", "model_repo"):
        assert facts[path]["identical"] == [True, True], path
        assert all(drafted and drafted > 0 for drafted in facts[path]["drafted"]), (path, facts[path])
        assert facts[path]["class_kept"], path
    assert facts["model_repo"]["positional_identical"]
    other = facts["other_dtype"]
    assert other["drafted"] == [None] * 4, "no cpu/bfloat16 profile: plain decoding, no strategy_stats"
    assert other["identical"] == [True] * 4
    assert len(other["warnings"]) == 1 and "cpu/bfloat16" in other["warnings"][0]


def test_a_hub_model_repo_fetches_the_adapter_its_kangaroo_profile_names(tiny_model_dir, tmp_path):
    """A model loaded by Hub id: transformers downloads only the model's own files, so the adapter
    beside its config is fetched from the repository (here an offline Hub cache laid out as
    huggingface_hub writes it)."""
    from transformers import AutoModelForCausalLM

    exported = tmp_path / "exported"
    adapter = _random_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 1, exported)
    profile = {
        "strategy": "kangaroo",
        "params": {"draft_adapter": Path(adapter).name, "max_draft_tokens": 4, "draft_exit_threshold": 0.0,
                   "backoff_probe_interval": 0},
        "measured": {"speedup": 1.1, "acceptance_rate": 0.5, "study": "tiny"},
    }
    (exported / "generation_config.json").write_text(json.dumps({PROFILE_KEY: {"cpu/float32": profile}}))
    package_dir = package(exported / "generation_config.json", tmp_path / "package").folder
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_cache = tmp_path / "hf-home" / "hub" / "models--hf-selfspec-test--tiny-kangaroo"
    (repo_cache / "snapshots").mkdir(parents=True)
    with_package(tiny_model_dir, package_dir, repo_cache / "snapshots" / commit)
    (repo_cache / "refs").mkdir()
    (repo_cache / "refs" / "main").write_text(commit)

    facts = run_isolated(
        tmp_path,
        package=None,
        model=str(tiny_model_dir),
        model_repo="hf-selfspec-test/tiny-kangaroo",
        prompts=[[5, 17, 42, 8, 9], [60, 1, 33]],
        max_new_tokens=24,
        check_other_dtype=False,
    )
    assert facts["hf_selfspec_importable"] is False
    assert facts["model_repo"]["identical"] == [True, True]
    assert all(drafted and drafted > 0 for drafted in facts["model_repo"]["drafted"]), facts["model_repo"]

    (repo_cache / "snapshots" / commit / Path(adapter).name).unlink()
    with pytest.raises(AssertionError, match="draft adapter adapter-1-1.safetensors of hf-selfspec-test/tiny-kangaroo "
                       "\\(revision main\\) cannot be fetched"):
        run_isolated(tmp_path, package=None, model=str(tiny_model_dir), model_repo="hf-selfspec-test/tiny-kangaroo",
                     prompts=[[5, 17]], max_new_tokens=4, check_other_dtype=False)


@pytest.mark.real_model
def test_embedded_model_with_the_shipped_profile_without_hf_selfspec(tmp_path):
    from hf_selfspec.embedded import TUNED_CONFIG, converted_model_dir
    from hf_selfspec.prompts import encode_prompt, load_prompts

    model_dir = converted_model_dir()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [encode_prompt(tokenizer, p)["input_ids"][0].tolist() for p in load_prompts("humaneval", n=2, offset=20)]
    package_dir = package(Path(str(TUNED_CONFIG)), tmp_path / "package").folder
    facts = run_isolated(
        tmp_path,
        package=str(package_dir),
        model=str(model_dir),
        model_repo=str(with_package(model_dir, package_dir, tmp_path / "model-repo")),
        prompts=prompts,
        max_new_tokens=32,
        check_other_dtype=False,
    )
    assert facts["hf_selfspec_importable"] is False
    for path in ("custom_generate", "model_repo"):
        assert facts[path]["identical"] == [True, True], path
        assert sum(facts[path]["drafted"]) > 0, (path, facts[path])
