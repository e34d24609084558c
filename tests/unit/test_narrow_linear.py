"""The verifier's choice of matrix layout for a few rows (`hf_selfspec.narrow_linear`): the same
product, taken only inside a verification, and decoding stays lossless on either layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_selfspec import narrow_linear
from hf_selfspec.narrow_linear import ROW_BANDS, install, verifying
from helpers.greedy import assert_same_greedy, random_prompts
from helpers.tiny_models import ARCHITECTURES, tiny_model

LAYOUTS = {"transposed": True, "stock": False}


def count_transposed(monkeypatch, faster: bool) -> list[torch.Size]:
    """With the transposed layout timed as `faster` for every shape: the rows of every product
    taken on it, as they are taken."""
    calls = []
    original = narrow_linear._transposed
    monkeypatch.setattr(narrow_linear, "transposed_is_faster", lambda weight, band: faster)

    def transposed(weight, rows):
        calls.append(rows.shape)
        return original(weight, rows)

    monkeypatch.setattr(narrow_linear, "_transposed", transposed)
    return calls


@pytest.fixture
def transposed_calls(monkeypatch):
    return count_transposed(monkeypatch, True)


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(16, 24), nn.Linear(24, 8, bias=False)

    def forward(self, x):
        return self.second(self.first(x))


@pytest.mark.parametrize("rows", [2, 5, ROW_BANDS[-1]])
@torch.no_grad()
def test_the_transposed_layout_gives_the_stock_product(transposed_calls, rows):
    model = TwoLinears()
    x = torch.randn(1, rows, 16)
    stock = model(x)
    with verifying(model):
        chosen = model(x)
    assert len(transposed_calls) == 2
    assert chosen.shape == stock.shape and chosen.is_contiguous()
    torch.testing.assert_close(chosen, stock)


@torch.no_grad()
def test_only_a_verification_of_a_few_rows_without_autograd_takes_it(transposed_calls):
    model = TwoLinears()
    model(torch.randn(1, 4, 16))  # outside a verification
    with verifying(model):
        model(torch.randn(1, 1, 16))  # one row: the matrix-vector product a plain step takes
        model(torch.randn(1, ROW_BANDS[-1] + 1, 16))  # a long prefill
        with torch.enable_grad():
            model(torch.randn(1, 4, 16))  # training keeps the stock kernel and its backward
    assert transposed_calls == []


@torch.no_grad()
def test_a_verification_asks_once_per_shape_and_rows_and_the_next_one_asks_again(monkeypatch):
    """Every layer of every verification consults the choice, so within one `verifying` block it
    is asked once per shape and number of rows (layers of one shape share it); a new block asks
    again, so a choice made later (or a test's) is seen."""
    asked = []

    def stock_is_faster(weight, band):
        asked.append((*weight.shape, band))
        return False

    monkeypatch.setattr(narrow_linear, "transposed_is_faster", stock_is_faster)
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


def test_the_layout_is_timed_once_per_shape_band_and_thread_count(monkeypatch):
    monkeypatch.setattr(narrow_linear, "_TRANSPOSED_FASTER", {})
    timed = []

    def clock(run, device):  # each round times the stock layout first: it takes 2 s, the transposed 1 s
        timed.append(run)
        return None, 2.0 if len(timed) % 2 else 1.0

    monkeypatch.setattr(narrow_linear, "timed", clock)
    weight = torch.randn(24, 16)
    assert narrow_linear.transposed_is_faster(weight, 4) is True
    assert narrow_linear.transposed_is_faster(weight, 4) is True  # remembered, not timed again
    assert len(timed) == 2 * (1 + narrow_linear._TIMING_ROUNDS)  # one call of each sizes the samples
    narrow_linear.transposed_is_faster(weight, 8)
    assert len(timed) == 4 * (1 + narrow_linear._TIMING_ROUNDS)
    threads = torch.get_num_threads()
    assert set(narrow_linear._TRANSPOSED_FASTER) == {(threads, torch.float32, 24, 16, band) for band in (4, 8)}


def test_choosing_the_layouts_first_leaves_no_timing_to_a_verification(monkeypatch):
    """Every band of every shape the verifier would time is timed by `choose_layouts`, once per
    shape (two layers of one shape share it), and a verification then times nothing."""
    monkeypatch.setattr(narrow_linear, "_TRANSPOSED_FASTER", {})
    model = TwoLinears()
    model.twin = nn.Linear(16, 24)  # the first layer's shape
    model.hooked = nn.Linear(4, 4)
    model.hooked.forward = lambda x: x  # another library's wrapper: never verified by us
    timing = narrow_linear.transposed_is_faster
    grad = []
    monkeypatch.setattr(narrow_linear, "transposed_is_faster",
                        lambda weight, band: grad.append(torch.is_grad_enabled()) or timing(weight, band))
    narrow_linear.choose_layouts(model)
    assert grad and not any(grad)  # timed as a verification runs, without autograd
    threads = torch.get_num_threads()
    assert set(narrow_linear._TRANSPOSED_FASTER) == {
        (threads, torch.float32, *shape, band) for shape in ((24, 16), (8, 24)) for band in ROW_BANDS
    }

    def untimed(run, device):
        raise AssertionError("a verification timed a layout")

    monkeypatch.setattr(narrow_linear, "timed", untimed)
    with torch.no_grad(), verifying(model):
        for rows in (2, 7, ROW_BANDS[-1]):
            model(torch.randn(1, rows, 16))


def test_a_product_too_quick_to_time_once_is_timed_over_calls_that_last_a_sample(monkeypatch):
    """A small layer's product takes microseconds, which one reading of the clock cannot tell
    apart: each sample repeats it for about `_SAMPLE_SECONDS`, sized by one timed call."""
    monkeypatch.setattr(narrow_linear, "_TRANSPOSED_FASTER", {})
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
    narrow_linear.transposed_is_faster(torch.randn(24, 16), 4)
    assert readings == [1, 1] + [32, 32] * narrow_linear._TIMING_ROUNDS


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_greedy_decoding_matches_plain_on_either_layout(monkeypatch, architecture, layout):
    calls = count_transposed(monkeypatch, LAYOUTS[layout])
    model = tiny_model(architecture, initializer_range=0.3)
    for prompt in random_prompts(model.config.vocab_size):
        assert_same_greedy(
            model, prompt, strategy="self_speculative", attn_skip_layers=[1, 3], mlp_skip_layers=[2],
            max_draft_tokens=5, draft_exit_threshold=0.0, prompt_lookup_tokens=4, prompt_lookup_min_ngram=1,
        )
    assert bool(calls) == LAYOUTS[layout]
