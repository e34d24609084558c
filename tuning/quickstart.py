"""`hf-selfspec quickstart`: the whole loop in one command, on the embedded model and the CPU.

A short tune, an export of its best trial, then the model loaded with the exported config,
decoding a HumanEval prompt the tune never saw, with and without the profile. A few trials on
two prompts rarely find a real speedup; the command says so plainly rather than oversell it.
"""

from __future__ import annotations

from pathlib import Path

import optuna

from hf_selfspec.loading import EMBEDDED
from hf_selfspec.prompts import HUMANEVAL

from . import TuningError
from .config import PromptConfig, SearchConfig, StudyConfig, StudySettings
from .export import export_profile
from .storage import open_storage, resolve_storage_url
from .tune import format_summary, run_tune

# A fixed study name, started afresh on every run: a resumed study would skip the warm-start
# trials (the likeliest good ones) and spend a short budget on random skip sets.
QUICKSTART_CONFIG = StudyConfig(
    prompts=PromptConfig(source=HUMANEVAL, n_prompts=2, max_new_tokens=32),
    search=SearchConfig(strategy="self_speculative"),
    study=StudySettings(name="quickstart"),
)
DEMO_NEW_TOKENS = 64


def run_quickstart(output: Path, n_trials: int, storage_url: str | None, show_progress: bool = True) -> int:
    from hf_selfspec.loading import load_model_and_tokenizer
    from hf_selfspec.measure import timed_generate
    from hf_selfspec.prompts import encode_prompt, load_prompts
    from hf_selfspec.strategies import PLAIN

    print(
        f"1/3  Tuning the embedded model for {n_trials} trials on {QUICKSTART_CONFIG.prompts.n_prompts} "
        "HumanEval prompts (the full search is `hf-selfspec tune studies/smollm2-135m.toml`).",
        flush=True,
    )
    storage_url = resolve_storage_url(storage_url)
    storage = open_storage(storage_url)
    if QUICKSTART_CONFIG.study.name in optuna.get_all_study_names(storage):
        optuna.delete_study(study_name=QUICKSTART_CONFIG.study.name, storage=storage)
    outcome = run_tune(QUICKSTART_CONFIG, storage_url, n_trials=n_trials, show_progress=show_progress)
    print(format_summary(outcome))
    best = outcome.best
    if best is None:
        raise TuningError(
            "no trial completed, so there is nothing to export; run quickstart again with more --n-trials"
        )
    if best.value <= 1:
        print(
            f"\nNo trial beat plain decoding in this short tune (best {best.value:.2f}x); exporting the best "
            "anyway. The full search, `hf-selfspec tune studies/smollm2-135m.toml`, tries far more skip sets."
        )

    print(f"\n2/3  Exporting trial {best.number} to {output}/generation_config.json", flush=True)
    result = export_profile(outcome.storage_url, outcome.study.study_name, output)

    print(f"\n3/3  Loading the model with {result.path} and decoding a held-out HumanEval prompt", flush=True)
    model, tokenizer = load_model_and_tokenizer(EMBEDDED, generation_config=result.path)
    prompt = load_prompts(HUMANEVAL, 1, offset=QUICKSTART_CONFIG.prompts.n_prompts)[0]
    inputs = encode_prompt(tokenizer, prompt)
    kwargs = {"max_new_tokens": DEMO_NEW_TOKENS, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    timed_generate(model, inputs, strategy=PLAIN, **{**kwargs, "max_new_tokens": 4})  # warm-up: no timed run pays it
    plain = timed_generate(model, inputs, strategy=PLAIN, **kwargs)
    tuned = timed_generate(model, inputs, **kwargs)  # no strategy: the exported profile decides
    if tuned.stats is None:
        raise TuningError(f"the model did not pick up the profile {result.key!r} from {result.path}")

    print(f"\n--- {prompt.id}, {len(tuned.new_tokens)} new tokens with the tuned profile ---")
    print(
        tokenizer.decode(inputs["input_ids"][0], skip_special_tokens=True)
        + tokenizer.decode(tuned.new_tokens, skip_special_tokens=True)
    )
    print("---")
    print(f"plain generate   {plain.tokens_per_second:6.1f} tokens/s")
    print(
        f"tuned profile    {tuned.tokens_per_second:6.1f} tokens/s  "
        f"({plain.seconds / tuned.seconds:.2f}x, acceptance {tuned.stats.acceptance_rate:.0%}, "
        f"strategy {tuned.stats.strategy})"
    )
    if tuned.new_tokens != plain.new_tokens:
        print("The tokens DIFFER from plain greedy decoding: that is a bug in the strategy, please report it.")
        return 1
    print("The tokens are identical to plain greedy decoding: the speedup is lossless.")
    return 0
