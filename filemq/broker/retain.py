"""Retained messages (:class:`Retained`): the retained store as routing keeps it, and the
retained messages each new subscription gets, bounded per connection.

One part of :class:`~filemq.broker.core.BrokerCore`.  It owns the
:class:`~filemq.queue.retained.RetainedStore` (applied from routed records; buffered while it
is rebuilt in the background), the SUBSCRIBEs waiting for that rebuild, and per connection
the retained messages a SUBSCRIBE matched that it has not taken yet (:attr:`out`, sent as its
output drains) and the replays waiting for records appended before their SUBSCRIBE to be
routed (:attr:`after`).  Delivery reads those two maps (live records never overtake retained
ones) and calls :meth:`drain`; what it needs of ingest is :class:`Routing`.  How each queued
message is sent (read rights, expiry, identifier, QoS, packet id, Maximum Packet Size, in
flight, the QoS 2 hold) is the delivery planner's (:meth:`Delivery.deliver_retained`): here
only which messages, in which order, and when the connection takes the next one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

from filemq.broker.delivery import Delivery, RetainedQueue, RetainedReplay
from filemq.broker.session.connection import Connection
from filemq.broker.session_state import (
    RETAINED_OUT_HIGH,
    SessionState,
    Subscription,
)
from segments.record import Record

if TYPE_CHECKING:
    from filemq.broker.systopics import SysTopics
    from filemq.queue.retained import RetainedStore
    from segments.log import LogView

log = logging.getLogger("filemq.broker")


class Routing(Protocol):
    """What retained sending needs of the part that routes committed records (ingest)."""

    @property
    def routed_offset(self) -> int: ...

    def last_commit(self) -> asyncio.Future[None] | None:
        """The commit future of the latest appended records not routed yet, or None."""


class _NotRouted:
    routed_offset = 0

    def last_commit(self) -> asyncio.Future[None] | None:
        return None


class Retained:
    """The retained store and the retained messages new subscriptions get."""

    def __init__(self, store: RetainedStore, log_view: LogView, delivery: Delivery, sys: SysTopics) -> None:
        self.store = store
        self.log = log_view
        self.delivery = delivery
        self.sys = sys
        self.routing: Routing = _NotRouted()  # (wired by the core: the ingest part)
        # False while the retained store is being rebuilt in the background (big logs):
        # retained records are buffered and SUBSCRIBEs wait for their retained messages.
        self.ready = True
        self.changes = 0  # retained records routed so far (snapshot trigger)
        self._buffer: list[Record] = []
        self._waiting: list[tuple[Connection, SessionState, Subscription, int]] = []
        # Retained messages a SUBSCRIBE matched and the connection has not taken yet (filter,
        # message, QoS): sent as its output drains, so a client that does not read cannot
        # make the broker queue them again and again (issue 10 item 8).
        self.out: dict[Connection, RetainedQueue] = {}
        # Retained replays of SUBSCRIBEs that came while records appended before them were not
        # routed yet (MQTT-3.3.1-6/-8): sent once the routed offset reaches theirs.
        self.after: dict[Connection, RetainedReplay] = {}

    def forget(self, conn: Connection) -> None:
        """``conn`` closed: what it had not taken is dropped."""
        self.out.pop(conn, None)
        self.after.pop(conn, None)

    def routed(self, records: list[Record]) -> None:
        """``records`` were routed: the retained ones go to the store (or its buffer); replays
        waiting for them are sent (before live records are pumped, MQTT-3.3.1-8)."""
        ready = self.ready
        for r in [r for r in records if r.retain]:
            self.changes += 1
            if ready:
                self.store.apply(r)
            else:
                self._buffer.append(r)
        if self.after:
            self.send_after()

    def recovered(self, store: RetainedStore) -> None:
        """Switch to the store rebuilt in the background; catch up and answer waiting SUBSCRIBEs."""
        for r in self._buffer:
            store.apply(r)
        self._buffer = []
        self.store = store
        self.ready = True
        waiting, self._waiting = self._waiting, []
        for conn, state, sub, below in waiting:
            if not conn.closed and state.conn is conn and state.subs.get(sub.filter) is sub:
                self.send(conn, state, sub, below)
        self.delivery.flush()

    def expire(self) -> int:
        """Remove retained messages whose MQTT 5 message expiry interval has passed
        (MQTT-3.3.2-5; the tick, once a second); the next snapshot leaves them out."""
        if not self.ready:
            return 0
        gone = self.store.expire(time.time_ns() // 1000)
        if gone:
            self.changes += 1  # (a snapshot trigger)
            log.debug("%d expired retained messages removed", gone)
        return gone

    def send(self, conn: Connection, state: SessionState, sub: Subscription, below: int) -> None:
        """Send the retained messages ``sub`` matches that were stored below offset ``below``
        (the routed offset at SUBSCRIBE time): later ones reach it live."""
        if sub.share is not None:
            return  # retained messages are not sent for shared subscriptions (as MQTT 5)
        if sub.plain.startswith("$SYS"):
            self.sys.send_retained(conn, state, sub)
            return
        if not self.ready:
            self._waiting.append((conn, state, sub, below))
            return
        routed = self.routing.routed_offset
        if below > routed:
            if routed < self.log.next_offset:
                self.after.setdefault(conn, []).append((state, sub, below))
                last = self.routing.last_commit()
                if last is not None:  # if that commit fails, the offsets are given back: send then
                    last.add_done_callback(self._after_failed)
                return
            # A failed commit gave the offsets up to ``below`` back: records there come later.
            below = sub.retain_below = routed
            state.subs_changed()
            if state.persistent:
                state.save_due = True  # (retain_below is in the session file)
        acl = conn.acl
        queue = self.out.get(conn)
        if queue is None:
            queue = self.out[conn] = deque()
        elif any(e[0] == sub.filter for e in queue):
            # A repeated SUBSCRIBE re-sends (MQTT-3.8.4-3): what it still had queued is replaced.
            queue = self.out[conn] = deque(e for e in queue if e[0] != sub.filter)
        for m in self.store.match(sub.plain):
            if m.offset >= below:
                continue  # routed after the SUBSCRIBE (store rebuilt late): delivered live
            if acl is not None and not acl.can_receive(m.topic):
                continue
            queue.append((sub.filter, m, min(sub.qos, m.qos)))
        self.drain(conn, state)

    def send_after(self) -> None:
        """Send the retained replays whose SUBSCRIBE's offset is routed now (see on_subscribe)."""
        waiting = dict(self.after)  # (the dict itself is read by delivery: emptied, not replaced)
        self.after.clear()
        for conn, subs in waiting.items():
            for state, sub, below in subs:
                if not conn.closed and state.conn is conn and state.subs.get(sub.filter) is sub:
                    self.send(conn, state, sub, below)
            self.delivery.schedule_pump(conn)

    def _after_failed(self, fut: asyncio.Future[None]) -> None:
        if self.after and (fut.cancelled() or fut.exception() is not None):
            self.send_after()
            self.delivery.flush()

    def drain(self, conn: Connection, state: SessionState) -> bool:
        """Send queued retained messages while the connection takes them: its output below
        :data:`RETAINED_OUT_HIGH`, its shell not paused, QoS 1/2 ones within the in-flight
        window, none of its output waiting for the session file (the queue follows that write,
        as the group's records do: :meth:`~.delivery.Delivery.pump`).  Each message goes
        through the delivery planner (:meth:`~.delivery.Delivery.deliver_retained`: read
        rights, expiry, identifier, packet id, Maximum Packet Size, in flight, the QoS 2
        hold); here only the queue.  The queue holds the store's messages (no payload
        copies); True when empty."""
        queue = self.out.get(conn)
        if queue is None:
            return True
        inflight = state.qos.inflight
        blocked = False
        deliver = self.delivery.deliver_retained
        while queue and not conn.closed and not conn.paused:
            if len(conn.out) >= RETAINED_OUT_HIGH:
                break
            if state.holding():
                # Output waits for the session file (a QoS 2 id, a live delivery's or one of
                # these): nothing overtakes it; its write pumps again (Delivery.release_output).
                blocked = True
                break
            f, m, qos = queue[0]
            if qos and len(inflight) >= max(conn.max_inflight, 1):
                blocked = True  # the acks that free the window pump again
                break
            queue.popleft()
            deliver(conn, state, m, qos, state.subscription_identifier(f))
        if queue:
            if not blocked and not conn.paused and not conn.closed:
                self.delivery.schedule_repump(conn)  # after this event's flush wrote the output
            return False
        del self.out[conn]
        return True
