"""bench.callgrind_cycle's in-process cycle runs against this tree (without valgrind): each
cycle's PUBACKs free the window and the refill sends new records again."""

from __future__ import annotations

import asyncio
import gc

import pytest

from bench import callgrind_cycle, callgrind_reads


@pytest.mark.parametrize("acks", ["20", "7"])
def test_the_cycle_harness_refills_the_window_every_cycle(monkeypatch: pytest.MonkeyPatch, acks: str) -> None:
    monkeypatch.setenv("WINDOW", "20")
    monkeypatch.setenv("ACKS", acks)
    try:
        asyncio.run(callgrind_cycle.run_cycles(5))  # asserts that every cycle refilled the window
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("per_read", ["1", "4", "9"])
def test_the_reads_harness_acks_every_id_it_feeds(monkeypatch: pytest.MonkeyPatch, per_read: str) -> None:
    """bench.callgrind_reads (issue 16, reads of a few PUBACKs) feeds whole reads of PUBACKs
    for ids in flight, below the refill mark: every id it sends is acked, none refilled."""
    monkeypatch.setenv("A", per_read)
    try:
        assert asyncio.run(callgrind_reads.feed_reads(50)) == 50 * int(per_read)
    finally:
        gc.unfreeze()
