"""Shared pytest fixtures."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest


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
