"""Shared pytest fixtures."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Every helper module under tests/ (a test module is not a harness: issue 31, item 5;
# tests/test_layout.py): pytest rewrites their asserts as it does the test modules', so a failing
# assert in a helper still shows the values it compared, a new helper module included.
pytest.register_assert_rewrite(*sorted(
    f"tests.{path.stem}" for path in Path(__file__).parent.glob("*.py")
    if not path.stem.startswith(("test_", "conftest", "__"))
))


def pytest_configure(config: pytest.Config) -> None:
    """``FILEMQ_TEST_EVENT_LOOP=uvloop``: every ``asyncio.run`` of the tests runs on uvloop (the
    loop ``filemq broker`` takes where it is installed, filemq/ops/eventloop.py); ``make test``
    runs the socket-level broker suites once more that way."""
    import os

    # Every JVM the tests start (the ``spark`` fixture's driver, the standalone cluster of
    # test_spark_cluster.py, the ingest of the demo's subprocesses) inherits this: the client
    # JIT only and the serial collector. A JVM that lives for seconds spends much of its CPU in
    # the optimising JIT's threads; measured on test_spark_ingest.py, 76 s of CPU -> 43 s, and
    # test_spark_cluster.py 43 s -> 26 s, the same results. Tests only: `filemq ingest` and
    # `make demo` keep the JVM's defaults. (Each JVM notes "Picked up JAVA_TOOL_OPTIONS" on
    # its stderr.) A JAVA_TOOL_OPTIONS already set is kept as it is.
    os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")

    # Hypothesis: no per-example deadline and no "input generation is slow" health check, for
    # every test that does not set its own (a test's @settings still wins, field by field).
    # Both measure the machine, not the code: with the suite's files run side by side
    # (pytest-xdist) on a shared 2-core machine a first call may take > 200 ms, and a test
    # failed on that alone (as many tests here already said with deadline=None one by one).
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "filemq-tests", deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.load_profile("filemq-tests")

    if os.environ.get("FILEMQ_TEST_EVENT_LOOP") == "uvloop":
        import asyncio

        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first: every file with a ``spark`` test, then every file with a
    ``slow`` one, then the rest, each file's tests in their own order (a stable sort).

    ``make test`` runs the suite under pytest-xdist with ``--dist loadfile`` (whole files to a
    worker, in this order), so the long files start at once instead of being left to the end
    where one worker would run them alone. Every worker computes the same order."""
    rank: dict[str, int] = {}
    for item in items:
        file = item.nodeid.split("::", 1)[0]
        if item.get_closest_marker("spark") is not None:
            rank[file] = 0
        elif item.get_closest_marker("slow") is not None:
            rank[file] = min(rank.get(file, 1), 1)
        else:
            rank.setdefault(file, 2)
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local SparkSession for the whole test session (starting Spark takes seconds).

    local[1], one shuffle partition, UI off, UTC: as the ingest job configures it, but small.
    """
    if shutil.which("java") is None:
        pytest.skip("Spark tests need a Java runtime (java not on PATH)")
    from spark_ingest.job import build_session

    session = build_session(master="local[1]", app_name="filemq-tests", shuffle_partitions=1)
    yield session
    session.stop()


@pytest.fixture(autouse=True)
def _restore_logger_levels() -> Iterator[None]:
    """CLI commands run in-process by CliRunner set logger levels (e.g. quieting `segments`
    for inspect/verify); restore every logger's level and the root's after each test so a
    later test's caplog still sees what it expects."""
    import logging

    manager = logging.root.manager
    before = {
        name: lg.level for name, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)
    }
    root_level = logging.root.level
    yield
    for name, lg in list(manager.loggerDict.items()):
        if isinstance(lg, logging.Logger):
            lg.setLevel(before.get(name, logging.NOTSET))
    logging.root.setLevel(root_level)
