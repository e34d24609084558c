"""Sizing the tuner's stages from what one plain step of the model costs here, and from the time
left: how many requests the model writes for its corpus, how many steps an adapter trains, how
many rounds the cost model is timed in, how many tokens the tune prompts decode, how many
held-out prompts confirmation decodes; and whether a stage can pay back at all.

A model of 135M parameters and one of 3B differ twentyfold in their step, and every stage's work
is counted in steps: sized for the small one, the large one's stages overran a budget many times
over. Each plan here says, when the stage cannot run in the time it has, why not, in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .progress import minutes
from .training.model_text import GENERATION_BATCH

# Each stage's share of an `optimize` budget; the tuner takes whatever the others leave.
SHARES = {"measure": 0.05, "corpus": 0.15, "adapter": 0.25, "confirm": 0.15}

# Tokens per self-prompted request and answer, and per continued function. A request kept costs
# several sampled candidates (some run out of tokens unfinished, some are judged unusable).
REQUEST_TOKENS, ANSWER_TOKENS, CONTINUATION_TOKENS = 64, 128, 128
CANDIDATES_PER_REQUEST = 4
# A prompt the model writes after, about: a chat's template and request (a passage for some), or
# a function's signature and docstring.
_PROMPT_TOKENS = 160
CHUNK_TOKENS, BATCH_CHUNKS = 256, 4
MIN_ADAPTER_STEPS = 100
_MAX_ADAPTER_STEPS = 2000
_MAX_ADAPTER_TEXT_TOKENS = 100_000
# Tokens of a reference passage answered in a chat (`corpus.reference_answers`), about.
REFERENCE_ANSWER_TOKENS = 215
# The cost model's timing rounds, most to fewest: fewer rounds let a burst of load move a price
# more, so a study takes as many as its time pays for, down to the fewest a typical value needs.
CALIBRATION_ROUNDS = (7, 5, 3)
# New tokens per tune prompt, most to fewest: fewer judge each trial on less text.
TUNE_NEW_TOKENS = (64, 32)
# Trials below which a study cannot tell a good draft from its warm start.
MIN_TRIALS = 5
# The fewest tune prompts a study is judged on: tuned on one prompt's text, a draft fits that text.
MIN_STUDY_PROMPTS = 2
# The cost model's timed runs besides the verifications (`calibration`): three drafts of six
# tokens, a prefill, and two plain decodes of the sample's reference.
_CALIBRATION_DRAFT_STEPS = 18
_CALIBRATION_WIDTHS = 5  # verification knots timed in a round, each three times
_CALIBRATION_TIMINGS_PER_WIDTH = 3


@dataclass(frozen=True)
class StepCosts:
    """What the model's forward passes cost here, as the measure stage timed them. A decode pays
    its prompt's prefill once and a step per token: on a large model on a CPU the prefill of a
    workload prompt costs several steps, so a per-token price that included it overpriced every
    decode of tens of tokens."""

    step: float  # a plain decoding step
    widest: float  # the widest verification timed
    prefill: float = 0.0  # a workload prompt's prefill

    @classmethod
    def of(cls, seconds_per_token: float, verify_seconds: Mapping[int, float], prefill: float = 0.0) -> StepCosts:
        """The costs from the measure stage's timings (`verify_seconds` by width, its keys ints or,
        read back from JSON, strings). A step is at least the narrowest verification's forward
        pass: a timed step below it is a shared host's jitter, and a stage sized from it overruns."""
        narrowest = verify_seconds[min(verify_seconds, key=int)] if verify_seconds else 0.0
        step = max(seconds_per_token, narrowest)
        return cls(step, max([step, *verify_seconds.values()]), prefill)

    def decode(self, tokens: int) -> float:
        return self.prefill + tokens * self.step


def batch_step_seconds(rows: int, verify_seconds: Mapping[int, float]) -> float:
    """A decoding step of `rows` texts side by side, priced as a verification of as many tokens
    of one text: either reads the weights once for all of them. Past the widest width timed, in
    proportion to the rows."""
    timed = {int(width): seconds for width, seconds in verify_seconds.items()}
    widest = max(timed)
    if rows > widest:
        return timed[widest] * rows / widest
    return timed[min(width for width in timed if width >= rows)]


def writing_seconds(rows: int, new_tokens: int, verify_seconds: Mapping[int, float], prompt_token: float,
                    row_choice: float = 0.0) -> float:
    """What `rows` prompts cost to continue by `new_tokens` tokens each in the model's text batches
    (`GENERATION_BATCH` rows at most): each batch's prefill at `prompt_token` a prompt token, then
    its steps (`batch_step_seconds`), each choosing every row's token at `row_choice` (sampled
    text; greedy text's choice is an argmax, free beside the step)."""
    full, rest = divmod(rows, GENERATION_BATCH)
    batches = [GENERATION_BATCH] * full + ([rest] if rest else [])
    return sum(size * _PROMPT_TOKENS * prompt_token
               + new_tokens * (batch_step_seconds(size, verify_seconds) + size * row_choice)
               for size in batches)


def corpus_plan(seconds: float, verify_seconds: Mapping[int, float], prompt_token: float,
                chat: bool = True, sampled_row_choice: float = 0.0) -> dict[str, int] | str:
    """The [corpus] counts that make the model write for about `seconds`: half on standard-library
    functions it continues (code), half on conversations it prompts itself (the workload's kinds
    of text, the requests sampled at `sampled_row_choice` a row's token beside each step), each
    written in batches (`writing_seconds`), at most one batch of each: past it,
    more text costs in proportion, and the teacher's pass over the corpus grows with it. A model
    without a chat template cannot be prompted into a conversation, so that half goes to pieces of
    standard-library text it continues instead. Where `seconds` pay for less than one of either,
    why the corpus is skipped."""
    half = seconds / 2

    def continued(rows: int) -> float:
        return writing_seconds(rows, CONTINUATION_TOKENS, verify_seconds, prompt_token)

    def requested(requests: int) -> float:
        candidates = writing_seconds(CANDIDATES_PER_REQUEST * requests, REQUEST_TOKENS, verify_seconds, prompt_token,
                                     sampled_row_choice)
        return candidates + writing_seconds(requests, ANSWER_TOKENS, verify_seconds, prompt_token)

    conversations = requested if chat else continued
    most = GENERATION_BATCH // CANDIDATES_PER_REQUEST if chat else GENERATION_BATCH
    if max(conversations(1), continued(1)) > half:
        smallest = conversations(1) + continued(1)
        return (f"skipped: the smallest corpus ({'one request and its answer' if chat else 'one continuation'}, and "
                f"one function) takes {minutes(smallest)} here, {minutes(seconds)} are left; give a larger --budget")
    plan = {"stdlib_functions": _most_within(continued, half, GENERATION_BATCH), "generated_tokens": CONTINUATION_TOKENS}
    if chat:
        plan.update(self_prompted=_most_within(requested, half, most), max_request_tokens=REQUEST_TOKENS,
                    answer_tokens=ANSWER_TOKENS)
    else:
        plan["stdlib_prompts"] = _most_within(continued, half, most)
    return plan


def _most_within(cost, seconds: float, most: int) -> int:
    """The largest count from 1 to `most` whose `cost(count)` fits in `seconds` (1 if none)."""
    return max([1, *(count for count in range(1, most + 1) if cost(count) <= seconds)])


def adapter_text(seconds: float, batch_forward_seconds: float, chat: bool = True) -> dict[str, int]:
    """The [corpus] counts of the text the adapter reads (teacher-forced, beside what the model
    writes), as much as the teacher's pass covers in a third of the adapter stage's `seconds`:
    standard-library code, and for a chat model half of it in reference passages answered in a
    chat. A chat model's drafts are judged on prose answers, which code alone does not teach."""
    tokens = min(_MAX_ADAPTER_TEXT_TOKENS, int(seconds / 3 / batch_forward_seconds * CHUNK_TOKENS * BATCH_CHUNKS))
    if not chat:
        return {"stdlib_tokens": tokens}
    passages = tokens // 2 // REFERENCE_ANSWER_TOKENS
    return {"stdlib_tokens": tokens - passages * REFERENCE_ANSWER_TOKENS, "reference_passages": passages}


def adapter_plan(seconds: float, step_seconds: float) -> tuple[int, str]:
    """Training steps of the draft that fit in two thirds of `seconds` (the rest is the teacher's
    pass over the corpus) at `step_seconds` a step, or 0 and why not."""
    steps = min(_MAX_ADAPTER_STEPS, int(seconds * 2 / 3 / step_seconds))
    if steps < MIN_ADAPTER_STEPS:
        return 0, (
            f"skipped: {minutes(seconds)} pays for {steps} training steps ({step_seconds:.2f} s each), fewer "
            f"than the {MIN_ADAPTER_STEPS} a draft needs; give a larger --budget"
        )
    return steps, f"{steps} training steps ({step_seconds:.2f} s each)"


@dataclass(frozen=True)
class TunePlan:
    """A study's size: its prompts' new tokens and the cost model's rounds, and what its parts cost."""

    max_new_tokens: int
    calibration_rounds: int
    before_trials: float  # reference decodes, teacher forcing and the cost model's timing
    trial: float
    confirmation: float  # the best estimates decoded beside plain, after the trials

    @property
    def least(self) -> float:
        """The stage at its smallest: everything but the trials, and `MIN_TRIALS` of them."""
        return self.before_trials + MIN_TRIALS * self.trial + self.confirmation


def tune_costs(
    costs: StepCosts, prompts: int, max_new_tokens: int, rounds: int, confirm_top: int, confirm_rounds: int
) -> TunePlan:
    """What an estimated study of `prompts` prompts costs, part by part, in the model's steps:
    a plain reference decode of each, its teacher-forced pass, the cost model's timing (`rounds`
    rounds of verifications, drafts and two plain decodes) and the loop's calibration (a decode of
    each prompt); per trial a draft pass over each prompt's text; and the confirmation of the
    `confirm_top` best, each decoded beside plain `confirm_rounds` times."""
    decode = costs.decode(max_new_tokens)
    text_pass = costs.widest * max(1, max_new_tokens // 32)
    verifications = _CALIBRATION_WIDTHS * _CALIBRATION_TIMINGS_PER_WIDTH * costs.widest
    calibration = rounds * (verifications + _CALIBRATION_DRAFT_STEPS * costs.step + 2 * decode + text_pass)
    return TunePlan(
        max_new_tokens=max_new_tokens,
        calibration_rounds=rounds,
        before_trials=prompts * (2 * decode + text_pass) + calibration,
        trial=prompts * text_pass,
        confirmation=(confirm_top + 1) * confirm_rounds * prompts * decode,
    )


def plan_tune(
    seconds: float, costs: StepCosts, prompts: int, confirm_top: int, confirm_rounds: int = 1,
    new_tokens: tuple[int, ...] = TUNE_NEW_TOKENS, calibration_rounds: tuple[int, ...] = CALIBRATION_ROUNDS,
) -> TunePlan | str:
    """The largest study (most new tokens, then most timing rounds) whose least (`TunePlan.least`)
    fits in `seconds`; or, where the smallest does not, why the stage is skipped."""
    plans = [
        tune_costs(costs, prompts, tokens, rounds, confirm_top, confirm_rounds)
        for tokens in new_tokens for rounds in calibration_rounds
    ]
    fitting = next((plan for plan in plans if plan.least <= seconds), None)
    if fitting is not None:
        return fitting
    return (f"skipped: {minutes(seconds)} left, and a study of {prompts} prompt(s) needs at least "
            f"{minutes(plans[-1].least)} here ({costs.step:.2f} s a token); give a larger --budget")


def plan_study(seconds: float, costs: StepCosts, prompts: int, confirm_top: int) -> tuple[int, TunePlan] | str:
    """The most of the `prompts` tune prompts whose study (`plan_tune`) fits in `seconds`: all of
    them, else the first half, a quarter... down to `MIN_STUDY_PROMPTS`; the count and its plan. A
    study of fewer prompts judges its trials on fewer kinds of text, but on a model too slow for
    one prompt of every kind it is that or no profile. Where not even the fewest fit, why not."""
    count = prompts
    while isinstance(plan := plan_tune(seconds, costs, count, confirm_top), str) and count > MIN_STUDY_PROMPTS:
        count = max(MIN_STUDY_PROMPTS, count // 2)
    return plan if isinstance(plan, str) else (count, plan)


def confirm_prompts(seconds: float, costs: StepCosts, once_decodes: int, per_prompt_decodes: int,
                    max_new_tokens: int, categories: int, most_per_category: int) -> tuple[int, str]:
    """Held-out prompts a confirmation fits in `seconds`, decoding `once_decodes` times before the
    first (the warm-ups) and `per_prompt_decodes` times each (as many per category as pay, up to
    `most_per_category`; where not one per category pays, the first categories' one each), or 0
    and why it is skipped."""
    decode = costs.decode(max_new_tokens)
    once, per_prompt = once_decodes * decode, per_prompt_decodes * decode
    affordable = int(max(seconds - once, 0.0) / per_prompt)
    if not affordable:
        return 0, (f"skipped: one held-out prompt costs {minutes(once + per_prompt)} here, {minutes(seconds)} are "
                   "left; the profile is the best trial measured on the tune prompts")
    count = min(affordable, categories * most_per_category)
    return count, f"{count} held-out prompt(s), about {minutes(once + count * per_prompt)}"
