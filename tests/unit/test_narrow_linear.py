"""The verifier's choice of kernel for its rows (`hf_selfspec.narrow_linear`): the same product,
taken only inside a verification, and decoding stays lossless on every kernel."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hf_selfspec import narrow_linear
from hf_selfspec.narrow_linear import PACKED, ROW_BANDS, STOCK, TRANSPOSED, install, verifying
from helpers.greedy import assert_same_greedy, random_prompts
from helpers.tiny_models import ARCHITECTURES, tiny_model

CAN_PACK = narrow_linear.pack(torch.randn(4, 4)) is not None
needs_packing = pytest.mark.skipif(not CAN_PACK, reason="this build of torch has no oneDNN packing")


def count_calls(monkeypatch, layout: str) -> list[torch.Size]:
    """With `layout` timed the fastest for every shape: the rows of every product taken on a
    kernel other than the stock one, as they are taken."""
    calls = []
    monkeypatch.setattr(narrow_linear, "fastest_layout", lambda weight, band, packable=False: layout)
    for name in ("_transposed", "_packed"):
        original = getattr(narrow_linear, name)

        def counted(weight, rows, *rest, original=original):
            calls.append(rows.shape)
            return original(weight, rows, *rest)

        monkeypatch.setattr(narrow_linear, name, counted)
    return calls


@pytest.fixture
def transposed_calls(monkeypatch):
    return count_calls(monkeypatch, TRANSPOSED)


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(16, 24), nn.Linear(24, 8, bias=False)

    def forward(self, x):
        return self.second(self.first(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [TRANSPOSED, pytest.param(PACKED, marks=needs_packing)])
@pytest.mark.parametrize("rows", [1, 2, 5, ROW_BANDS[-1]])
@torch.no_grad()
def test_each_kernel_gives_the_stock_product(monkeypatch, rows, layout, dtype):
    calls = count_calls(monkeypatch, layout)
    model = TwoLinears().to(dtype)
    x = torch.randn(1, rows, 16, dtype=dtype)
    stock = model(x)
    with verifying(model):
        chosen = model(x)
    assert len(calls) == 2
    assert chosen.shape == stock.shape and chosen.dtype == dtype and chosen.is_contiguous()
    # The kernels sum in other orders, and the transposed one adds the bias after rounding: last
    # bits apart, which a bfloat16 output near zero shows as a large relative difference.
    tolerance = {"atol": 1e-2, "rtol": 1.6e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(chosen, stock, **tolerance)


@torch.no_grad()
def test_only_a_verification_of_at_most_the_widest_band_without_autograd_takes_it(transposed_calls):
    model = TwoLinears()
    model(torch.randn(1, 4, 16))  # outside a verification
    with verifying(model):
        model(torch.randn(1, ROW_BANDS[-1] + 1, 16))  # a long prefill
        with torch.enable_grad():
            model(torch.randn(1, 4, 16))  # training keeps the stock kernel and its backward
    assert transposed_calls == []
    with verifying(model):
        model(torch.randn(1, 1, 16))  # one row: a plain step inside the loop
    assert len(transposed_calls) == 2


@needs_packing
@torch.no_grad()
def test_a_packed_copy_is_made_again_when_its_weight_changes(monkeypatch):
    """An optimiser's step writes a weight in place, and `to()` or a load may swap it for
    another tensor: the packed copy follows either, so a verification never multiplies by a
    weight the layer no longer has."""
    count_calls(monkeypatch, PACKED)
    model = TwoLinears()
    x = torch.randn(1, 3, 16)
    with verifying(model):
        model(x)
        model.first.weight.mul_(2)  # in place
        model.second.weight = nn.Parameter(torch.randn(8, 24))  # another tensor
        chosen = model(x)
    torch.testing.assert_close(chosen, model(x))


@needs_packing
def test_a_verified_model_can_still_be_copied(monkeypatch):
    """A draft adapter deep-copies one of the model's blocks, after verifications may have
    packed its layers: the copy works and makes its own packed copies."""
    count_calls(monkeypatch, PACKED)
    model = TwoLinears()
    x = torch.randn(1, 3, 16)
    with torch.no_grad(), verifying(model):
        model(x)
    twin = copy.deepcopy(model)
    with torch.no_grad(), verifying(twin):
        torch.testing.assert_close(twin(x), model(x))
    assert twin.first in narrow_linear._PACKED


def test_layers_whose_copies_would_not_fit_are_never_packed(monkeypatch):
    asked = []
    monkeypatch.setattr(
        narrow_linear, "fastest_layout", lambda weight, band, packable=False: asked.append(packable) or STOCK
    )
    model = TwoLinears()
    weights = sum(layer.weight.numel() * layer.weight.element_size() for layer in (model.first, model.second))
    monkeypatch.setattr(narrow_linear, "available_memory", lambda: weights)  # half of it would not do
    with torch.no_grad(), verifying(model):
        model(torch.randn(1, 3, 16))
    assert asked == [False, False]
    roomy = TwoLinears()
    monkeypatch.setattr(narrow_linear, "available_memory", lambda: 2 * weights)
    with torch.no_grad(), verifying(roomy):
        roomy(torch.randn(1, 3, 16))
    assert asked[2:] == [True, True]


def test_a_model_whose_copies_would_not_fit_says_so_once_and_copies_nothing(monkeypatch, caplog):
    """Where free memory holds no packed copy of a model's weights, the first verification says
    so (once in the process, however many models follow) and no layer is packed."""
    monkeypatch.setattr(narrow_linear, "_SAID_NO_ROOM", [])
    monkeypatch.setattr(narrow_linear, "fastest_layout", lambda weight, band, packable=False: PACKED if packable else STOCK)
    models = [TwoLinears(), TwoLinears()]
    weights = sum(layer.weight.numel() * layer.weight.element_size() for layer in (models[0].first, models[0].second))
    monkeypatch.setattr(narrow_linear, "available_memory", lambda: weights)  # half of it would not do
    with caplog.at_level("WARNING", logger=narrow_linear.__name__):
        for model in models:
            with torch.no_grad(), verifying(model):
                model(torch.randn(1, 3, 16))
    said = [record.getMessage() for record in caplog.records if "would not fit" in record.getMessage()]
    assert len(said) == 1 and "packed copies" in said[0]
    assert not any(layer in narrow_linear._PACKED for model in models for layer in (model.first, model.second))


def test_a_dtype_oneDNN_cannot_pack_is_timed_on_the_other_kernels(monkeypatch):
    monkeypatch.setattr(narrow_linear, "_FASTEST", {})
    weight = torch.randn(24, 16, dtype=torch.float64)
    assert narrow_linear.pack(weight) is None
    assert narrow_linear.fastest_layout(weight, 4, packable=True) in (STOCK, TRANSPOSED)


@torch.no_grad()
def test_a_verification_asks_once_per_shape_and_rows_and_the_next_one_asks_again(monkeypatch):
    """Every layer of every verification consults the choice, so within one `verifying` block it
    is asked once per shape and number of rows (layers of one shape share it); a new block asks
    again, so a choice made later (or a test's) is seen."""
    asked = []

    def stock_is_faster(weight, band, packable=False):
        asked.append((*weight.shape, band))
        return STOCK

    monkeypatch.setattr(narrow_linear, "fastest_layout", stock_is_faster)
    model = TwoLinears()
    model.twin = nn.Linear(16, 24)  # the first layer's shape
    x = torch.randn(1, 3, 16)
    with verifying(model):
        for _ in range(2):
            model(x), model.twin(x)
        model(torch.randn(1, 5, 16))
    assert asked == [(24, 16, 4), (8, 24, 4), (24, 16, 6), (8, 24, 6)]
    with verifying(model):
        model(x)
    assert asked[4:] == [(24, 16, 4), (8, 24, 4)]


def test_install_leaves_wrapped_and_subclassed_layers_alone():
    class QuantisedLinear(nn.Linear):
        pass

    model = TwoLinears()
    model.third = QuantisedLinear(8, 8)
    hooked = model.second.forward = lambda x: x  # another library's wrapper
    install(model)
    install(model)  # a second call changes nothing
    assert model.first.forward.__func__ is narrow_linear._forward
    assert model.second.forward is hooked
    assert "forward" not in model.third.__dict__


@pytest.mark.parametrize("packable", [False, pytest.param(True, marks=needs_packing)])
def test_the_layout_is_timed_once_per_shape_band_and_thread_count(monkeypatch, packable):
    monkeypatch.setattr(narrow_linear, "_FASTEST", {})
    timed = []
    kernels = 3 if packable else 2  # each round times the stock kernel, the transposed, then the packed

    def clock(run, device):  # the last one timed in a round takes 1 s, the others 2 s
        timed.append(run)
        return None, 1.0 if len(timed) % kernels == 0 else 2.0

    monkeypatch.setattr(narrow_linear, "timed", clock)
    weight = torch.randn(24, 16)
    winner = PACKED if packable else TRANSPOSED
    assert narrow_linear.fastest_layout(weight, 4, packable) == winner
    assert narrow_linear.fastest_layout(weight, 4, packable) == winner  # remembered, not timed again
    assert len(timed) == kernels * (1 + narrow_linear._TIMING_ROUNDS)  # one call of each sizes the samples
    narrow_linear.fastest_layout(weight, 8, packable)
    assert len(timed) == 2 * kernels * (1 + narrow_linear._TIMING_ROUNDS)
    threads = torch.get_num_threads()
    assert set(narrow_linear._FASTEST) == {(threads, torch.float32, 24, 16, band, packable) for band in (4, 8)}


def test_choosing_the_layouts_first_leaves_no_timing_to_a_verification(monkeypatch):
    """Every band of every shape the verifier would time is timed by `choose_layouts`, once per
    shape (two layers of one shape share it), and a verification then times nothing."""
    monkeypatch.setattr(narrow_linear, "_FASTEST", {})
    model = TwoLinears()
    model.twin = nn.Linear(16, 24)  # the first layer's shape
    model.hooked = nn.Linear(4, 4)
    model.hooked.forward = lambda x: x  # another library's wrapper: never verified by us
    timing = narrow_linear.fastest_layout
    grad = []
    monkeypatch.setattr(narrow_linear, "fastest_layout",
                        lambda *args: grad.append(torch.is_grad_enabled()) or timing(*args))
    narrow_linear.choose_layouts(model)
    assert grad and not any(grad)  # timed as a verification runs, without autograd
    threads, packable = torch.get_num_threads(), model.first._hf_selfspec_packable
    assert set(narrow_linear._FASTEST) == {
        (threads, torch.float32, *shape, band, packable) for shape in ((24, 16), (8, 24)) for band in ROW_BANDS
    }
    for layer in (model.first, model.second, model.twin):  # packed now where a band chose it
        chose_packed = PACKED in (narrow_linear._FASTEST[threads, torch.float32, *layer.weight.shape, band, packable]
                                  for band in ROW_BANDS)
        assert (layer in narrow_linear._PACKED) == chose_packed

    def untimed(run, device):
        raise AssertionError("a verification timed a layout")

    monkeypatch.setattr(narrow_linear, "timed", untimed)
    with torch.no_grad(), verifying(model):
        for rows in (2, 7, ROW_BANDS[-1]):
            model(torch.randn(1, rows, 16))


def test_a_product_too_quick_to_time_once_is_timed_over_calls_that_last_a_sample(monkeypatch):
    """A small layer's product takes microseconds, which one reading of the clock cannot tell
    apart: each sample repeats it for about `_SAMPLE_SECONDS`, sized by one timed call."""
    monkeypatch.setattr(narrow_linear, "_FASTEST", {})
    products, readings = [], []
    for layout, name in ((narrow_linear.F, "linear"), (narrow_linear, "_transposed")):
        product = getattr(layout, name)
        monkeypatch.setattr(layout, name, lambda *args, product=product: products.append(1) or product(*args))

    def clock(run, device):  # every product takes a 32nd of a sample (a power of two divides exactly)
        before = len(products)
        run()
        readings.append(len(products) - before)
        return None, readings[-1] * narrow_linear._SAMPLE_SECONDS / 32

    monkeypatch.setattr(narrow_linear, "timed", clock)
    narrow_linear.fastest_layout(torch.randn(24, 16), 4)
    assert readings == [1, 1] + [32, 32] * narrow_linear._TIMING_ROUNDS


@pytest.mark.parametrize("layout", [STOCK, TRANSPOSED, pytest.param(PACKED, marks=needs_packing)])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_greedy_decoding_matches_plain_on_every_kernel(monkeypatch, architecture, layout):
    calls = count_calls(monkeypatch, layout)
    model = tiny_model(architecture, initializer_range=0.3)
    for prompt in random_prompts(model.config.vocab_size):
        assert_same_greedy(
            model, prompt, strategy="self_speculative", attn_skip_layers=[1, 3], mlp_skip_layers=[2],
            max_draft_tokens=5, draft_exit_threshold=0.0, prompt_lookup_tokens=4, prompt_lookup_min_ngram=1,
        )
    assert bool(calls) == (layout != STOCK)


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_plain_decoding_and_transformers_lookup_take_our_kernels_when_asked(transposed_calls, architecture):
    """`narrow_kernels=True` gives plain decoding and transformers' own prompt lookup the
    verifier's kernels, with plain's tokens; by default they keep the stock one."""
    model = tiny_model(architecture, initializer_range=0.3)
    prompt = random_prompts(model.config.vocab_size, count=1)[0]
    for extra in ({}, {"prompt_lookup_num_tokens": 4}):
        expected = model.generate(prompt, max_new_tokens=20, do_sample=False, strategy="plain", **extra)
        assert transposed_calls == []
        narrow = model.generate(prompt, max_new_tokens=20, do_sample=False, strategy="plain", narrow_kernels=True, **extra)
        assert narrow.tolist() == expected.tolist()
        assert transposed_calls and all(rows[0] <= ROW_BANDS[-1] for rows in transposed_calls)
        transposed_calls.clear()


def test_a_strategy_on_the_stock_kernels_when_told(transposed_calls):
    model = tiny_model("llama", initializer_range=0.3)
    for prompt in random_prompts(model.config.vocab_size):
        assert_same_greedy(
            model, prompt, strategy="self_speculative", attn_skip_layers=[1], mlp_skip_layers=[2],
            draft_exit_threshold=0.0, narrow_kernels=False,
        )
    assert transposed_calls == []
    assert_same_greedy(model, random_prompts(model.config.vocab_size)[0], strategy="self_speculative")
    assert transposed_calls


def test_narrow_kernels_must_be_a_bool():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="narrow_kernels must be True, False or None, got 'yes'"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, narrow_kernels="yes")


def test_uninstall_gives_the_layers_their_stock_forward_back():
    model = TwoLinears()
    with torch.no_grad(), verifying(model):
        model(torch.randn(1, 2, 16))
    assert "forward" in model.first.__dict__
    narrow_linear.uninstall(model)
    assert not any("forward" in layer.__dict__ for layer in (model.first, model.second))
    assert not hasattr(model.first, "_hf_selfspec_packable") and model.first not in narrow_linear._PACKED
    assert not getattr(model, "_hf_selfspec_narrow_linear", False)
    with torch.no_grad(), verifying(model):  # installed again where verified again
        model(torch.randn(1, 2, 16))
    assert model.first.forward.__func__ is narrow_linear._forward
