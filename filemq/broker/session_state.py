"""The broker's per-client and per-share state and the publish hook's types: what the
concerns of :class:`~filemq.broker.core.BrokerCore` share.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from filemq.broker.session.connection import Connection
from filemq.broker.session.qos_state import QosState
from filemq.broker.session_store import StoredSession, StoredSubscription, StoredWill
from filemq.common.topics import (
    parse_shared,
    topic_matches,
)
from filemq.mqtt.packets import SUB_NO_LOCAL, SUB_QOS_MASK, SUB_RETAIN_AS_PUBLISHED, Publish
from filemq.mqtt.properties import encode_message_headers, encode_vbi

if TYPE_CHECKING:
    from filemq.broker.acl import ClientAcl
    from filemq.queue.groups import ConsumerGroup

log = logging.getLogger("filemq.broker")

SESSION_GROUP_PREFIX = "mqtt-session:"
SHARE_GROUP_PREFIX = "mqtt-share:"
CLEAN_GROUP_PREFIX = "mqtt-clean:"

_PUBACK = 0x40
_PUBREC = 0x50
_PUBREL = 0x62
_PUBCOMP = 0x70
RETAINED_OUT_HIGH = 256 * 1024  # retained PUBLISH bytes queued in one connection's output at once
PERSIST_DELAY_S = 0.1  # group offsets are written this long after subscriber acks
# Acked progress goes to the progress journal at most this often (after the loop pass of the
# first ack since the last append): a kill -9 re-delivers the in-flight window plus at most
# this long of acks, and a busy loop of small reads appends once per interval, not per pass.
JOURNAL_INTERVAL_S = 0.001
# ... and at the latest after the loop pass in which the acks since the last append reach this
# many per group acked into (Queue.groups_acked): a loop of quick passes (a subscriber draining a backlog while the publishers wait for
# a commit) can ack several windows within one interval (a kill -9 once re-delivered 120).
JOURNAL_MAX_ACKS = 40
_MAX_PUMP = 1000  # records pushed to one connection per wake-up before yielding the loop


# MQTT 5 reason codes the broker's PUBLISH/SUBSCRIBE handling sends (spec 2.4).
RC_UNSPECIFIED_ERROR = 0x80
RC_NOT_AUTHORIZED = 0x87
RC_TOPIC_FILTER_INVALID = 0x8F
RC_PACKET_TOO_LARGE = 0x95
RC_QUOTA_EXCEEDED = 0x97  # (also refusal_code's, filemq.broker.session.connection, and max_connections')
RC_PAYLOAD_FORMAT_INVALID = 0x99
# Offsets whose publisher's client id is remembered for no local (MQTT-3.8.3-3).
PUBLISHERS_KEPT = 65536


class PublisherRuns:
    """Who published each of the latest ``kept`` offsets (MQTT 5 publishers, for no local,
    MQTT-3.8.3-3), as runs of consecutive offsets of one client id: a read's run of
    PUBLISHes costs one entry, not one per message.  Offsets are added in increasing order
    (the log's); the oldest are dropped beyond ``kept``; :meth:`forget_from` drops what a
    failed commit never stored (the log reuses those offsets)."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        # Told of every run added and every forget_from (the core keeps, per persistent session
        # with no local, its own offsets beyond this bounded map: OwnRuns).
        self.sink: Callable[[int, int, str], None] | None = None
        self.forget_sink: Callable[[int], None] | None = None
        self._starts: list[int] = []  # first offset of each run, increasing
        self._ends: list[int] = []  # one past its last offset
        self._ids: list[str] = []
        self._head = 0  # runs before it are dropped (the lists are compacted now and then)
        self._count = 0  # offsets held

    def __len__(self) -> int:
        return self._count

    def add_run(self, first: int, n: int, client_id: str) -> None:
        """``client_id`` published offsets ``first`` .. ``first + n - 1``."""
        if n <= 0:
            return
        if self.sink is not None:
            self.sink(first, n, client_id)
        ends = self._ends
        if len(ends) > self._head and ends[-1] == first and self._ids[-1] == client_id:
            ends[-1] = first + n
        else:
            self._starts.append(first)
            ends.append(first + n)
            self._ids.append(client_id)
        self._count += n
        if self._count > self.kept:
            self._drop_oldest(self._count - self.kept)

    def set(self, offset: int, client_id: str) -> None:
        self.add_run(offset, 1, client_id)

    def _drop_oldest(self, excess: int) -> None:
        starts, ends = self._starts, self._ends
        head = self._head
        while excess > 0:
            size = ends[head] - starts[head]
            if size <= excess:
                excess -= size
                self._count -= size
                head += 1
            else:
                starts[head] += excess
                self._count -= excess
                excess = 0
        if head > 64 and head * 2 > len(starts):
            del starts[:head], ends[:head], self._ids[:head]
            head = 0
        self._head = head

    def get(self, offset: int) -> str | None:
        """The client id that published ``offset``, or None (not known or dropped)."""
        i = bisect_right(self._starts, offset, self._head) - 1
        if i >= self._head and offset < self._ends[i]:
            return self._ids[i]
        return None

    def forget_from(self, offset: int) -> None:
        """Drop every offset >= ``offset``."""
        if self.forget_sink is not None:
            self.forget_sink(offset)
        starts, ends, ids = self._starts, self._ends, self._ids
        while len(starts) > self._head and ends[-1] > offset:
            if starts[-1] >= offset:
                self._count -= ends[-1] - starts[-1]
                starts.pop()
                ends.pop()
                ids.pop()
            else:
                self._count -= ends[-1] - offset
                ends[-1] = offset

    def items(self) -> list[tuple[int, str]]:
        """(offset, client id) of every offset held, oldest first (for tests and debugging)."""
        return [(o, self._ids[i]) for i in range(self._head, len(self._starts))
                for o in range(self._starts[i], self._ends[i])]

    def values(self) -> list[str]:
        return [cid for _, cid in self.items()]


class OwnRuns:
    """The offsets a persistent session's own client published while it had a no local
    subscription (MQTT-3.8.3-3), as runs ``[start, end)``: unlike :class:`PublisherRuns`
    not bounded to the latest offsets, kept in the session file (``"own"``) and pruned below
    the session group's Pending offset, so no local holds across a restart and however far
    behind the session is."""

    __slots__ = ("runs",)

    def __init__(self, runs: list[tuple[int, int]] | None = None) -> None:
        self.runs: list[list[int]] = [[s, e] for s, e in runs or () if e > s]

    def __bool__(self) -> bool:
        return bool(self.runs)

    def add(self, first: int, n: int) -> None:
        runs = self.runs
        if runs and runs[-1][1] == first:
            runs[-1][1] = first + n
        else:
            runs.append([first, first + n])

    def holds(self, offset: int) -> bool:
        runs = self.runs
        i = bisect_right(runs, offset, key=_run_start) - 1
        return i >= 0 and offset < runs[i][1]

    def forget_from(self, offset: int) -> bool:
        """Drop offsets >= ``offset`` (a failed commit gave them back); True if any."""
        runs = self.runs
        changed = False
        while runs and runs[-1][1] > offset:
            changed = True
            if runs[-1][0] >= offset:
                runs.pop()
            else:
                runs[-1][1] = offset
        return changed

    def pruned(self, below: int) -> list[tuple[int, int]]:
        """The runs, without what lies below ``below`` (already passed by the group)."""
        return [(max(s, below), e) for s, e in self.runs if e > below]


def _run_start(run: list[int]) -> int:
    return run[0]


def _ack(first: int, packet_id: int) -> bytes:
    return bytes((first, 2, packet_id >> 8, packet_id & 0xFF))


def _copy_outcome(dst: asyncio.Future[None], src: asyncio.Future[None]) -> None:
    if dst.done():
        return
    if src.cancelled():
        dst.cancel()
    elif (exc := src.exception()) is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(None)


def message_expiry(headers: bytes, timestamp_us: int, now_us: int) -> bytes | None:
    """A record's ``headers`` as they leave now: None when its message expiry interval has
    passed (never delivered, MQTT-3.3.2-5), else with the interval lowered by the whole seconds
    since ``timestamp_us`` (MQTT-3.3.2-6).  The headers are the canonical property section of
    :func:`filemq.mqtt.properties.encode_message_headers` (properties in identifier order), so
    the expiry interval (0x02) is the first property or follows a payload format indicator."""
    if headers[0] == 0x02:
        i = 1
    elif headers[0] == 0x01 and len(headers) > 2 and headers[2] == 0x02:
        i = 3
    else:
        return headers
    elapsed = (now_us - timestamp_us) // 1_000_000
    if elapsed <= 0:
        return headers
    interval = int.from_bytes(headers[i:i + 4], "big")
    if elapsed >= interval:
        return None
    return headers[:i] + (interval - elapsed).to_bytes(4, "big") + headers[i + 4:]


def ack5(first: int, packet_id: int, reason_code: int) -> bytes:
    """An MQTT 5 PUBACK (0x40) / PUBREC (0x50) with a reason code (3.4.2.1, 3.5.2.1)."""
    if not reason_code:
        return _ack(first, packet_id)
    return bytes((first, 3, packet_id >> 8, packet_id & 0xFF, reason_code))


def _too_long(topic: str, limit: int) -> bool:
    """``max_topic_length`` counts UTF-8 bytes (a character is 1-4 of them)."""
    n = len(topic)
    return n > limit or (n * 4 > limit and len(topic.encode("utf-8")) > limit)


def parse_share_key(topic_filter: str) -> tuple[str | None, str]:
    """``(share key, plain filter)``: the key of ``$share/<name>/<filter>`` is ``<name>/<filter>``
    (a shared subscription is named by share name and filter, MQTT 5 §4.8.2); None otherwise.
    Raises :class:`InvalidTopic` as :func:`~filemq.common.topics.parse_shared`."""
    name, plain = parse_shared(topic_filter)
    return (None if name is None else f"{name}/{plain}"), plain


# ---- the publish hook (collector: dedup and CRC checks) -----------------------------------


@dataclass(frozen=True, slots=True)
class ClientInfo:
    """Who sent a PUBLISH: what a :data:`PublishHook` may base its decision on."""

    client_id: str
    username: str | None
    peer: str


@dataclass(frozen=True, slots=True)
class HookResult:
    """A :data:`PublishHook`'s verdict; build it with :meth:`store`, :meth:`ack_drop`, :meth:`reject`."""

    action: Literal["store", "ack_drop", "reject"]
    payload: bytes | None = None
    reason: str = ""

    @classmethod
    def store(cls, payload: bytes | None = None) -> HookResult:
        """Store the message (with ``payload`` instead of the received one, if given)."""
        return cls("store", payload)

    @classmethod
    def ack_drop(cls, reason: str = "") -> HookResult:
        """Acknowledge without storing (e.g. a duplicate); counted as dropped."""
        return cls("ack_drop", None, reason)

    @classmethod
    def reject(cls, reason: str) -> HookResult:
        """Do not acknowledge; close the connection, logging ``reason``."""
        return cls("reject", None, reason)


STORE = HookResult.store()

PublishHook = Callable[[ClientInfo, Publish], HookResult]
"""Called for every inbound PUBLISH (after validation and ACL) before it is stored."""


# ---- per-client state ----------------------------------------------------------------------


@dataclass(slots=True)
class Subscription:
    """One subscription of a session; ``start`` is the first log offset it receives."""

    filter: str  # as the client gave it, ``$share/...`` included
    plain: str  # the filter without the share prefix
    share: str | None  # the share key ``<name>/<filter>`` of a ``$share`` subscription
    qos: int
    start: int
    # Retained records below this offset are not delivered live to it: they were appended
    # before its SUBSCRIBE, whose retained replay sends the last one with RETAIN 1 (MQTT-3.3.1-8).
    retain_below: int = 0
    # MQTT 5: the subscription options byte without its QoS bits (no local, retain as
    # published, retain handling; 3.8.3.1) and the subscription identifier (0: none; 3.8.2.1.2).
    options: int = 0
    identifier: int = 0

    def identifier_property(self) -> bytes:
        """Its subscription identifier as the MQTT 5 property a PUBLISH it takes carries
        (3.3.2.3.8, MQTT-3.3.4-3); b"" when it has none."""
        return b"\x0b" + encode_vbi(self.identifier) if self.identifier else b""


class SessionState:
    """One client id's session; a persistent one outlives its connections (and, through the
    :class:`SessionStore`, the broker process)."""

    def __init__(self, client_id: str, persistent: bool, owner: str | None = None) -> None:
        self.client_id = client_id
        self.persistent = persistent
        self.owner = owner  # the username that created the session; only it may resume it
        # Session expiry interval: None on MQTT 3.1.1 (a persistent session lives until a
        # clean_session = 1 CONNECT); MQTT 5: seconds after the connection closes, 0 = then.
        self.expiry: int | None = None
        # MQTT 5: wall-clock time the connection closed (in the session file), None while
        # connected; and a will waiting for its Will Delay Interval (3.1.3.2.2): the will, the
        # ACL of the connection that set it, its monotonic due time.
        self.disconnected_at: float | None = None
        self.will_pending: tuple[Publish, ClientAcl | None, float] | None = None
        self.subs: dict[str, Subscription] = {}
        self.group: ConsumerGroup | None = None
        # Its QoS 1/2 state: packet ids, the outbound in-flight window, QoS 2 ids both ways
        # (the session module's, filemq/broker/session/connection.py).
        self.qos = QosState()
        # While a session-file write that records new qos2_sent ids runs, this session's
        # deliveries wait (its future; the PUBLISHes of the batch leave when it is durable).
        self.out_hold: asyncio.Future[None] | None = None
        # Commit future -> future that resolves once that commit's QoS 2 ids are written.
        self.qos2_gates: dict[asyncio.Future[None], asyncio.Future[None]] = {}
        self.save_next: asyncio.Future[None] | None = None  # the next session-file write
        self.save_running = False  # a session-file write is in a worker thread
        self.save_due = False  # something changed that should be written lazily
        self.conn: Connection | None = None
        self._qos_cache: dict[str, list[tuple[int, int, str | None, int]]] = {}
        # MQTT 5 deliveries: per topic (start, qos, share, retain_below, no_local, retain as
        # published, the encoded subscription identifier property or b"").
        self._match5_cache: dict[str, list[tuple[int, int, str | None, int, bool, bool, bytes]]] = {}
        # run_qos of a run's topic set (a fetch's frozenset) and share: (QoS, the latest start
        # of the subscriptions it looked at), the answer for every run from that offset on.
        self._run_qos_cache: dict[tuple[frozenset[str], str | None], tuple[int, int]] = {}
        self._share_names: frozenset[str] | None = None
        self._no_local: bool | None = None
        self._plain5: bool | None = None
        # Offsets its client published while it had a no local subscription (persistent
        # sessions; in the session file), for no local beyond PublisherRuns' window.
        self.own_runs = OwnRuns()

    def holding(self) -> bool:
        """Whether deliveries wait for a session-file write (:attr:`out_hold`).  A method, not
        the attribute: a compiled caller would keep the attribute narrowed to None across the
        calls that set it (mypyc checks the narrowed type at the next read)."""
        return self.out_hold is not None

    def subscription_identifier(self, filter: str) -> bytes:
        """The identifier property (3.3.4) of this session's subscription ``filter`` (the one
        a retained message sent because of its SUBSCRIBE carries, MQTT-3.3.4-3); b"" when it
        has none or the subscription is gone."""
        sub = self.subs.get(filter)
        return b"" if sub is None else sub.identifier_property()

    def own_filters(self) -> tuple[str, ...]:
        return tuple(sorted({s.plain for s in self.subs.values() if s.share is None}))

    def share_names(self) -> frozenset[str]:
        names = self._share_names
        if names is None:
            names = self._share_names = frozenset(s.share for s in self.subs.values() if s.share is not None)
        return names

    def subs_changed(self) -> None:
        self._qos_cache.clear()
        self._match5_cache.clear()
        self._run_qos_cache.clear()
        self._share_names = None
        self._no_local = None
        self._plain5 = None

    def has_no_local(self) -> bool:
        """Whether any subscription of this session has the no local option (3.8.3.1)."""
        nl = self._no_local
        if nl is None:
            nl = self._no_local = any(s.options & SUB_NO_LOCAL for s in self.subs.values())
        return nl

    def plain5(self) -> bool:
        """No subscription of this session has the no local option or a subscription
        identifier: :meth:`match5` of a record that is not retained is then
        ``(granted_qos(...), b"", False)``."""
        plain = self._plain5
        if plain is None:
            plain = self._plain5 = not any(s.options & SUB_NO_LOCAL or s.identifier for s in self.subs.values())
        return plain

    def match5(self, topic: str, offset: int, share: str | None, retain: bool,
               own: bool) -> tuple[int, bytes, bool]:
        """MQTT 5 delivery of a record: ``(QoS, subscription identifier properties, retain as
        published)`` over this session's subscriptions (of ``share``) that take it; QoS -1:
        none.  ``own``: the record was published by this client id (no local skips it,
        MQTT-3.8.3-3).  One copy carries every matching subscription's identifier (3.3.4,
        MQTT-3.3.4-3/-5); its RETAIN flag is kept if any of them says retain as published."""
        entries = self._match5_cache.get(topic)
        if entries is None:
            entries = [
                (s.start, s.qos, s.share, s.retain_below, bool(s.options & SUB_NO_LOCAL),
                 bool(s.options & SUB_RETAIN_AS_PUBLISHED),
                 s.identifier_property())
                for s in self.subs.values() if topic_matches(s.plain, topic)
            ]
            if len(self._match5_cache) > 4096:
                self._match5_cache.clear()
            self._match5_cache[topic] = entries
        best = -1
        ids = b""
        rap = False
        for start, qos, sh, retain_below, no_local, keep_retain, ident in entries:
            if sh != share or start > offset or (retain and offset < retain_below) or (no_local and own):
                continue
            if qos > best:
                best = qos
            if ident:
                ids += ident
            rap = rap or keep_retain
        return best, ids, rap

    def granted_qos(self, topic: str, offset: int, share: str | None, retain: bool = False) -> int:
        """Highest QoS of this session's subscriptions (of ``share``) that take this record
        (``retain``: its retain flag); -1: none."""
        entries = self._qos_cache.get(topic)
        if entries is None:
            entries = [
                (s.start, s.qos, s.share, s.retain_below) for s in self.subs.values() if topic_matches(s.plain, topic)
            ]
            if len(self._qos_cache) > 4096:
                self._qos_cache.clear()
            self._qos_cache[topic] = entries
        best = -1
        for start, qos, sh, retain_below in entries:
            if sh == share and start <= offset and qos > best and not (retain and offset < retain_below):
                best = qos
        return best

    def run_qos(self, topics: Set[str], lowest: int, share: str | None) -> int:
        """The QoS :meth:`granted_qos` gives each not retained record with offset >= ``lowest``
        and a topic in ``topics``, if that is one value for all of them; else -1.  A frozenset
        of topics (a fetch's run) is answered from a cache once ``lowest`` is past the start of
        every subscription of ``share`` that matches one of them (then ``lowest`` changes
        nothing: each takes every record, none starts inside the run)."""
        key = None
        if type(topics) is frozenset:
            key = (topics, share)
            hit = self._run_qos_cache.get(key)
            if hit is not None and lowest >= hit[1]:
                return hit[0]
        best = -2
        latest = -1
        for topic in topics:
            qos = self.granted_qos(topic, lowest, share)
            if qos != best and best != -2:
                return -1
            best = qos
            for start, _, sh, _ in self._qos_cache[topic]:
                if sh == share:
                    if start > lowest:
                        return -1  # a subscription that starts inside the run
                    if start > latest:
                        latest = start
        if key is not None:
            if len(self._run_qos_cache) >= 1024:
                self._run_qos_cache.clear()
            self._run_qos_cache[key] = (best, latest)
        return best

    def stored(self) -> StoredSession:
        """What to write; QoS 2 ids whose record is not committed yet are left out (an id on
        disk without its record would make a re-sent PUBLISH look like a duplicate)."""
        qos = self.qos
        ids = qos.durable_qos2_in()
        return StoredSession(
            self.client_id,
            {f: StoredSubscription(s.qos, s.start, s.options & ~SUB_QOS_MASK, s.identifier, s.retain_below)
             for f, s in self.subs.items()},
            ids,
            owner=self.owner,
            qos2_offsets={pid: off for pid, off in qos.qos2_offsets.items() if pid in ids},
            qos2_outbound=set(qos.qos2_out),
            qos2_sent=dict(qos.qos2_sent),
            own_offsets=self.own_runs.pruned(self.group.pending_offset if self.group is not None else 0)
            if self.own_runs else [],
            expiry=self.expiry,
            disconnected_at=self.disconnected_at if self.expiry is not None else None,
            will=self._stored_will(),
        )

    def _stored_will(self) -> StoredWill | None:
        """The will held for its delay, with its due time on the wall clock (a restart keeps it)."""
        pending = self.will_pending
        if pending is None or self.expiry is None:
            return None
        will, _, due = pending
        return StoredWill(will.topic, will.payload, will.qos, will.retain,
                          encode_message_headers(will.properties), time.time() + (due - time.monotonic()))


class SharedGroup:
    """``$share/<name>/...``: one durable consumer group whose live members share records."""

    def __init__(self, name: str, group: ConsumerGroup) -> None:
        self.name = name
        self.group = group
        self.members: list[Connection] = []
        self.filter_refs: Counter[str] = Counter()
        self.rr = 0

    def __repr__(self) -> str:
        return f"SharedGroup({self.name!r}, members={len(self.members)})"
