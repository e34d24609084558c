"""The cost model's prices: seconds per forward pass of the draft and of the verifier at every
width, and how they are kept with a study."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import optuna

from hf_selfspec.tuner_api import HeadsShape, SelfSpecParams, read_adapter_shape


def verification_knots(max_tokens: int) -> tuple[int, ...]:
    """The widths the verifier is timed at: one token, two and three times every power of two,
    and `max_tokens`. Dense where a CPU's cost bends (one token takes the matrix-vector path),
    sparse where it runs nearly on a line; timing every width instead spreads the same rounds so
    thin that on a busy machine each width's typical time is mostly noise."""
    doubled = {base << shift for base in (2, 3) for shift in range(max_tokens.bit_length())}
    return tuple(sorted({1, max_tokens} | {width for width in doubled if width <= max_tokens}))


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in least squares: every run of values that
    falls is pooled into its mean (pool adjacent violators)."""
    blocks: list[tuple[float, int]] = []  # (sum, count) of each pooled run
    for value in values:
        total, count = value, 1
        while blocks and blocks[-1][0] / blocks[-1][1] > total / count:
            previous_total, previous_count = blocks.pop()
            total, count = total + previous_total, count + previous_count
        blocks.append((total, count))
    return [total / count for total, count in blocks for _ in range(count)]


def verification_prices(typical: Mapping[int, float], max_tokens: int) -> tuple[float, ...]:
    """Index k: the price of verifying k tokens (0 for none). The timed widths' typical seconds
    are made non-decreasing, since checking more tokens never costs less, and a noisy one that
    undercuts a narrower one would otherwise price a longer proposal as cheaper; widths between
    two timed ones are priced on the line between them."""
    knots = sorted(typical)
    fitted = nondecreasing([typical[width] for width in knots])
    prices = [0.0]
    for width in range(1, max_tokens + 1):
        right = bisect.bisect_left(knots, width)
        if knots[right] == width:
            prices.append(fitted[right])
            continue
        share = (width - knots[right - 1]) / (knots[right] - knots[right - 1])
        prices.append(fitted[right - 1] + share * (fitted[right] - fitted[right - 1]))
    return tuple(prices)


@dataclass(frozen=True)
class CostModel:
    """Seconds per forward pass, timed on this machine.

    Every decoder layer has the same shapes, so a draft step costs a constant plus a fixed amount
    per attention and per MLP sub-layer that runs, plus its LM head (a line in the rows kept
    when the head is restricted). The verifier has a price for every width it may check
    (`verification_prices`), because on a CPU it is far from linear: one token takes the
    matrix-vector path, and two may already cost nearly twice as much. Overheads are what a
    step spends beyond its forward passes: in plain `generate`, and in our decoding loop.
    """

    num_layers: int
    verify_seconds: tuple[float, ...]  # index k: one forward pass over k tokens
    plain_step_overhead: float
    draft_constant: float
    attention_seconds: float
    mlp_seconds: float
    restricted_head_constant: float  # relative to the full head
    restricted_head_per_row: float
    loop_step_overhead: float = 0.0
    # Plain decoding's forward pass over one token, on the stock kernels; the loop's own one-token
    # pass is `verify(1)`, on whichever kernel is faster here (`narrow_linear`). 0: the same.
    plain_forward_seconds: float = 0.0
    # A trained adapter's draft token with the full head, timed: its block, mask and rotary set-up
    # are not a decoder layer's, and the shallow layers are few enough for overheads to weigh.
    adapter_draft_seconds: dict[str, float] = field(default_factory=dict)

    def draft_token_seconds(self, params: SelfSpecParams) -> float:
        """An adapter calibration did not time (a cost model in units of a step, written by hand)
        is priced as the layers below its exit, run whole, and one more layer of the same shapes
        for its block (with or without its MLP); draft heads, which run no layer, as what a
        draft costs besides its layers."""
        if params.draft_adapter in self.adapter_draft_seconds:
            seconds = self.adapter_draft_seconds[params.draft_adapter]
        else:
            if params.draft_adapter:
                shape = read_adapter_shape(params.draft_adapter)
                if isinstance(shape, HeadsShape):
                    attention_run = mlp_run = 0
                else:
                    attention_run, mlp_run = shape.exit_layer + 1, shape.exit_layer + int(shape.mlp)
            else:
                attention_run = self.num_layers - len(params.attn_skip_layers)
                mlp_run = self.num_layers - len(params.mlp_skip_layers)
            seconds = self.draft_constant + attention_run * self.attention_seconds + mlp_run * self.mlp_seconds
        if params.draft_vocab_size:
            seconds += self.restricted_head_constant + params.draft_vocab_size * self.restricted_head_per_row
        return max(seconds, 0.0)

    def verify(self, tokens: int) -> float:
        return self.verify_seconds[min(tokens, len(self.verify_seconds) - 1)]

    def plain_forward(self) -> float:
        return self.plain_forward_seconds or self.verify(1)


def record_cost_model(study: optuna.Study, cost: CostModel) -> None:
    """Keep the prices the study's estimates are made at with the study, so that an estimate
    far from its confirmation can be traced to the price that misled it."""
    study.set_user_attr("cost_model", dataclasses.asdict(cost))
