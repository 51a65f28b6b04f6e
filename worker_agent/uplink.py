"""The uplink shared by every export: one byte budget, served by priority.

:class:`Uplink` is a token bucket (``uplink.rate_limit_bytes_per_s``) whose waiters are
served strictly by priority, then in arrival order: while a higher-priority export waits, no
lower-priority export gets a byte. An export asks for small grants (one batch or a chunk of at
most ``MAX_GRANT_BYTES`` of records), so a record of a high-priority export waits at most for
the grant already given out -- at 1 MB/s and 16 KiB a few tens of milliseconds -- plus its own.

Without a rate (``None``) every ``take`` returns at once: priorities only matter when the
uplink is the bottleneck. :class:`Share` is one export's view: its own optional cap
(``rate_limit_bytes_per_s`` of the export), then the shared uplink at its priority.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable

from worker_agent.forwarder import TokenBucket

log = logging.getLogger(__name__)

MAX_GRANT_BYTES = 16 * 1024  # what an MQTT export asks for at once under a rate limit
BURST_S = 0.05  # tokens the bucket holds at most, in seconds of rate


class Uplink:
    """A byte-rate limit shared by exports, served highest ``priority`` first."""

    def __init__(self, rate: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        if rate is not None and rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self._clock = clock
        self._burst = (rate or 0.0) * BURST_S
        self._tokens = self._burst
        self._stamp = clock()
        self._seq = itertools.count()
        self._waiters: list[tuple[int, int, int, asyncio.Future[None]]] = []
        self._dispatcher: asyncio.Task[None] | None = None
        self.bytes_granted = 0

    @property
    def limited(self) -> bool:
        return self.rate is not None

    def _refill(self) -> None:
        assert self.rate is not None
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    async def take(self, n: int, priority: int = 0) -> None:
        """Return once ``n`` bytes may be sent by an export of ``priority`` (higher first)."""
        self.bytes_granted += n
        if self.rate is None:
            return
        self._refill()
        if not self._waiters and self._tokens >= 0:
            self._tokens -= n  # may go into debt: the next taker waits it off
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (-priority, next(self._seq), n, future))
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.create_task(self._dispatch(), name="filemq-uplink")
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._tokens += n  # granted but not used: give it back
            raise

    async def _dispatch(self) -> None:
        assert self.rate is not None
        waiters = self._waiters
        while waiters:
            self._refill()
            if self._tokens < 0:
                await asyncio.sleep(-self._tokens / self.rate)
                continue
            _, _, n, future = heapq.heappop(waiters)
            if future.done():  # its taker was cancelled
                continue
            self._tokens -= n
            future.set_result(None)

    def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()


class Share:
    """One export's access to the uplink: its own cap first, then the shared budget."""

    def __init__(self, uplink: Uplink, priority: int, rate: int | None = None) -> None:
        self.uplink = uplink
        self.priority = priority
        self._own = TokenBucket(rate) if rate else None

    @property
    def limited(self) -> bool:
        return self._own is not None or self.uplink.limited

    async def take(self, n: int) -> None:
        if self._own is not None:
            await self._own.take(n)
        await self.uplink.take(n, self.priority)
