"""How the quickstart's demo turns a contender's timed runs into one rate."""

from __future__ import annotations

import pytest

from hf_selfspec.measure import TimedRun
from hf_selfspec.tuning.quickstart import demo_rate


def _run(tokens: int, seconds: float) -> TimedRun:
    return TimedRun(new_tokens=list(range(tokens)), seconds=seconds, stats=None)


def test_a_run_cut_short_by_a_near_tie_counts_only_its_own_tokens():
    # The first repeat ended early (a reduced-precision near-tie led to an end of text sooner);
    # the other two made all 64 tokens. Crediting every run with the first run's tokens would
    # price this profile at 38 / 2.5 tokens a second; each run's own rate is 23.8, 25.6 and 24.6.
    runs = [_run(38, 1.6), _run(64, 2.5), _run(64, 2.6)]
    assert demo_rate(runs) == pytest.approx(64 / 2.6)


def test_a_run_cut_short_first_or_last_gives_the_same_rate():
    short, full, slower = _run(38, 1.6), _run(64, 2.5), _run(64, 2.6)
    assert demo_rate([short, full, slower]) == demo_rate([full, slower, short])


def test_runs_of_equal_length_give_their_tokens_over_their_median_seconds():
    runs = [_run(64, 2.0), _run(64, 3.0), _run(64, 2.5)]
    assert demo_rate(runs) == pytest.approx(64 / 2.5)
