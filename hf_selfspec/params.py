"""The knobs of self-speculative decoding, their defaults, and their validation.

Every other module (the generate hook, the tuned profiles, the tuner's search space, the bench)
reads parameter names from here, so a knob is added or renamed in exactly one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping


@dataclass(frozen=True)
class SelfSpecParams:
    """Resolved parameters for one `generate` call under a strategy.

    `draft_exit_threshold` is the fixed exit threshold of `self_speculative` and the *initial*
    threshold of `adaptive_draft_exit`; the Draft & Verify paper starts that one at 0.6.
    `draft_vocab_size` > 0 restricts the draft's LM head to that many lowest token ids plus the
    prompt's own tokens (0: the full head).
    """

    attn_skip_layers: tuple[int, ...] = ()
    mlp_skip_layers: tuple[int, ...] = ()
    # 0: the model never drafts, and prompt lookup alone proposes (with no lookup, every step
    # is a plain one on the verifier's kernels): where no draft of the model pays, the loop
    # still keeps what copying text gains.
    max_draft_tokens: int = 8
    draft_exit_threshold: float = 0.6
    target_acceptance: float = 0.9
    threshold_step: float = 0.01
    acceptance_ema: float = 0.5
    threshold_ema: float = 0.9
    target_confidence_threshold: float = 0.5
    prompt_lookup_tokens: int = 0
    prompt_lookup_ngram: int = 3
    # A lone matching token predicts little (on this project's CPU a rejected lookup costs most
    # of a forward pass), so by default a lookup needs at least two tokens of context to match.
    prompt_lookup_min_ngram: int = 2
    # The longest a lookup proposal may grow within a request (see `AdaptiveLookupLength`), which
    # then starts at `prompt_lookup_tokens` and, unlike a fixed length, is not capped by
    # `max_draft_tokens` (that caps the model's draft). 0: every lookup proposes a fixed
    # `prompt_lookup_tokens`.
    prompt_lookup_max_tokens: int = 0
    # The shortest an adaptive lookup proposal shrinks to after cuts (or its starting length
    # `prompt_lookup_tokens`, if that is shorter); see `AdaptiveLookupLength`.
    prompt_lookup_min_tokens: int = 1
    # Where both a lookup proposal and the model's draft are on offer, verify whichever has
    # committed tokens more cheaply so far in the request, probing the other every this many
    # steps (see `CheaperDraftSource`). 0: a lookup proposal always goes first.
    draft_source_probe_interval: int = 0
    draft_vocab_size: int = 0
    # Runner-up tokens of the draft verified beside each drafted token, in the same forward pass
    # (see `alternatives.py`).
    draft_alternatives: int = 0
    # The draft heads' likeliest first tokens verified beside a lookup proposal's first token,
    # where they differ from it (draft heads name them without running a layer; other drafts
    # name none): a lookup proposal's first token is where it is most often wrong.
    lookup_alternatives: int = 0
    # Steps between probes of whichever of speculating and plain decoding is currently slower
    # per committed token (0: always speculate); see `ThroughputBackoff`. On the embedded model's
    # chat prompts, 8 probed a hopeless draft often enough to cost a few percent, and 32 was no
    # better than 16 there while slower to notice text that starts repeating.
    backoff_probe_interval: int = 16
    # A trained draft adapter's file (see `hf_selfspec.adapter`); when set, the draft is the
    # model's first layers plus the adapter instead of a layer-skip set. Relative names resolve
    # against the directory of the generation_config.json the profile came from.
    draft_adapter: str = ""
    # A lookup corpus's file (see `hf_selfspec.lookup_corpus`): text the model wrote itself, where
    # prompt lookup looks next when the current text has no match. Resolved like `draft_adapter`.
    lookup_corpus: str = ""
    # The online corpus of the model's earlier calls (a call's `online_corpus`; see
    # `hf_selfspec.online_corpus`): its proposal goes on while at least this share of the matched
    # context's occurrences agree with it. Suffix decoding's `min_token_prob` is 0.1 on GPUs, where
    # a rejected token costs little; on a CPU each one costs a good part of a forward pass.
    online_corpus_min_prob: float = 0.3
    # The longest one online proposal may be.
    online_corpus_max_tokens: int = 16
    # The shortest context (the text's suffix found in the online corpus, followed back) it proposes
    # from: requests that share a format share its short phrases everywhere, and a few tokens of
    # agreement say little of what the model writes next, while a rejected proposal still costs
    # its verification.
    online_corpus_min_context: int = 7
    # A saved online corpus (a lookup-corpus file, as `OnlineCorpus.save` writes it) that the
    # call's online corpus starts from: what a tuning study's corpus learned, shipped beside its
    # profile. Read only where the call's online corpus is on. Resolved like `draft_adapter`.
    online_corpus_file: str = ""
    # The largest batch (`input_ids` rows times `num_return_sequences`) this speculates on: a
    # larger one decodes plainly. 0: any batch.
    max_batch_size: int = 0
    # In a batch, the share of its rows that must want a longer proposal for the batch to have
    # one: its model draft goes on while at least that many rows still draft, and its
    # verification is no wider than that many rows' proposals (see `batch.py`). Each drafted or
    # verified position costs every row, so a lone row's long proposal costs the batch more than
    # it can give it, the more so the larger the batch. 0: as long as any row wants it.
    batch_quorum: float = 0.25

    @property
    def max_proposal_tokens(self) -> int:
        """The most tokens one step may propose: the model's draft's bound, or an adaptive
        lookup's if that reaches further."""
        lookup = max(self.prompt_lookup_max_tokens, self.online_corpus_max_tokens) if self.prompt_lookup_tokens else 0
        return max(self.max_draft_tokens, lookup)

    def as_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["attn_skip_layers"] = list(self.attn_skip_layers)
        values["mlp_skip_layers"] = list(self.mlp_skip_layers)
        return values


PARAM_NAMES: frozenset[str] = frozenset(f.name for f in fields(SelfSpecParams))
_LAYER_KEYS = ("attn_skip_layers", "mlp_skip_layers")
_PROBABILITY_KEYS = (
    "draft_exit_threshold",
    "target_acceptance",
    "threshold_step",
    "acceptance_ema",
    "threshold_ema",
    "target_confidence_threshold",
    "online_corpus_min_prob",
    "batch_quorum",
)
# Parameters that name a file beside the profile's generation_config.json; whatever copies,
# exports or uploads a profile carries these files along.
PATH_KEYS = ("draft_adapter", "lookup_corpus", "online_corpus_file")
_COUNT_KEYS = {
    "max_draft_tokens": 0,
    "prompt_lookup_tokens": 0,
    "prompt_lookup_ngram": 1,
    "prompt_lookup_min_ngram": 1,
    "prompt_lookup_max_tokens": 0,
    "prompt_lookup_min_tokens": 1,
    "draft_source_probe_interval": 0,
    "draft_vocab_size": 0,
    "draft_alternatives": 0,
    "lookup_alternatives": 0,
    "backoff_probe_interval": 0,
    "online_corpus_max_tokens": 1,
    "online_corpus_min_context": 1,
    "max_batch_size": 0,
}


def default_skip_layers(num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The documented untuned skip set: both sub-layers of every other layer in the back half.

    Early layers build the representation that later ones refine, so skipping from the middle
    onwards costs the least acceptance; the last layer is kept because it shapes the logits.
    """
    layers = tuple(range(num_layers // 2, num_layers - 1, 2))
    return layers, layers


def check_param_types(values: Mapping[str, Any], where: str) -> None:
    """Reject unknown names and wrong types, naming the offending key and where it came from."""
    for key, value in values.items():
        if key not in PARAM_NAMES:
            raise ValueError(
                f"{where}: unknown self-speculative parameter {key!r}; known: {', '.join(sorted(PARAM_NAMES))}"
            )
        if key in _LAYER_KEYS:
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in value
            ):
                raise ValueError(f"{where}: {key} must be a list of layer indices (ints), got {value!r}")
        elif key in _COUNT_KEYS:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{where}: {key} must be an int, got {value!r}")
        elif key in PATH_KEYS:
            if not isinstance(value, str):
                raise ValueError(f"{where}: {key} must be a file name, got {value!r}")
        elif key in _PROBABILITY_KEYS:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{where}: {key} must be a number, got {value!r}")


def resolve_params(
    num_layers: int,
    explicit: Mapping[str, Any],
    config_values: Mapping[str, Any] = {},
    profile_values: Mapping[str, Any] = {},
) -> SelfSpecParams:
    """Merge the sources (explicit kwargs win over `generation_config`, which wins over a tuned
    profile) and validate the result against the model's depth."""
    merged: dict[str, Any] = {}
    for source, where in ((profile_values, "tuned profile"), (config_values, "generation_config"), (explicit, "generate()")):
        check_param_types(source, where)
        merged.update({k: v for k, v in source.items() if v is not None})
    if "attn_skip_layers" not in merged and "mlp_skip_layers" not in merged:
        merged["attn_skip_layers"], merged["mlp_skip_layers"] = default_skip_layers(num_layers)
    for key in _LAYER_KEYS:
        layers = merged.get(key, ())
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"{key} has layer index {bad[0]} out of range for a model with {num_layers} layers")
        merged[key] = tuple(sorted(set(layers)))
    fully_skipped = set(merged["attn_skip_layers"]) & set(merged.get("mlp_skip_layers", ()))
    if len(fully_skipped) == num_layers:
        raise ValueError(
            "attn_skip_layers and mlp_skip_layers skip every layer; the draft must keep at least one sub-layer"
        )
    for key in _PROBABILITY_KEYS:
        if key in merged and not 0.0 <= float(merged[key]) <= 1.0:
            raise ValueError(f"{key} must lie in [0, 1], got {merged[key]}")
    for key, minimum in _COUNT_KEYS.items():
        if key in merged and merged[key] < minimum:
            raise ValueError(f"{key} must be >= {minimum}, got {merged[key]}")
    params = SelfSpecParams(**merged)
    if params.prompt_lookup_min_ngram > params.prompt_lookup_ngram:
        raise ValueError(
            f"prompt_lookup_min_ngram ({params.prompt_lookup_min_ngram}) must not exceed "
            f"prompt_lookup_ngram ({params.prompt_lookup_ngram})"
        )
    if 0 < params.prompt_lookup_max_tokens < params.prompt_lookup_tokens:
        raise ValueError(
            f"prompt_lookup_max_tokens ({params.prompt_lookup_max_tokens}) must be 0 (a fixed lookup length) "
            f"or at least prompt_lookup_tokens ({params.prompt_lookup_tokens})"
        )
    if params.lookup_corpus and not params.prompt_lookup_tokens:
        raise ValueError("lookup_corpus extends prompt lookup and needs prompt_lookup_tokens > 0")
    return params
