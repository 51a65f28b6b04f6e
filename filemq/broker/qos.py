"""The QoS 1/2 state machine of a session, both ways (MQTT 4.3, 4.4): the PUBACK / PUBREC /
PUBCOMP a subscriber answers the broker's deliveries with; a publisher's QoS 2 exchange (a
re-sent id recognised and not stored twice, PUBREC behind the commit and the session file,
PUBREL -> PUBCOMP); and on reconnect the re-send of what is unacknowledged.

What holds:

* An acknowledgement that does not fit the in-flight message's state (a PUBACK for a QoS 2
  delivery, a PUBCOMP before PUBREC) is a protocol violation: the connection closes and the
  message stays in flight (MQTT-4.8.0-1, 4.3).
* A delivery's record is acked in its consumer group once the client has it: at PUBACK, or at
  PUBREC (a persistent session: once the session file holds the id awaiting PUBCOMP, so a
  restart re-sends the PUBREL).
* A QoS 2 PUBLISH whose id is held (stored, PUBREL not come) is answered with PUBREC again
  and not stored twice; an id is held from its append (or its ack-and-drop) until PUBREL, and
  a persistent session's PUBREC leaves only once its file holds the id.
* A PUBCOMP leaves only once a persistent session's file no longer holds the released
  inbound id (the client may reuse the id right after).
* On reconnect every unacknowledged PUBLISH is re-sent with its id and DUP = 1, in the order
  first sent, and every PUBREL not answered (MQTT-4.4.0-1).

The window refills at a quarter (:func:`refill_mark`); reads of many PUBACKs are acked in
bulk (``ConsumerGroup.ack_many``).  The state itself, and the per-connection inbound half
(acks behind commits, Receive Maximum), are the session module's (filemq/broker/session/connection.py).
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import add, attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, cast

from filemq.broker.session.connection import Connection
from filemq.broker.session.inflight import Inflight, Outbound, SentRun, message_of
from filemq.broker.session.qos_state import QosState
from filemq.broker.session_state import (
    _PUBCOMP,
    _PUBREC,
    _PUBREL,
    SessionState,
    _ack,
)
from filemq.common.native import mypyc_attr
from filemq.mqtt.packets import Publish

if TYPE_CHECKING:
    import asyncio

    from filemq.broker.delivery import Delivery
    from filemq.broker.registry import SessionRegistry
    from filemq.queue.groups import ConsumerGroup
    from segments.log import LogView

log = logging.getLogger("filemq.broker")

# SentRecord.group and .offset, in C; typed for any in-flight entry: only a SentRecord (a
# tuple) has items, anything else raises TypeError (on_pubacks relies on it).
_group_of_sent = cast("Callable[[object], ConsumerGroup | None]", itemgetter(1))
_offset_of_sent = cast("Callable[[object], int]", itemgetter(0))
_delta_of = attrgetter("delta")  # SentRun.delta


def _same_group_runs(outs: Iterable[Any], group: ConsumerGroup) -> bool:
    """Whether every entry of ``outs`` (a read's distinct in-flight entries) is a SentRun of
    ``group`` (no hashing of the entries: a SentRecord is a tuple of its fields)."""
    return all(type(out) is SentRun and out.group is group for out in outs)


_NO_GROUPS: set[ConsumerGroup | None] = set()

_consume: Callable[[Iterable[Any]], Any] = functools.partial(deque, maxlen=0)  # runs an iterator to its end in C
# Reads with at least this many PUBACKs take on_pubacks' bulk path; below it its sets and
# lists cost more than the per-id loop (callgrind, WINDOW=20: +8 % Ir per delivery at 5 per
# read, +1.4 % at 10, -3.6 % at 20, -8 % at 100; docs/PERFORMANCE.md).
_BULK_ACKS = 16
# Reads of at most this many PUBACKs take on_pubacks' per-id loop, also for gap-free runs
# (callgrind, a read of 2-6 PUBACKs of run-path deliveries: ~10,000 Ir less per read than the
# maps; docs/PERFORMANCE.md).
_SMALL_READ = 8


def refill_mark(window: int) -> int:
    """Messages in flight at or below which a window of ``window`` is refilled: a quarter of
    it, at least one (:meth:`QosAcks._refill`; filemq.broker.batching waits for the
    acks that bring a subscriber down to it)."""
    return window >> 2 or 1


@mypyc_attr(native_class=False)  # (tests replace its methods on the instance: on_pubacks)
class QosAcks:
    """The QoS 1/2 exchanges of every session, both ways (see the module docstring).  Owns no
    state of its own: the packet ids, in-flight windows and QoS 2 id sets are the session's
    (:class:`~filemq.broker.session.connection.QosState`, ``state.qos``), whose methods are their
    transitions; this part calls them and carries out what they cause outside the session:
    acked records go to their groups, session files are written, and the progress journal's
    cadence, window refills and the output are delivery's."""

    def __init__(self, log_view: LogView, registry: SessionRegistry, delivery: Delivery) -> None:
        self.log = log_view
        self.registry = registry
        self.delivery = delivery

    # ---- inbound QoS 2: PUBLISH -> PUBREC -> PUBREL -> PUBCOMP (4.3.3) --------------------

    def received_again(self, state: SessionState, p: Publish) -> tuple[bool, asyncio.Future[None] | None]:
        """Whether QoS 2 PUBLISH ``p`` re-sends a message stored already whose PUBREL has not
        come (then it gets its PUBREC again and is not stored twice, 4.3.3), and that message's
        commit (None once settled).  An id whose commit failed names nothing stored; one read
        from the session file after a restart names a stored message only if the log holds
        this very message at the id's offset (otherwise it is stored, at worst twice)."""
        pid = p.packet_id
        assert pid is not None
        qos = state.qos
        qos2_in = qos.qos2_in
        fut = cast("asyncio.Future[None] | None", qos2_in.get(pid))  # (a Commit the core made)
        if fut is not None and fut.done() and (fut.cancelled() or fut.exception() is not None):
            del qos2_in[pid]  # its commit failed: nothing was stored, store this one
        if pid in qos.qos2_loaded:
            qos.qos2_loaded.discard(pid)
            if not self._stored_at(qos.qos2_offsets.get(pid), p):
                del qos2_in[pid]
                qos.qos2_offsets.pop(pid, None)
        # (The set is exact -- ids leave it durably before PUBCOMP -- so an id in it names
        # the stored message.)
        return pid in qos2_in, fut

    def pubrec_again(self, conn: Connection, pid: int, stored: asyncio.Future[None] | None) -> None:
        """PUBREC again for QoS 2 id ``pid``, stored already (``stored``: its commit, None
        once settled), once the id is durable too."""
        state = conn.session
        assert state is not None
        wait: asyncio.Future[None] | None = None
        if stored is not None and not stored.done():
            wait = self.registry.qos2_gate(state, stored) if state.persistent else stored
        elif state.persistent and (state.save_running or state.save_next is not None):
            wait = self.registry.save_soon(state)
        conn.queue_ack(wait, _ack(_PUBREC, pid))
        if wait is not None and conn.last_batch is not wait:
            self.delivery.join_batch(conn, wait)

    def stored_qos2(self, conn: Connection, pid: int, offset: int, commit: asyncio.Future[None]) -> None:
        """QoS 2 id ``pid`` was appended at ``offset``: held until PUBREL; its PUBREC leaves once
        the record is committed and, in a persistent session, the id is in the session file."""
        state = conn.session
        assert state is not None
        state.qos.stored_qos2(pid, commit, offset)
        if state.persistent:
            commit = self.registry.qos2_gate(state, commit)
        conn.queue_ack(commit, _ack(_PUBREC, pid), offset)
        if conn.last_batch is not commit:
            self.delivery.join_batch(conn, commit)

    def dropped_qos2(self, conn: Connection, pid: int) -> None:
        """QoS 2 id ``pid`` acknowledged and dropped (admission): PUBREC now, the id held until
        PUBREL all the same, so a re-send is recognised (4.3.3)."""
        state = conn.session
        assert state is not None
        state.qos.dropped_qos2(pid)
        conn.queue_ack(None, _ack(_PUBREC, pid))

    def _stored_at(self, offset: int | None, p: Publish) -> bool:
        """Whether the log's record at ``offset`` is ``p`` (same topic and payload)."""
        if offset is None:
            return False
        try:
            records = self.log.read(offset, 1)
        except (OSError, ValueError) as exc:
            log.warning("reading offset %d to check a QoS 2 re-send failed: %s", offset, exc)
            return False
        return bool(records) and records[0].offset == offset and records[0].topic == p.topic \
            and records[0].payload == p.payload

    # ---- outbound: the re-send on reconnect (4.4) ---------------------------------------------

    def resend(self, conn: Connection, state: SessionState) -> None:
        """``state`` resumed on ``conn``: re-send each unacknowledged PUBLISH with its id and
        DUP = 1 and each PUBREL not answered by PUBCOMP, in the order first sent (4.4,
        MQTT-4.4.0-1)."""
        for pid, out in state.qos.inflight.items():
            if out.stage == 0:
                topic, payload = message_of(out, pid)
                conn.send(conn.publish_bytes(topic, payload, out.qos, True, pid, out.retain, out.headers))
            else:
                conn.send(_ack(_PUBREL, pid))

    def on_puback(self, conn: Connection, pid: int) -> None:
        self.on_pubacks(conn, (pid,))

    def on_pubacks(self, conn: Connection, pids: Sequence[int]) -> None:
        """PUBACKs, many at once when a read held nothing else."""
        state = conn.session
        assert state is not None
        inflight = state.qos.inflight
        n = len(pids)
        if n > _SMALL_READ:
            # (a read of 2.._SMALL_READ PUBACKs, a client that answers each PUBLISH in a send
            # of its own, takes the per-id loop below: the maps' fixed costs outweigh it there)
            outs = list(map(inflight.get, pids))
            first = outs[0]
            if type(first) is SentRun:
                # The common read: PUBACKs of gap-free runs (QoS 1, so no ack can be the
                # wrong one) of one group, acked with C-level maps and one ack_many. Anything
                # else (an unknown id, another kind of entry, two groups) takes the loop below.
                group = first.group
                if outs.count(first) == n:  # (identity: a SentRun has no __eq__)
                    offsets = list(map(add, pids, repeat(first.delta)))
                elif _same_group_runs(dict(zip(map(id, outs), outs, strict=True)).values(), group):
                    offsets = list(map(add, pids, map(_delta_of, outs)))
                else:
                    offsets = None
                if offsets is not None:
                    _consume(map(inflight.pop, pids, repeat(None)))  # (a repeated id: popped once)
                    group.ack_many(offsets)
                    self.delivery.note_acks(n)
                    self._refill(conn, inflight)
                    return
            elif n >= _BULK_ACKS:
                # SentRecords (runs with gaps) of one group, likewise.
                try:
                    # Only a SentRecord (a tuple) has an item 1: None (an unknown id) and an
                    # Outbound raise TypeError, and take the loop below.
                    groups = set(map(_group_of_sent, outs))
                except TypeError:
                    groups = _NO_GROUPS
                if len(groups) == 1:
                    _consume(map(inflight.pop, pids, repeat(None)))  # (a repeated id: popped once)
                    sent_group = groups.pop()
                    if sent_group is not None:
                        sent_group.ack_many(list(map(_offset_of_sent, outs)))
                        self.delivery.note_acks(n)
                    self._refill(conn, inflight)
                    return
        acked = 0
        for pid in pids:
            out = inflight.get(pid)
            if out is None:
                log.debug("client %r: PUBACK for unknown packet id %d ignored", conn.client_id, pid)
                continue
            if out.qos != 1:
                self._wrong_ack(conn, "PUBACK", pid, out)
                break
            del inflight[pid]
            if out.group is not None:
                out.group.ack(pid + out.delta if type(out) is SentRun else out.offset)  # type: ignore[union-attr]
                acked += 1
        if acked:
            self.delivery.note_acks(acked)
        self._refill(conn, inflight)

    def _refill(self, conn: Connection, inflight: dict[int, Inflight]) -> None:
        """Fill ``conn``'s in-flight window again after acks, once at most a quarter of it
        (at least one message) is still in flight, not after every ack: a client that sends
        its PUBACKs one at a time then gets its next deliveries in one write of three quarters
        of a window, not one write (and one fetch) per PUBACK, while the last quarter keeps it
        busy; the credit batching of RabbitMQ's ``credit_flow``.  Nothing stalls: above the
        mark, messages are in flight, and their acks come back here.  A window of 2 (an MQTT 5
        Receive Maximum) is refilled after each ack, as flow control's tests expect (4.9).
        (A quarter, not half as before 2026-11-27: each refill, its fetch, its write and the
        wake-up of the subscriber it costs carry 24 deliveries of the default 32 instead of
        16 -- 10 % fewer instructions per delivery in bench.callgrind_delivery, 4-10 % less
        CPU with such clients, docs/PERFORMANCE.md -- for the same duplicates after a crash,
        which the window sets.)"""
        if len(inflight) <= refill_mark(conn.max_inflight):
            self.delivery.schedule_pump(conn)

    def on_pubrec(self, conn: Connection, pid: int, reason_code: int = 0) -> None:
        state = conn.session
        assert state is not None
        qos = state.qos
        out = qos.inflight.get(pid)
        if out is not None and out.qos != 2:
            self._wrong_ack(conn, "PUBREC", pid, out)
            return
        assert out is None or isinstance(out, Outbound)  # (QoS 2: SentRecord and SentRun are QoS 1)
        if reason_code >= 0x80:
            # MQTT 5: a PUBREC with a failure reason code ends the exchange; no PUBREL is sent
            # and the packet id is free again (4.3.3, MQTT-4.3.3-4 / 4.9: the quota returns).
            if out is not None and out.stage == 0:
                if qos.refused(pid):
                    self.registry.save_soon(state)
                if out.group is not None:
                    out.group.ack(out.offset)
                    self.delivery.note_acks(1)
                log.info("client %r: PUBREC 0x%02x for packet id %d: the receiver refused the message",
                         conn.client_id, reason_code, pid)
                self._refill(conn, qos.inflight)
            return
        if out is not None and out.stage == 0:
            assert isinstance(out, Outbound)  # a SentRecord is QoS 1 (refused above)
            qos.received(out, pid, state.persistent)
            if state.persistent:
                # The id awaiting PUBCOMP is session state (3.1.2.4): written before the
                # group's ack can be, so after a restart the PUBREL is re-sent (a receiver
                # may hand the message on only at PUBREL, 4.3.3 Method A).
                written = self.registry.save_soon(state)
                if out.group is not None:
                    written.add_done_callback(functools.partial(self._ack_released, out.group, out.offset))
            elif out.group is not None:
                # The client has the message: the group may move on; only the id is pending.
                out.group.ack(out.offset)
                self.delivery.note_acks(1)
        # Also for an unknown id or a repeated PUBREC: PUBREL is idempotent (4.3.3).
        conn.send(_ack(_PUBREL, pid))

    def on_pubcomp(self, conn: Connection, pid: int) -> None:
        state = conn.session
        assert state is not None
        qos = state.qos
        out = qos.inflight.get(pid)
        if out is None:
            log.debug("client %r: PUBCOMP for unknown packet id %d ignored", conn.client_id, pid)
            return
        if out.qos != 2 or out.stage == 0:
            self._wrong_ack(conn, "PUBCOMP", pid, out)
            return
        assert isinstance(out, Outbound)  # (QoS 2: SentRecord and SentRun are QoS 1)
        named = qos.completed(pid)
        if out.group is not None and out.group.ack(out.offset):
            self.delivery.note_acks(1)  # not acked at PUBREC yet (session write pending or failed)
        if named:
            # Written soon, in a worker thread (nothing waits: a stale id would only cost one
            # PUBREL after a crash, which the client answers with PUBCOMP).
            self.registry.save_soon(state)
        self._refill(conn, qos.inflight)

    def resume_outbound(self, state: SessionState, sent: dict[int, int]) -> None:
        """A persistent session loaded from its file (after a restart): every QoS 2 PUBLISH
        it had sent and not completed (``sent``: id -> offset) goes back in flight with its own
        packet id, to be re-sent with DUP on connect (MQTT-4.4.0-1), so the client that holds
        the id (4.3.3 method B) takes it for the duplicate it is and no new message ever gets
        that id while the client may hold it (MQTT-2.2.1-3).  The group's redelivery from
        Pending then skips those offsets.  An id already PUBREC'd (its PUBREL is pending)
        learns its record, which its PUBCOMP acks; an id whose record is gone (retention)
        gets a PUBREL, which frees it at the client."""
        group = state.group
        qos = state.qos
        inflight = qos.inflight
        for pid, offset in sorted(sent.items()):
            out = inflight.get(pid)
            if out is not None:  # PUBREC'd before the restart: PUBREL re-sent on connect
                if group is not None and offset >= group.pending_offset and isinstance(out, Outbound):
                    out.offset, out.group = offset, group
                    qos.resumed_offsets.add(offset)
                qos.qos2_sent[pid] = offset
                continue
            if offset < 0:
                # A retained message's delivery (no group) or a shared group's record: its
                # PUBREL frees the id at the client (4.3.3); a retained message is not sent
                # again (as ever), a shared one comes again from its group (new id).
                qos.release_only(pid)
                qos.qos2_sent[pid] = offset
                continue
            if group is None or offset < group.pending_offset:
                continue  # acked: its PUBCOMP came (the group acks a QoS 2 delivery after PUBREC)
            qos.qos2_sent[pid] = offset
            found = self.log.read(offset, 1)
            if not found or found[0].offset != offset:
                qos.release_only(pid)
                continue
            r = found[0]
            inflight[pid] = Outbound(offset, group, 2, r.topic, r.payload, None, r.retain, r.headers)
            qos.resumed_offsets.add(offset)

    def _ack_released(self, group: ConsumerGroup, offset: int, written: asyncio.Future[None]) -> None:
        """The group's ack of a record PUBREC'd by a persistent session, once the session file
        holds its id; after a failed write the PUBCOMP acks it (until then it stays unacked:
        re-sent after a restart, not lost)."""
        if written.cancelled() or written.exception() is not None:
            return
        group.ack(offset)
        self.delivery.note_acks(1)
        self.delivery.flush()

    def _wrong_ack(self, conn: Connection, ack: str, pid: int, out: Inflight) -> None:
        """An acknowledgement that does not fit the in-flight message's state is a protocol
        violation (MQTT-4.8.0-1, 4.3): close; the message stays in flight and is re-sent
        (DUP = 1, or its PUBREL) when the session reconnects."""
        conn.close(f"protocol error: {ack} for packet id {pid}, which awaits {QosState.expected_ack(out)} "
                   f"(QoS {out.qos} delivery; MQTT-4.8.0-1)", will=True, level=logging.WARNING)

    def on_pubrel(self, conn: Connection, pid: int) -> None:
        state = conn.session
        assert state is not None
        known = state.qos.released_qos2(pid)
        if state.persistent and (known or state.save_running or state.save_next is not None):
            # The removal is durable before PUBCOMP, so the id set on disk stays exact: after
            # PUBCOMP the client may reuse the id for a new message, which must be stored.
            done = self.registry.save_soon(state)
            conn.queue_ack(done, _ack(_PUBCOMP, pid))
            if conn.last_batch is not done:
                self.delivery.join_batch(conn, done)
        else:
            conn.queue_ack(None, _ack(_PUBCOMP, pid))

