"""Lossless self-speculative decoding for Hugging Face transformers.

    model = hf_selfspec.enable(AutoModelForCausalLM.from_pretrained(...))
    model.generate(**inputs, strategy="adaptive_draft_exit", attn_skip_layers=[...], mlp_skip_layers=[...])
"""

from .compatibility import warn_if_transformers_untested

# Before importing the rest: an untested transformers may already fail there.
warn_if_transformers_untested()

from .embedded import load_embedded
from .mixin import SelfSpecGenerateOutput, SelfSpecMixin, enable
from .online_corpus import OnlineCorpus, online_corpus, online_corpus_keys
from .params import SelfSpecParams, default_skip_layers
from .policies import AdaptiveExitPolicy, Backoff, ExitPolicy, Gate, TargetConfidenceGate, ThroughputBackoff
from .stats import StrategyStats
from .strategies import PLAIN, Strategy, available_strategies, register_strategy

__all__ = [
    "PLAIN",
    "AdaptiveExitPolicy",
    "Backoff",
    "ExitPolicy",
    "Gate",
    "OnlineCorpus",
    "SelfSpecGenerateOutput",
    "SelfSpecMixin",
    "SelfSpecParams",
    "Strategy",
    "StrategyStats",
    "TargetConfidenceGate",
    "ThroughputBackoff",
    "available_strategies",
    "default_skip_layers",
    "enable",
    "load_embedded",
    "online_corpus",
    "online_corpus_keys",
    "register_strategy",
]
