"""The broker's shared state and rules, without sockets: sessions, routing, durable acks.

:class:`BrokerCore` is what every :class:`~filemq.broker.session.Connection` delegates to.
It runs on the event loop (it uses the queue's group committer) but never touches a socket:
connections collect output bytes and the asyncio shell (:mod:`filemq.broker.server`) writes
them after each event with :meth:`BrokerCore.flush`.

What a caller may rely on:

* **Durable ack.** A PUBLISH is appended with ``GroupCommitter.append_nowait``; its PUBACK
  (QoS 1) / PUBREC (QoS 2) is queued on the connection behind the batch's shared commit
  future and released by one done-callback per *batch* (not per message), so all the acks of
  one fsync leave in one ``transport.write`` per connection.
* **Routing.** Committed records are routed once, from the commit listener: the topic trie
  (hashed children) finds the live connections and shared groups whose filters match, and
  only those are woken.  Records are put in the :class:`~filemq.broker.tailcache.TailCache`
  the groups read through, so live subscribers never re-read the segment files.
* **Sessions.** A clean session gets a non-durable consumer group from the log's end (dropped
  at disconnect); a persistent session gets the durable group ``mqtt-session:<client id>`` and
  a :class:`~filemq.broker.sessions.StoredSession` (subscriptions with their start offsets,
  QoS 2 inbound ids).  ``$share/<name>/<filter>`` subscriptions share the durable group
  ``mqtt-share:<name>/<filter>``: a shared subscription is its share name *and* its filter
  (MQTT 5 §4.8.2), so members with another filter never take its records; each record goes
  to one live member.
* Delivered QoS = min(subscription QoS, message QoS); records older than the subscription
  that matches them (its ``start``) are skipped and acked.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from filemq.acl import fill_pattern
from filemq.broker.session import AUTHENTICATING, AWAITING_CONNECT, CONNECTED, Connection
from filemq.broker.sessions import SessionSnapshot, SessionStore, StoredSession, StoredSubscription
from filemq.mqtt.codec import ProtocolError, encode, encode_puback, publish_bytes
from filemq.mqtt.packets import (
    CONNACK_ACCEPTED,
    CONNACK_BAD_USERNAME_OR_PASSWORD,
    CONNACK_IDENTIFIER_REJECTED,
    CONNACK_NOT_AUTHORIZED,
    CONNACK_RETURN_CODE_NAMES,
    CONNACK_SERVER_UNAVAILABLE,
    CONNACK_UNACCEPTABLE_PROTOCOL_VERSION,
    SUBACK_FAILURE,
    Connack,
    Connect,
    Publish,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)
from filemq.topics import (
    InvalidTopic,
    TopicTrie,
    parse_shared,
    topic_matches,
    validate_topic_filter,
    validate_topic_name,
)
from segments.record import Record

if TYPE_CHECKING:
    from filemq.acl import Acl
    from filemq.auth import PasswordFile
    from filemq.broker.tailcache import TailCache
    from filemq.config import BrokerSection
    from filemq.groups import ConsumerGroup
    from filemq.queue import Queue
    from filemq.retained import RetainedMessage, RetainedStore
    from filemq.sysinfo import BrokerStats

log = logging.getLogger("filemq.broker")

SESSION_GROUP_PREFIX = "mqtt-session:"
SHARE_GROUP_PREFIX = "mqtt-share:"
CLEAN_GROUP_PREFIX = "mqtt-clean:"

_PUBREC = 0x50
_PUBREL = 0x62
_PUBCOMP = 0x70
RETAINED_OUT_HIGH = 256 * 1024  # retained PUBLISH bytes queued in one connection's output at once
PERSIST_DELAY_S = 0.1  # group offsets are written this long after subscriber acks
_MAX_PUMP = 1000  # records pushed to one connection per wake-up before yielding the loop


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


def _too_long(topic: str, limit: int) -> bool:
    """``max_topic_length`` counts UTF-8 bytes (a character is 1-4 of them)."""
    n = len(topic)
    return n > limit or (n * 4 > limit and len(topic.encode("utf-8")) > limit)


def parse_share_key(topic_filter: str) -> tuple[str | None, str]:
    """``(share key, plain filter)``: the key of ``$share/<name>/<filter>`` is ``<name>/<filter>``
    (a shared subscription is named by share name and filter, MQTT 5 §4.8.2); None otherwise.
    Raises :class:`InvalidTopic` as :func:`~filemq.topics.parse_shared`."""
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


class Outbound:
    """A QoS 1/2 PUBLISH sent to the client and not yet completed."""

    __slots__ = ("offset", "group", "qos", "topic", "payload", "share", "stage", "retain")

    def __init__(
        self, offset: int, group: ConsumerGroup | None, qos: int, topic: str, payload: bytes,
        share: str | None, retain: bool = False,
    ) -> None:
        self.offset = offset
        self.group = group  # None: a retained-message delivery, not a group record
        self.qos = qos
        self.topic = topic
        self.payload = payload
        self.share = share
        self.stage = 0  # 0: PUBLISH sent; 1: PUBREC received, PUBREL sent (QoS 2)
        self.retain = retain


class SessionState:
    """One client id's session; a persistent one outlives its connections (and, through the
    :class:`SessionStore`, the broker process)."""

    def __init__(self, client_id: str, persistent: bool, owner: str | None = None) -> None:
        self.client_id = client_id
        self.persistent = persistent
        self.owner = owner  # the username that created the session; only it may resume it
        self.subs: dict[str, Subscription] = {}
        self.group: ConsumerGroup | None = None
        self.inflight: dict[int, Outbound] = {}
        self.next_pid = 1
        # QoS 2 inbound ids waiting for PUBREL -> the commit future of the stored record
        # (None: committed long ago, or loaded from the session file, which is exact).
        self.qos2_in: dict[int, asyncio.Future[None] | None] = {}
        self.qos2_offsets: dict[int, int] = {}  # QoS 2 inbound id -> its record's offset
        self.qos2_loaded: set[int] = set()  # ids read from the session file, not yet re-checked
        # Commit future -> future that resolves once that commit's QoS 2 ids are written.
        self.qos2_gates: dict[asyncio.Future[None], asyncio.Future[None]] = {}
        self.save_next: asyncio.Future[None] | None = None  # the next session-file write
        self.save_running = False  # a session-file write is in a worker thread
        self.save_due = False  # something changed that should be written lazily
        self.conn: Connection | None = None
        self._qos_cache: dict[str, list[tuple[int, int, str | None]]] = {}
        self._share_names: frozenset[str] | None = None

    def own_filters(self) -> tuple[str, ...]:
        return tuple(sorted({s.plain for s in self.subs.values() if s.share is None}))

    def share_names(self) -> frozenset[str]:
        names = self._share_names
        if names is None:
            names = self._share_names = frozenset(s.share for s in self.subs.values() if s.share is not None)
        return names

    def subs_changed(self) -> None:
        self._qos_cache.clear()
        self._share_names = None

    def granted_qos(self, topic: str, offset: int, share: str | None) -> int:
        """Highest QoS of this session's subscriptions (of ``share``) that take this record; -1: none."""
        entries = self._qos_cache.get(topic)
        if entries is None:
            entries = [
                (s.start, s.qos, s.share) for s in self.subs.values() if topic_matches(s.plain, topic)
            ]
            if len(self._qos_cache) > 4096:
                self._qos_cache.clear()
            self._qos_cache[topic] = entries
        best = -1
        for start, qos, sh in entries:
            if sh == share and start <= offset and qos > best:
                best = qos
        return best

    def alloc_pid(self) -> int:
        pid = self.next_pid
        inflight = self.inflight
        while pid in inflight:
            pid = pid % 0xFFFF + 1
        self.next_pid = pid % 0xFFFF + 1
        return pid

    def stored(self) -> StoredSession:
        """What to write; QoS 2 ids whose record is not committed yet are left out (an id on
        disk without its record would make a re-sent PUBLISH look like a duplicate)."""
        ids = {
            pid for pid, f in self.qos2_in.items()
            if f is None or (f.done() and not f.cancelled() and f.exception() is None)
        }
        return StoredSession(
            self.client_id,
            {f: StoredSubscription(s.qos, s.start) for f, s in self.subs.items()},
            ids,
            owner=self.owner,
            qos2_offsets={pid: off for pid, off in self.qos2_offsets.items() if pid in ids},
        )


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


# ---- the core ------------------------------------------------------------------------------


class BrokerCore:
    """Broker state shared by all connections; see the module docstring for the guarantees."""

    def __init__(
        self,
        queue: Queue,
        cache: TailCache,
        *,
        config: BrokerSection,
        store: SessionStore,
        retained: RetainedStore,
        stats: BrokerStats,
        acl: Acl,
        passwords: PasswordFile | None = None,
        publish_hook: PublishHook | None = None,
        group_factory: Callable[[str, tuple[str, ...], bool], ConsumerGroup] | None = None,
    ) -> None:
        self.queue = queue
        self.log = queue.log
        # Topics reaching _append passed the codec's and CONNECT's topic-name checks already.
        self._append = functools.partial(queue.publish_nowait, validated=True)
        self.cache = cache
        self.config = config
        self.store = store
        self.retained = retained
        # False while the retained store is being rebuilt in the background (big logs):
        # retained records are buffered and SUBSCRIBEs wait for their retained messages.
        self.retained_ready = True
        self.retained_changes = 0  # retained records routed so far (snapshot trigger)
        self._retained_buffer: list[Record] = []
        self._retained_waiting: list[tuple[Connection, SessionState, Subscription, int]] = []
        # Retained messages a SUBSCRIBE matched and the connection has not taken yet (filter,
        # message, QoS): sent as its output drains, so a client that does not read cannot
        # make the broker queue them again and again (issue 10 item 8).
        self._retained_out: dict[Connection, deque[tuple[str, RetainedMessage, int]]] = {}
        self.stats = stats
        self.acl = acl
        self.passwords = passwords
        self.hook = publish_hook
        # New groups start at the routed offset, as new subscriptions do (see on_subscribe).
        self._group_factory = group_factory or (
            lambda n, f, d: queue.group(n, f, durable=d, start=self._routed))
        self.connect_timeout = 10.0
        self.conns: set[Connection] = set()
        self.connections: dict[str, Connection] = {}  # client id -> live connection
        self.sessions: dict[str, SessionState] = {}  # persistent sessions known in memory
        self.shares: dict[str, SharedGroup] = {}
        self.trie: TopicTrie[Any] = TopicTrie()
        self.sys_retained: dict[str, bytes] = {}
        self._sys_warned: set[str] = set()  # invalid $SYS topics already warned about
        self._dirty: set[Connection] = set()
        self._pending: deque[tuple[Record, asyncio.Future[None]]] = deque()
        self._routed = self.log.committed_offset
        cache.limit = self._routed  # groups see a record only once it is routed
        self._batches: dict[asyncio.Future[None], set[Connection]] = {}
        self._clean_ids = 0
        self._repump: set[Connection] = set()
        self._to_pump: set[Connection] = set()
        self._repump_scheduled = False
        self._acked = False  # group acks since the last persistence nudge
        self._persist_handle: asyncio.TimerHandle | None = None
        self._persist_task: asyncio.Task[None] | None = None
        self._session_writes: set[asyncio.Future[None]] = set()  # running session-file writes
        # Writes a session snapshot durably, then calls ``done(None or the exception)``; by
        # default in a worker thread (never an fsync on the event loop); tests may replace it.
        self.session_writer: Callable[[SessionSnapshot, Callable[[BaseException | None], None]], None] = (
            self._write_in_thread)
        self.anonymous_allowed = config.anonymous_allowed()
        queue.add_commit_listener(self._on_committed)

    @property
    def routed_offset(self) -> int:
        """Every committed record below this offset has been routed (and applied to retained)."""
        return self._routed

    # ---- output --------------------------------------------------------------------------

    def mark_dirty(self, conn: Connection) -> None:
        self._dirty.add(conn)

    def flush(self) -> None:
        """Write every connection's queued output with one transport write each."""
        if self._acked:
            self._acked = False
            if self._persist_handle is None:
                self._persist_handle = asyncio.get_running_loop().call_later(
                    PERSIST_DELAY_S, self._persist_offsets)
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
            if conn.closed or conn.transport is None:
                continue
            data = conn.data_to_send()
            if data:
                sent += len(data)
                conn.transport.write(data)
        self.stats.sent_bytes(sent)

    def set_acl(self, acl: Acl) -> None:
        """Put a new ACL in force (reload): every connected client's rules are rebuilt at once,
        so its existing subscriptions deliver only what it may still read."""
        self.acl = acl
        for conn in self.conns:
            if conn.state == CONNECTED:
                conn.acl = acl.for_client(conn.username, conn.client_id)

    def new_connection(self, conn: Connection) -> None:
        self.conns.add(conn)

    def at_capacity(self) -> bool:
        return len(self.conns) >= self.config.max_connections

    # ---- CONNECT -------------------------------------------------------------------------

    def _refuse(self, conn: Connection, code: int, why: str) -> None:
        conn.send_packet(Connack(False, code))
        conn.close(f"CONNECT refused ({CONNACK_RETURN_CODE_NAMES.get(code, code)}): {why}", will=False,
                   level=logging.WARNING)

    def on_connect(self, conn: Connection, p: Connect) -> None:
        if p.protocol_name != "MQTT" or p.protocol_level != 4:
            self._refuse(conn, CONNACK_UNACCEPTABLE_PROTOCOL_VERSION,
                         f"protocol {p.protocol_name!r} level {p.protocol_level}; only MQTT 3.1.1 (level 4)")
            return
        conn.client_id = p.client_id
        conn.username = p.username
        if not p.client_id:
            if not p.clean_session:
                self._refuse(conn, CONNACK_IDENTIFIER_REJECTED,
                             "zero-length client id needs clean_session = 1")
                return
            conn.client_id = "filemq-" + secrets.token_hex(8)
        if p.will_topic is not None:
            try:
                validate_topic_name(p.will_topic)
            except InvalidTopic as exc:
                raise ProtocolError(f"invalid will topic: {exc}", "CONNECT") from None
            limit = self.config.message_size_limit
            if limit is not None and len(p.will_payload) > limit:
                # 3.1.1 has no CONNACK code for it: refused by closing, as Mosquitto does.
                conn.close(f"CONNECT refused: will payload of {len(p.will_payload)} bytes exceeds "
                           f"message_size_limit {limit}", will=False, level=logging.WARNING)
                return
            conn.will = Publish(p.will_topic, p.will_payload, p.will_qos, p.will_retain)
        keepalive = p.keepalive
        kmax = self.config.keepalive_max
        if kmax is not None and (keepalive == 0 or keepalive > kmax):
            keepalive = kmax
        conn.keepalive = keepalive
        if conn.identity is not None:  # use_identity_as_username: the certificate logged in
            conn.username = conn.identity
            self._accept(conn, p)
            return
        passwords = self.passwords
        if p.username is None:
            if passwords is not None and not self.anonymous_allowed:
                self._refuse(conn, CONNACK_NOT_AUTHORIZED, "anonymous clients are not allowed; send a username")
                return
            self._accept(conn, p)
            return
        if passwords is None:
            self._accept(conn, p)  # no password file: usernames only select ACL rules
            return
        if p.password is None:
            self._refuse(conn, CONNACK_BAD_USERNAME_OR_PASSWORD, f"user {p.username!r} sent no password")
            return
        if passwords.cached(p.username, p.password):
            self._accept(conn, p)
            return
        # PBKDF2 takes ~100 ms: run it off the loop; packets arriving meanwhile wait.
        conn.state = AUTHENTICATING
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, passwords.check, p.username, p.password)
        fut.add_done_callback(lambda f: self._auth_done(conn, p, f))

    def _auth_done(self, conn: Connection, p: Connect, fut: asyncio.Future[bool]) -> None:
        if conn.closed:
            return
        ok = not fut.cancelled() and fut.exception() is None and fut.result()
        conn.state = AWAITING_CONNECT
        if ok:
            self._accept(conn, p)
            conn.resume_after_auth()
        else:
            self._refuse(conn, CONNACK_BAD_USERNAME_OR_PASSWORD, f"wrong password for user {p.username!r}")
        self.flush()

    def _not_owner(self, conn: Connection, mem: SessionState | None,
                   stored: StoredSession | None) -> str | None:
        """Why ``conn``'s user may not take its client id (another user's session), or None."""
        user, cid = conn.username, conn.client_id
        old = self.connections.get(cid)
        if old is not None and old is not conn and old.username != user:
            return f"client id {cid!r} is connected as user {old.username!r}, not {user!r}"
        if mem is not None:
            owner, known, filters = mem.owner, True, list(mem.subs)
        elif stored is not None:
            owner, known, filters = stored.owner, stored.owner_known, list(stored.subscriptions)
        else:
            return None
        if known:
            if owner != user:
                return f"the session of client id {cid!r} belongs to user {owner!r}, not {user!r}"
            return None
        # A session file from before owners were recorded: adopted by the first client whose
        # ACL allows all its subscriptions (see sessions.py).
        assert conn.acl is not None
        denied = [f for f in filters if not conn.acl.can_subscribe(f)]
        if denied:
            return (f"the session of client id {cid!r} has no recorded owner and user {user!r} "
                    f"may not subscribe to its filter {denied[0]!r}")
        return None

    def _accept(self, conn: Connection, p: Connect) -> None:
        cid = conn.client_id
        conn.acl = self.acl.for_client(conn.username, cid)
        mem = self.sessions.get(cid)
        stored = self.store.load(cid) if mem is None else None
        why = self._not_owner(conn, mem, stored)
        if why is not None:
            # Neither resumed nor discarded: a session belongs to the user who made it.
            self._refuse(conn, CONNACK_NOT_AUTHORIZED, why)
            return
        old = self.connections.get(cid)
        if old is not None and old is not conn:
            # 3.1.4-2: the existing client is disconnected; it did not send DISCONNECT, so
            # its will is published (3.1.2.5).
            old.close(f"session taken over by a new connection from {conn.peer}", will=True)
        present = adopted = False
        if p.clean_session:
            self._discard_persistent(cid)
            state = SessionState(cid, persistent=False, owner=conn.username)
        else:
            if mem is not None:
                state, present = mem, True
            else:
                state = SessionState(cid, persistent=True, owner=conn.username)
                if stored is not None:
                    present = True
                    for f, entry in stored.subscriptions.items():
                        share, plain = parse_share_key(f)
                        state.subs[f] = Subscription(f, plain, share, entry.qos, entry.start)
                    state.qos2_in = dict.fromkeys(stored.qos2_inbound)
                    state.qos2_offsets = dict(stored.qos2_offsets)
                    state.qos2_loaded = set(stored.qos2_inbound)
                    state.subs_changed()
                    if state.own_filters():
                        state.group = self._group(SESSION_GROUP_PREFIX + cid, state.own_filters(), True)
                    if not stored.owner_known:
                        log.warning("client %r: its session file has no owner (written by an older "
                                    "filemq); adopted by user %r", cid, conn.username)
                        adopted = True  # written below, with the owner
                self.sessions[cid] = state
            # A new session's file, or one auto-subscribe changed, is written before CONNACK
            # (so a reconnect after a crash reports session_present = 1), in a worker
            # thread; a write of this session already under way is waited for too.
            if (self._auto_subscribe(conn, state) or not present or adopted or state.save_running
                    or state.save_next is not None):
                written = self._save_now(state)
                if written.done():  # (a writer that runs inline, as in tests)
                    self._session_written(conn, state, p, present, written)
                    return
                conn.state = AUTHENTICATING  # packets arriving meanwhile wait (backlog)
                written.add_done_callback(functools.partial(self._session_written, conn, state, p, present))
                return
        self._connected(conn, state, p, present)

    def _session_written(self, conn: Connection, state: SessionState, p: Connect, present: bool,
                         done: asyncio.Future[None]) -> None:
        failed = done.cancelled() or done.exception() is not None
        if failed and not present and self.sessions.get(state.client_id) is state and state.conn is None:
            del self.sessions[state.client_id]  # never report a session that is not on disk
        if conn.closed:
            return
        if failed:
            self._refuse(conn, CONNACK_SERVER_UNAVAILABLE, "writing the session file failed")
        elif self.sessions.get(state.client_id) is not state:
            self._refuse(conn, CONNACK_SERVER_UNAVAILABLE, "its session was discarded meanwhile (clean_session = 1)")
        else:
            old = self.connections.get(conn.client_id)
            if old is not None and old is not conn:
                old.close(f"session taken over by a new connection from {conn.peer}", will=True)
            conn.state = AWAITING_CONNECT
            self._connected(conn, state, p, present)
            conn.resume_after_auth()
        self.flush()

    def _connected(self, conn: Connection, state: SessionState, p: Connect, present: bool) -> None:
        """CONNACK (accepted) and the session's start: subscriptions, re-sends, deliveries."""
        cid = conn.client_id
        conn.session = state
        state.conn = conn
        self.connections[cid] = conn
        conn.state = CONNECTED
        conn.send_packet(Connack(present, CONNACK_ACCEPTED))
        self.stats.client_connected()
        for sub in state.subs.values():
            self._register(conn, state, sub)
        # 4.4: re-send unacknowledged PUBLISH (DUP) and PUBREL with their original ids.
        for pid, out in state.inflight.items():
            if out.stage == 0:
                conn.send(encode(Publish(out.topic, out.payload, out.qos, out.retain, True, pid)))
            else:
                conn.send(_ack(_PUBREL, pid))
        log.info("client %r connected from %s (clean_session=%s, keepalive=%d, session_present=%s)",
                 cid, conn.peer, p.clean_session, conn.keepalive, present)
        self.pump(conn)

    def _auto_subscribe(self, conn: Connection, state: SessionState) -> bool:
        """Add the auto-subscribe rules' filters; True if any was new (to be written)."""
        changed = False
        for rule in self.config.auto_subscribe:
            filled = fill_pattern(rule.filter, conn.username, conn.client_id)  # one pass
            if filled is None:
                continue
            f = filled
            if f in state.subs:
                continue
            try:
                share, plain = parse_share_key(f)
                validate_topic_filter(plain)
            except InvalidTopic as exc:
                log.warning("auto-subscribe %r for client %r skipped: %s", rule.filter, conn.client_id, exc)
                continue
            assert conn.acl is not None
            if not conn.acl.can_subscribe(f):
                log.warning("auto-subscribe %r for client %r denied by the ACL", f, conn.client_id)
                continue
            state.subs[f] = Subscription(f, plain, share, rule.qos, self._routed)
            changed = True
        if changed:
            state.subs_changed()
            self._update_groups(state)
        return changed

    def _discard_persistent(self, cid: str) -> None:
        state = self.sessions.pop(cid, None)
        # Group first, file second: a crash in between leaves a session file whose group is
        # gone (harmless), never a group without a file holding back retention.
        dropped = self.queue.drop_group(SESSION_GROUP_PREFIX + cid)
        stored = self.store.delete(cid)
        if state is not None or stored or dropped:
            log.info("client %r connected with clean_session = 1: its persistent session was discarded", cid)

    def _group(self, name: str, filters: tuple[str, ...], durable: bool) -> ConsumerGroup:
        group = self._group_factory(name, filters, durable)
        if tuple(group.filters) != filters:
            group.set_filters(filters)
        return self._through_cache(group)

    def _through_cache(self, group: ConsumerGroup) -> ConsumerGroup:
        # Groups read the log through the tail cache, so live subscribers never hit the files.
        if group.reader is not self.cache:
            group.use_reader(self.cache)
        return group

    def _drop_group(self, name: str) -> None:
        self.queue.drop_group(name)

    # ---- subscriptions -------------------------------------------------------------------

    def _register(self, conn: Connection, state: SessionState, sub: Subscription) -> None:
        if sub.share is None:
            self.trie.add(sub.plain, conn)
            return
        sh = self._share(sub.share, sub.plain)
        if conn not in sh.members:
            sh.members.append(conn)
        sh.filter_refs[sub.plain] += 1
        if sh.filter_refs[sub.plain] == 1:
            self.trie.add(sub.plain, sh)

    def _unregister(self, conn: Connection, sub: Subscription) -> None:
        if sub.share is None:
            self.trie.remove(sub.plain, conn)
            return
        sh = self.shares.get(sub.share)
        if sh is None:
            return
        sh.filter_refs[sub.plain] -= 1
        if sh.filter_refs[sub.plain] <= 0:
            del sh.filter_refs[sub.plain]
            self.trie.remove(sub.plain, sh)

    def _share(self, name: str, plain: str) -> SharedGroup:
        sh = self.shares.get(name)
        if sh is None:
            group = self._through_cache(self._group_factory(SHARE_GROUP_PREFIX + name, (plain,), True))
            sh = self.shares[name] = SharedGroup(name, group)
        filters = sh.group.filters
        if plain not in filters:
            # Shared-group filters only grow: offline members may still need the old ones.
            sh.group.set_filters(tuple(filters) + (plain,))
        return sh

    def _update_groups(self, state: SessionState) -> None:
        own = state.own_filters()
        if not own:
            if state.group is not None and not state.persistent:
                self._drop_group(state.group.name)
                state.group = None
            return
        if state.group is None:
            if state.persistent:
                name = SESSION_GROUP_PREFIX + state.client_id
            else:
                self._clean_ids += 1
                name = f"{CLEAN_GROUP_PREFIX}{state.client_id}:{self._clean_ids}"
            state.group = self._group(name, own, state.persistent)
        elif tuple(state.group.filters) != own:
            state.group.set_filters(own)

    def on_subscribe(self, conn: Connection, p: Subscribe) -> None:
        state = conn.session
        acl = conn.acl
        assert state is not None and acl is not None
        codes: list[int] = []
        new_subs: list[Subscription] = []
        # MQTT-3.3.1-6: records routed before this point are in the retained store, records
        # from it on are delivered live (groups never read past it, see TailCache.limit), so
        # a retained message is never neither.  next_offset would skip appended records that
        # are not committed yet, while the retained store only has committed ones.
        start = self._routed
        for f, qos in p.topics:
            try:
                share, plain = parse_share_key(f)
                validate_topic_filter(plain)
            except InvalidTopic as exc:
                log.info("client %r: SUBSCRIBE %r refused: %s", conn.client_id, f, exc)
                codes.append(SUBACK_FAILURE)
                continue
            if _too_long(f, self.config.max_topic_length):
                log.info("client %r: SUBSCRIBE filter of %d bytes refused (max_topic_length %d)",
                         conn.client_id, len(f.encode("utf-8")), self.config.max_topic_length)
                codes.append(SUBACK_FAILURE)
                continue
            if not acl.can_subscribe(f):
                log.info("client %r (user %r): SUBSCRIBE %r denied by the ACL", conn.client_id, conn.username, f)
                codes.append(SUBACK_FAILURE)
                continue
            qos = min(qos, 2)
            old = state.subs.get(f)
            if old is not None:
                self._unregister(conn, old)
            sub = Subscription(f, plain, share, qos, old.start if old is not None else start)
            state.subs[f] = sub
            new_subs.append(sub)
            codes.append(qos)
        if new_subs:
            state.subs_changed()
            self._update_groups(state)
            for sub in new_subs:
                self._register(conn, state, sub)
            if state.persistent:
                self.store.save(state.stored())
        conn.send_packet(Suback(p.packet_id, codes))
        for sub in new_subs:
            self._send_retained(conn, state, sub, start)
        self.pump(conn)

    def _send_retained(self, conn: Connection, state: SessionState, sub: Subscription, below: int) -> None:
        """Send the retained messages ``sub`` matches that were stored below offset ``below``
        (the routed offset at SUBSCRIBE time): later ones reach it live."""
        if sub.share is not None:
            return  # retained messages are not sent for shared subscriptions (as MQTT 5)
        if sub.plain.startswith("$SYS"):
            acl = conn.acl
            for topic, payload in self.sys_retained.items():
                if topic_matches(sub.plain, topic) and (
                        acl is None or acl.can_receive(topic)):
                    conn.send(encode(Publish(topic, payload, 0, True)))
            return
        if not self.retained_ready:
            self._retained_waiting.append((conn, state, sub, below))
            return
        acl = conn.acl
        queue = self._retained_out.get(conn)
        if queue is None:
            queue = self._retained_out[conn] = deque()
        elif any(e[0] == sub.filter for e in queue):
            # A repeated SUBSCRIBE re-sends (MQTT-3.8.4-3): what it still had queued is replaced.
            queue = self._retained_out[conn] = deque(e for e in queue if e[0] != sub.filter)
        for m in self.retained.match(sub.plain):
            if m.offset >= below:
                continue  # routed after the SUBSCRIBE (store rebuilt late): delivered live
            if acl is not None and not acl.can_receive(m.topic):
                continue
            queue.append((sub.filter, m, min(sub.qos, m.qos)))
        self._drain_retained(conn, state)

    def _drain_retained(self, conn: Connection, state: SessionState) -> bool:
        """Send queued retained messages while the connection takes them: its output below
        :data:`RETAINED_OUT_HIGH`, its transport not paused, QoS 1/2 ones within the in-flight
        window.  The queue holds the store's messages (no payload copies); True when empty."""
        queue = self._retained_out.get(conn)
        if queue is None:
            return True
        sent = 0
        inflight = state.inflight
        blocked = False
        while queue and not conn.closed and not conn.paused:
            if len(conn.out) >= RETAINED_OUT_HIGH:
                break
            _, m, qos = queue[0]
            if qos and len(inflight) >= max(conn.max_inflight, 1):
                blocked = True  # the acks that free the window pump again
                break
            queue.popleft()
            if conn.acl is not None and not conn.acl.can_receive(m.topic):
                continue  # the read right went away (ACL reload) while it was queued
            if qos == 0:
                conn.send(publish_bytes(m.topic, m.payload, 0, False, None, True))
            else:
                pid = state.alloc_pid()
                inflight[pid] = Outbound(m.offset, None, qos, m.topic, m.payload, None, True)
                conn.send(publish_bytes(m.topic, m.payload, qos, False, pid, True))
            sent += 1
        if sent:
            self.stats.publish_sent(sent)
        if queue:
            if not blocked and not conn.paused and not conn.closed:
                self._schedule_repump(conn)  # after this event's flush wrote the output
            return False
        del self._retained_out[conn]
        return True

    def on_unsubscribe(self, conn: Connection, p: Unsubscribe) -> None:
        state = conn.session
        assert state is not None
        changed = False
        shares_before = state.share_names()
        for f in p.topics:
            sub = state.subs.pop(f, None)
            if sub is not None:
                self._unregister(conn, sub)
                changed = True
        if changed:
            state.subs_changed()
            for name in shares_before - state.share_names():
                self._leave_share(conn, state, name)
            self._update_groups(state)
            if state.persistent:
                self.store.save(state.stored())
        conn.send_packet(Unsuback(p.packet_id))

    # ---- inbound PUBLISH -----------------------------------------------------------------

    def on_publish(self, conn: Connection, p: Publish) -> None:
        stats = self.stats
        topic = p.topic
        stats.publish_received(topic, time.monotonic())
        qos = p.qos
        if p.dup and not qos:
            raise ProtocolError("QoS 0 PUBLISH with DUP = 1 (MQTT-3.3.1-2)", "PUBLISH")
        if _too_long(topic, self.config.max_topic_length):
            conn.close(f"PUBLISH topic of {len(topic.encode('utf-8'))} bytes exceeds max_topic_length "
                       f"{self.config.max_topic_length}", will=True, level=logging.WARNING)
            return
        limit = self.config.message_size_limit
        if limit is not None and len(p.payload) > limit:
            # 3.1.1 has no negative ack: close; not stored, not acknowledged.
            conn.close(f"PUBLISH payload of {len(p.payload)} bytes to {topic!r} exceeds message_size_limit "
                       f"{limit}; not stored, not acknowledged", will=True, level=logging.WARNING)
            return
        if topic[0] == "$":
            log.warning("client %r: PUBLISH to %r dropped: clients may not publish to $-topics",
                        conn.client_id, topic)
            stats.publish_denied()
            self._ack_now(conn, p)
            return
        acl = conn.acl
        if acl is not None and not acl.can_publish(topic):
            stats.publish_denied()
            if self.config.acl_denied_publish == "disconnect":
                # Not acknowledged: the sender keeps the message and can be fixed and resend it.
                conn.close(f"PUBLISH to {topic!r} denied by the ACL for user {conn.username!r}; "
                           "not acknowledged", will=True, level=logging.WARNING)
                return
            log.warning("client %r (user %r): PUBLISH to %r denied by the ACL; acknowledged and dropped",
                        conn.client_id, conn.username, topic)
            self._ack_now(conn, p)
            return
        state = conn.session
        assert state is not None
        if qos == 2:
            pid = p.packet_id
            assert pid is not None
            fut = state.qos2_in.get(pid)
            if fut is not None and fut.done() and (fut.cancelled() or fut.exception() is not None):
                del state.qos2_in[pid]  # its commit failed: nothing was stored, store this one
            if pid in state.qos2_loaded:
                # From the session file (a restart): a duplicate only if the log holds this
                # very message at the id's offset; otherwise it is stored (at worst twice).
                state.qos2_loaded.discard(pid)
                if not self._stored_at(state.qos2_offsets.get(pid), p):
                    del state.qos2_in[pid]
                    state.qos2_offsets.pop(pid, None)
            if pid in state.qos2_in:
                # Already stored, PUBREL not seen: PUBREC again, do not store twice (4.3.3).
                # The set is exact (ids leave it durably before PUBCOMP), so this id names
                # the stored message; its PUBREC waits until the id is durable too.
                wait: asyncio.Future[None] | None = None
                if fut is not None and not fut.done():
                    wait = self._qos2_gate(state, fut) if state.persistent else fut
                elif state.persistent and (state.save_running or state.save_next is not None):
                    wait = self._save_soon(state)
                conn.queue_ack(wait, _ack(_PUBREC, pid))
                if wait is not None and conn.last_batch is not wait:
                    self._join_batch(conn, wait)
                return
        payload = p.payload
        hook = self.hook
        if hook is not None:
            result = hook(ClientInfo(conn.client_id, conn.username, conn.peer), p)
            if result.action == "reject":
                conn.close(f"PUBLISH to {topic!r} rejected: {result.reason}", will=True, level=logging.WARNING)
                return
            if result.action == "ack_drop":
                stats.publish_denied()
                if qos == 2:
                    assert p.packet_id is not None
                    state.qos2_in[p.packet_id] = None
                self._ack_now(conn, p)
                return
            if result.payload is not None:
                payload = result.payload
        ts = time.time_ns() // 1000
        try:
            offset, fut = self._append(topic, payload, qos, p.retain, ts)
        except (OSError, ValueError) as exc:
            if qos:
                conn.close(f"storing PUBLISH to {topic!r} failed: {exc}", will=True, level=logging.ERROR)
            else:
                log.error("client %r: QoS 0 PUBLISH to %r dropped: %s", conn.client_id, topic, exc)
            return
        self._track(Record(offset, ts, topic, payload, qos, p.retain), fut)
        if qos == 0:
            return
        pid = p.packet_id
        assert pid is not None
        if qos == 1:
            conn.queue_ack(fut, encode_puback(pid), offset)
        else:
            state.qos2_in[pid] = fut
            state.qos2_offsets[pid] = offset
            if state.persistent:
                # PUBREC once the record is committed *and* its id is in the session file.
                fut = self._qos2_gate(state, fut)
            conn.queue_ack(fut, _ack(_PUBREC, pid), offset)
        if conn.last_batch is not fut:
            self._join_batch(conn, fut)

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

    def _ack_now(self, conn: Connection, p: Publish) -> None:
        if p.qos == 1:
            assert p.packet_id is not None
            conn.queue_ack(None, encode_puback(p.packet_id))
        elif p.qos == 2:
            assert p.packet_id is not None
            conn.session.qos2_in.setdefault(p.packet_id, None)  # type: ignore[union-attr]
            conn.queue_ack(None, _ack(_PUBREC, p.packet_id))

    def _track(self, record: Record, fut: asyncio.Future[None]) -> None:
        pending = self._pending
        if pending and pending[-1][0].offset >= record.offset:
            # A failed commit made the log reuse offsets: those entries were never stored.
            while pending and pending[-1][0].offset >= record.offset:
                pending.pop()
        pending.append((record, fut))

    def _join_batch(self, conn: Connection, fut: asyncio.Future[None]) -> None:
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
        self.flush()

    # ---- session-file writes off the event loop -----------------------------------------

    def _qos2_gate(self, state: SessionState, fut: asyncio.Future[None]) -> asyncio.Future[None]:
        """A future that resolves once commit ``fut`` resolved and then the session file
        (with the QoS 2 ids ``fut`` stored) was written; one per commit batch and session,
        so one write covers every QoS 2 PUBREC of the batch (also across a takeover: the
        session is the same).  Fails as ``fut`` or the write fails."""
        gate = state.qos2_gates.get(fut)
        if gate is None:
            gate = state.qos2_gates[fut] = asyncio.get_running_loop().create_future()
            fut.add_done_callback(functools.partial(self._qos2_committed, state, gate))
        return gate

    def _qos2_committed(self, state: SessionState, gate: asyncio.Future[None], fut: asyncio.Future[None]) -> None:
        state.qos2_gates.pop(fut, None)
        if fut.cancelled():
            gate.cancel()
        elif (exc := fut.exception()) is not None:
            gate.set_exception(exc)
        else:
            self._save_soon(state).add_done_callback(functools.partial(_copy_outcome, gate))

    def _save_now(self, state: SessionState) -> asyncio.Future[None]:
        """:meth:`_save_soon`, but started at once when no write of ``state`` is running."""
        fut = self._save_soon(state)
        if not state.save_running:
            self._start_save(state)
        return fut

    def _save_soon(self, state: SessionState) -> asyncio.Future[None]:
        """Write ``state``'s session file in a worker thread, soon (changes made before the
        write starts are all in it: one write per batch).  The future resolves when it is
        durable, or fails with the OSError."""
        fut = state.save_next
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = state.save_next = loop.create_future()
            if not state.save_running:
                loop.call_soon(self._start_save, state)
        return fut

    def _start_save(self, state: SessionState) -> None:
        fut, state.save_next = state.save_next, None
        if fut is None:
            return
        if state.persistent and self.sessions.get(state.client_id) is not state:
            fut.set_result(None)  # discarded meanwhile (clean_session = 1): never revive its file
            return
        state.save_running = True
        state.save_due = False
        snap = self.store.snapshot(state.stored())
        self.session_writer(snap, functools.partial(self._save_done, state, fut))

    def _write_in_thread(self, snap: SessionSnapshot, done: Callable[[BaseException | None], None]) -> None:
        """The default :attr:`session_writer`: ``store.write`` in the loop's executor."""
        job = asyncio.get_running_loop().run_in_executor(None, self.store.write, snap)
        self._session_writes.add(job)

        def finished(j: asyncio.Future[None]) -> None:
            self._session_writes.discard(j)
            done(asyncio.CancelledError() if j.cancelled() else j.exception())

        job.add_done_callback(finished)

    def _save_done(self, state: SessionState, fut: asyncio.Future[None], exc: BaseException | None) -> None:
        state.save_running = False
        if isinstance(exc, asyncio.CancelledError):
            fut.cancel()
        elif exc is not None:
            log.error("client %r: writing the session file failed: %s", state.client_id, exc)
            fut.set_exception(exc)
        else:
            fut.set_result(None)
        if state.save_next is not None:
            self._start_save(state)

    async def session_writes_done(self) -> None:
        """Wait until no session-file write is running or due (tests, shutdown)."""
        for _ in range(1000):
            await asyncio.sleep(0)
            if not self._session_writes:
                if not any(s.save_next is not None for s in self.sessions.values()):
                    return
                continue
            await asyncio.gather(*self._session_writes, return_exceptions=True)

    def _save_session(self, state: SessionState) -> None:
        state.save_due = False
        try:
            self.store.save(state.stored())
        except OSError as exc:
            log.error("client %r: writing the session file failed: %s", state.client_id, exc)

    def store_internal(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        """Store a message the broker itself publishes (a will); nobody waits for its ack."""
        ts = time.time_ns() // 1000
        try:
            offset, fut = self._append(topic, payload, qos, retain, ts)
        except (OSError, ValueError, RuntimeError) as exc:
            log.error("message to %r not stored: %s", topic, exc)
            return
        self._track(Record(offset, ts, topic, payload, qos, retain), fut)

    # ---- routing committed records ---------------------------------------------------------

    def _on_committed(self, committed: int) -> None:
        pending = self._pending
        routed = self._routed
        records: list[Record] = []
        while pending and pending[0][0].offset < committed:
            record, fut = pending.popleft()
            if fut.done() and (fut.cancelled() or fut.exception() is not None):
                continue
            if record.offset < routed:
                continue
            if record.offset > routed:
                records.extend(self._read_gap(routed, record.offset))
            records.append(record)
            routed = record.offset + 1
        if routed < committed and not (pending and pending[0][0].offset == routed):
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
        cache_put = self.cache.put
        retained = self.retained
        ready = self.retained_ready
        match = self.trie.match
        woken: set[Any] = set()
        seen: dict[str, None] = {}
        for r in records:
            cache_put(r)
            if r.retain:
                self.retained_changes += 1
                if ready:
                    retained.apply(r)
                else:
                    self._retained_buffer.append(r)
            if r.topic not in seen:
                seen[r.topic] = None
                woken |= match(r.topic)
        for target in woken:
            if isinstance(target, SharedGroup):
                self.pump_share(target)
            else:
                self.pump(target)
        self.flush()

    def retained_recovered(self, store: RetainedStore) -> None:
        """Switch to the store rebuilt in the background; catch up and answer waiting SUBSCRIBEs."""
        for r in self._retained_buffer:
            store.apply(r)
        self._retained_buffer = []
        self.retained = store
        self.retained_ready = True
        waiting, self._retained_waiting = self._retained_waiting, []
        for conn, state, sub, below in waiting:
            if not conn.closed and state.conn is conn and state.subs.get(sub.filter) is sub:
                self._send_retained(conn, state, sub, below)
        self.flush()

    # ---- delivery --------------------------------------------------------------------------

    def pump(self, conn: Connection) -> None:
        """Push records to ``conn`` while its in-flight window has room."""
        state = conn.session
        if state is None or conn.closed or conn.paused or state.conn is not conn:
            return
        if conn in self._retained_out and not self._drain_retained(conn, state):
            return  # live records after the retained ones, never before
        group = state.group
        pushed = 0
        if group is not None:
            cid = conn.client_id
            while pushed < _MAX_PUMP:
                room = conn.max_inflight - len(state.inflight)
                if room <= 0 or conn.paused:
                    break
                records = group.fetch(min(room, 100), cid)
                if not records:
                    break
                self._deliver(conn, state, group, records, None)
                pushed += len(records)
            if pushed >= _MAX_PUMP:
                self._schedule_repump(conn)
        for name in state.share_names():
            sh = self.shares.get(name)
            if sh is not None:
                self.pump_share(sh)

    def _schedule_repump(self, conn: Connection) -> None:
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
        members = [m for m in sh.members if not m.closed and not m.paused and m.session is not None]
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
                room = conn.max_inflight - len(state.inflight)
                if room <= 0 or conn.paused:
                    continue
                records = group.fetch(min(room, 8), conn.client_id)
                if records:
                    progress = True
                    self._deliver(conn, state, group, records, sh.name)
            sh.rr += 1
            if not progress:
                return

    def _deliver(self, conn: Connection, state: SessionState, group: ConsumerGroup,
                 records: list[Record], share: str | None) -> None:
        """Send ``records`` (fetched from ``group`` for ``conn``) in one write; records no
        subscription of ``conn`` takes (older than it, or denied by the ACL) are acked."""
        acl = conn.acl
        # Every delivery is checked against the receiving user's read rights (cached per topic).
        check_acl = acl is not None and not acl.allow_all
        granted = state.granted_qos
        inflight = state.inflight
        ack = group.ack
        redelivered = group.redelivered
        parts: list[bytes] = []
        for r in records:
            offset = r.offset
            topic = r.topic
            qos = granted(topic, offset, share)
            if qos < 0 or (check_acl and not acl.can_receive(topic)):  # type: ignore[union-attr]
                ack(offset)
                continue
            if r.qos < qos:
                qos = r.qos
            if qos == 0:
                parts.append(publish_bytes(topic, r.payload, 0, False, None))
                ack(offset)
                continue
            pid = state.next_pid
            while pid in inflight:
                pid = pid % 0xFFFF + 1
            state.next_pid = pid % 0xFFFF + 1
            inflight[pid] = Outbound(offset, group, qos, topic, r.payload, share)
            parts.append(publish_bytes(topic, r.payload, qos, redelivered(offset), pid))
        if parts:
            self.stats.publish_sent(len(parts))
            conn.send(parts[0] if len(parts) == 1 else b"".join(parts))

    def on_puback(self, conn: Connection, pid: int) -> None:
        self.on_pubacks(conn, (pid,))

    def on_pubacks(self, conn: Connection, pids: Sequence[int]) -> None:
        """PUBACKs, many at once when a read held nothing else."""
        state = conn.session
        assert state is not None
        inflight = state.inflight
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
                out.group.ack(out.offset)
                self._acked = True
        self._to_pump.add(conn)

    def on_pubrec(self, conn: Connection, pid: int) -> None:
        state = conn.session
        assert state is not None
        out = state.inflight.get(pid)
        if out is not None and out.qos != 2:
            self._wrong_ack(conn, "PUBREC", pid, out)
            return
        if out is not None and out.stage == 0:
            out.stage = 1
            if out.group is not None:
                # The client has the message: the group may move on; only the id is pending.
                out.group.ack(out.offset)
                self._acked = True
        # Also for an unknown id or a repeated PUBREC: PUBREL is idempotent (4.3.3).
        conn.send(_ack(_PUBREL, pid))

    def on_pubcomp(self, conn: Connection, pid: int) -> None:
        state = conn.session
        assert state is not None
        out = state.inflight.get(pid)
        if out is None:
            log.debug("client %r: PUBCOMP for unknown packet id %d ignored", conn.client_id, pid)
            return
        if out.qos != 2 or out.stage == 0:
            self._wrong_ack(conn, "PUBCOMP", pid, out)
            return
        del state.inflight[pid]
        self._to_pump.add(conn)

    def _wrong_ack(self, conn: Connection, ack: str, pid: int, out: Outbound) -> None:
        """An acknowledgement that does not fit the in-flight message's state is a protocol
        violation (MQTT-4.8.0-1, 4.3): close; the message stays in flight and is re-sent
        (DUP = 1, or its PUBREL) when the session reconnects."""
        expected = "PUBACK" if out.qos == 1 else ("PUBREC" if out.stage == 0 else "PUBCOMP")
        conn.close(f"protocol error: {ack} for packet id {pid}, which awaits {expected} "
                   f"(QoS {out.qos} delivery; MQTT-4.8.0-1)", will=True, level=logging.WARNING)

    def on_pubrel(self, conn: Connection, pid: int) -> None:
        state = conn.session
        assert state is not None
        known = pid in state.qos2_in
        state.qos2_in.pop(pid, None)
        state.qos2_offsets.pop(pid, None)
        state.qos2_loaded.discard(pid)
        if state.persistent and (known or state.save_running or state.save_next is not None):
            # The removal is durable before PUBCOMP, so the id set on disk stays exact: after
            # PUBCOMP the client may reuse the id for a new message, which must be stored.
            done = self._save_soon(state)
            conn.queue_ack(done, _ack(_PUBCOMP, pid))
            if conn.last_batch is not done:
                self._join_batch(conn, done)
        else:
            conn.queue_ack(None, _ack(_PUBCOMP, pid))

    # ---- disconnect ------------------------------------------------------------------------

    def on_close(self, conn: Connection, prev_state: str) -> None:
        self.conns.discard(conn)
        self._dirty.discard(conn)
        self._repump.discard(conn)
        self._to_pump.discard(conn)
        self._retained_out.pop(conn, None)
        if prev_state != CONNECTED:
            return
        self.stats.client_disconnected()
        cid = conn.client_id
        if self.connections.get(cid) is conn:
            del self.connections[cid]
        state = conn.session
        if state is not None and state.conn is conn:
            state.conn = None
            for sub in state.subs.values():
                self._unregister(conn, sub)
            for name in state.share_names():
                self._leave_share(conn, state, name)
            if state.persistent:
                if state.save_due:
                    self._save_session(state)
            elif state.group is not None:
                self._drop_group(state.group.name)
                state.group = None
        will = conn.will
        if conn.publish_will and will is not None:
            acl = conn.acl
            if will.topic.startswith("$") or (acl is not None and not acl.can_publish(will.topic)):
                log.warning("client %r: will to %r not published (ACL or $-topic)", cid, will.topic)
            else:
                log.info("client %r: publishing its will to %r", cid, will.topic)
                self.store_internal(will.topic, will.payload, will.qos, will.retain)

    def _leave_share(self, conn: Connection, state: SessionState, name: str) -> None:
        """``conn`` stops being a member of share ``name`` (disconnect or last UNSUBSCRIBE)."""
        sh = self.shares.get(name)
        if sh is None:
            return
        if conn in sh.members:
            sh.members.remove(conn)
        # Its unacked shared records go to the other members, not back to it later.
        for pid in [p for p, o in state.inflight.items() if o.share == name and o.stage == 0]:
            del state.inflight[pid]
        if sh.group.release(conn.client_id):
            self.pump_share(sh)

    def _persist_offsets(self) -> None:
        """Write the offsets of groups that subscribers acked into, ~100 ms after the acks.

        The queue's own housekeeping runs once a second (an idle broker must not wake more
        often); under traffic this keeps the re-delivery after a crash to ~100 ms of acks.
        The writes (fsync + rename) run in a worker thread.
        """
        self._persist_handle = None
        if self._persist_task is not None and not self._persist_task.done():
            self._acked = True  # try again after the running write
            return
        snapshots = self.queue.persist_due()
        if snapshots:
            self._persist_task = asyncio.get_running_loop().create_task(
                asyncio.to_thread(self.queue.write_snapshots, snapshots), name="filemq-broker-offsets")

    # ---- periodic work ---------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """Once a second: keepalive and connect timeouts."""
        if now is None:
            now = time.monotonic()
        for conn in list(self.conns):
            if conn.keepalive_expired(now):
                if conn.state == AWAITING_CONNECT:
                    conn.close(f"no CONNECT within {self.connect_timeout:.0f} s", will=False)
                else:
                    conn.close(f"keepalive expired (no packet for 1.5 x {conn.keepalive} s)", will=True)
        self.flush()

    def publish_sys(self, messages: list[tuple[str, bytes]], *, replace: str | None = None) -> None:
        """Send ``$SYS`` messages (not stored in the log) to live subscribers as QoS 0.

        The latest value per topic is kept for new subscribers.  ``replace`` is a topic prefix
        that ``messages`` covers completely: kept topics under it that are missing from
        ``messages`` (e.g. the backlog of a session discarded since) are dropped.  Each delivery is
        checked against the receiver's ACL like any other; a topic that is not a valid topic
        name (e.g. over 65,535 UTF-8 bytes, from a huge client id) is skipped and counted in
        ``stats.sys_skipped``, with one warning per topic.
        """
        current = self.sys_retained
        if replace is not None:
            current = {t: v for t, v in current.items() if not t.startswith(replace)}
        for topic, payload in messages:
            if not self._sys_topic_ok(topic):
                continue
            current[topic] = payload
            data = None
            for target in self.trie.match(topic):
                if isinstance(target, Connection) and not target.closed:
                    acl = target.acl
                    if acl is not None and not acl.can_receive(topic):
                        continue
                    if data is None:
                        data = publish_bytes(topic, payload, 0, False, None)
                    target.send(data)
        self.sys_retained = current
        self.flush()

    def _sys_topic_ok(self, topic: str) -> bool:
        try:
            validate_topic_name(topic)  # MQTT 1.5.3: at most 65,535 UTF-8 bytes, no U+0000
        except InvalidTopic as exc:
            self.stats.sys_skipped += 1
            warned = self._sys_warned
            if topic not in warned and len(warned) < 1024:
                warned.add(topic)
                log.warning("$SYS message not published (invalid topic name): %s", exc)
            return False
        return True

    def save_sessions(self) -> None:
        """Write every persistent session with unwritten changes (shutdown, periodic)."""
        for state in self.sessions.values():
            if state.save_due:
                self._save_session(state)

    def pending_commits(self) -> list[asyncio.Future[None]]:
        """Commit futures that acks are still waiting for."""
        return [f for f in self._batches if not f.done()]

    async def stop_persisting(self) -> None:
        """Cancel the pending offset nudge; wait for offset and session-file writes in progress (shutdown)."""
        if self._persist_handle is not None:
            self._persist_handle.cancel()
            self._persist_handle = None
        if self._persist_task is not None:
            await asyncio.gather(self._persist_task, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.session_writes_done(), 5.0)  # bounded: a stuck disk

    def close_all(self, reason: str) -> None:
        for conn in list(self.conns):
            conn.close(reason, will=False)
        self.flush()
