"""Decode through a packaged folder in an interpreter that cannot import hf_selfspec.

Run as `python -I -S zero_install_check.py SPEC.json` by `helpers.zero_install.run_isolated`:
`-I -S` skips the site hooks that install hf_selfspec's editable finder, the spec's
`site_packages` then give torch and transformers back, and an import blocker refuses hf_selfspec
should a regular install sit there too. Prints one JSON object of facts for the test to assert on.

The spec: `package` (a folder written by `hf-selfspec package`, or null), `model` (a model
directory without custom_generate/), `model_repo` (the same model with the package in it, as a
directory or a Hub id found in the offline cache, or null),
`prompts` (lists of token ids), `max_new_tokens`, `check_other_dtype` (also decode in
bfloat16, for which the package has no profile) and optionally `dtype` (the models', float32 by
default). Where an output differs from plain's, plain's logits at the first difference come with
it, for the test to judge a reduced-precision near-tie.
"""

from __future__ import annotations

import json
import logging
import sys
from importlib.abc import MetaPathFinder

BLOCKED = ("hf_selfspec", "tuning")


class _Blocker(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked)", name=fullname)
        return None


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def _decode(generate, prompts, max_new_tokens, **kwargs):
    """Token ids, the strategy's drafted count (None when it decoded plainly), the raw logits and
    the accepted count per prompt."""
    import torch

    results = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        output = generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            output_logits=True,
            **kwargs,
        )
        stats = getattr(output, "strategy_stats", None)
        drafted, accepted = (None, None) if stats is None else (stats.drafted_tokens, stats.accepted_tokens)
        results.append((output.sequences[0].tolist(), drafted, output.logits, accepted))
    return results


def _first_difference(plain, packaged) -> dict | None:
    """Where the packaged output first leaves plain's (a new-token index), with plain's logits there."""
    new_plain, new_packaged = plain[0][-len(plain[2]):], packaged[0][-len(packaged[2]):]
    index = next((i for i, (a, b) in enumerate(zip(new_plain, new_packaged)) if a != b), None)
    if index is None:
        return None
    return {"index": index, "plain_new": new_plain, "packaged_new": new_packaged,
            "plain_logits": plain[2][index].reshape(-1).float().tolist()}


def _compare(model, generate, prompts, max_new_tokens, **kwargs) -> dict:
    plain_class = type(model)
    plain = _decode(lambda **a: plain_class.generate(model, **a), prompts, max_new_tokens)
    packaged = _decode(generate, prompts, max_new_tokens, **kwargs)
    return {
        "identical": [p[0] == q[0] for p, q in zip(plain, packaged)],
        "differences": [_first_difference(p, q) for p, q in zip(plain, packaged)],
        "drafted": [q[1] for q in packaged],
        "accepted": [q[3] for q in packaged],
        "class_kept": type(model) is plain_class,
    }


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path, encoding="utf-8").read())
    sys.meta_path.insert(0, _Blocker())
    sys.path.extend(spec["site_packages"])
    facts = {"hf_selfspec_importable": any(_importable(name) for name in BLOCKED)}

    import torch
    from transformers import AutoModelForCausalLM

    prompts, new_tokens, package = spec["prompts"], spec["max_new_tokens"], spec["package"]
    dtype = getattr(torch, spec.get("dtype", "float32"))
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()
    if package:
        facts["custom_generate"] = _compare(
            model, model.generate, prompts, new_tokens, custom_generate=package, trust_remote_code=True
        )
    if spec["model_repo"]:
        repo_model = AutoModelForCausalLM.from_pretrained(
            spec["model_repo"], dtype=dtype, trust_remote_code=True
        ).eval()
        facts["model_repo"] = _compare(repo_model, repo_model.generate, prompts, new_tokens)
        # `model.generate(input_ids)`: the ids arrive positionally, `model` by keyword
        positional = repo_model.generate(torch.tensor(prompts[:1]), max_new_tokens=new_tokens, do_sample=False)
        plain = type(repo_model).generate(repo_model, torch.tensor(prompts[:1]), max_new_tokens=new_tokens, do_sample=False)
        facts["model_repo"]["positional_identical"] = positional.tolist() == plain.tolist()
    if spec["check_other_dtype"]:
        records = _Records()
        logging.getLogger().addHandler(records)
        model = model.to(torch.bfloat16)
        facts["other_dtype"] = _compare(
            model, model.generate, prompts * 2, new_tokens, custom_generate=package, trust_remote_code=True
        )
        facts["other_dtype"]["warnings"] = [m for m in records.messages if "decoding plainly" in m]
    print(json.dumps(facts))


if __name__ == "__main__":
    main(sys.argv[1])
