"""Which event loop a test runs on (``FILEMQ_TEST_EVENT_LOOP=uvloop``, tests/conftest.py), and
a coroutine run on it within a bound (:func:`run`)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from filemq.common.config import Config
from filemq.ops.eventloop import running_loop_name, serves_tls

T = TypeVar("T")

TLS_ON_UVLOOP = ("TLS listeners run on the standard loop, never on uvloop "
                 "(filemq/ops/eventloop.py; tests/test_eventloop.py)")


def skip_tls_on_uvloop(config: Config) -> None:
    """Skip the calling test when it would start a TLS listener on uvloop.

    ``filemq broker`` never does that (``loop_factory`` takes the standard loop for a TLS
    listener), so the uvloop pass of ``make test`` has nothing to check there. Decided by the
    config the test starts, not by the test's name: a name misses tests such as wss://.
    """
    if serves_tls(config) and running_loop_name() != "asyncio":
        pytest.skip(TLS_ON_UVLOOP)


def run(coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
    """Run ``coro`` on a new event loop, cancelled after ``timeout`` s (TimeoutError): no test
    waits forever."""
    return asyncio.run(asyncio.wait_for(coro, timeout))
