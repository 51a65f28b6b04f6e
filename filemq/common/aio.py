"""Small asyncio helpers shared by the broker, the agent and the collector."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has ended; its own CancelledError is not raised here.

    ``task.cancel(); with suppress(CancelledError): await task`` also swallows a CancelledError
    meant for the *awaiting* task when that one is cancelled meanwhile (a SIGTERM or Ctrl-C
    arriving during a shutdown step): the caller then runs on as if it had not been asked to
    stop.  Here a cancellation of the caller that arrives while it waits is re-raised
    (``Task.cancelling()`` grew, Python 3.11); one it already received and handled before
    the call does not count.  Any other exception ``task`` ended with propagates, as it did
    with ``suppress``.
    """
    current = asyncio.current_task()
    before = current.cancelling() if current is not None else 0
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if current is not None and current.cancelling() > before:
            raise
