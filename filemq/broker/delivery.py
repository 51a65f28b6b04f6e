"""Outbound delivery: pumping consumer groups into connections within the in-flight
window, the output path (one write per connection per loop pass), the commit batches inbound
acks wait on, and what a disconnect releases.  The acknowledgements of deliveries are
filemq/broker/qos.py's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence, Set
from itertools import repeat
from typing import TYPE_CHECKING, Any, cast

from filemq.broker.session.connection import Connection
from filemq.broker.session.inflight import Outbound, SentRecord, SentRun
from filemq.broker.session_state import (
    _MAX_PUMP,
    JOURNAL_INTERVAL_S,
    JOURNAL_MAX_ACKS,
    PERSIST_DELAY_S,
    PublisherRuns,
    SessionState,
    SharedGroup,
    Subscription,
    message_expiry,
)
from filemq.common.native import mypyc_attr
from filemq.mqtt.codec import publish_bytes, publish_bytes5
from filemq.mqtt.packets import PROTOCOL_LEVEL_5
from filemq.mqtt.runcodec import (
    all_plain,
    publish_prefixes5,
    publish_run,
    publish_run_prefixed,
    publish_run_prefixed5,
)
from segments.record import (
    Record,
    record_offset,
    record_payload,
    record_topic,
)

if TYPE_CHECKING:
    from filemq.broker.ports import QueuePort
    from filemq.broker.registry import SessionRegistry
    from filemq.broker.router import Router
    from filemq.broker.sysinfo import BrokerStats
    from filemq.broker.tailcache import TailCache
    from filemq.queue.groups import ConsumerGroup
    from filemq.queue.retained import RetainedMessage
    from segments.log import LogView

log = logging.getLogger("filemq.broker")


def _nothing_queued(conn: Connection, state: SessionState) -> bool:
    return True


# A SentRecord from a tuple of its fields, in C (SentRecord(...) runs Python-level __new__).
_sent_record = cast(Callable[[Iterable[Any]], SentRecord], functools.partial(tuple.__new__, SentRecord))


SYS_OFFSET = 1 << 62
"""The offset a ``$SYS`` message (never in the log) is planned under: past every subscription's
start, so each subscription that matches its topic now takes it."""


def _acks_nothing(offset: int) -> bool:
    return False


def _never_redelivered(offset: int) -> bool:
    return False


def _replay_rules(qos: int, ids: bytes) -> tuple[Callable[[str, int, str | None, bool], int],
                                                 Callable[[str, int, str | None, bool, bool], tuple[int, bytes, bool]]]:
    """The planner's ``granted_qos`` and ``match5`` for a retained replay: a retained message
    sent because of a SUBSCRIBE goes to that subscription alone, at ``qos``, with its
    identifier property ``ids`` (3.3.4, MQTT-3.3.4-3; MQTT 5 only: 3.1.1 asks ``granted``),
    RETAIN 1 (MQTT-3.3.1-8: retain as published does not apply, 3.3.1.3), no local not asked."""
    def granted(topic: str, offset: int, share: str | None, retain: bool) -> int:
        return qos

    def match(topic: str, offset: int, share: str | None, retain: bool, own: bool) -> tuple[int, bytes, bool]:
        return qos, ids, True

    return granted, match


RetainedQueue = deque[tuple[str, "RetainedMessage", int]]
"""Retained messages a SUBSCRIBE matched and a connection has not taken yet (filter, message, QoS)."""
RetainedReplay = list[tuple[SessionState, Subscription, int]]
"""Retained replays waiting for the routed offset to reach theirs (session, subscription, below)."""


@mypyc_attr(native_class=False)  # (tests and benches replace its methods on the instance: pump, _deliver_run, persist_offsets)
class Delivery:
    """Outbound delivery and the output path: what leaves for each connection, in one write
    per connection per event-loop pass (the acks that free its window: :class:`~.qos.QosAcks`).

    Owns the dirty set (connections with output), the re-pump sets, the commit batches acks
    wait on, the progress-journal cadence and the offset-file nudge."""

    def __init__(self, queue: QueuePort, cache: TailCache, stats: BrokerStats, router: Router,
                 registry: SessionRegistry, publishers: PublisherRuns) -> None:
        self.queue = queue
        self.log: LogView = queue.log  # only its read side: a test fake stands in (compiled build)
        # (A bound method, not self.queue.groups_acked(): one lookup per flush less.)
        self._groups_acked: Callable[[], int] = queue.groups_acked
        self.cache = cache
        self.stats = stats
        self.router = router
        self.registry = registry
        self.publishers = publishers
        # The retained part's queues (read here: live records go after a connection's
        # retained ones, never before); drain_retained sends from them (see wire_retained).
        self._retained_out: dict[Connection, RetainedQueue] = {}
        self._retained_after: dict[Connection, RetainedReplay] = {}
        self.drain_retained: Callable[[Connection, SessionState], bool] = _nothing_queued
        self._dirty: set[Connection] = set()
        self._batches: dict[asyncio.Future[None], set[Connection]] = {}
        self._repump: set[Connection] = set()
        self._to_pump: set[Connection] = set()
        self._repump_scheduled = False
        self._flush_scheduled = False  # a flush_soon() is pending for this loop pass
        self._journal_scheduled = False  # a progress-journal append is pending (this pass or timed)
        self._journal_at = 0.0  # loop.time() of the last progress-journal append
        self._acked = False  # group acks since the last persistence nudge
        self._acks = 0  # group acks not yet in the progress journal (a lower bound: see flush)
        self._persist_handle: asyncio.TimerHandle | None = None
        self._persist_task: asyncio.Task[None] | None = None

    def wire_retained(self, out: dict[Connection, RetainedQueue], after: dict[Connection, RetainedReplay],
                      drain: Callable[[Connection, SessionState], bool]) -> None:
        """The retained part's per-connection queues and the method that sends from them."""
        self._retained_out = out
        self._retained_after = after
        self.drain_retained = drain

    # ---- output --------------------------------------------------------------------------

    def mark_dirty(self, conn: Connection) -> None:
        self._dirty.add(conn)

    def flush_soon(self) -> None:
        """Flush once the callbacks of this event-loop pass ran: the acks a commit releases
        (its future's callbacks) and the deliveries it routes (its listener) leave for one
        connection in one write, not one each."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_pass)

    def _flush_pass(self) -> None:
        self._flush_scheduled = False
        self.flush()

    def _journal_pass(self) -> None:
        """The timed append (JOURNAL_INTERVAL_S after the previous one)."""
        self._journal_scheduled = False
        if self._acked:
            self._journal_at = asyncio.get_running_loop().time()
            self._journal_now()

    def _journal_now(self) -> None:
        self._acked = False
        self._acks = 0
        self.queue.journal_progress()
        if self._persist_handle is None:
            self._persist_handle = asyncio.get_running_loop().call_later(PERSIST_DELAY_S, self.persist_offsets)

    async def stop_persisting(self) -> None:
        """Cancel the pending offset nudge; wait for an offset write in progress (shutdown)."""
        if self._persist_handle is not None:
            self._persist_handle.cancel()
            self._persist_handle = None
        if self._persist_task is not None:
            await asyncio.gather(self._persist_task, return_exceptions=True)

    def note_acks(self, n: int) -> None:
        """``n`` records were acked in their groups (the QoS part): the progress journal and
        the offset files follow (see :meth:`flush`)."""
        self._acked = True
        self._acks += n

    def schedule_pump(self, conn: Connection) -> None:
        """Pump ``conn`` at the next flush (with the other connections whose window freed)."""
        self._to_pump.add(conn)

    def forget(self, conn: Connection) -> None:
        """``conn`` closed: nothing more is written or pumped to it."""
        self._dirty.discard(conn)
        self._repump.discard(conn)
        self._to_pump.discard(conn)

    # ---- acks released per commit batch ----------------------------------------------------

    def join_batch(self, conn: Connection, fut: asyncio.Future[None]) -> None:
        """Have ``conn``'s acks released when the commit ``fut`` resolves (one callback per batch)."""
        conns = self._batches.get(fut)
        if conns is None:
            conns = self._batches[fut] = set()
            fut.add_done_callback(self._on_batch_done)
        conns.add(conn)
        conn.last_batch = fut

    def _on_batch_done(self, fut: asyncio.Future[None]) -> None:
        """Release the acks a commit batch covers, connection by connection."""
        conns = self._batches.pop(fut, ())
        for conn in conns:
            if conn.last_batch is fut:
                conn.last_batch = None
            if not conn.closed:
                conn.ack_ready()
        self.flush_soon()  # with the deliveries this commit routes, in one write per connection

    def pending_commits(self) -> list[asyncio.Future[None]]:
        """Commit futures that acks are still waiting for."""
        return [f for f in self._batches if not f.done()]

    # ---- delivery --------------------------------------------------------------------------

    def pump(self, conn: Connection) -> None:
        """Push records to ``conn`` while its in-flight window has room."""
        state = conn.session
        if state is None or conn.closed or conn.paused or state.conn is not conn or state.holding():
            return
        if conn in self._retained_after or (conn in self._retained_out and not self.drain_retained(conn, state)):
            return  # live records after the retained ones, never before
        group = state.group
        pushed = 0
        if group is not None:
            cid = conn.client_id
            while pushed < _MAX_PUMP:
                room = conn.max_inflight - len(state.qos.inflight)
                if room <= 0 or conn.paused or state.holding():
                    break
                records = group.fetch(min(room, 100), cid)
                if not records:
                    break
                self._deliver(conn, state, group, records, None)
                pushed += len(records)
            if pushed >= _MAX_PUMP:
                self.schedule_repump(conn)
        for name in state.share_names():
            sh = self.router.shares.get(name)
            if sh is not None:
                self.pump_share(sh)

    def flush(self) -> None:
        """Hand every connection's queued output to its shell (``conn.write``), one write each."""
        if self._acked:
            if not self._journal_scheduled:
                # One journal append after the loop pass of the first acks, and at most one
                # per JOURNAL_INTERVAL_S: a kill -9 re-delivers only the acks of about that long.
                self._journal_scheduled = True
                loop = asyncio.get_running_loop()
                wait = self._journal_at + JOURNAL_INTERVAL_S - loop.time()
                if wait > 0:
                    loop.call_later(wait, self._journal_pass)
                else:
                    loop.call_soon(self._journal_pass)
            elif self._acks >= JOURNAL_MAX_ACKS and self._acks >= JOURNAL_MAX_ACKS * self._groups_acked():
                # Quick passes acked JOURNAL_MAX_ACKS per group that acked before the interval
                # ran out: append now, so a kill -9 re-delivers about that many acks per group
                # (plus its in-flight window). Per group, not in all: ten busy subscribers
                # would append every few reads, for a bound on each ten times tighter than
                # needed. The timer stays: it appends what is acked after this, if anything
                # (no timer made and cancelled per append).
                self._journal_now()
        if self._to_pump:
            # Window room freed by the acks of one read is filled with one fetch, not one each.
            to_pump, self._to_pump = self._to_pump, set()
            for conn in to_pump:
                self.pump(conn)
        dirty = self._dirty
        if not dirty:
            return
        self._dirty = set()
        sent = 0
        for conn in dirty:
            write = conn.write
            if conn.closed or write is None:
                continue
            data = conn.data_to_send()
            if data:
                sent += len(data)
                write(data)
        self.stats.sent_bytes(sent)

    def schedule_repump(self, conn: Connection) -> None:
        self._repump.add(conn)
        if not self._repump_scheduled:
            self._repump_scheduled = True
            asyncio.get_running_loop().call_soon(self._do_repump)

    def _do_repump(self) -> None:
        self._repump_scheduled = False
        conns, self._repump = self._repump, set()
        for conn in conns:
            self.pump(conn)
        self.flush()

    def pump_share(self, sh: SharedGroup) -> None:
        """Hand the shared group's records to its live members, a few at a time each."""
        members = [m for m in sh.members if not m.closed and not m.paused and m.session is not None
                   and not m.session.holding()]
        if not members:
            return
        group = sh.group
        for _ in range(_MAX_PUMP):
            progress = False
            n = len(members)
            for i in range(n):
                conn = members[(sh.rr + i) % n]
                state = conn.session
                assert state is not None
                room = conn.max_inflight - len(state.qos.inflight)
                if room <= 0 or conn.paused:
                    continue
                records = group.fetch(min(room, 8), conn.client_id)
                if records:
                    progress = True
                    self._deliver(conn, state, group, records, sh.name)
            sh.rr += 1
            if not progress:
                return

    def deliver_retained(self, conn: Connection, state: SessionState, m: RetainedMessage, qos: int,
                         ids: bytes) -> bool:
        """Send retained message ``m`` to ``conn`` because of a SUBSCRIBE (the retained part's
        :meth:`~.retain.Retained.drain`): at ``qos`` (the subscription's, at most the message's)
        with ``ids``, the subscription's identifier property (3.3.4; b"": none), through the
        delivery planner (:meth:`_deliver`).  True when its output waits for the session file
        (a QoS 2 id on a persistent session): the rest of the queue follows that write."""
        record = Record(m.offset, m.timestamp_us, m.topic, m.payload, m.qos, True, m.headers)
        return self._deliver(conn, state, None, [record], None, (qos, ids))

    def deliver_sys(self, conn: Connection, state: SessionState, topic: str, payload: bytes,
                    ids: bytes | None = None) -> None:
        """Send the broker's ``$SYS`` message (never in the log) to ``conn`` at QoS 0 through the
        delivery planner (:meth:`_deliver`): live (``ids`` None) to the subscriptions that
        match its topic now, with their identifiers (MQTT-3.3.4-3), RETAIN 0; or, with ``ids``
        (a new subscription's identifier property, b"": none), as the kept message a new
        subscription gets, RETAIN 1 (the :class:`~.systopics.SysTopics` part decides which).
        The read rights, Maximum Packet Size and topic aliases are any delivery's.  (No
        client publishes to ``$`` topics, so no output held for the session file carries a
        ``$SYS`` topic's alias: a ``$SYS`` message may leave before it.)"""
        record = Record(SYS_OFFSET, 0, topic, payload, 0, ids is not None, b"")
        self._deliver(conn, state, None, [record], None, None if ids is None else (0, ids))

    def _deliver(self, conn: Connection, state: SessionState, group: ConsumerGroup | None,
                 records: list[Record], share: str | None, replay: tuple[int, bytes] | None = None) -> bool:
        """The delivery planner: send ``records`` (fetched from ``group`` for ``conn``) in one
        write.  For each record, in order, one set of rules for both protocols decides whether
        it goes out, at which QoS and with which packet id; only the encoding and what MQTT 5
        adds differ by protocol:

        * in flight again since a restart, with its old id: skipped (``resumed_offsets``);
        * the granted QoS of the subscriptions that match it (none, or older than the
          subscription: acked, not sent; MQTT 5 also: no local, MQTT-3.8.3-3), and the
          receiving user's read rights (the ACL): else acked;
        * expired (3.3.2.3.3, MQTT-3.3.2-5): acked; MQTT 5 gets the remaining expiry interval
          (MQTT-3.3.2-6) and the matching subscriptions' identifiers (3.3.4);
        * the QoS: the lower of the granted one and the message's; QoS 0 is acked at once;
        * a packet id: the next free one from ``next_pid`` (MQTT-2.3.1-2); in flight with it
          (the stored properties too: re-sent with them after a reconnect, 4.4);
        * MQTT 5: larger than the client's Maximum Packet Size as it would be sent (topic
          alias included): discarded as delivered (MQTT-3.1.2-25; no packet id taken); retain
          as published (MQTT-3.3.1-12/-13); topic aliases;
        * QoS 2 on a persistent session: from its first new id on, the output waits for the
          session file (:meth:`_hold_output`).

        ``replay=(qos, ids)``: ``records`` are retained messages sent because of a SUBSCRIBE
        (:meth:`deliver_retained`; ``group`` None, nothing to ack): the same rules, with the
        subscription's QoS and identifier property given instead of matched, RETAIN 1 on both
        protocols (MQTT-3.3.1-8; retain as published does not apply, 3.3.1.3), no no local,
        never a resumed offset, in flight with no group.  True when output waits for the
        session file (a retained replay stops there, its queue follows the write).
        ``group`` None without ``replay``: a live ``$SYS`` message (:meth:`deliver_sys`, QoS 0,
        offset :data:`SYS_OFFSET`): matched as a group record is, nothing to ack.

        A qualifying run takes :meth:`_deliver_run`, the same outcome in C loops."""
        granted: Callable[[str, int, str | None, bool], int]
        match: Callable[[str, int, str | None, bool, bool], tuple[int, bytes, bool]]
        ack: Callable[[int], bool]
        redelivered: Callable[[int], bool]
        qos_state = state.qos
        # The per-call choices of the three callers; the per-record loop below is one for all.
        if group is not None and replay is None:
            if len(records) > 1 and self._deliver_run(conn, state, group, records, share):
                return False
            granted = state.granted_qos
            match = state.match5
            ack = group.ack
            redelivered = group.redelivered
            resumed = qos_state.resumed_offsets if group is state.group else None
            retain = False  # MQTT-3.3.1-9 (3.1.1); MQTT 5: retain as published, per record
        elif replay is None:  # a live $SYS message: matched now, no group, nothing acked
            granted = state.granted_qos
            match = state.match5
            ack = _acks_nothing
            redelivered = _never_redelivered
            resumed = None
            retain = False
        else:  # a retained replay: no group, nothing acked, no DUP
            granted, match = _replay_rules(replay[0], replay[1])
            ack = _acks_nothing
            redelivered = _never_redelivered
            resumed = None
            retain = True  # MQTT-3.3.1-8, both protocols
        v5 = conn.protocol_level == PROTOCOL_LEVEL_5
        acl = conn.acl
        # Every delivery is checked against the receiving user's read rights (cached per topic).
        check_acl = acl is not None and not acl.allow_all
        inflight = qos_state.inflight
        publishers = self.publishers if v5 and group is not None and state.has_no_local() else None
        own_runs = state.own_runs if publishers is not None and state.own_runs else None
        cid = conn.client_id
        limit = conn.client_max_packet if v5 else None
        alias_max = conn.alias_max if v5 else 0
        parts: list[bytes] = []
        now_us = 0
        hold = -1  # parts from this index on wait for the session file (a new QoS 2 id in it)
        ids = b""
        for r in records:
            offset = r.offset
            if resumed and offset in resumed:
                resumed.discard(offset)  # in flight again since the restart, with its old id
                continue
            topic = r.topic
            if v5:
                own = publishers is not None and (publishers.get(offset) == cid
                                                  or (own_runs is not None and own_runs.holds(offset)))
                qos, ids, keep_retain = match(topic, offset, share, r.retain, own)
                retain = keep_retain and r.retain
            else:
                qos = granted(topic, offset, share, r.retain)
            if qos < 0 or (check_acl and not acl.can_receive(topic)):  # type: ignore[union-attr]
                ack(offset)
                continue
            headers = r.headers
            if headers:  # an MQTT 5 message: it may have expired
                now_us = now_us or time.time_ns() // 1000
                expiring = message_expiry(headers, r.timestamp_us, now_us)
                if expiring is None:
                    ack(offset)
                    continue
                if v5:
                    headers = expiring
            if ids:
                headers += ids
            if r.qos < qos:
                qos = r.qos
            if qos == 0:
                ack(offset)
                if not v5:
                    parts.append(publish_bytes(topic, r.payload, 0, False, None, retain))
                    continue
                data = publish_bytes5(topic, r.payload, 0, False, None, retain, headers)
                if alias_max:
                    data = conn.aliased(data, topic, r.payload, 0, False, None, retain, headers, limit)
                if limit is not None and len(data) > limit:
                    self.too_large(conn, topic, len(data), limit)
                    continue
                parts.append(data)
                continue
            pid = qos_state.free_pid()
            if v5:
                data = publish_bytes5(topic, r.payload, qos, redelivered(offset), pid, retain, headers)
                if alias_max:
                    data = conn.aliased(data, topic, r.payload, qos, data[0] & 0x08 != 0, pid, retain, headers, limit)
                if limit is not None and len(data) > limit:
                    ack(offset)
                    self.too_large(conn, topic, len(data), limit)
                    continue
            else:
                data = publish_bytes(topic, r.payload, qos, redelivered(offset), pid, retain)
            qos_state.take_pid(pid)
            # The properties as sent (MQTT 5: expiry, identifiers), so a re-send after a
            # reconnect (4.4) repeats them; onward delivery has started, so it is re-sent even
            # if the message expires meanwhile.  (3.1.1: the record's own, for a session that
            # resumes on MQTT 5.)
            inflight[pid] = Outbound(offset, group, qos, topic, r.payload, share, retain, headers)
            if qos == 2 and state.persistent:
                # (-1: a shared group's record or a retained message; after a restart its
                # PUBREL frees the id, and a share's group hands the record out again, to any
                # member)
                qos_state.qos2_sent[pid] = offset if resumed is not None else -1
                if hold < 0:
                    hold = len(parts)
            parts.append(data)
        if parts:
            self.stats.publish_sent(len(parts))
            if hold >= 0:
                parts = self._hold_output(conn, state, parts, hold)
            if parts:
                conn.send(parts[0] if len(parts) == 1 else b"".join(parts))
        return hold >= 0

    def _deliver_run(self, conn: Connection, state: SessionState, group: ConsumerGroup,
                     records: list[Record], share: str | None) -> bool:
        """:meth:`_deliver` of the common run, with the per-record work in C loops: every
        record goes out at QoS 1 (the same granted QoS for every topic of the run from its
        lowest offset on, no record below it), none is retained, has headers, may be a
        redelivery (DUP) or is refused by the ACL, and a block of consecutive packet ids
        from ``next_pid`` on is free (the ids the per-record loop would take).  Sends the same
        bytes and leaves the same state as the loop; False (nothing done) when the run does
        not qualify.  MQTT 5 also needs: no subscription with no local
        or an identifier, no topic aliases to the client, and every PUBLISH surely within the
        client's Maximum Packet Size (records without headers have no expiry).

        It holds no rule of its own: each condition is asked of the rule's one home, the one
        the per-record loop asks (the granted QoS: ``SessionState.run_qos`` over
        ``granted_qos``'s cache; read rights: ``ClientAcl.can_receive``; DUP:
        ``ConsumerGroup.may_be_redelivered``; packet ids: ``QosState.take_pids``, the ids
        ``alloc_pid`` would give), and anything it does not recognise as the plain case goes
        to the loop.  Hypothesis pins it to the loop: the same bytes and the same in-flight
        state with and without it (``tests/test_broker_session.py::
        test_deliver_run_sends_what_the_record_loop_sends``, and its MQTT 5 twin in
        ``tests/test_broker_mqtt5_publish.py``)."""
        v5 = conn.protocol_level == PROTOCOL_LEVEL_5
        if v5 and (conn.alias_max or not state.plain5()):
            return False
        offsets: Sequence[int]
        prefixes: list[bytes] | None = None
        distinct: Set[str] | None = None
        if group.last_run is records and group.run_start >= 0:
            # The group's fetch read these as the gap-free run [run_start, run_start + n);
            # the tail cache may hold their PUBLISH prefixes (made once for all subscribers),
            # which it gives only for plain records (runcodec.all_plain); MQTT 5 maps them to
            # its own (runcodec.publish_prefixes5).
            lowest = group.run_start
            offsets = range(lowest, lowest + len(records))
            distinct = group.run_topics
            prefixes = self.cache.plain_prefixes(lowest, len(records))
        if prefixes is None and not all_plain(records):
            return False
        if distinct is None:
            offsets = list(map(record_offset, records))
            lowest = min(offsets)
            distinct = set(map(record_topic, records))
        if group.may_be_redelivered(lowest):
            return False
        acl = conn.acl
        if acl is not None and not acl.allow_all and not all(map(acl.can_receive, distinct)):
            return False
        if state.run_qos(distinct, lowest, share) != 1:
            return False
        payloads = list(map(record_payload, records))
        limit = conn.client_max_packet
        if v5 and limit is not None and max(map(len, payloads)) + 4 * max(map(len, distinct)) + 10 > limit:
            return False  # (a bound: fixed header <= 5, topic <= 2 + 4 per character, id 2, properties 1)
        pid = state.qos.take_pids(len(records))
        if not pid:
            return False
        end = pid + len(records)
        inflight = state.qos.inflight
        topics: list[str] = []
        if type(offsets) is range:
            # Gap-free: one SentRun for the whole run (each of its ids -> the same object).
            inflight.update(zip(range(pid, end), repeat(SentRun(lowest - pid, group, records, pid, share))))
        else:
            topics = list(map(record_topic, records))
            inflight.update(zip(range(pid, end), map(_sent_record, zip(
                offsets, repeat(group), topics, payloads, repeat(share), strict=False)), strict=True))
        self.stats.publish_sent(len(records))
        if prefixes is None:
            conn.send(publish_run(topics or list(map(record_topic, records)), payloads, pid, v5))
        elif v5:
            conn.send(publish_run_prefixed5(publish_prefixes5(prefixes), payloads, pid))
        else:
            conn.send(publish_run_prefixed(prefixes, payloads, pid))
        return True

    def _hold_output(self, conn: Connection, state: SessionState, parts: list[bytes], hold: int) -> list[bytes]:
        """``parts[hold:]`` begin with a QoS 2 PUBLISH whose id is new in ``state.qos.qos2_sent``:
        they leave once the session file holds it (so after a crash the broker knows every id
        the client may hold, MQTT-2.2.1-3 / 4.3.3); until then this session's deliveries wait,
        so nothing overtakes them.  Returns what may be sent now."""
        held = b"".join(parts[hold:])
        written = state.out_hold = self.registry.save_soon(state)
        written.add_done_callback(functools.partial(self.release_output, conn, state, held))
        return parts[:hold]

    def release_output(self, conn: Connection, state: SessionState, held: bytes,
                        written: asyncio.Future[None]) -> None:
        if state.out_hold is written:
            state.out_hold = None
        if state.conn is not conn or conn.closed:
            # In flight: re-sent (DUP) when the session reconnects (or was, by a new connection).
            if state.conn is not None and not state.conn.closed:
                self.pump(state.conn)
                self.flush()
            return
        if written.cancelled() or written.exception() is not None:
            conn.close("the session file could not be written (a QoS 2 delivery's packet id); "
                       "closing, the delivery is re-sent after the reconnect", will=True)
            return
        conn.send(held)
        self.pump(conn)
        self.flush()

    dropped_too_large = 0  # PUBLISHes not sent: larger than the client's Maximum Packet Size

    def too_large(self, conn: Connection, topic: str, size: int, limit: int) -> None:
        self.dropped_too_large += 1
        log.warning("client %r: PUBLISH to %r of %d bytes not sent: over its Maximum Packet Size %d "
                    "(MQTT-3.1.2-25); discarded as delivered", conn.client_id, topic, size, limit)

    def leave_share(self, conn: Connection, state: SessionState, name: str) -> None:
        """``conn`` stops being a member of share ``name`` (disconnect or last UNSUBSCRIBE)."""
        sh = self.router.shares.get(name)
        if sh is None:
            return
        if conn in sh.members:
            sh.members.remove(conn)
        # Its unacked shared records go to the other members, not back to it later.
        inflight = state.qos.inflight
        for pid in [p for p, o in inflight.items() if o.share == name and o.stage == 0]:
            del inflight[pid]
        if sh.group.release(conn.client_id):
            self.pump_share(sh)

    def persist_offsets(self) -> None:
        """Write the offsets of groups that subscribers acked into and that are due, ~100 ms
        after the acks (a journaled group is due once per ``journaled_persist_interval_ms``:
        the progress journal, not these files, bounds the re-delivery after a crash).

        The queue's own housekeeping runs once a second (an idle broker must not wake more
        often). The writes (fsync + rename) run in a worker thread.
        """
        self._persist_handle = None
        if self._persist_task is not None and not self._persist_task.done():
            self._acked = True  # try again after the running write
            return
        snapshots = self.queue.persist_due()
        if snapshots:
            self._persist_task = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self.queue.write_snapshots, snapshots), name="filemq-broker-offsets")
