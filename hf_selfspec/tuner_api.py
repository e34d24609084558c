"""The core as the tuner sees it: every name the auto-tuner (`hf_selfspec.tuning`) takes from the
core, and only these.

The tuner times the decoding loop's parts, prices them and writes profiles the core reads, so it
reaches further in than a user does; collecting what it reaches for here keeps that reach
declared in one place. A core change that renames or drops one of these names is a change to
the tuner's contract, and `tests/unit/test_import_structure.py` holds the tuner to this list.
"""

from .adapter import (
    AdapterShape,
    DraftAdapter,
    check_exit_layer,
    load_adapter,
    read_adapter,
    read_adapter_shape,
    save_adapter,
)
from .argtypes import positive_float, positive_int
from .cache import DraftAwareCache, cache_keyword
from .consistency import DIVERGENT, NEAR_TIE, Consistency, check_greedy_consistency
from .decoding import DecodeRequest, Runtime, WallClock, speculative_decode
from .draft_heads import DraftChain, DraftHeads, HeadsShape, heads_for
from .decoding_types import MODEL_SOURCE, DecodingState, Draft, Drafter, ExitPolicy
from .drafters import DraftHeadsDrafter, LayerSkipDrafter, RestrictedDraftHead, ShallowExitDrafter
from .dtypes import AUTO, parse_dtype
from .embedded import EMBEDDED_NAME, EmbeddedModelMissing, load_embedded
from .files import adapter_files, cache_root
from .inputs import InputError, file_stem, model_name, output_directory, read_text_file, usable_device
from .layer_skip import SkippingDecoder, decoder_layers
from .loading import EMBEDDED, load_model_and_tokenizer, pretrained_source
from .lookup_corpus import read_corpus_description, save_lookup_corpus
from .masks import additive_mask, check_hand_built_masks_supported, model_attention_mask
from .measure import TimedRun, forward_timings, timed, timed_generate
from .narrow_linear import choose_layouts, verifying
from .online_corpus import OnlineCorpus, online_corpus
from .params import SelfSpecParams, default_skip_layers, resolve_params
from .policies import AdaptiveLookupLength
from .profile_files import AdapterConflictError, adapter_digest, copy_adapter, files_named_by
from .profiles import TunedProfile, device_profile_key, read_config_json, read_profiles_file, write_profile
from .prompts import (
    HELD_OUT_SPLIT,
    HUMANEVAL,
    STREAMS,
    TUNE_SPLIT,
    WORKLOAD,
    WORKLOAD_CATEGORIES,
    Prompt,
    PromptFileError,
    encode_batch,
    encode_prompt,
    load_prompts,
    read_jsonl_prompts,
)
from .selection import TokenSelector
from .stats import StrategyStats, geometric_mean
from .strategies import PLAIN, Strategy, available_strategies, resolve_strategy

__all__ = [
    "AUTO",
    "AdapterConflictError",
    "AdapterShape",
    "AdaptiveLookupLength",
    "Consistency",
    "DIVERGENT",
    "DecodeRequest",
    "DecodingState",
    "Draft",
    "DraftAdapter",
    "DraftAwareCache",
    "DraftChain",
    "DraftHeads",
    "DraftHeadsDrafter",
    "Drafter",
    "EMBEDDED",
    "EMBEDDED_NAME",
    "EmbeddedModelMissing",
    "ExitPolicy",
    "HELD_OUT_SPLIT",
    "HeadsShape",
    "HUMANEVAL",
    "InputError",
    "LayerSkipDrafter",
    "MODEL_SOURCE",
    "NEAR_TIE",
    "OnlineCorpus",
    "PLAIN",
    "Prompt",
    "PromptFileError",
    "RestrictedDraftHead",
    "Runtime",
    "STREAMS",
    "SelfSpecParams",
    "ShallowExitDrafter",
    "SkippingDecoder",
    "Strategy",
    "StrategyStats",
    "TUNE_SPLIT",
    "TimedRun",
    "TokenSelector",
    "TunedProfile",
    "WORKLOAD",
    "WORKLOAD_CATEGORIES",
    "WallClock",
    "adapter_digest",
    "adapter_files",
    "additive_mask",
    "available_strategies",
    "cache_keyword",
    "cache_root",
    "check_exit_layer",
    "check_greedy_consistency",
    "check_hand_built_masks_supported",
    "choose_layouts",
    "copy_adapter",
    "decoder_layers",
    "default_skip_layers",
    "device_profile_key",
    "encode_batch",
    "encode_prompt",
    "file_stem",
    "files_named_by",
    "forward_timings",
    "geometric_mean",
    "heads_for",
    "load_adapter",
    "load_embedded",
    "load_model_and_tokenizer",
    "load_prompts",
    "model_attention_mask",
    "model_name",
    "online_corpus",
    "output_directory",
    "parse_dtype",
    "positive_float",
    "positive_int",
    "pretrained_source",
    "read_adapter",
    "read_adapter_shape",
    "read_config_json",
    "read_corpus_description",
    "read_jsonl_prompts",
    "read_profiles_file",
    "read_text_file",
    "resolve_params",
    "resolve_strategy",
    "save_adapter",
    "save_lookup_corpus",
    "speculative_decode",
    "timed",
    "timed_generate",
    "usable_device",
    "verifying",
    "write_profile",
]
