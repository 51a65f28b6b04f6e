"""The bench harness's small helpers, checked without a broker."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from bench.harness.summary import percentile_ms


@given(values=st.lists(st.integers(min_value=0, max_value=10**9), max_size=200),
       q=st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]))
def test_percentile_is_the_nearest_rank_of_the_values_in_any_order(values: list[int], q: float) -> None:
    """The ``q`` quantile (the latency scenario's p50/p99, the everyday scenario's PUBACK
    p50/p99) is one of the values, with more than a share ``q`` of them at or below it (all
    of them for q = 1) and at most ``int(n * q)`` below it."""
    got = percentile_ms(random.Random(0).sample(values, len(values)), q, per_ms=1)  # per_ms=1: the values' unit
    if not values:
        assert got is None
        return
    assert got in values
    n = len(values)
    assert sum(v <= got for v in values) >= min(n, int(n * q) + 1)
    assert sum(v < got for v in values) <= int(n * q)


def test_percentile_units() -> None:
    assert percentile_ms([30_000, 10_000, 20_000], 0.5, per_ms=1000) == 20.0  # us, in ms
    assert percentile_ms([1_234, 5_678], 0.99, per_ms=1000) == 5.68  # to 2 digits
    assert percentile_ms([2_500_000, 1_000_000], 1.0, per_ms=1_000_000) == 2.5  # ns
