"""How long a raised ack-batching mark can hold back a read (issue 33 item 12): the bound
docs/BROKER.md states is the one the sweep gives, found with a fake clock (no sockets, no
event loop: the sweep is called at its times)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

import filemq.broker.batching as batching
from filemq.broker.batching import SWEEP_S, AckBatcher, AckBatching

BROKER_MD = Path(__file__).resolve().parent.parent / "docs" / "BROKER.md"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class _Loop:
    """call_later recorded, not run: the test calls the sweep at its due time itself."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.due: list[float] = []

    def call_later(self, delay: float, callback: Any) -> Any:
        self.due.append(self.clock.now + delay)
        return self


class _Sock:
    def setsockopt(self, *args: Any) -> None:
        pass


def _hold_times(reads_at: list[float]) -> tuple[float, float]:
    """(shortest, longest) time from a read that raised the mark to the sweep that sets it
    back, the sweeps running every SWEEP_S from the first raise, over reads at ``reads_at``
    (seconds after the previous sweep)."""
    shortest, longest = float("inf"), 0.0
    for offset in reads_at:
        clock = _Clock()
        loop = _Loop(clock)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(batching, "time", clock)
            # (the asyncio module batching calls: batching.asyncio, not re-exported for mypy)
            mp.setattr(asyncio, "get_running_loop", lambda loop=loop: loop)
            ab = AckBatching()
            first = AckBatcher(_Sock(), ab)
            first.last_read = 0.0
            first.set_mark(96)  # the sweep starts: due at SWEEP_S
            clock.now = loop.due[-1]
            first.last_read = clock.now  # (kept read: only the sweep's period matters)
            ab.sweep()  # a sweep at SWEEP_S; the next is due at 2 * SWEEP_S
            raised = AckBatcher(_Sock(), ab)
            clock.now += offset
            raised.last_read = clock.now
            raised.set_mark(96)
            read = clock.now
            while raised.mark != 1:
                clock.now = loop.due[-1]
                first.last_read = clock.now
                ab.sweep()
            shortest = min(shortest, clock.now - read)
            longest = max(longest, clock.now - read)
    return shortest, longest


def test_a_raised_mark_holds_a_read_back_at_most_two_sweep_periods_as_broker_md_says() -> None:
    """A socket is set back by the first sweep that finds it unread for SWEEP_S; sweeps come
    every SWEEP_S, so a read just after a sweep is found "unread for SWEEP_S" only by the sweep
    after next: a PINGREQ behind the mark waits up to two sweep periods (4 ms), plus what the
    event loop and the scheduler add on a busy machine -- not "2 ms at most", as BROKER.md said
    (the outside run measured 7.4 ms over 50 trials).  The doc states this bound."""
    offsets = [SWEEP_S * k / 20 for k in range(1, 20)]
    shortest, longest = _hold_times(offsets)
    assert shortest >= SWEEP_S and SWEEP_S < longest <= 2 * SWEEP_S
    text = " ".join(BROKER_MD.read_text(encoding="utf-8").split())
    stated = re.search(r"a read behind a raised mark waits at most two sweep periods \((\d+(?:\.\d+)?) ms\)", text)
    assert stated is not None, "docs/BROKER.md no longer states the bound"
    assert float(stated.group(1)) == pytest.approx(2 * SWEEP_S * 1000)
