"""The numeric knobs the tuner searches: each one's kind, the range it searches by default and the
limits a study's range must respect, and which of them a strategy's trials search.

Which knobs a strategy reads is the strategy's to say (`Strategy.tunable_knobs`), so a strategy
registered with `register_strategy` is tuned like the built-in ones; the ranges are the tuner's.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_selfspec.tuner_api import SelfSpecParams, resolve_strategy

from .. import TuningError


@dataclass(frozen=True)
class Knob:
    """One numeric parameter the tuner may search, with the range it searches by default and the
    limits any configured range must respect (None: unbounded on that side)."""

    name: str
    kind: type
    default_range: tuple[float, float]
    limits: tuple[float | None, float | None]
    log: bool = False


_DEFAULTS = SelfSpecParams()


def _fixed_at_default(name: str) -> tuple[float, float]:
    """A range that is just `generate`'s own default: the knob is not searched unless a study
    gives it a range, and its value cannot drift from the default if that changes."""
    value = getattr(_DEFAULTS, name)
    return (value, value)


KNOBS: dict[str, Knob] = {
    knob.name: knob
    for knob in (
        Knob("max_draft_tokens", int, (1, 12), (0, None)),
        Knob("draft_exit_threshold", float, (0.05, 0.95), (0.0, 1.0)),
        # α of Draft & Verify: the acceptance rate the adaptive threshold steers towards.
        Knob("target_acceptance", float, (0.5, 0.95), (0.0, 1.0)),
        # ε of Draft & Verify: how far one verification moves the threshold. Useful values span
        # two orders of magnitude, so it is searched on a log scale.
        Knob("threshold_step", float, (0.001, 0.1), (0.0, 1.0), log=True),
        Knob("target_confidence_threshold", float, (0.05, 0.95), (0.0, 1.0)),
        # Off unless a study opts in with a range: composing prompt lookup with the layer-skip
        # draft, and restricting the draft's LM head, change what the draft costs.
        Knob("prompt_lookup_tokens", int, _fixed_at_default("prompt_lookup_tokens"), (0, None)),
        # The shortest n-gram match a lookup accepts, and the longest it tries first (a range for
        # both must keep the first at most the second; see the config's checks).
        Knob("prompt_lookup_min_ngram", int, _fixed_at_default("prompt_lookup_min_ngram"), (1, None)),
        Knob("prompt_lookup_ngram", int, _fixed_at_default("prompt_lookup_ngram"), (1, None)),
        # How far an adaptive lookup length may grow (0: a fixed length). A range for it must stay
        # at or above prompt_lookup_tokens's, or trials that cross are invalid and pruned.
        Knob("prompt_lookup_max_tokens", int, _fixed_at_default("prompt_lookup_max_tokens"), (0, None)),
        # How far it may shrink; a floor above the starting length is that length, so any range is valid.
        Knob("prompt_lookup_min_tokens", int, _fixed_at_default("prompt_lookup_min_tokens"), (1, None)),
        # How often the loser of lookup and the model's draft is probed (0: lookup always first).
        Knob("draft_source_probe_interval", int, _fixed_at_default("draft_source_probe_interval"), (0, None)),
        Knob("draft_vocab_size", int, _fixed_at_default("draft_vocab_size"), (0, None)),
        # Verifying the draft's runner-ups widens every verification: off unless a study asks.
        Knob("draft_alternatives", int, _fixed_at_default("draft_alternatives"), (0, None)),
        # The draft heads' first guesses beside a lookup proposal widen its verifications alike.
        Knob("lookup_alternatives", int, _fixed_at_default("lookup_alternatives"), (0, None)),
        # How often the back-off probes the mode it is not using (0: never back off).
        Knob("backoff_probe_interval", int, _fixed_at_default("backoff_probe_interval"), (0, None)),
        # The online corpus's (searched only in trials that switch it on; see the config's
        # `online_corpus`): the share of a context's occurrences that must agree for its proposal
        # to go on, the longest proposal, and the shortest context it proposes from.
        Knob("online_corpus_min_prob", float, _fixed_at_default("online_corpus_min_prob"), (0.0, 1.0)),
        Knob("online_corpus_max_tokens", int, _fixed_at_default("online_corpus_max_tokens"), (1, None)),
        Knob("online_corpus_min_context", int, _fixed_at_default("online_corpus_min_context"), (1, None)),
        # The share of a batch's rows that must want a longer proposal for the batch to have one:
        # read only where a batch has more than one row, so searched only where a batched study
        # gives it a range.
        Knob("batch_quorum", float, _fixed_at_default("batch_quorum"), (0.0, 1.0)),
    )
}


# The knobs that only a trial with the online corpus switched on reads.
ONLINE_CORPUS_KNOBS = ("online_corpus_min_prob", "online_corpus_max_tokens", "online_corpus_min_context")


def strategy_knobs(strategy: str) -> tuple[str, ...]:
    """The knobs a trial of `strategy` searches, in the order the sampler is asked for them."""
    try:
        return resolve_strategy(strategy).tunable_knobs
    except ValueError as error:  # a study of a strategy this process has not registered
        raise TuningError(
            f"{error}; a strategy of your own must be registered (hf_selfspec.register_strategy) wherever its "
            "study is tuned or exported"
        ) from None

