"""The collector settings of the long-running processes (filemq/ops/gctune.py)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from filemq.ops import broker_app
from filemq.ops.gctune import GC_YOUNG_THRESHOLD, tune_gc


@pytest.fixture
def restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_tune_gc_raises_the_young_threshold_keeps_the_older_ones_and_freezes(restore_gc: None) -> None:
    _, older, oldest = gc.get_threshold()
    tune_gc()
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, older, oldest)
    assert gc.get_freeze_count() > 0  # the start-up's objects are in the permanent generation
    frozen = gc.get_freeze_count()
    made_after: list[object] = []  # a container, tracked by the collector
    tune_gc(freeze=False)  # idempotent thresholds; nothing more frozen
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, older, oldest)
    # Nothing more frozen: the count does not grow and an object made after the first
    # freeze is still in a collected generation. (Not `== frozen`: a frozen object that
    # another thread frees, e.g. pytest-xdist's I/O thread in a worker, leaves the count.)
    assert gc.get_freeze_count() <= frozen
    assert any(o is made_after for o in gc.get_objects())


def test_cycles_are_still_collected_without_a_manual_collect(restore_gc: None) -> None:
    """Less often, not never: a reference cycle made after tune_gc is freed by the collector
    on its own once enough objects were allocated (bounded: a few young thresholds)."""
    tune_gc()

    class Node:
        other: Any = None

    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    keep: list[list[object]] = []
    for _ in range(5 * GC_YOUNG_THRESHOLD):
        keep.append([])  # container allocations count towards the young threshold
        if gone() is None:
            break
    assert gone() is None


def test_the_broker_process_tunes_its_collector_before_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(broker_app, "tune_gc", lambda: calls.append("tune_gc"))

    def fake_run(coro: Any, **kw: Any) -> int:
        coro.close()
        calls.append("run")
        return 0

    monkeypatch.setattr(broker_app, "run_until_signalled", fake_run)
    from filemq.common.config import load_config
    assert broker_app.run_broker(load_config(None, {})) == 0
    assert calls == ["tune_gc", "run"]
