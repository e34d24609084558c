"""Per exit layer: the Kangaroo draft's cost per token relative to a plain step, and its
acceptance while decoding HumanEval 20-39 (never trained or tuned on), bfloat16.

    OMP_NUM_THREADS=2 .venv/bin/python studies/measure_kangaroo.py ADAPTER.safetensors [...]

Each prompt is decoded plainly and then under every setting in turn, so a machine shared with
other work slows all of them alike. A plain step's cost is plain greedy's seconds per token; the
draft's is the strategy's drafting seconds per drafted token; acceptance is accepted / drafted
tokens. No back-off, so every step drafts. Outputs are compared with plain greedy as they go.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

import torch

from hf_selfspec import load_embedded
from hf_selfspec.prompts import encode_prompt, load_prompts

NEW_TOKENS = 64
SETTINGS = ((0.0, 4), (0.5, 6))  # (draft_exit_threshold, max_draft_tokens)
DRAFT_VOCAB = 8192


def main(adapters: list[str]) -> None:
    model, tokenizer = load_embedded(dtype=torch.bfloat16, generation_config=None)
    encoded = [encode_prompt(tokenizer, p) for p in load_prompts("humaneval", n=20, offset=20)]
    common = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    model.generate(**encoded[0], strategy="plain", **common)  # warm-up
    totals: dict[tuple, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for inputs in encoded:
        started = time.perf_counter()
        expected = model.generate(**inputs, strategy="plain", **common)
        plain_seconds = time.perf_counter() - started
        for adapter in adapters:
            for threshold, max_draft in SETTINGS:
                started = time.perf_counter()
                out = model.generate(**inputs, strategy="kangaroo", draft_adapter=adapter, draft_vocab_size=DRAFT_VOCAB,
                                     draft_exit_threshold=threshold, max_draft_tokens=max_draft,
                                     backoff_probe_interval=0, return_dict_in_generate=True, **common)
                seconds = time.perf_counter() - started
                stats, total = out.strategy_stats, totals[adapter, threshold, max_draft]
                total["seconds"] += seconds
                total["plain_seconds"] += plain_seconds
                total["plain_tokens"] += expected.shape[1] - inputs["input_ids"].shape[1]
                total["drafted"] += stats.drafted_tokens
                total["accepted"] += stats.accepted_tokens
                total["draft_seconds"] += stats.draft_seconds
                total["verify_seconds"] += stats.verify_seconds
                total["steps"] += stats.verification_steps
                total["identical"] += out.sequences.tolist() == expected.tolist()
    for (adapter, threshold, max_draft), t in totals.items():
        step = t["plain_seconds"] / t["plain_tokens"]
        print(
            f"{os.path.basename(adapter)} threshold {threshold} max {max_draft}: plain step {1000 * step:.1f} ms, "
            f"acceptance {t['accepted'] / t['drafted']:.3f}, drafted/step {t['drafted'] / t['steps']:.2f}, "
            f"accepted/step {t['accepted'] / t['steps']:.2f}, draft cost {t['draft_seconds'] / t['drafted'] / step:.3f} "
            f"step/token, verification {t['verify_seconds'] / t['steps'] / step:.2f} steps, "
            f"speedup {t['plain_seconds'] / t['seconds']:.2f}x, identical to plain {int(t['identical'])}/{len(encoded)}"
        )


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main(sys.argv[1:])
