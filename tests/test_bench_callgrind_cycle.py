"""bench.callgrind_cycle's in-process cycle runs against this tree (without valgrind): each
cycle's PUBACKs free the window and the refill sends new records again."""

from __future__ import annotations

import asyncio
import gc

import pytest

from bench import callgrind_cycle


@pytest.mark.parametrize("acks", ["20", "7"])
def test_the_cycle_harness_refills_the_window_every_cycle(monkeypatch: pytest.MonkeyPatch, acks: str) -> None:
    monkeypatch.setenv("WINDOW", "20")
    monkeypatch.setenv("ACKS", acks)
    try:
        asyncio.run(callgrind_cycle._cycles(5))  # asserts that every cycle refilled the window
    finally:
        gc.unfreeze()
