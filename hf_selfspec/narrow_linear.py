"""Linear layers inside a verification, on whichever kernel this machine multiplies faster.

A verification runs the full model over a handful of tokens, and a plain step inside the loop
over one. On a CPU the stock kernel is not always the fastest way to take those products:

- the matrix library may treat a few rows as a general matrix product whose cost is far from
  the one-row product a plain step takes, two rows costing twice one; computed the other way
  round, the weight times the transposed rows (`transposed`), the product can take a kernel
  that reads the weight once for every row;
- for bfloat16 and a few rows, the stock kernel hands the weight to oneDNN in the layout it is
  stored in, which oneDNN rearranges into its own blocked layout on every call; a copy kept in
  that layout (`packed`, what torch's own compiler uses for CPU inference) reads the weight
  once and skips the rearranging.

Which kernel wins depends on the library, the processor, the dtype, the weight's shape, the
number of rows and of threads, so it is timed on this machine, once per shape, band of rows and
thread count, the first time a verification meets them (or all at once, `choose_layouts`).

Only what runs inside `verifying` changes, and only on the CPU, without autograd, for the plain
`torch.nn.Linear` layers of the model: a prefill outside the loop, training and every other
caller keep the stock kernel, and plain decoding does too unless its caller asks
(`generate(..., narrow_kernels=True)`) or a profile declines a batch larger than its
`max_batch_size`, whose plain steps are the few-row products this kernel is chosen for. Inside
`stock_kernels` even a verification keeps the stock kernel, so that a draft's share of a
speed-up can be told from the kernel's. The kernels sum in different orders, as the stock
kernel already does at a different number of rows, so the verifier's logits may differ from
plain decoding's in their last bits, never in more.

A packed copy costs the memory of its weight. A model's layers are packed only where their
copies fit in half the memory the system reports available when the model is first verified;
elsewhere the choice is between the other two, which copy no weight, and the first model that
finds no room says so once (a warning from this module's logger): a large model's verifications
are then slower than where it fits, and the reason is memory, not the machine's kernels.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn
from torch.nn import functional as F

from .measure import timed

logger = logging.getLogger(__name__)

STOCK, TRANSPOSED, PACKED = "stock", "transposed", "packed"
# Row counts are timed at the top of their band (1, 2, 3-4, 5-6, ...): a verification's width
# varies from step to step, and timing every width of a large model would cost seconds.
ROW_BANDS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_TIMING_ROUNDS = 5
# One product of a small layer's few rows takes a fraction of a millisecond, where a single
# timing is mostly the clock's and the scheduler's noise: each timed sample repeats the product
# until it lasts about this long, or a noisy choice would differ from one process to the next.
_SAMPLE_SECONDS = 2e-3
# The share of the available memory a model's packed copies may take.
_PACKED_MEMORY_SHARE = 0.5

# Inside `verifying`: the kernel chosen so far in this block, by (dtype, out features, in
# features, rows, whether the layer may be packed); None outside
_VERIFYING: ContextVar[dict[tuple[torch.dtype, int, int, int, bool], str] | None] = ContextVar(
    "hf_selfspec_verifying", default=None
)
# (threads, dtype, out features, in features, band, packing allowed) -> the fastest kernel; the
# kernels split the work between threads differently, so the winner may change with their number
_FASTEST: dict[tuple[int, torch.dtype, int, int, int, bool], str] = {}
# layer -> (the weight it packed, that weight's version, its packed copy). Kept beside the layers,
# not in them: an opaque packed tensor cannot be deep-copied, and a copy of a layer (a draft
# adapter copies one of the model's blocks) makes its own when verified.
_PACKED: weakref.WeakKeyDictionary[nn.Linear, tuple[weakref.ref, int, torch.Tensor | None]] = (
    weakref.WeakKeyDictionary()
)
# Inside `stock_kernels`: `verifying` leaves every product on the stock kernel
_STOCK_ONLY: ContextVar[bool] = ContextVar("hf_selfspec_stock_only", default=False)
_TIMING_LOCK = threading.Lock()
_INSTALL_LOCK = threading.Lock()
# Whether a model's packed copies were found not to fit, and said so, in this process.
_SAID_NO_ROOM: list[bool] = []


def _band(rows: int) -> int | None:
    return next((band for band in ROW_BANDS if rows <= band), None)


def _transposed(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, rows.t()).t().contiguous()


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` copied into oneDNN's layout for a linear layer, or None where this build of torch
    or this dtype has none."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (AttributeError, NotImplementedError, RuntimeError):
        return None


def _packed(packed: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def _runs(product: Callable[[], torch.Tensor]) -> bool:
    """Whether `product` runs: a dtype may pack where oneDNN has no kernel to multiply it."""
    try:
        product()
    except (NotImplementedError, RuntimeError):
        return False
    return True


def _repeated(product: Callable[[], torch.Tensor], seconds: float) -> Callable[[], None]:
    """`product`, called often enough in a row to last about `_SAMPLE_SECONDS` if one call takes
    `seconds`."""
    calls = max(1, math.ceil(_SAMPLE_SECONDS / seconds)) if seconds > 0 else 1

    def run() -> None:
        for _ in range(calls):
            product()

    return run


def fastest_layout(weight: torch.Tensor, band: int, packable: bool = False) -> str:
    """`STOCK`, `TRANSPOSED` or `PACKED` (only where `packable`): whichever multiplies `band`
    rows through `weight` fastest, timed once per shape, band and number of threads on random
    rows (the kernels' speed depends on shapes, not values)."""
    key = (torch.get_num_threads(), weight.dtype, weight.shape[0], weight.shape[1], band, packable)
    known = _FASTEST.get(key)
    if known is not None:
        return known
    with _TIMING_LOCK:
        if key not in _FASTEST:
            rows = torch.randn(band, weight.shape[1], dtype=weight.dtype)
            products = {STOCK: lambda: F.linear(rows, weight), TRANSPOSED: lambda: _transposed(weight, rows)}
            packed = pack(weight) if packable else None
            if packed is not None and _runs(lambda: _packed(packed, rows, None)):
                products[PACKED] = lambda: _packed(packed, rows, None)
            for product in products.values():  # untimed: first calls pay for allocation and dispatch
                product()
            once = min(timed(product, weight.device)[1] for product in products.values())  # sizes the samples
            samples = {name: _repeated(product, once) for name, product in products.items()}
            # alternated, so that a burst of load hits all alike
            rounds = [
                {name: timed(run, weight.device)[1] for name, run in samples.items()} for _ in range(_TIMING_ROUNDS)
            ]
            _FASTEST[key] = min(samples, key=lambda name: statistics.median(seconds[name] for seconds in rounds))
        return _FASTEST[key]


def _packed_weight(layer: nn.Linear) -> torch.Tensor | None:
    """`layer`'s packed copy, made again whenever its weight changed since (another tensor, or
    this one written in place); None where it cannot be packed."""
    weight = layer.weight
    kept = _PACKED.get(layer)
    if kept is None or kept[0]() is not weight or kept[1] != weight._version:
        kept = _PACKED[layer] = (weakref.ref(weight), weight._version, pack(weight))
    return kept[2]


def _forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    # This runs for every layer of every verification's forward pass, so it asks as little as it
    # can: the choice for a shape and number of rows is looked up once per `verifying` block. The
    # input's dtype stands for the weight's: they match outside autocast, and a choice shared
    # under it can cost speed, never a different product.
    choices = _VERIFYING.get()
    if choices is not None and input.is_cpu and not torch.is_grad_enabled():
        rows = input.numel() // self.in_features
        weight = self.weight
        packable = self._hf_selfspec_packable and input.dtype == weight.dtype
        key = (input.dtype, self.out_features, self.in_features, rows, packable)
        layout = choices.get(key)
        if layout is None:
            band = _band(rows)
            layout = choices[key] = STOCK if band is None else fastest_layout(weight, band, packable)
        if layout != STOCK:
            flat = input.reshape(rows, self.in_features)
            packed = _packed_weight(self) if layout == PACKED else None
            if packed is not None:
                output = _packed(packed, flat, self.bias)
            else:
                output = _transposed(weight, flat)
                if self.bias is not None:
                    output += self.bias
            return output.reshape(*input.shape[:-1], self.out_features)
    return nn.Linear.forward(self, input)


def available_memory() -> int | None:
    """Bytes of memory the system says it could give now, or None where it does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def install(model: nn.Module) -> None:
    """Give `model`'s plain `nn.Linear` layers the choice of kernel inside `verifying`. Layers of
    a subclass (quantised ones) and layers whose forward another library already wraps
    (accelerate's offloading hooks) are left as they are.

    The forward stays on the layers after the call that installed it, so that later calls do not
    pay for installing it again; outside `verifying` it is the stock forward. `uninstall` takes
    it off."""
    if getattr(model, "_hf_selfspec_narrow_linear", False):
        return
    with _INSTALL_LOCK:
        if getattr(model, "_hf_selfspec_narrow_linear", False):  # another thread got here first
            return
        layers = [
            module for module in model.modules() if type(module) is nn.Linear and "forward" not in module.__dict__
        ]
        copies = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
        available = available_memory()
        packable = available is not None and copies <= _PACKED_MEMORY_SHARE * available
        if available is not None and not packable and not _SAID_NO_ROOM:
            _SAID_NO_ROOM.append(True)
            logger.warning(
                "the packed copies of this model's linear layers (%.1f GiB) would not fit in half of the %.1f GiB "
                "of memory free: verifications keep its weights as they are, on the stock or transposed product",
                copies / 2**30, available / 2**30,
            )
        for layer in layers:
            layer._hf_selfspec_packable = packable
            layer.forward = types.MethodType(_forward, layer)
        model._hf_selfspec_narrow_linear = True


def _installed_layers(model: nn.Module) -> Iterator[nn.Linear]:
    for module in model.modules():
        if module.__dict__.get("forward") is not None and getattr(module.forward, "__func__", None) is _forward:
            yield module


def uninstall(model: nn.Module) -> None:
    """Give `model`'s layers back their stock forward and drop their packed copies: the model is
    then as it was before its first verification (a later one installs the choice again)."""
    with _INSTALL_LOCK:
        for layer in list(_installed_layers(model)):
            del layer.forward
            del layer._hf_selfspec_packable
            _PACKED.pop(layer, None)
        model.__dict__.pop("_hf_selfspec_narrow_linear", None)


def choose_layouts(model: nn.Module) -> None:
    """Time now, for every row band, the kernel of each weight shape among `model`'s layers that
    a verification would time the first time it met them, and pack the layers that chose a
    packed copy.

    Timing a band of a large LM head takes several of its products, many times a decoding step,
    and packing it a copy of the whole weight, so a verification that meets a band first pays
    for them inside the decode it belongs to. Code that times decodes (a benchmark, the tuner)
    calls this first, as a server may at start, so that no timed decode carries them; a process
    that never calls it times each band when it first needs it. Timed without autograd, as a
    verification runs: with it, the products would record a graph and the timings would choose
    for another computation."""
    install(model)
    with torch.no_grad():
        for module in _installed_layers(model):
            if module.weight.device.type == "cpu":
                chosen = [fastest_layout(module.weight, band, module._hf_selfspec_packable) for band in ROW_BANDS]
                if PACKED in chosen:
                    _packed_weight(module)


@contextmanager
def verifying(model: nn.Module) -> Iterator[None]:
    """Run `model`'s forward passes in this block on the faster kernel for their rows (on the
    stock one inside `stock_kernels`)."""
    if _STOCK_ONLY.get():
        yield
        return
    if isinstance(model, nn.Module):
        install(model)
    token = _VERIFYING.set({})
    try:
        yield
    finally:
        _VERIFYING.reset(token)


@contextmanager
def stock_kernels() -> Iterator[None]:
    """Keep every product in this block on the stock kernel, verifications included."""
    token = _STOCK_ONLY.set(True)
    try:
        yield
    finally:
        _STOCK_ONLY.reset(token)
