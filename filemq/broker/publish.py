"""Inbound PUBLISH: admission (one rule set, one verdict, for every entry), the durable
append and the acks released per commit batch; then routing of committed records to
subscribers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, NamedTuple

from filemq.broker.router import Target
from filemq.broker.session.connection import Connection, refusal_code
from filemq.broker.session_state import (
    _PUBACK,
    _PUBREC,
    PUBLISHERS_KEPT,
    RC_NOT_AUTHORIZED,
    RC_PACKET_TOO_LARGE,
    RC_PAYLOAD_FORMAT_INVALID,
    RC_QUOTA_EXCEEDED,
    ClientInfo,
    PublisherRuns,
    PublishHook,
    SharedGroup,
    _too_long,
    ack5,
)
from filemq.common.native import mypyc_attr
from filemq.common.topics import InvalidTopic, validate_topic_name
from filemq.mqtt.codec import ProtocolError, encode_puback
from filemq.mqtt.packets import (
    PROTOCOL_LEVEL_5,
    RC_IMPLEMENTATION_SPECIFIC_ERROR,
    RC_MALFORMED_PACKET,
    RC_PROTOCOL_ERROR,
    Properties,
    Publish,
    PublishRun,
)
from filemq.mqtt.properties import encode_message_headers
from filemq.mqtt.runcodec import puback_run
from segments.record import Record

if TYPE_CHECKING:
    from filemq.broker.delivery import Delivery
    from filemq.broker.ports import QueuePort
    from filemq.broker.qos import QosAcks
    from filemq.broker.registry import SessionRegistry
    from filemq.broker.retain import Retained
    from filemq.broker.router import Router
    from filemq.broker.sysinfo import BrokerStats
    from filemq.broker.tailcache import TailCache
    from filemq.common.config import BrokerSection
    from segments.log import LogView
    pass

log = logging.getLogger("filemq.broker")

_new_record: Callable[[tuple[int, int, str, bytes, int, bool, bytes]], Record] = \
    functools.partial(tuple.__new__, Record)

# What admission does with a PUBLISH (Verdict.action).
STORE = 0  # append it: the verdict's payload (the publish hook's, or the PUBLISH's) and headers
ACK_DROP = 1  # acknowledge it (QoS 2: PUBREC, its id held until PUBREL) and drop it
REFUSE = 2  # MQTT 5: PUBACK/PUBREC with reason code ``code``, not stored (QoS 0: dropped)
CLOSE = 3  # close the connection (its will published): ``reason``; MQTT 5: DISCONNECT ``code`` first, if any
PROTOCOL_ERROR = 4  # a protocol error (ProtocolError(reason), DISCONNECT ``code``)
PUBREC_AGAIN = 5  # a QoS 2 id stored already and not released: its PUBREC again, not stored twice

# The admission rules, in the order they are checked (Ingest._rule_broken's answer; 0: none).
RULE_DUP_AT_QOS_0 = 1  # MQTT-3.3.1-2: DUP = 1 at QoS 0 is a protocol error
RULE_TOPIC_TOO_LONG = 2  # max_topic_length, in UTF-8 bytes
RULE_RESPONSE_TOPIC = 3  # MQTT-3.3.2-14: a response topic is a topic name
RULE_PAYLOAD_NOT_UTF8 = 4  # 3.3.2.3.2: payload format indicator 1 promises a UTF-8 payload
RULE_TOO_LARGE = 5  # message_size_limit
RULE_DOLLAR_TOPIC = 6  # clients may not publish to $-topics
RULE_ACL = 7  # the ACL denies the topic to its user
ALONE = -1  # (asked for a run) not stored in a run, whether or not a rule is broken: see Ingest._rule_broken


class Verdict(NamedTuple):
    """What admission (:meth:`Ingest.admit`) does with one PUBLISH: ``action`` (``STORE``,
    ``ACK_DROP``, ``REFUSE``, ``CLOSE``, ``PROTOCOL_ERROR``, ``PUBREC_AGAIN``) and what it needs."""

    action: int
    code: int = 0  # REFUSE: the MQTT 5 reason code; CLOSE, PROTOCOL_ERROR: the DISCONNECT's (0: none)
    reason: str = ""  # CLOSE, PROTOCOL_ERROR: why (the close reason)
    payload: bytes = b""  # STORE: what is stored
    headers: bytes = b""  # STORE: the record's headers (MQTT 5 message properties)
    stored: asyncio.Future[None] | None = None  # PUBREC_AGAIN: the stored message's commit (None: settled)


_ACK_AND_DROP = Verdict(ACK_DROP)


def _refusal5(p: Publish, code: int, closes: bool) -> Verdict:
    """MQTT 5's verdict for a PUBLISH refused with ``code``: the code on its PUBACK/PUBREC.  A
    QoS 0 one has no ack: dropped, or, where ``closes``, its connection closed with DISCONNECT
    ``code`` (a payload that is not UTF-8, 0x99; too large, 0x95; an ACL deny with
    ``acl_denied_publish = disconnect``, 0x87)."""
    if closes and p.packet_id is None:
        return Verdict(CLOSE, code, f"QoS 0 PUBLISH to {p.topic!r} refused (0x{code:02x})")
    return Verdict(REFUSE, code)


def _not_a_topic_name(topic: str) -> str:
    """Why ``topic`` is not a topic name (MQTT 4.7.3), or "" if it is one."""
    try:
        validate_topic_name(topic)
    except InvalidTopic as exc:
        return str(exc)
    return ""


def _is_utf8(payload: bytes) -> bool:
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def new_publisher_map() -> PublisherRuns:
    """The map of who published the latest offsets: offset -> client id of an MQTT 5
    publisher (no local), as runs (PublisherRuns: one entry per read's run of PUBLISHes; an
    OrderedDict entry per offset cost ~2.5k instructions per MQTT 5 PUBLISH, most of v5's
    cost over 3.1.1; a plain dict's oldest-first drop walks its deleted slots, ~50 us per
    PUBLISH at 65,536 entries)."""
    return PublisherRuns(PUBLISHERS_KEPT)


@mypyc_attr(native_class=False)  # (tests replace its methods on the instance: on_publish, on_publishes, on_publish_run)
class Ingest:
    """Inbound PUBLISH: admission (:meth:`_rule_broken`'s rules, :meth:`admit`'s verdict:
    size, ``$`` topics, ACL, MQTT 5 reason codes, QoS 2 dedup, the publish hook), the append
    to the log, the acks queued behind the commit batch; then, from the commit listener,
    routing of committed records (tail cache, retained, woken subscribers).

    Owns the appended-not-yet-routed runs, the routed offset and the publisher map."""

    def __init__(self, queue: QueuePort, cache: TailCache, config: BrokerSection, stats: BrokerStats,
                 hook: PublishHook | None, router: Router, registry: SessionRegistry, delivery: Delivery,
                 retained: Retained, publishers: PublisherRuns, qos: QosAcks) -> None:
        self.log: LogView = queue.log  # only its read side: a test fake stands in (compiled build)
        # Topics reaching _append passed the codec's and CONNECT's topic-name checks already.
        self._append = functools.partial(queue.publish_nowait, validated=True)
        self._append_many = queue.publish_many_nowait  # the same, for a run of PUBLISHes
        self.cache = cache
        self.config = config
        self.stats = stats
        self.hook = hook
        self.router = router
        self.registry = registry
        self.delivery = delivery
        self.retained = retained
        self.qos = qos  # inbound QoS 2: the dedup of re-sent ids, PUBREC behind the id's write
        self._publishers = publishers
        # Appended, not yet routed: runs of records with consecutive offsets (one per
        # on_publish, or per run of on_publishes), each with its commit future.
        self._pending: deque[tuple[list[Record], asyncio.Future[None]]] = deque()
        self._routed = self.log.committed_offset
        cache.limit = self._routed  # groups see a record only once it is routed
        queue.add_commit_listener(self._on_committed)

    @property
    def routed_offset(self) -> int:
        """Every committed record below this offset has been routed (and applied to retained)."""
        return self._routed

    def last_commit(self) -> asyncio.Future[None] | None:
        """The commit future of the latest appended records not routed yet, or None."""
        return self._pending[-1][1] if self._pending else None

    # ---- inbound PUBLISH -----------------------------------------------------------------
    #
    # Admission has one home.  _rule_broken holds the condition of every rule and has no
    # effect; admit turns the rule a PUBLISH breaks into its verdict (with the rule's log
    # line and count) and takes the stateful steps (QoS 2 dedup, the publish hook); on_publish
    # carries the verdict out.  The run entries ask the same _rule_broken (payload None)
    # whether a PUBLISH, or a whole PublishRun, is stored in a run with nothing else done for
    # it; any other PUBLISH goes through on_publish, in its place in the read.

    def on_publish(self, conn: Connection, p: Publish) -> None:
        """One PUBLISH: :meth:`on_publishes`'s case of one message.  Stored at once when
        admission has nothing to do for it but store it (:meth:`_rule_broken` asked as for a
        run), else admitted (:meth:`admit`) and answered by its verdict; stored with the log's
        append of one record (for one, its run machinery costs more than it saves)."""
        topic = p.topic
        self.stats.publish_received(topic, time.monotonic())
        props = p.properties
        if not self._rule_broken(conn, topic, p.qos, p.dup, len(p.payload), props, None):
            self._store_one(conn, p, p.payload, b"" if props is None else
                            encode_message_headers(props) if p.headers is None else p.headers)
            return
        v = self.admit(conn, p)
        action = v.action
        if action == STORE:
            self._store_one(conn, p, v.payload, v.headers)
        elif action == ACK_DROP:
            self._ack_now(conn, p)
        elif action == REFUSE:
            self._refuse5(conn, p, v.code)
        elif action == CLOSE:
            conn.close(v.reason, will=True, level=logging.WARNING, reason_code=v.code or None)
        elif action == PROTOCOL_ERROR:
            raise ProtocolError(v.reason, "PUBLISH", v.code)
        else:
            assert p.packet_id is not None
            self.qos.pubrec_again(conn, p.packet_id, v.stored)

    def on_publishes(self, conn: Connection, ps: Sequence[Publish]) -> None:
        """A run of PUBLISHes from one read (MQTT 3.1.1; MQTT 5: QoS 1 ones without a topic
        alias, whose Receive Maximum room the connection checked), in order: the same outcome
        as :meth:`on_publish` for each, for less work per message.  Those admission has nothing
        to do for but store (:meth:`_rule_broken` with no payload: QoS 1, no publish hook, no
        rule broken, no property checked against the payload) are appended with one call,
        their message properties as each record's headers, share one time stamp, and their
        PUBACKs wait for the commit as one entry; any other goes through :meth:`on_publish`,
        after the run before it."""
        broken = self._rule_broken
        topics: list[str] = []
        payloads: list[bytes] = []
        retains: list[bool] = []
        pids: list[int] = []
        headers: list[bytes] | None = None  # (MQTT 5: once a message of the run has properties)
        # The last arguments _rule_broken found stored in a run with: the same answer for the
        # same ones and any smaller payload (a read from a device is mostly one topic).
        ok_topic: str | None = None
        ok_qos = ok_size = -1
        ok_dup = False
        ok_props: Properties | None = None
        for p in ps:
            topic = p.topic
            props = p.properties
            payload = p.payload
            size = len(payload)
            qos = p.qos
            dup = p.dup
            if not (topic == ok_topic and size <= ok_size and qos == ok_qos and dup == ok_dup and props is ok_props):
                if broken(conn, topic, qos, dup, size, props, None):
                    if topics:
                        if not self._append_run(conn, topics, payloads, retains, pids, headers):
                            return
                        topics, payloads, retains, pids, headers = [], [], [], [], None
                    self.on_publish(conn, p)
                    if conn.closed:
                        return
                    continue
                ok_topic, ok_qos, ok_size, ok_dup, ok_props = topic, qos, size, dup, props
            if props is not None:
                if headers is None:
                    headers = [b""] * len(topics)
                header = p.headers
                headers.append(encode_message_headers(props) if header is None else header)
            elif headers is not None:
                headers.append(b"")
            topics.append(topic)
            payloads.append(payload)
            retains.append(p.retain)
            pids.append(p.packet_id)  # type: ignore[arg-type]
        if topics:
            self._append_run(conn, topics, payloads, retains, pids, headers)

    def on_publish_run(self, conn: Connection, run: PublishRun) -> None:
        """A :class:`PublishRun` (one topic, QoS, RETAIN and DUP flag; MQTT 5: QoS 1, one
        property section without a topic alias, whose Receive Maximum room the connection
        checked): the same outcome as :meth:`on_publishes` of its messages.  Admission is
        asked once, for the topic, the largest payload and the properties; a run it has
        nothing to do for but store is stored without a step per message."""
        topic = run.topic
        payloads = run.payloads
        props = run.properties
        if self._rule_broken(conn, topic, run.qos, run.dup, 0, props, None, payloads):
            self.on_publishes(conn, run.publishes())
            return
        n = len(payloads)
        if props is None:
            self._append_run(conn, [topic] * n, payloads, [run.retain] * n, run.packet_ids)  # type: ignore[arg-type]
        else:
            headers = encode_message_headers(props) if run.headers is None else run.headers
            self._append_run(conn, [topic] * n, payloads, [run.retain] * n, run.packet_ids,  # type: ignore[arg-type]
                             [headers] * n)

    def _rule_broken(self, conn: Connection, topic: str, qos: int, dup: bool, size: int,
                     props: Properties | None, payload: bytes | None, run: Sequence[bytes] | None = None) -> int:
        """The first admission rule a PUBLISH (of ``size`` payload bytes) from ``conn`` breaks,
        0 if none, in the order they are checked: MQTT-3.3.1-2 (DUP at QoS 0),
        ``max_topic_length`` (UTF-8 bytes), MQTT 5's MQTT-3.3.2-14 (a response topic is a topic
        name) and 3.3.2.3.2 (payload format indicator 1: a UTF-8 payload), ``message_size_limit``,
        no ``$`` topics from clients, the ACL.  The conditions only: no log, no count, no state
        changed (:meth:`admit` does what a broken rule calls for); nothing read but the
        arguments, ``conn``'s ACL, the configuration and the hook, so within a read the same
        arguments get the same answer, and an answer of 0 holds for any smaller ``size`` too
        (``message_size_limit`` is an upper bound): :meth:`on_publishes` remembers the last
        one, :meth:`on_publish_run` asks with its largest payload.

        ``payload`` None asks for a run: whether the PUBLISH is stored with nothing else done
        for it (``run``: a PublishRun's payloads, of which ``size`` is then the largest, only
        measured when there is a ``message_size_limit``).  :data:`ALONE`
        then stands for anything that needs :meth:`admit` even if no rule is broken: QoS 0 or 2
        (QoS 2: the dedup of its id), a publish hook, a property the rules check against the
        payload (a response topic, payload format indicator 1)."""
        if payload is None and (qos != 1 or self.hook is not None):
            return ALONE
        if dup and not qos:
            return RULE_DUP_AT_QOS_0
        config = self.config
        if _too_long(topic, config.max_topic_length):
            return RULE_TOPIC_TOO_LONG
        if props is not None and (props.response_topic is not None or props.payload_format_indicator == 1):
            if payload is None:
                return ALONE
            if props.response_topic is not None and _not_a_topic_name(props.response_topic):
                return RULE_RESPONSE_TOPIC
            if props.payload_format_indicator == 1 and not _is_utf8(payload):
                return RULE_PAYLOAD_NOT_UTF8
        limit = config.message_size_limit
        if limit is not None and (size if run is None else max(map(len, run))) > limit:
            return RULE_TOO_LARGE
        if topic[0] == "$":
            return RULE_DOLLAR_TOPIC
        acl = conn.acl
        if acl is not None and not acl.can_publish(topic):
            return RULE_ACL
        return 0

    def admit(self, conn: Connection, p: Publish) -> Verdict:
        """Admission of one PUBLISH from ``conn``: what is done with it.  A broken rule
        (:meth:`_rule_broken`) gets its verdict here, by protocol: MQTT 3.1.1 has no negative
        ack (a PUBLISH too large closes; a ``$`` topic, or one the ACL denies, is acknowledged
        and dropped, or closes with ``acl_denied_publish = disconnect``); MQTT 5 refuses with a
        reason code on PUBACK/PUBREC and the connection stays (issue 13 item 6), a QoS 0 one
        is dropped, or closes with DISCONNECT where the rule's code calls for it.  A QoS 2 id
        stored already and not released gets its PUBREC again (4.3.3); the publish hook
        stores, acknowledges and drops, or rejects (DISCONNECT 0x83); else stored, with the
        message properties as record headers.  Logs and counts what it refuses."""
        topic = p.topic
        qos = p.qos
        props = p.properties
        rule = self._rule_broken(conn, topic, qos, p.dup, len(p.payload), props, p.payload)
        if rule:
            return self._refusal(conn, p, rule)
        state = conn.session
        assert state is not None
        if qos == 2:
            again, stored = self.qos.received_again(state, p)
            if again:
                # Already stored, PUBREL not seen: PUBREC again, do not store twice (4.3.3).
                return Verdict(PUBREC_AGAIN, stored=stored)
        # (the decoder's headers, for a property section it has seen before)
        headers = b"" if props is None else encode_message_headers(props) if p.headers is None else p.headers
        hook = self.hook
        if hook is None:
            return Verdict(STORE, payload=p.payload, headers=headers)
        result = hook(ClientInfo(conn.client_id, conn.username, conn.peer), p)
        if result.action == "reject":
            # MQTT 5: DISCONNECT 0x83 first (valid but not processed, MQTT-4.13.2-1).
            return Verdict(CLOSE, RC_IMPLEMENTATION_SPECIFIC_ERROR, f"PUBLISH to {topic!r} rejected: {result.reason}")
        if result.action == "ack_drop":
            self.stats.publish_denied()
            return _ACK_AND_DROP
        return Verdict(STORE, payload=p.payload if result.payload is None else result.payload, headers=headers)

    def _refusal(self, conn: Connection, p: Publish, rule: int) -> Verdict:
        """The verdict for a PUBLISH that breaks ``rule`` (see :meth:`admit`), its log line and
        its count."""
        topic = p.topic
        if rule == RULE_DUP_AT_QOS_0:
            return Verdict(PROTOCOL_ERROR, RC_MALFORMED_PACKET, "QoS 0 PUBLISH with DUP = 1 (MQTT-3.3.1-2)")
        if rule == RULE_TOPIC_TOO_LONG:
            return Verdict(CLOSE, reason=f"PUBLISH topic of {len(topic.encode('utf-8'))} bytes exceeds "
                                         f"max_topic_length {self.config.max_topic_length}")
        props = p.properties
        if rule == RULE_RESPONSE_TOPIC:
            assert props is not None and props.response_topic is not None
            return Verdict(PROTOCOL_ERROR, RC_PROTOCOL_ERROR,
                           f"response topic {props.response_topic!r} is not a topic name: "
                           f"{_not_a_topic_name(props.response_topic)} (MQTT-3.3.2-14)")
        if rule == RULE_PAYLOAD_NOT_UTF8:  # (MQTT 5: a property)
            log.warning("client %r: PUBLISH to %r says UTF-8 but its payload is not (0x99)", conn.client_id, topic)
            return _refusal5(p, RC_PAYLOAD_FORMAT_INVALID, True)
        v5 = conn.protocol_level == PROTOCOL_LEVEL_5
        if rule == RULE_TOO_LARGE:
            size = len(p.payload)
            limit = self.config.message_size_limit
            if v5:
                log.warning("client %r: PUBLISH payload of %d bytes to %r exceeds message_size_limit %d; "
                            "not stored", conn.client_id, size, topic, limit)
                return _refusal5(p, RC_PACKET_TOO_LARGE if not p.qos else RC_QUOTA_EXCEEDED, True)
            # 3.1.1 has no negative ack: close; not stored, not acknowledged.
            return Verdict(CLOSE, reason=f"PUBLISH payload of {size} bytes to {topic!r} exceeds message_size_limit "
                                         f"{limit}; not stored, not acknowledged")
        self.stats.publish_denied()
        if rule == RULE_DOLLAR_TOPIC:
            if v5:
                log.warning("client %r: PUBLISH to %r refused (0x87): clients may not publish to $-topics",
                            conn.client_id, topic)
                return _refusal5(p, RC_NOT_AUTHORIZED, False)
            log.warning("client %r: PUBLISH to %r dropped: clients may not publish to $-topics",
                        conn.client_id, topic)
            return _ACK_AND_DROP
        assert rule == RULE_ACL
        disconnect = self.config.acl_denied_publish == "disconnect"
        if v5:
            log.warning("client %r (user %r): PUBLISH to %r denied by the ACL (0x87)",
                        conn.client_id, conn.username, topic)
            return _refusal5(p, RC_NOT_AUTHORIZED, disconnect)
        if disconnect:
            # Not acknowledged: the sender keeps the message and can be fixed and resend it.
            return Verdict(CLOSE, reason=f"PUBLISH to {topic!r} denied by the ACL for user {conn.username!r}; "
                                         "not acknowledged")
        log.warning("client %r (user %r): PUBLISH to %r denied by the ACL; acknowledged and dropped",
                    conn.client_id, conn.username, topic)
        return _ACK_AND_DROP

    def _store_one(self, conn: Connection, p: Publish, payload: bytes, headers: bytes) -> None:
        """Append a PUBLISH admitted alone (``payload``: the hook's; ``headers``: the record's);
        its PUBACK waits for the commit, its PUBREC for the commit and, in a persistent session,
        for its id in the session file."""
        topic = p.topic
        qos = p.qos
        ts = time.time_ns() // 1000
        try:
            if headers:
                offset, fut = self._append(topic, payload, qos, p.retain, ts, headers=headers)
            else:
                offset, fut = self._append(topic, payload, qos, p.retain, ts)
        except (OSError, ValueError) as exc:
            if not qos:
                log.error("client %r: QoS 0 PUBLISH to %r dropped: %s", conn.client_id, topic, exc)
            elif conn.protocol_level == PROTOCOL_LEVEL_5:
                # Refused by the log (below min_free_bytes: 0x97 quota exceeded; else 0x80).
                log.error("client %r: storing PUBLISH to %r refused: %s", conn.client_id, topic, exc)
                self._refuse5(conn, p, refusal_code(exc))
            else:
                conn.close(f"storing PUBLISH to {topic!r} failed: {exc}", will=True, level=logging.ERROR)
            return
        self._track(Record(offset, ts, topic, payload, qos, p.retain, headers), fut)
        if conn.protocol_level == PROTOCOL_LEVEL_5:
            self._note_publisher(offset, conn.client_id)
        if qos == 0:
            return
        pid = p.packet_id
        assert pid is not None
        if qos == 1:
            conn.queue_ack(fut, encode_puback(pid), offset)
        else:
            self.qos.stored_qos2(conn, pid, offset, fut)
            return
        if conn.last_batch is not fut:
            self.delivery.join_batch(conn, fut)

    def _append_run(self, conn: Connection, topics: list[str], payloads: list[bytes], retains: list[bool],
                    pids: list[int], headers: list[bytes] | None = None) -> bool:
        """Store a run of QoS 1 PUBLISHes admission has nothing to do for but store (``headers``:
        each one's record headers, None for none) and queue their PUBACKs behind the commit;
        False if storing failed and the connection was closed."""
        stats = self.stats
        now = time.monotonic()
        n = len(topics)
        stats.messages_received += n
        hot = stats.hot_topics
        topic = topics[0]
        if topics.count(topic) == n:
            hot.record(topic, now, n)
        else:
            for topic, count in Counter(topics).items():
                hot.record(topic, now, count)
        ts = time.time_ns() // 1000
        v5 = conn.protocol_level == PROTOCOL_LEVEL_5
        before = self.log.next_offset
        refused: list[int] = []
        code = 0
        try:
            if headers is None:
                first, fut = self._append_many(topics, payloads, retains, 1, ts)
            else:
                first, fut = self._append_many(topics, payloads, retains, 1, ts, headers)
        except (OSError, ValueError) as exc:
            stored = self.log.next_offset - before
            if not v5 or not 0 <= stored < n:
                # As one at a time: not acknowledged (records stored before the failing one are
                # routed from the log; their PUBACKs never leave, the client re-sends them).
                conn.close(f"storing {n} PUBLISHes to {topics[0]!r}... failed: {exc}", will=True,
                           level=logging.ERROR)
                return False
            # MQTT 5 (issue 13 item 6): the stored ones are acknowledged after their commit,
            # as usual; the failing one and those after it get a reason code; the connection stays.
            code = refusal_code(exc)
            log.error("client %r: storing %d of %d PUBLISHes to %r refused: %s (0x%02x)", conn.client_id,
                      n - stored, n, topics[0], exc, code)
            refused = pids[stored:]
            topics, payloads, retains, pids = topics[:stored], payloads[:stored], retains[:stored], pids[:stored]
            if headers is not None:
                headers = headers[:stored]
            n = stored
            try:
                first, fut = self._append_many([], [], [], 1, ts)  # the open batch's commit future
            except (OSError, ValueError) as exc2:
                conn.close(f"storing PUBLISHes to {topics[0] if topics else '?'!r} failed: {exc2}", will=True,
                           level=logging.ERROR)
                return False
            first = before
            if not n:
                for pid in refused:
                    conn.queue_ack(None, ack5(_PUBACK, pid, code))
                return True
        pending = self._pending
        if pending and pending[-1][0][-1].offset >= first:
            self._forget_from(first)
        if conn.protocol_level == PROTOCOL_LEVEL_5:
            # No local (MQTT-3.8.3-3): who published each offset, as on_publish notes it.
            self._publishers.add_run(first, n, conn.client_id)
        # The run's Records built in C: zip yields each one's fields, tuple.__new__ makes the
        # Record of them (NamedTuple.__new__ is a Python function; no bytecode runs per record).
        pending.append((list(map(_new_record, zip(range(first, first + n), repeat(ts), topics, payloads,
                                                  repeat(1), retains, repeat(b"") if headers is None else headers))),
                        fut))
        # n PUBACKs (0x40 0x02 id), back to back.
        conn.queue_ack(fut, puback_run(pids), first + n - 1)
        if conn.last_batch is not fut:
            self.delivery.join_batch(conn, fut)
        for pid in refused:
            conn.queue_ack(None, ack5(_PUBACK, pid, code))
        return True

    def _refuse5(self, conn: Connection, p: Publish, code: int) -> None:
        """Tell an MQTT 5 publisher its PUBLISH was not stored: PUBACK/PUBREC with ``code``, in
        order behind the acks still waiting for commits; the connection stays.  A QoS 0 one
        has no ack: dropped."""
        pid = p.packet_id
        if pid is not None:
            conn.queue_ack(None, ack5(_PUBREC if p.qos == 2 else _PUBACK, pid, code))
            return
        log.info("client %r: QoS 0 PUBLISH to %r dropped (0x%02x)", conn.client_id, p.topic, code)

    def _note_publisher(self, offset: int, client_id: str) -> None:
        """Remember who published ``offset`` (for no local, MQTT-3.8.3-3): the log does not
        record it, so a bounded map of the latest :data:`PUBLISHERS_KEPT` offsets does."""
        self._publishers.set(offset, client_id)

    def _ack_now(self, conn: Connection, p: Publish) -> None:
        if p.qos == 1:
            assert p.packet_id is not None
            conn.queue_ack(None, encode_puback(p.packet_id))
        elif p.qos == 2:
            assert p.packet_id is not None
            self.qos.dropped_qos2(conn, p.packet_id)

    def _track(self, record: Record, fut: asyncio.Future[None]) -> None:
        pending = self._pending
        if pending and pending[-1][0][-1].offset >= record.offset:
            self._forget_from(record.offset)
        pending.append(([record], fut))

    def _forget_from(self, offset: int) -> None:
        """A failed commit made the log reuse offsets from ``offset`` on: the pending records
        there were never stored."""
        pending = self._pending
        self._publishers.forget_from(offset)
        while pending:
            records = pending[-1][0]
            if records[-1].offset < offset:
                break
            keep = max(0, offset - records[0].offset)
            if keep:
                del records[keep:]
                break
            pending.pop()

    # ---- routing committed records ---------------------------------------------------------

    def _on_committed(self, committed: int) -> None:
        pending = self._pending
        routed = self._routed
        records: list[Record] = []
        while pending and pending[0][0][0].offset < committed:
            run, fut = pending[0]
            first = run[0].offset
            if run[-1].offset >= committed:  # (a run is appended in one go: not expected)
                pending[0] = (run[committed - first:], fut)
                run = run[:committed - first]
            else:
                pending.popleft()
            if fut.done() and (fut.cancelled() or fut.exception() is not None):
                continue
            if run[-1].offset < routed:
                continue
            if first < routed:
                run = run[routed - first:]
            elif first > routed:
                records.extend(self._read_gap(routed, first))
            records.extend(run)
            routed = run[-1].offset + 1
        if routed < committed and not (pending and pending[0][0][0].offset == routed):
            records.extend(self._read_gap(routed, committed))
            routed = committed
        self._routed = max(routed, self._routed)
        self.cache.limit = self._routed
        if records:
            self._route(records)

    def _read_gap(self, start: int, end: int) -> list[Record]:
        """Records appended by someone else (e.g. the queue API) that the broker must route."""
        out: list[Record] = []
        while start < end:
            batch = self.log.read(start, min(1000, end - start))
            batch = [r for r in batch if r.offset < end]
            if not batch:
                break
            out.extend(batch)
            start = batch[-1].offset + 1
        return out

    def _route(self, records: list[Record]) -> None:
        match = self.router.trie.match
        woken: set[Target] = set()
        self.cache.put_many(records)
        for topic in {r.topic for r in records}:
            woken |= match(topic)
        self.retained.routed(records)  # (its replays before live records, MQTT-3.3.1-8)
        delivery = self.delivery
        for target in woken:
            if isinstance(target, SharedGroup):
                delivery.pump_share(target)
            else:
                delivery.pump(target)
        delivery.flush_soon()

    def store_internal(self, topic: str, payload: bytes, qos: int, retain: bool, headers: bytes = b"") -> None:
        """Store a message the broker itself publishes (a will; ``headers``: its MQTT 5
        message properties); nobody waits for its ack."""
        ts = time.time_ns() // 1000
        try:
            if headers:
                offset, fut = self._append(topic, payload, qos, retain, ts, headers=headers)
            else:
                offset, fut = self._append(topic, payload, qos, retain, ts)
        except (OSError, ValueError, RuntimeError) as exc:
            log.error("message to %r not stored: %s", topic, exc)
            return
        self._track(Record(offset, ts, topic, payload, qos, retain, headers), fut)
