"""Per exit layer: the Kangaroo draft's cost per token relative to a plain step, and its
acceptance while decoding HumanEval 20-39 (never trained or tuned on), bfloat16.

    OMP_NUM_THREADS=2 .venv/bin/python studies/measure_kangaroo.py ADAPTER.safetensors [...]

A plain step's cost is plain greedy's seconds per token on the same prompts; the draft's is the
strategy's drafting seconds per drafted token (with max_draft_tokens drafts every step, no exit
and no back-off, so every step drafts). Acceptance is accepted / drafted tokens at each exit
threshold listed; greedy outputs are checked against plain greedy as they go.
"""

from __future__ import annotations

import sys
import time

import torch

from hf_selfspec import load_embedded
from hf_selfspec.prompts import encode_prompt, load_prompts

NEW_TOKENS = 64


def main(adapters: list[str]) -> None:
    model, tokenizer = load_embedded(dtype=torch.bfloat16, generation_config=None)
    encoded = [encode_prompt(tokenizer, p) for p in load_prompts("humaneval", n=20, offset=20)]
    common = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    model.generate(**encoded[0], strategy="plain", **common)  # warm-up
    plain_seconds, plain_tokens, plain_outputs = 0.0, 0, []
    for inputs in encoded:
        started = time.perf_counter()
        out = model.generate(**inputs, strategy="plain", **common)
        plain_seconds += time.perf_counter() - started
        plain_tokens += out.shape[1] - inputs["input_ids"].shape[1]
        plain_outputs.append(out)
    step = plain_seconds / plain_tokens
    print(f"plain step: {1000 * step:.1f} ms/token")
    for adapter in adapters:
        for threshold, max_draft in ((0.0, 4), (0.3, 8), (0.5, 8), (0.7, 8)):
            drafted = accepted = 0
            draft_seconds = verify_seconds = total = 0.0
            steps = same = 0
            for inputs, expected in zip(encoded, plain_outputs):
                started = time.perf_counter()
                out = model.generate(**inputs, strategy="kangaroo", draft_adapter=adapter, draft_vocab_size=8192,
                                     draft_exit_threshold=threshold, max_draft_tokens=max_draft,
                                     backoff_probe_interval=0, return_dict_in_generate=True, **common)
                total += time.perf_counter() - started
                s = out.strategy_stats
                drafted += s.drafted_tokens
                accepted += s.accepted_tokens
                draft_seconds += s.draft_seconds
                verify_seconds += s.verify_seconds
                steps += s.verification_steps
                same += out.sequences.tolist() == expected.tolist()
            print(
                f"{adapter.rsplit('/', 1)[-1]} threshold {threshold} max {max_draft}: acceptance {accepted / drafted:.3f}, "
                f"drafted/step {drafted / steps:.2f}, draft cost {draft_seconds / drafted / step:.3f} step/token, "
                f"verify {verify_seconds / steps / step:.2f} steps, speedup {plain_seconds / total:.2f}x, "
                f"identical to plain {same}/{len(encoded)}",
                flush=True,
            )


if __name__ == "__main__":
    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "1")))
    main(sys.argv[1:])
