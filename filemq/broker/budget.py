"""Back-pressure from the log to the sockets (issue 30 item 3; docs/BROKER.md, "Ingest budget").

The bytes the broker has accepted and not yet made durable (appended to the log, not yet
through a group commit: :attr:`segments.log.Log.uncommitted_bytes`) are bounded by
``broker.max_uncommitted_bytes``.  Once a read from a connection appended and the log is at
the bound, that connection is not read again (``pause_reading``) until commits have brought
the uncommitted bytes down to half the bound; then every held connection is read again, in
the order they were held, so each publisher gets its turn and none is starved.  Connections
that did not append (subscribers' acks, PINGREQs, CONNECTs) are never held.

Before, reading paused only when a client's *output* backed up, never when the log writer
lagged: one client pipelining 1 MB PUBLISHes faster than the disk grew the broker's memory
without bound (2.9 GB in 20 s) and other clients waited 9-15 s for their PUBACKs.

What a caller may rely on: the uncommitted bytes exceed the bound by at most what one read of
each connection held at that moment brought in (a read is at most 256 KiB, and a check is
made once per :data:`CHECK_BYTES` read) plus one packet in progress per connection
(``max_packet_size``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

log = logging.getLogger("filemq.broker")

RECHECK_S = 0.1
"""While connections are held: how often to look again without a commit (a failed commit
drops the buffered bytes without telling the commit listeners)."""

CHECK_BYTES = 1024
"""A connection's reads are checked against the bound once per this many bytes read from it
(one addition per read otherwise): a subscriber's small reads of PUBACKs cost nothing."""

DEFAULT_BROKER_BYTES = 32 << 20
DEFAULT_COLLECTOR_BYTES = 256 << 20


class UncommittedLog(Protocol):
    @property
    def uncommitted_bytes(self) -> int: ...


class HeldReader(Protocol):
    """A connection's protocol: ``held`` is part of its reading decision."""

    held: bool

    def update_reading(self) -> None: ...


class IngestBudget:
    """The bound on accepted, not yet durable bytes, and the connections it holds."""

    __slots__ = ("log", "limit", "resume_at", "held", "holds", "_timer")

    def __init__(self, log: UncommittedLog, limit: int) -> None:
        self.log = log
        self.limit = limit
        self.resume_at = limit // 2
        self.held: dict[HeldReader, None] = {}
        self.holds = 0  # times a connection was held (metrics, tests)
        self._timer: asyncio.TimerHandle | None = None

    def over(self) -> bool:
        return self.log.uncommitted_bytes >= self.limit

    def hold(self, reader: HeldReader) -> None:
        """Stop reading ``reader`` until the log has caught up (it just appended, over the bound)."""
        if reader.held:
            return
        reader.held = True
        self.held[reader] = None
        self.holds += 1
        reader.update_reading()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(RECHECK_S, self._on_timer)

    def forget(self, reader: HeldReader) -> None:
        """``reader``'s connection is gone."""
        self.held.pop(reader, None)

    def on_commit(self, _committed: int = 0) -> None:
        """A commit listener: read the held connections again once half the bound is free."""
        if self.held and self.log.uncommitted_bytes <= self.resume_at:
            held, self.held = self.held, {}
            for reader in held:
                reader.held = False
                reader.update_reading()

    def _on_timer(self) -> None:
        self._timer = None
        self.on_commit()
        if self.held:
            self._timer = asyncio.get_running_loop().call_later(RECHECK_S, self._on_timer)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

