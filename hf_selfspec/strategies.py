"""Strategies: named compositions of a drafter, an exit policy, a gate, a back-off and prompt
lookup's sources, and their registry.

A user strategy subclasses `Strategy`, overrides the factory it wants to change and registers
itself; the decoding loop, the verifier and every `generate` feature come with it unchanged:

    @hf_selfspec.register_strategy("cautious")
    class Cautious(hf_selfspec.Strategy):
        def build_exit_policy(self, params):
            return ExitPolicy(threshold=0.9)
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from .cache import DraftAwareCache
from .decoding import RowParts, SpeculationParts
from .adapter import load_adapter
from .masks import check_hand_built_masks_supported
from .decoding_types import Drafter, ExitPolicy
from .draft_heads import HeadsShape
from .drafters import AssistantDrafter, DraftHeadsDrafter, LayerSkipDrafter, ShallowExitDrafter
from .layer_skip import SkippingDecoder
from .lookup import CorpusLookup, OnlineLookup, PromptLookup, TextLookup
from .lookup_corpus import load_lookup_corpus
from .online_corpus import OnlineCorpus
from .params import PARAM_NAMES, SelfSpecParams
from .policies import (
    AdaptiveExitPolicy,
    AdaptiveLookupLength,
    Backoff,
    CheaperDraftSource,
    DraftSourceChoice,
    Gate,
    LookupLength,
    TargetConfidenceGate,
    ThroughputBackoff,
)

PLAIN = "plain"  # `strategy="plain"`: decode with transformers alone, even if a tuned profile exists

_REGISTRY: dict[str, type["Strategy"]] = {}


class Strategy:
    name: ClassVar[str] = ""
    # Whether `assistant_model=` may replace the layer-skip draft.
    accepts_assistant_model: ClassVar[bool] = False
    # Whether the strategy drafts only with a trained adapter (`draft_adapter`).
    needs_draft_adapter: ClassVar[bool] = False
    # The numeric `SelfSpecParams` knobs this strategy reads that are worth searching, in the
    # order a tuner asks for them (the draft itself, skip set or adapter, is searched apart). The
    # tuner builds a strategy's search space from this, so a registered strategy can be tuned.
    tunable_knobs: ClassVar[tuple[str, ...]] = (
        "max_draft_tokens",
        "draft_exit_threshold",
        "prompt_lookup_tokens",
        "prompt_lookup_min_ngram",
        "prompt_lookup_ngram",
        "prompt_lookup_max_tokens",
        "draft_source_probe_interval",
        "draft_vocab_size",
        "draft_alternatives",
        "backoff_probe_interval",
        "prompt_lookup_min_tokens",
        "online_corpus_min_prob",
        "online_corpus_max_tokens",
        "online_corpus_min_context",
        "batch_quorum",
        "lookup_alternatives",
    )

    def build_exit_policy(self, params: SelfSpecParams) -> ExitPolicy:
        return ExitPolicy(params.draft_exit_threshold)

    def build_gate(self, params: SelfSpecParams) -> Gate:
        return Gate()

    def build_backoff(self, params: SelfSpecParams) -> Backoff:
        if params.backoff_probe_interval:
            return ThroughputBackoff(params.backoff_probe_interval)
        return Backoff()

    def build_batch_backoff(self, params: SelfSpecParams) -> Backoff:
        """The back-off of a batch. Every row pays for each position that any row proposes, so a
        batch always weighs speculating against plain batched decoding, even under a profile
        that never backs one text off (`backoff_probe_interval` 0, where the default interval
        serves), and measures speculation over as few first steps as a source without a match
        (`UNMATCHED_FIRST_STEPS`): a losing step there costs every row at once."""
        interval = params.backoff_probe_interval or SelfSpecParams.backoff_probe_interval
        return ThroughputBackoff(interval, self.UNMATCHED_FIRST_STEPS)

    # Where the text has nothing to copy, the corpus's proposals and the model's drafts are each
    # measured over this many steps before they are compared with the steps without them: a
    # 64-token answer has only a dozen or two such steps, and the loop's eight would spend most
    # of them measuring proposals that the text may never take.
    UNMATCHED_FIRST_STEPS = 3

    def build_unmatched_backoff(self, params: SelfSpecParams) -> Backoff:
        """Whether the corpus, or the model, proposes where the text itself has nothing to copy
        (`PromptLookup` asks one for each); on and off with the loop's back-off."""
        if params.backoff_probe_interval:
            return ThroughputBackoff(params.backoff_probe_interval, self.UNMATCHED_FIRST_STEPS)
        return Backoff()

    def build_lookup_length(self, params: SelfSpecParams) -> LookupLength:
        if params.prompt_lookup_max_tokens:
            return AdaptiveLookupLength(
                params.prompt_lookup_tokens, params.prompt_lookup_max_tokens, params.prompt_lookup_min_tokens
            )
        return LookupLength(params.prompt_lookup_tokens)

    def build_draft_source_choice(self, params: SelfSpecParams) -> DraftSourceChoice:
        if params.draft_source_probe_interval:
            return CheaperDraftSource(params.draft_source_probe_interval)
        return DraftSourceChoice()

    def build_lookup(
        self, model: nn.Module, params: SelfSpecParams, online_corpus: OnlineCorpus | None = None
    ) -> PromptLookup | None:
        """Prompt lookup's sources beside the model's draft, if the parameters ask for lookup;
        `online_corpus`, where given, is one more (the call's `online_corpus`)."""
        if not params.prompt_lookup_tokens:
            return None
        ngrams = params.prompt_lookup_min_ngram, params.prompt_lookup_ngram
        corpus = None
        if params.lookup_corpus:
            corpus = CorpusLookup(
                load_lookup_corpus(model, params.lookup_corpus), *ngrams, self.build_lookup_length(params),
                self.build_unmatched_backoff(params),
            )
        online = None
        if online_corpus is not None:
            online = OnlineLookup(
                online_corpus, *ngrams, params.online_corpus_max_tokens, params.online_corpus_min_prob,
                params.online_corpus_min_context, self.build_unmatched_backoff(params),
            )
        return PromptLookup(
            TextLookup(*ngrams, self.build_lookup_length(params)),
            corpus,
            self.build_draft_source_choice(params),
            self.build_unmatched_backoff(params),
            params.max_draft_tokens,
            online,
        )

    def build_model_drafter(
        self, model: nn.Module, params: SelfSpecParams, cache: DraftAwareCache, assistant_model: nn.Module | None
    ) -> Drafter:
        """The draft that runs a model (a skip set, an adapter, an assistant): the part whose
        forward passes the tuner's estimate predicts instead of running, keeping the rest of
        the strategy's composition as it is."""
        for knob in ("draft_alternatives", "lookup_alternatives"):
            if not getattr(params, knob):
                continue
            if assistant_model is not None:
                raise ValueError(f"{knob} needs the model's own draft, not an assistant_model")
            check_hand_built_masks_supported(model, knob, f"use {knob}=0")
            vocab_size = model.get_output_embeddings().weight.shape[0]
            if getattr(params, knob) >= vocab_size:
                raise ValueError(f"{knob} ({getattr(params, knob)}) must be below the model's vocabulary size ({vocab_size})")
        if assistant_model is not None:
            return AssistantDrafter(assistant_model, cache)
        if self.needs_draft_adapter and not params.draft_adapter:
            raise ValueError(
                f"strategy {self.name!r} needs draft_adapter=<file>: train one with `hf-selfspec train-adapter`"
            )
        if params.draft_adapter:
            adapter = load_adapter(model, params.draft_adapter)
            if isinstance(adapter.shape, HeadsShape):
                return DraftHeadsDrafter(model, adapter, params.draft_vocab_size, params.draft_alternatives)
            return ShallowExitDrafter(model, cache, adapter, params.draft_vocab_size, params.draft_alternatives,
                                      params.batch_quorum)
        decoder = SkippingDecoder(model, params.attn_skip_layers, params.mlp_skip_layers)
        return LayerSkipDrafter(model, cache, decoder, params.draft_vocab_size, params.draft_alternatives,
                                params.batch_quorum)

    def build_drafter(
        self,
        model: nn.Module,
        params: SelfSpecParams,
        cache: DraftAwareCache,
        assistant_model: nn.Module | None,
        model_drafter: Drafter | None = None,
    ) -> Drafter:
        """What drafts where the model may: `model_drafter` where one is given (the tuner's
        estimate gives its prediction), else the model's own draft (`build_model_drafter`). A
        strategy with a drafter of its own returns it here, and keeps it under the estimate."""
        if model_drafter is not None:
            return model_drafter
        return self.build_model_drafter(model, params, cache, assistant_model)

    def build(
        self,
        model: nn.Module,
        params: SelfSpecParams,
        cache: DraftAwareCache,
        assistant_model: nn.Module | None = None,
        model_drafter: Drafter | None = None,
        online_corpus: OnlineCorpus | None = None,
        rows: int = 1,
    ) -> SpeculationParts:
        """The strategy's parts for one decode of `rows` texts; `model_drafter`, where given,
        stands in for the model's own draft and the rest of the composition stays as it is;
        `online_corpus`, where given, is a lookup source of the call's. Each row decides its own
        proposals; a batch's steps are weighed by the batch's back-off (`build_batch_backoff`)."""
        if assistant_model is not None and not self.accepts_assistant_model:
            raise ValueError(f"strategy {self.name!r} drafts with the model itself and does not take assistant_model")
        if assistant_model is not None:
            check_assistant(model, assistant_model)
        return SpeculationParts(
            drafter=self.build_drafter(model, params, cache, assistant_model, model_drafter),
            backoff=self.build_backoff(params) if rows == 1 else self.build_batch_backoff(params),
            rows=[
                RowParts(self.build_exit_policy(params), self.build_gate(params),
                         self.build_lookup(model, params, online_corpus))
                for _ in range(rows)
            ],
            batch_quorum=params.batch_quorum,
            lookup_alternatives=params.lookup_alternatives,
        )


def _vocabulary_size(model: object) -> int | None:
    head = model.get_output_embeddings() if isinstance(model, nn.Module) and hasattr(model, "get_output_embeddings") else None
    return head.weight.shape[0] if head is not None else None


def check_assistant(model: nn.Module, assistant_model: object) -> None:
    """An assistant drafts token ids that the model verifies: it must be a language model with
    the model's vocabulary (as transformers' own assisted decoding requires)."""
    size = _vocabulary_size(assistant_model)
    if size is None:
        raise ValueError(f"assistant_model must be a loaded causal language model, got {type(assistant_model).__name__}")
    if size != _vocabulary_size(model):
        raise ValueError(
            f"assistant_model has a vocabulary of {size} tokens, the model {_vocabulary_size(model)}: "
            "an assistant must share the model's tokenizer"
        )


def register_strategy(name: str):
    """Class decorator: make a `Strategy` subclass available as `generate(strategy=name)`."""

    def register(cls: type[Strategy]) -> type[Strategy]:
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise TypeError(f"register_strategy({name!r}) expects a subclass of hf_selfspec.Strategy, got {cls!r}")
        if not name or name == PLAIN:
            raise ValueError(f"{name!r} cannot name a strategy")
        unknown = [knob for knob in cls.tunable_knobs if knob not in PARAM_NAMES]
        if unknown:
            raise ValueError(
                f"strategy {name!r}: tunable_knobs names {unknown[0]!r}, which is no SelfSpecParams field; "
                f"known: {', '.join(sorted(PARAM_NAMES))}"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register


def available_strategies() -> list[str]:
    return sorted(_REGISTRY)


def resolve_strategy(strategy: str | Strategy) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str) and strategy in _REGISTRY:
        return _REGISTRY[strategy]()
    raise ValueError(
        f"unknown strategy {strategy!r}; available: {', '.join(available_strategies())} "
        f"(or {PLAIN!r} for plain transformers decoding)"
    )


@register_strategy("self_speculative")
class SelfSpeculative(Strategy):
    """Draft with the skip set until `max_draft_tokens` or the fixed exit threshold."""


@register_strategy("adaptive_draft_exit")
class AdaptiveDraftExit(Strategy):
    """The exit threshold follows the acceptance rate (Draft & Verify)."""

    # `acceptance_ema` and `threshold_ema` are read too, but not searched.
    tunable_knobs = Strategy.tunable_knobs + ("target_acceptance", "threshold_step")

    def build_exit_policy(self, params: SelfSpecParams) -> ExitPolicy:
        return AdaptiveExitPolicy(
            threshold=params.draft_exit_threshold,
            target_acceptance=params.target_acceptance,
            threshold_step=params.threshold_step,
            acceptance_ema=params.acceptance_ema,
            threshold_ema=params.threshold_ema,
        )


@register_strategy("target_confidence_gated")
class TargetConfidenceGated(Strategy):
    """Draft only after steps where the verifier was confident; works over an assistant too."""

    accepts_assistant_model = True
    tunable_knobs = Strategy.tunable_knobs + ("target_confidence_threshold",)

    def build_gate(self, params: SelfSpecParams) -> Gate:
        return TargetConfidenceGate(params.target_confidence_threshold)


@register_strategy("kangaroo")
class Kangaroo(Strategy):
    """Draft with the model's first layers and a trained adapter (Kangaroo, Liu et al. 2024)
    until `max_draft_tokens` or the fixed exit threshold; every other strategy drafts the same
    way when given `draft_adapter`, this one insists on it."""

    needs_draft_adapter = True
