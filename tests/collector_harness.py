"""The in-process collector's tests: its config and bounded waits (tests/test_collector.py and
the fleet tests).

:func:`collector_config` is a collector on port 0 with its data and landing under a test's
directory (files rolled each minute); :func:`collector_run` and :func:`collector_until` are the
pipeline's :func:`tests.pipeline_harness.run` and ``until`` with the collector tests' shorter
bounds: a scenario bounded at 40 s (not 100), a condition polled every 10 ms for up to 15 s
(not every 50 ms for 30 s).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from filemq.common.config import load_config
from tests.pipeline_harness import run, until


def collector_config(tmp_path: Path, **overrides: Any) -> Any:
    values = {
        "data_dir": str(tmp_path / "data"),
        "collector.landing": str(tmp_path / "landing"),
        "collector.port": 0,
        "collector.collector_id": "c1",
        "collector.roll_seconds": 60,
        "log.fsync": "never",
        "log.min_free_bytes": 0,
    }
    values.update(overrides)
    return load_config(None, values)


def collector_run(coro: Coroutine[Any, Any, None], timeout: float = 40) -> None:
    run(coro, timeout)


async def collector_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    await until(predicate, timeout, poll=0.01)
