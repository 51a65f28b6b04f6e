"""The in-process collector's tests: its config and bounded waits (tests/test_collector.py and
the fleet tests).

:func:`collector_config` is a collector on port 0 with its data and landing under a test's
directory (files rolled each minute); :func:`collector_run` runs a scenario bounded at 40 s and
:func:`collector_until` polls a condition every 10 ms for up to 15 s (TimeoutError). The
pipeline tests' :func:`tests.pipeline_harness.run` and ``until`` allow longer (100 s, 30 s).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from filemq.common.config import load_config


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


def collector_run(coro: Awaitable[None], timeout: float = 40) -> None:
    async def main() -> None:
        await asyncio.wait_for(coro, timeout)

    asyncio.run(main())


async def collector_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)
