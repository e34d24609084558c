"""`generate(strategy=...)` on any transformers decoder, by subclassing or by `enable(model)`.

The speculative loop takes the place of greedy search and sampling through transformers' own
`custom_generate` hook, handed a callable, not in front of `generate`: that way every input
transformers prepares (the processors from the config, `stop_strings` with the tokenizer,
`min_new_tokens`, the length limits) reaches the loop exactly as it would reach plain decoding.

Everything a call decides (its strategy, parameters, streamer) travels in that callable, and the
draft runs the model's layers itself with per-call state, so nothing is set on the model or
patched into it for the length of a call: one model serves concurrent calls from many threads,
plain and speculative alike. The one thing that stays is the verifier's choice of kernel
(`narrow_linear`): its first use gives the model's linear layers a forward that takes the faster
kernel only inside a verification, and `narrow_linear.uninstall(model)` takes it off.
"""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch
from torch import nn
from transformers import GenerationMixin, StoppingCriteriaList, StopStringCriteria, SynthIDTextWatermarkingConfig
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .batch import why_not_left_padded
from .cache import CACHE_ARGUMENT, cache_given_to, rollback_view, why_not_rollback_capable
from .decoding import DecodeRequest, speculative_decode
from .layer_skip import decoder_layers
from .narrow_linear import stock_kernels, verifying
from .online_corpus import OnlineCorpus, corpus_for_call, feed
from .params import PARAM_NAMES, SelfSpecParams, resolve_params
from .profile_files import anchor_profile_files
from .profiles import TunedProfile, profile_for_model
from .selection import TokenSelector
from .stats import StrategyStats
from .strategies import PLAIN, Strategy, available_strategies, resolve_strategy

logger = logging.getLogger(__name__)


@dataclass
class SelfSpecGenerateOutput(GenerateDecoderOnlyOutput):
    """The usual decoder-only output, plus what the strategy did."""

    strategy_stats: StrategyStats | None = None


@dataclass
class StrategyPlan:
    strategy: Strategy
    params: SelfSpecParams
    assistant_model: nn.Module | None
    from_profile: bool  # a tuned profile chose it: where it cannot run, decode plainly instead
    online_corpus: OnlineCorpus | None = None  # the call's, a lookup source where the strategy looks up


def _call_generation_config(model: nn.Module, args: tuple, kwargs: dict[str, Any]):
    """The generation config this `generate` call runs with: passed by keyword or position, else the model's."""
    return kwargs.get("generation_config") or (args[1] if len(args) > 1 else None) or model.generation_config


def _call_prompt(args: tuple, kwargs: dict[str, Any]):
    """The prompt this `generate` call was given, by position or by keyword (None if neither)."""
    return args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))


def _unsupported(config, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why this call cannot run under a strategy, or None. Reads kwargs over the config."""

    def setting(name: str, default=None):
        return kwargs[name] if name in kwargs else getattr(config, name, default)

    if setting("is_assistant", False):
        # transformers' assisted decoding (its early exit among them) drafts with this model and
        # reads one score per drafted token from it: its loop, not ours, decides the speculation.
        return "draft for transformers' assisted decoding (the model is its assistant)"
    if (setting("num_beams", 1) or 1) > 1:
        return "run beam search (num_beams > 1)"
    if setting("cache_implementation") not in (None, "dynamic"):
        return f"use a {setting('cache_implementation')!r} cache: a strategy needs a dynamic cache it can roll back"
    if setting("use_cache", True) is False:
        return "decode with use_cache=False"
    if setting("output_attentions", False) or setting("output_hidden_states", False):
        return "return attentions or hidden states"
    if kwargs.get("inputs_embeds") is not None:
        return "start from inputs_embeds: a strategy drafts and verifies token ids"
    # Processors that keep state from one call to the next, assuming one call per new token in
    # order; a verification scores several positions at once, some of them never committed.
    if setting("guidance_scale") not in (None, 1):
        return "use classifier-free guidance (guidance_scale): its processor decodes the unguided text step by step"
    if isinstance(setting("watermarking_config"), SynthIDTextWatermarkingConfig):
        return "watermark with SynthID: its processor remembers every context it has scored"
    mode = _generation_mode(config, kwargs)
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"run transformers' {mode.value.replace('_', ' ')} (its own decoding loop)"
    inputs = _call_prompt(args, kwargs)
    mask_problem = why_not_left_padded(kwargs.get("attention_mask"), inputs)
    if mask_problem is not None:
        return f"decode with this attention_mask: {mask_problem}"
    batch = _batch_size(config, args, kwargs)
    if batch > 1:
        reason = _why_not_batched(batch, kwargs)
        if reason is not None:
            return reason
    past = cache_given_to(kwargs)
    if past is not None:
        return why_not_rollback_capable(past) or _why_not_continued(past, inputs)
    return None


def _batch_size(config, args: tuple, kwargs: dict[str, Any]) -> int:
    """The rows a call decodes: its prompts, each `num_return_sequences` times."""
    inputs = _call_prompt(args, kwargs)
    returned = kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1)) or 1
    return (inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() > 1 else 1) * returned


def _why_not_batched(batch: int, kwargs: dict[str, Any]) -> str | None:
    """Why a batch of `batch` texts cannot run under a strategy, or None."""
    if cache_given_to(kwargs) is not None:
        return f"continue a batch of {batch} from a given cache: decode a batch from a fresh cache"
    if kwargs.get("prefix_allowed_tokens_fn") is not None:
        # it is told each text's row in the batch, which a strategy does not know while it verifies
        return f"constrain a batch of {batch} with prefix_allowed_tokens_fn"
    return None


def _generation_mode(config, kwargs: dict[str, Any]) -> GenerationMode:
    """The decoding mode transformers would pick for this call (our assistant model aside: a
    strategy drafts with it)."""
    call_config = copy.deepcopy(config)
    call_config.update(**{name: value for name, value in kwargs.items() if hasattr(call_config, name)})
    return call_config.get_generation_mode()


def _why_not_continued(past, inputs) -> str | None:
    """A given cache must hold KV for a part of the prompt only: the prompt's first tokens, as a
    chat's previous turn leaves it. (Given a cache that holds all of it, plain decoding feeds the
    whole prompt again after it.)"""
    prompt_length = inputs.shape[-1] if isinstance(inputs, torch.Tensor) else None
    cached = past.get_seq_length()
    if prompt_length is not None and cached >= prompt_length:
        return (
            f"continue from a {CACHE_ARGUMENT} holding {cached} tokens with a prompt of {prompt_length}: "
            "pass the whole text, of which the cache holds the first tokens"
        )
    return None


def _decline(strategy_name: str | None, reason: str) -> None:
    """A call that a strategy cannot run: an explicit strategy (named) fails; a tuned profile's
    (None) is logged, and the call decodes plainly."""
    if strategy_name is not None:
        raise ValueError(f"strategy={strategy_name!r} cannot {reason}")
    logger.info("Decoding plainly: the tuned profile's strategy cannot %s.", reason)


# Read from the mask transformers prepared where the call passed none: it then masks every token
# of the input that equals pad_token_id (where that is not an EOS id), wherever it stands.
INFERRED_MASK = (
    "decode with the attention_mask transformers inferred from pad_token_id in input_ids: {}; pass "
    "attention_mask (torch.ones_like(input_ids) to attend to every token)"
)


_PROMPT_TENSORS = ("input_ids", "inputs", "attention_mask")


def prompt_on_device(
    device: torch.device, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any], torch.device | None]:
    """The call with its prompt on the model's `device`, and the device it came from if another.

    Plain decoding takes a prompt on another device than the model's (a CPU prompt for a GPU
    model): it builds its logits processors and stopping criteria there and moves each forward's
    inputs. Our loop keeps the text on the model's device, so the prompt moves before transformers
    builds them, and the output moves back after.
    """
    prompt = _call_prompt(args, kwargs)
    if not isinstance(prompt, torch.Tensor) or prompt.device == device:
        return args, kwargs, None
    args = tuple(value.to(device) if isinstance(value, torch.Tensor) else value for value in args)
    kwargs = {
        name: value.to(device) if name in _PROMPT_TENSORS and isinstance(value, torch.Tensor) else value
        for name, value in kwargs.items()
    }
    return args, kwargs, prompt.device


def output_on_device(output, device: torch.device | None):
    """`generate`'s tokens, scores and logits on `device`, where plain decoding would leave them."""
    if device is None:
        return output
    if isinstance(output, torch.Tensor):
        return output.to(device)
    output.sequences = output.sequences.to(device)
    for name in ("scores", "logits"):
        if getattr(output, name, None) is not None:
            setattr(output, name, tuple(row.to(device) for row in getattr(output, name)))
    return output


class SelfSpecMixin(GenerationMixin):
    """Adds `strategy=` (and the strategy parameters) to `generate`.

    Without `strategy`, a model whose generation config carries a tuned profile for the device
    it runs on uses that profile; otherwise `generate` is plain transformers. `strategy="plain"`
    always decodes plainly.
    """

    def generate(self, *args, strategy: str | Strategy | None = None, **kwargs):
        return generate_with_strategy(self, super().generate, args, kwargs, strategy)


def generate_with_strategy(
    model: nn.Module,
    plain_generate: Callable,
    args: tuple,
    kwargs: dict[str, Any],
    strategy: str | Strategy | None = None,
    lent_profiles: tuple[Mapping[str, TunedProfile], str | None] | None = None,
):
    """`plain_generate(*args, **kwargs)` (transformers' `generate` bound to `model`), under a
    strategy where the call or a profile asks for one. `lent_profiles`: profiles to use where the
    model's generation config has none, and the directory their file names are relative to.

    `narrow_kernels` (a keyword of the call) chooses the kernel of the forward passes' few-row
    products: True, the fastest on this machine (`narrow_linear`), also for plain decoding and
    transformers' own prompt lookup; False, the stock kernel, also inside our verifications;
    None (the default), the fastest inside our loop and the stock one elsewhere.

    `online_corpus` (a keyword of the call, else the generation config's `online_corpus`) names
    the model's online corpus the call reads and adds its prompt and output to
    (`hf_selfspec.online_corpus`): True for the model's default one, a key for that key's, False
    or None (the default) for none. Off unless asked: a corpus shared by every call would
    propose one user's text inside another's request. A profile's `online_corpus_file` is what
    that corpus starts from."""
    narrow = _narrow_kernels(kwargs)
    if narrow is not None and kwargs.get("custom_generate") is None:
        with verifying(model) if narrow else stock_kernels():
            return generate_with_strategy(model, plain_generate, args, kwargs, strategy, lent_profiles)
    if kwargs.get("custom_generate") is not None:
        # Another decoding loop takes over (a packaged hf-selfspec one among them); it gets our
        # keywords as given.
        if strategy is not None:
            kwargs["strategy"] = strategy
        return plain_generate(*args, **kwargs)
    config_choice = getattr(_call_generation_config(model, args, kwargs), "online_corpus", None)
    online = corpus_for_call(model, kwargs.pop("online_corpus", config_choice))
    explicit = {name: kwargs.pop(name) for name in list(kwargs) if name in PARAM_NAMES}
    plan = _plan_strategy(model, strategy, explicit, args, kwargs, lent_profiles)
    if plan is None:
        return _fed(online, plain_generate(*args, **kwargs), model, args, kwargs)
    batch = _batch_size(_call_generation_config(model, args, kwargs), args, kwargs)
    if plan.params.max_batch_size and batch > plan.params.max_batch_size:
        # A batch too large to speculate on still takes its plain steps on the kernel our loop
        # would take them on: a batch's few rows a step are what that kernel is chosen for.
        logger.info("Decoding plainly on the loop's kernel: a batch of %d is more than max_batch_size %d.",
                    batch, plan.params.max_batch_size)
        with verifying(model):
            return _fed(online, plain_generate(*args, **kwargs), model, args, kwargs)
    if online is not None and plan.params.online_corpus_file:
        online.start_from(plan.params.online_corpus_file)
    plan = replace(plan, online_corpus=online)
    kwargs.pop("assistant_model", None)  # ours to draft with; transformers must not see it
    args, kwargs, caller_device = prompt_on_device(model.device, args, kwargs)
    kwargs = _stop_strings_as_criterion(model, args, kwargs)
    # transformers hands a `custom_generate` callable everything it would hand `_sample` but
    # the streamer, to which it has already given the prompt: the loop gets it here.
    loop = functools.partial(_speculative_sample, plan=plan, streamer=kwargs.get("streamer"))
    output = output_on_device(plain_generate(*args, custom_generate=loop, **kwargs), caller_device)
    return _fed(online, output, model, args, kwargs)


def _fed(corpus: OnlineCorpus | None, output, model: nn.Module, args: tuple, kwargs: dict[str, Any]):
    """`output`, once its texts are added to `corpus` (if any): only now are they final."""
    prompt = _call_prompt(args, kwargs)
    if corpus is not None and isinstance(prompt, torch.Tensor):
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        config = _call_generation_config(model, args, kwargs)
        pad = kwargs.get("pad_token_id", config.pad_token_id)
        if pad is None:  # transformers pads with the first EOS then
            eos = kwargs.get("eos_token_id", config.eos_token_id)
            pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        feed(corpus, sequences, prompt, kwargs.get("attention_mask"), None if pad is None else int(pad))
    return output


def _narrow_kernels(kwargs: dict[str, Any]) -> bool | None:
    """The call's `narrow_kernels`, taken out of its keywords (transformers would refuse it); a
    call that runs another decoding loop keeps it, for that loop to read."""
    if kwargs.get("custom_generate") is not None or "narrow_kernels" not in kwargs:
        return None
    narrow = kwargs.pop("narrow_kernels")
    if narrow is not None and not isinstance(narrow, bool):
        raise ValueError(f"narrow_kernels must be True, False or None, got {narrow!r}")
    return narrow


def _stop_strings_as_criterion(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call with its stop strings turned into a stopping criterion of its own.

    transformers does not hand a `custom_generate` callable's call the tokenizer it was given,
    and without one it refuses stop strings: the criterion it would build from them is built here.
    Without a tokenizer the call is left as it is, for transformers to say what is missing."""
    config = _call_generation_config(model, args, kwargs)
    stop_strings = kwargs["stop_strings"] if "stop_strings" in kwargs else getattr(config, "stop_strings", None)
    tokenizer = kwargs.get("tokenizer")
    if stop_strings is None or tokenizer is None:
        return kwargs
    criteria = [*(kwargs.get("stopping_criteria") or []), StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)]
    return {**kwargs, "stop_strings": None, "stopping_criteria": StoppingCriteriaList(criteria)}


def _plan_strategy(
    model: nn.Module,
    strategy: str | Strategy | None,
    explicit: dict[str, Any],
    args: tuple,
    kwargs: dict[str, Any],
    lent_profiles: tuple[Mapping[str, TunedProfile], str | None] | None,
) -> StrategyPlan | None:
    profile, profile_dir = None, None
    if strategy != PLAIN:
        profile = profile_for_model(model)
        if profile is None and lent_profiles is not None:
            profile, profile_dir = profile_for_model(model, lent_profiles[0]), lent_profiles[1]
    plain = strategy == PLAIN or (strategy is None and profile is None)
    # Under a tuned profile, a parameter alone overrides the profile's value of it.
    if explicit and plain:
        raise ValueError(
            f"{sorted(explicit)[0]} only applies under a strategy; pass strategy= one of "
            f"{', '.join(available_strategies())}"
        )
    if plain:
        return None
    config = _call_generation_config(model, args, kwargs)
    reason = _unsupported(config, args, kwargs)
    if reason is not None:
        _decline(None if strategy is None else getattr(strategy, "name", strategy), reason)
        return None
    resolved = resolve_strategy(strategy if strategy is not None else profile.strategy)
    config_values = {name: getattr(config, name) for name in PARAM_NAMES if getattr(config, name, None) is not None}
    params = resolve_params(
        len(decoder_layers(model)),
        explicit,
        anchor_profile_files(model, config_values),
        anchor_profile_files(model, profile.params, profile_dir) if profile is not None else {},
    )
    return StrategyPlan(resolved, params, kwargs.get("assistant_model"), from_profile=strategy is None)


def _speculative_sample(
    model: nn.Module,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    *,
    plan: StrategyPlan,
    streamer=None,
    **model_kwargs,
):
    """What `_sample` does, speculatively: transformers calls it as the call's `custom_generate`."""
    mask = model_kwargs.get("attention_mask")
    problem = None if mask is None else why_not_left_padded(mask, input_ids)
    if problem is not None:
        _decline(None if plan.from_profile else plan.strategy.name, INFERRED_MASK.format(problem))
        return type(model)._sample(
            model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer, **model_kwargs
        )
    # The cache plain decoding would fill: the caller's, or the one transformers made
    filled_cache = model_kwargs[CACHE_ARGUMENT]
    keep_scores = generation_config.return_dict_in_generate and (
        generation_config.output_scores or generation_config.output_logits
    )
    with rollback_view(filled_cache) as cache:
        parts = plan.strategy.build(
            model, plan.params, cache, plan.assistant_model, online_corpus=plan.online_corpus, rows=input_ids.shape[0]
        )
        request = DecodeRequest(
            input_ids,
            TokenSelector(logits_processor, generation_config.do_sample),
            stopping_criteria,
            max_length=generation_config.max_length,
            max_proposal_tokens=plan.params.max_proposal_tokens,
            streamer=streamer,
            keep_scores=keep_scores,
            attention_mask=mask,
            pad_token_id=_pad_token_id(generation_config),
        )
        result = speculative_decode(model, cache, parts, request, StrategyStats(strategy=plan.strategy.name))
    if not generation_config.return_dict_in_generate:
        return result.sequences
    return SelfSpecGenerateOutput(
        sequences=result.sequences,
        scores=result.scores if generation_config.output_scores else None,
        logits=result.logits if generation_config.output_logits else None,
        **{CACHE_ARGUMENT: filled_cache},
        strategy_stats=result.stats,
    )


def _pad_token_id(generation_config) -> int | None:
    """What a batch's rows are padded with after they stop, as transformers' `_sample` pads them."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is None:
        pad = generation_config.pad_token_id
    return None if pad is None else int(pad.flatten()[0]) if isinstance(pad, torch.Tensor) else int(pad)


_enabled_classes: dict[type, type] = {}


def enable(model: nn.Module) -> nn.Module:
    """Let an already loaded model accept `strategy=`: the same object, its class swapped for a
    cached subclass with `SelfSpecMixin` in front, so weights and hooks stay where they are.

    The first speculative call (or `narrow_kernels=True`) also gives the model's linear layers a
    forward that takes the verifier's kernel inside a verification and the stock one elsewhere;
    it stays for later calls, and `hf_selfspec.narrow_linear.uninstall(model)` takes it off."""
    if isinstance(model, SelfSpecMixin):
        return model
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"{type(model).__name__} cannot generate, so it cannot take a decoding strategy")
    model.__class__ = enabled_class(type(model))
    return model


def enabled_class(cls: type) -> type:
    """`cls` with `SelfSpecMixin` in front: one subclass per class, so enabled models of one
    class share a type. It keeps `cls`'s name: transformers recognises models by class name (a
    pipeline checks it against its task's models, `save_pretrained` records it as the
    architecture)."""
    if cls not in _enabled_classes:
        _enabled_classes[cls] = type(cls.__name__, (SelfSpecMixin, cls), {"__qualname__": cls.__qualname__})
    return _enabled_classes[cls]


def transformers_class(model: nn.Module) -> type:
    """The model's class without `SelfSpecMixin`, of this copy of the core or another (an installed
    hf_selfspec's, a packaged one's): recognised by name, as each copy defines its own."""
    return next(
        cls for cls in type(model).__mro__ if not any(base.__name__ == SelfSpecMixin.__name__ for base in cls.__mro__)
    )
