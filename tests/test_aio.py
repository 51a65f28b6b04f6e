"""filemq.common.aio.cancel_and_wait: stopping a helper task never swallows a cancellation
of the task that stops it (the `suppress(CancelledError)` pattern did)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from filemq.common.aio import cancel_and_wait


async def _slow_to_stop(stopping: asyncio.Event) -> None:
    """A helper task that takes a while to end once cancelled (cleanup in its finally)."""
    try:
        await asyncio.sleep(3600)
    finally:
        stopping.set()
        await asyncio.shield(asyncio.sleep(0.05))


def test_the_helper_ends_and_its_cancellation_is_not_raised() -> None:
    async def main() -> None:
        helper = asyncio.create_task(asyncio.sleep(3600))
        await asyncio.sleep(0)
        await cancel_and_wait(helper)
        assert helper.cancelled()

    asyncio.run(main())


def test_a_cancellation_of_the_caller_while_it_waits_is_raised() -> None:
    async def stopper(stopping: asyncio.Event) -> str:
        helper = asyncio.create_task(_slow_to_stop(stopping))
        await asyncio.sleep(0)
        await cancel_and_wait(helper)
        return "ran on"  # what suppress(CancelledError) let happen

    async def main() -> None:
        stopping = asyncio.Event()
        outer = asyncio.create_task(stopper(stopping))
        await stopping.wait()  # the helper is cancelled and still cleaning up
        outer.cancel()  # e.g. SIGTERM now
        with pytest.raises(asyncio.CancelledError):
            await outer
        assert outer.cancelled()

    asyncio.run(main())


def test_an_earlier_handled_cancellation_does_not_abort_a_later_stop() -> None:
    async def cleanup_after_cancel() -> str:
        with contextlib.suppress(asyncio.CancelledError):  # handled: now stop the helpers
            await asyncio.sleep(3600)  # (the task's cancelling() stays 1 after this)
        helper = asyncio.create_task(asyncio.sleep(3600))
        await asyncio.sleep(0)
        await cancel_and_wait(helper)
        return "cleaned up"

    async def main() -> None:
        t = asyncio.create_task(cleanup_after_cancel())
        await asyncio.sleep(0)
        t.cancel()
        assert await t == "cleaned up"

    asyncio.run(main())


def test_another_exception_of_the_helper_propagates() -> None:
    async def failing() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            raise RuntimeError("cleanup failed")

    async def main() -> None:
        helper = asyncio.create_task(failing())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="cleanup failed"):
            await cancel_and_wait(helper)
        with contextlib.suppress(RuntimeError):
            helper.result()

    asyncio.run(main())
