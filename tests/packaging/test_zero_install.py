"""A folder written by `hf-selfspec package` works with transformers alone.

Each case runs tests/helpers/zero_install_check.py in an interpreter started with `-I -S` that sees this
venv's torch and transformers but cannot import hf_selfspec: a fresh venv would prove the same,
but installing torch into one takes minutes and a network.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.adapters import random_adapter
from helpers.tiny_models import tiny_transformers_model
from helpers.zero_install import run_isolated

from hf_selfspec.hub.package import bundled_profiles_for_repository, package
from hf_selfspec.profiles import PROFILE_KEY

pytestmark = pytest.mark.version_sensitive

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


def test_a_package_lends_its_kangaroo_profile_with_the_adapter_and_corpus_it_holds(tiny_model_dir, tmp_path):
    """`custom_generate=<package folder>` on a checkpoint whose folder has no profile and none of
    our files: the lent profile's adapter and lookup corpus are the package's."""
    from transformers import AutoModelForCausalLM

    from hf_selfspec.lookup_corpus import save_lookup_corpus

    exported = tmp_path / "exported"
    adapter = random_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 1, exported)
    corpus = save_lookup_corpus([[5, 17, 42, 8, 9, 60, 1, 33, 7, 7]], exported / "corpus", 96, "tiny")
    profile = {
        "strategy": "kangaroo",
        "params": {"draft_adapter": Path(adapter).name, "lookup_corpus": Path(corpus).name, "prompt_lookup_tokens": 3,
                   "max_draft_tokens": 4, "draft_exit_threshold": 0.0, "backoff_probe_interval": 0},
    }
    (exported / "generation_config.json").write_text(json.dumps({PROFILE_KEY: {"cpu/float32": profile}}))
    package_dir = package(exported / "generation_config.json", tmp_path / "package").folder
    shutil.rmtree(exported)  # the package's copies are the only ones
    assert sorted(p.name for p in tiny_model_dir.iterdir()) == ["config.json", "generation_config.json",
                                                                 "model.safetensors"]
    facts = run_isolated(tmp_path, package=str(package_dir), model=str(tiny_model_dir), model_repo=None,
                         prompts=[[5, 17, 42, 8, 9], [60, 1, 33]], max_new_tokens=24, check_other_dtype=False)
    assert facts["custom_generate"]["identical"] == [True, True]
    assert all(drafted and drafted > 0 for drafted in facts["custom_generate"]["drafted"]), facts


def test_a_hub_model_repo_fetches_the_adapter_its_kangaroo_profile_names(tiny_model_dir, tmp_path):
    """A model loaded by Hub id: transformers downloads only the model's own files, so the adapter
    beside its config is fetched from the repository (here an offline Hub cache laid out as
    huggingface_hub writes it)."""
    from transformers import AutoModelForCausalLM

    exported = tmp_path / "exported"
    adapter = random_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 1, exported)
    profile = {
        "strategy": "kangaroo",
        "params": {"draft_adapter": Path(adapter).name, "max_draft_tokens": 4, "draft_exit_threshold": 0.0,
                   "backoff_probe_interval": 0},
        "measured": {"speedup": 1.1, "acceptance_rate": 0.5, "study": "tiny"},
    }
    (exported / "generation_config.json").write_text(json.dumps({PROFILE_KEY: {"cpu/float32": profile}}))
    package_dir = package(exported / "generation_config.json", tmp_path / "package").folder
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_id = "hf-selfspec-test/tiny-kangaroo"
    repo_cache = tmp_path / "hf-home" / "hub" / "models--hf-selfspec-test--tiny-kangaroo"
    (repo_cache / "snapshots").mkdir(parents=True)
    snapshot = with_package(tiny_model_dir, package_dir, repo_cache / "snapshots" / commit)
    # As `hf-selfspec push` uploads it: the lent profiles name their files in the repository
    bundled = snapshot / "custom_generate" / "bundled_profiles.py"
    bundled.unlink()
    bundled.write_text(bundled_profiles_for_repository(package_dir, repo_id))
    (repo_cache / "refs").mkdir()
    (repo_cache / "refs" / "main").write_text(commit)

    facts = run_isolated(
        tmp_path,
        package=repo_id,  # lent to a model whose folder has no profile and no adapter
        model=str(tiny_model_dir),
        model_repo=repo_id,
        prompts=[[5, 17, 42, 8, 9], [60, 1, 33]],
        max_new_tokens=24,
        check_other_dtype=False,
    )
    assert facts["hf_selfspec_importable"] is False
    for path in ("custom_generate", "model_repo"):
        assert facts[path]["identical"] == [True, True], path
        assert all(drafted and drafted > 0 for drafted in facts[path]["drafted"]), facts[path]

    (repo_cache / "snapshots" / commit / Path(adapter).name).unlink()
    with pytest.raises(AssertionError, match="draft adapter adapter-1-1.safetensors of hf-selfspec-test/tiny-kangaroo "
                       "\\(revision main\\) cannot be fetched"):
        run_isolated(tmp_path, package=None, model=str(tiny_model_dir), model_repo="hf-selfspec-test/tiny-kangaroo",
                     prompts=[[5, 17]], max_new_tokens=4, check_other_dtype=False)


def _shipped_configs() -> list[Path]:
    from hf_selfspec.embedded import TUNED_CONFIG

    return sorted(Path(str(TUNED_CONFIG)).parent.glob("*generation_config.json"))


@pytest.mark.real_model
@pytest.mark.parametrize("config", _shipped_configs(), ids=lambda path: path.name)
@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=pytest.mark.bfloat16_repeat), "float32"])
def test_every_shipped_profile_lent_to_a_clean_checkpoint_without_hf_selfspec(tmp_path, config, dtype):
    """docs/hub.md's flow: `package --config <shipped>`, then `custom_generate=PKG` on an ordinary
    checkpoint folder (no profile, none of our files), in a venv without hf_selfspec. The shipped
    profiles' adapter and corpus are found in the package; bfloat16 outputs are consistent."""
    from transformers import AutoTokenizer

    from hf_selfspec.consistency import check_greedy_consistency
    from hf_selfspec.embedded import converted_model_dir
    from hf_selfspec.profiles import read_profiles_file
    from hf_selfspec.prompts import encode_prompt, load_prompts

    profiles = read_profiles_file(config)
    if f"cpu/{dtype}" not in profiles:
        pytest.skip(f"{config.name} has no cpu/{dtype} profile")
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    for item in converted_model_dir().iterdir():
        (checkpoint / item.name).symlink_to(item.resolve())
    assert not read_profiles_file(checkpoint / "generation_config.json")
    assert not list(checkpoint.glob("*kangaroo*")) and not list(checkpoint.glob("own-code*"))
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [encode_prompt(tokenizer, p)["input_ids"][0].tolist() for p in load_prompts("humaneval", n=2, offset=20)]
    package_dir = package(config, tmp_path / "package").folder
    model_repo = with_package(checkpoint, package_dir, tmp_path / "model-repo")  # the package in the model's repo
    facts = run_isolated(tmp_path, package=str(package_dir), model=str(checkpoint), model_repo=str(model_repo),
                         prompts=prompts, max_new_tokens=32, check_other_dtype=False, dtype=dtype)
    assert facts["hf_selfspec_importable"] is False
    for path in ("custom_generate", "model_repo"):
        assert sum(facts[path]["drafted"]) > 0, (path, facts[path])
        for difference in facts[path]["differences"]:
            if difference is not None:  # reduced precision: a near-tie only
                verdict = check_greedy_consistency(
                    difference["packaged_new"], difference["plain_new"],
                    {difference["index"]: torch.tensor(difference["plain_logits"])}, getattr(torch, dtype),
                )
                assert verdict.consistent, (path, verdict)
        if dtype == "float32":
            assert facts[path]["identical"] == [True] * len(prompts), path


def test_a_generation_config_switches_the_online_corpus_on_and_the_package_starts_it_from_its_file(
    tiny_model_dir, tmp_path
):
    """Off by default; `online_corpus` in the model's generation config switches it on, and the
    corpus starts from the saved one the lent profile names (what tuning learned): the first
    prompt's text is in that file, the second's is learned by its first call, for its second."""
    from transformers import AutoModelForCausalLM

    from hf_selfspec.lookup_corpus import save_lookup_corpus

    prompts = [[5, 17, 42, 8, 9], [60, 1, 33], [60, 1, 33]]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    learned = model.generate(torch.tensor(prompts[:1]), max_new_tokens=24, do_sample=False)[0].tolist()
    exported = tmp_path / "exported"
    corpus = save_lookup_corpus([learned], exported / "online-learned", 96, "what tuning learned")
    params = {**TINY_PROFILE["params"], "online_corpus_file": Path(corpus).name, "prompt_lookup_tokens": 2,
              "online_corpus_min_context": 1, "online_corpus_min_prob": 0.0}
    (exported / "generation_config.json").write_text(json.dumps({PROFILE_KEY: {"cpu/float32": {**TINY_PROFILE, "params": params}}}))
    package_dir = package(exported / "generation_config.json", tmp_path / "package").folder

    def decode(name: str, config: dict) -> dict:
        served = tmp_path / name
        served.mkdir()
        for item in tiny_model_dir.iterdir():
            if item.name != "generation_config.json":
                (served / item.name).symlink_to(item.resolve())
        (served / "generation_config.json").write_text(json.dumps(config))
        return run_isolated(tmp_path, package=str(package_dir), model=str(served), model_repo=None, prompts=prompts,
                            max_new_tokens=24, check_other_dtype=False)["custom_generate"]

    off, on = decode("off", {}), decode("on", {"online_corpus": "tenant"})
    assert off["identical"] == on["identical"] == [True] * 3
    assert off["accepted"][1] == off["accepted"][2], "without the corpus, a call learns nothing from the last"
    assert on["accepted"][0] > off["accepted"][0], "started from the packaged corpus"
    assert on["accepted"][2] > on["accepted"][1], "learned from the call before"
