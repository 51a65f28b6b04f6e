"""Fairness per event-loop pass (issue 30 item 4; docs/BROKER.md, "Fair turns").

A connection gets at most :data:`TURN_BYTES` of input handled per pass of the event loop,
on both loops.  A read larger than that is handled a turn at a time: the first slice now,
the rest on later passes (``call_soon``), with the socket not read meanwhile, so every other
connection's bytes are handled in between.  On uvloop this also ends libuv's run of up to 32
reads of one socket per poll (it stops as soon as reading is paused).  Since an MQTT packet
is at least 2 bytes, a turn handles at most ``TURN_BYTES / 2`` packets: one client streaming
PINGREQs holds the loop for one turn, not for everything it managed to send.

Before, one client streaming PINGREQs made a new client wait 10.6-11.5 s for its CONNACK
on uvloop (1.7 s on asyncio), and a client with keepalive 2 s pinging every second was
closed as "keepalive expired": its PINGREQs sat unread while the flood was handled.

Nothing here knows MQTT: :class:`Turns` holds one connection's bytes beyond its turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

TURN_BYTES = 16 * 1024
"""Input bytes of one connection handled per event-loop pass at most."""


class Turns:
    """One connection's bytes waiting for their turn.  ``handle(chunk)`` handles bytes;
    ``can_go()`` says whether the connection may take input now (not paused by its output,
    by a password check or by the ingest budget); ``reading_done()`` is called once nothing
    waits any more, to let the connection read its socket again."""

    __slots__ = ("rest", "handle", "can_go", "reading_done", "_scheduled", "handling")

    def __init__(self, handle: Callable[[bytes], None], can_go: Callable[[], bool],
                 reading_done: Callable[[], None]) -> None:
        self.rest = b""
        self.handle = handle
        self.can_go = can_go
        self.reading_done = reading_done
        self._scheduled = False
        self.handling = False  # a turn is being handled (its bytes bypass take())

    def waiting(self) -> bool:
        """Bytes wait for a later turn: new input goes behind them (:meth:`take`)."""
        return bool(self.rest) and not self.handling

    def take(self, data: bytes) -> bytes:
        """The part of ``data`` to handle in this turn; the rest waits (the caller stops
        reading the socket while :attr:`rest` is not empty)."""
        if self.rest:  # (a read the transport had in hand when reading paused)
            self.rest += data
            self.schedule()
            return b""
        if len(data) <= TURN_BYTES:
            return data
        self.rest = data[TURN_BYTES:]
        self.schedule()
        return data[:TURN_BYTES]

    def schedule(self) -> None:
        """Handle the next turn on a later pass (when the connection may take input)."""
        if self.rest and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._next)

    def _next(self) -> None:
        self._scheduled = False
        if not self.rest or not self.can_go():
            return  # blocked: the connection calls schedule() again when it may go on
        rest = self.rest
        chunk, self.rest = rest[:TURN_BYTES], rest[TURN_BYTES:]
        self.handling = True
        try:
            self.handle(chunk)
        finally:
            self.handling = False
        if self.rest:
            self.schedule()
        else:
            self.reading_done()

    def drop(self) -> None:
        """The connection is gone."""
        self.rest = b""
