"""Summaries: how results are rounded and put in words for people (the ``--json`` lines
carry the figures themselves)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.loadspec import LoadResult


def rnd(x: float, digits: int = 1) -> float:
    """A figure as a result reports it."""
    return round(x, digits)


def percentile_ms(values: Sequence[int], q: float, *, per_ms: int) -> float | None:
    """The ``q`` quantile of ``values`` by nearest rank (the value at index ``int(n * q)``, the
    largest for q near 1), in ms to 2 digits, ``per_ms`` of the values' unit making one ms
    (1,000 for microseconds, 1,000,000 for nanoseconds); None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(int(len(ordered) * q), len(ordered) - 1)] / per_ms, 2)


def errors_text(result: LoadResult) -> str:
    """"; errors: [...]" (the first two) for a progress line, or ""."""
    return f"; errors: {result.errors[:2]}" if result.errors else ""


def refusal(result: LoadResult) -> str | None:
    """"CONNACK 0xNN" when the broker refused the load clients' CONNECT, else None."""
    code = result.connack_code
    return None if code is None else f"CONNACK 0x{code:02X}"


def cpu_text(result: dict[str, Any], baselines: tuple[str, ...]) -> str:
    """filemq's broker CPU per message and each baseline's, with the ratio, for a summary line."""
    parts = [f"filemq broker CPU {result.get('filemq_cpu_us_per_msg', '-')} us/msg"]
    for base in baselines:
        if f"{base}_cpu_us_per_msg" in result:
            parts.append(f"{base} {result[f'{base}_cpu_us_per_msg']} us/msg "
                         f"(ratio {result.get(f'cpu_ratio_vs_{base}', '-')}x)")
    return "; ".join(parts)
