"""Linear layers over a few rows, on whichever matrix layout this machine multiplies faster.

A verification runs the full model over a handful of tokens. On a CPU, the matrix library may
treat those few rows as a general matrix product whose cost is far from the one-row product a
plain decoding step takes: two rows can cost twice one, and the LM head, the largest weight,
pays most. Computed the other way round, the weight times the transposed rows, the same product
can take a kernel that reads the weight once for every row. Which layout wins depends on the
library, the processor, the dtype, the weight's shape, the number of rows and of threads, so it
is timed on this machine, once per shape, band of rows and thread count, the first time a
verification meets them.

Only what runs inside `verifying` changes, and only on the CPU, without autograd, for the plain
`torch.nn.Linear` layers of the model: plain decoding, a prefill outside the loop, training and
every other caller keep the stock kernel. The two layouts sum in different orders, as the stock
kernel already does at a different number of rows, so the verifier's logits may differ from plain
decoding's in their last bits, never in more.
"""

from __future__ import annotations

import math
import statistics
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn
from torch.nn import functional as F

from .measure import timed

# Row counts are timed at the top of their band (2, 3-4, 5-6, ...): a verification's width varies
# from step to step, and timing every width of a large model would cost seconds.
ROW_BANDS = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_TIMING_ROUNDS = 5
# One product of a small layer's few rows takes a fraction of a millisecond, where a single
# timing is mostly the clock's and the scheduler's noise: each timed sample repeats the product
# until it lasts about this long, or a noisy choice would differ from one process to the next.
_SAMPLE_SECONDS = 2e-3

# Inside `verifying`: the layout chosen so far in this block, by (dtype, out features, in features,
# rows); None outside
_VERIFYING: ContextVar[dict[tuple[torch.dtype, int, int, int], bool] | None] = ContextVar(
    "hf_selfspec_verifying", default=None
)
# (threads, dtype, out features, in features, band) -> whether the transposed layout is faster;
# the kernels split the work between threads differently, so the winner may change with their number
_TRANSPOSED_FASTER: dict[tuple[int, torch.dtype, int, int, int], bool] = {}
_TIMING_LOCK = threading.Lock()
_INSTALL_LOCK = threading.Lock()


def _band(rows: int) -> int | None:
    return next((band for band in ROW_BANDS if rows <= band), None)


def _transposed(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, rows.t()).t().contiguous()


def _repeated(product: Callable[[], torch.Tensor], seconds: float) -> Callable[[], None]:
    """`product`, called often enough in a row to last about `_SAMPLE_SECONDS` if one call takes
    `seconds`."""
    calls = max(1, math.ceil(_SAMPLE_SECONDS / seconds)) if seconds > 0 else 1

    def run() -> None:
        for _ in range(calls):
            product()

    return run


def transposed_is_faster(weight: torch.Tensor, band: int) -> bool:
    """Whether `band` rows through `weight` multiply faster transposed, timed once per shape, band
    and number of threads on random rows (the kernel's speed depends on shapes, not values)."""
    key = (torch.get_num_threads(), weight.dtype, weight.shape[0], weight.shape[1], band)
    known = _TRANSPOSED_FASTER.get(key)
    if known is not None:
        return known
    with _TIMING_LOCK:
        if key not in _TRANSPOSED_FASTER:
            rows = torch.randn(band, weight.shape[1], dtype=weight.dtype)
            stock, transposed = (lambda: F.linear(rows, weight)), (lambda: _transposed(weight, rows))
            stock(), transposed()  # untimed: first calls pay for allocation and dispatch
            once = min(timed(stock, weight.device)[1], timed(transposed, weight.device)[1])  # sizes the samples
            stock, transposed = _repeated(stock, once), _repeated(transposed, once)
            # alternated, so that a burst of load hits both alike
            rounds = [
                (timed(stock, weight.device)[1], timed(transposed, weight.device)[1]) for _ in range(_TIMING_ROUNDS)
            ]
            stock_seconds, transposed_seconds = (statistics.median(column) for column in zip(*rounds))
            _TRANSPOSED_FASTER[key] = transposed_seconds < stock_seconds
        return _TRANSPOSED_FASTER[key]


def _forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    # This runs for every layer of every verification's forward pass, so it asks as little as it
    # can: the choice for a shape and number of rows is looked up once per `verifying` block. The
    # input's dtype stands for the weight's: they match outside autocast, and a choice shared
    # under it can cost speed, never a different product.
    choices = _VERIFYING.get()
    if choices is not None and input.is_cpu and not torch.is_grad_enabled():
        rows = input.numel() // self.in_features
        key = (input.dtype, self.out_features, self.in_features, rows)
        transposed = choices.get(key)
        if transposed is None:
            band = _band(rows) if rows > 1 else None
            transposed = choices[key] = band is not None and transposed_is_faster(self.weight, band)
        if transposed:
            output = _transposed(self.weight, input.reshape(rows, self.in_features))
            if self.bias is not None:
                output += self.bias
            return output.reshape(*input.shape[:-1], self.out_features)
    return nn.Linear.forward(self, input)


def install(model: nn.Module) -> None:
    """Give `model`'s plain `nn.Linear` layers the choice of layout inside `verifying`. Layers of
    a subclass (quantised ones) and layers whose forward another library already wraps
    (accelerate's offloading hooks) are left as they are."""
    if getattr(model, "_hf_selfspec_narrow_linear", False):
        return
    with _INSTALL_LOCK:
        if getattr(model, "_hf_selfspec_narrow_linear", False):  # another thread got here first
            return
        for module in model.modules():
            if type(module) is nn.Linear and "forward" not in module.__dict__:
                module.forward = types.MethodType(_forward, module)
        model._hf_selfspec_narrow_linear = True


def choose_layouts(model: nn.Module) -> None:
    """Time now, for every row band, the layout of each weight shape among `model`'s layers that
    a verification would time the first time it met them.

    Timing a band of a large LM head takes several of its products, many times a decoding step,
    so a verification that meets a band first pays for the timing inside the decode it belongs
    to. Code that times decodes (a benchmark, the tuner) calls this first, as a server may at
    start, so that no timed decode carries it; a process that never calls it times each band
    when it first needs it, as before. Timed without autograd, as a verification runs: with it,
    the products would record a graph and the timings would choose for another computation."""
    install(model)
    with torch.no_grad():
        for module in model.modules():
            if module.__dict__.get("forward") is not None and getattr(module.forward, "__func__", None) is _forward:
                if module.weight.device.type == "cpu":
                    for band in ROW_BANDS:
                        transposed_is_faster(module.weight, band)


@contextmanager
def verifying(model: nn.Module) -> Iterator[None]:
    """Run `model`'s forward passes in this block on the faster layout for their rows."""
    if isinstance(model, nn.Module):
        install(model)
    token = _VERIFYING.set({})
    try:
        yield
    finally:
        _VERIFYING.reset(token)
