"""What `hf-selfspec quickstart` tunes: the shipped Kangaroo adapters with prompt lookup into the
shipped corpus, on the workload's tune split, and a demo prompt held out from it."""

from __future__ import annotations

from helpers import REPO_ROOT

from hf_selfspec.adapter import read_adapter_shape
from hf_selfspec.lookup_corpus import read_corpus_description
from hf_selfspec.prompts import HELD_OUT_SPLIT, WORKLOAD_CATEGORIES
from hf_selfspec.strategies import resolve_strategy
from hf_selfspec.tuning.studies.knobs import strategy_knobs
from hf_selfspec.tuning.studies.config import load_study_config
from hf_selfspec.tuning.quickstart import QUICKSTART_CONFIG, demo_prompt
from hf_selfspec.tuning.studies.study_prompts import select_study_prompts


def test_the_quickstart_searches_kangaroo_and_lookup_with_the_shipped_files():
    search = QUICKSTART_CONFIG.search
    assert resolve_strategy(search.strategy).needs_draft_adapter
    assert set(search.ranges) <= set(strategy_knobs(search.strategy))  # every range is searched
    assert search.draft_adapters
    for weights in search.draft_adapters.values():
        assert read_adapter_shape(weights).exit_layer == 1
    read_corpus_description(search.lookup_corpus)
    assert search.range_of("prompt_lookup_tokens")[0] >= 1  # a corpus extends a lookup that always runs


def test_the_quickstart_tunes_on_every_category_and_demos_on_a_prompt_it_did_not_tune_on():
    tuned = select_study_prompts(QUICKSTART_CONFIG.prompts)
    assert sorted(prompt.category for prompt in tuned) == sorted(WORKLOAD_CATEGORIES)
    demo = demo_prompt()
    assert demo.split == HELD_OUT_SPLIT
    assert demo.id not in {prompt.id for prompt in tuned}


def test_the_quickstart_searches_the_ranges_of_the_study_behind_the_shipped_default():
    """The wheel carries no study TOML, so the quickstart keeps its own copy of the ranges; it
    must not drift from the study that tuned the shipped bfloat16 default."""
    study = load_study_config(REPO_ROOT / "studies" / "smollm2-135m-workload-general-bf16.toml").search
    quickstart = QUICKSTART_CONFIG.search
    assert quickstart.strategy == study.strategy
    assert set(quickstart.ranges) == set(study.ranges)
    for knob in study.ranges:
        assert tuple(quickstart.range_of(knob)) == tuple(study.range_of(knob)), knob
