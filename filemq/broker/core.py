"""The broker's shared state and rules, without sockets: sessions, routing, durable acks.

:class:`BrokerCore` handles the events a :class:`~filemq.broker.session.connection.Connection` makes
of its bytes (:meth:`BrokerCore.receive`, each event to the part that owns it) and answers on
the connection (acks, deliveries, CONNACK, closes).  It runs on the event loop (it uses the
queue's group committer) but never touches a socket: connections collect output bytes and
:meth:`BrokerCore.flush` hands them to each connection's shell (``conn.write``) after each event.

What a caller may rely on:

* **Durable ack.** A PUBLISH is appended with ``GroupCommitter.append_nowait``; its PUBACK
  (QoS 1) / PUBREC (QoS 2) is queued on the connection behind the batch's shared commit
  future and released by one done-callback per *batch* (not per message), so all the acks of
  one fsync leave in one write per connection (``conn.write``, the shell's).
* **Routing.** Committed records are routed once, from the commit listener: the topic trie
  (hashed children) finds the live connections and shared groups whose filters match, and
  only those are woken.  Records are put in the :class:`~filemq.broker.tailcache.TailCache`
  the groups read through, so live subscribers never re-read the segment files.
* **Sessions.** A clean session gets a non-durable consumer group from the log's end (dropped
  at disconnect); a persistent session gets the durable group ``mqtt-session:<client id>`` and
  a :class:`~filemq.broker.session_store.StoredSession` (subscriptions with their start offsets,
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
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from filemq.broker.connect import Connector
from filemq.broker.delivery import Delivery
from filemq.broker.publish import Ingest, new_publisher_map
from filemq.broker.qos import QosAcks
from filemq.broker.registry import SessionRegistry, SessionWriter
from filemq.broker.retain import Retained
from filemq.broker.router import Router
from filemq.broker.session.connection import AWAITING_CONNECT, CONNECTED, Connection
from filemq.broker.session.events import Acks, Event, Publishes
from filemq.broker.session.inflight import Outbound
from filemq.broker.session_state import (
    CLEAN_GROUP_PREFIX,
    PERSIST_DELAY_S,
    RETAINED_OUT_HIGH,
    SESSION_GROUP_PREFIX,
    SHARE_GROUP_PREFIX,
    STORE,
    ClientInfo,
    HookResult,
    PublisherRuns,
    PublishHook,
    SessionState,
    SharedGroup,
    Subscription,
    parse_share_key,
)
from filemq.broker.subscribe import Subscriptions
from filemq.broker.systopics import SysTopics
from filemq.mqtt.codec import ProtocolError
from filemq.mqtt.packets import (
    PROTOCOL_LEVEL_5,
    Disconnect,
    Puback,
    Pubcomp,
    Publish,
    PublishRun,
    Pubrec,
    Pubrel,
    Subscribe,
    Unsubscribe,
)
from filemq.mqtt.packets import (
    Connect as ConnectPacket,
)

if TYPE_CHECKING:
    from filemq.broker.acl import Acl
    from filemq.broker.auth import PasswordFile
    from filemq.broker.ports import QueuePort
    from filemq.broker.router import GroupFactory
    from filemq.broker.session_store import SessionStore
    from filemq.broker.sysinfo import BrokerStats
    from filemq.broker.tailcache import TailCache
    from filemq.common.config import BrokerSection
    from filemq.queue.groups import ConsumerGroup
    from filemq.queue.retained import RetainedStore
    from segments.log import LogView

log = logging.getLogger("filemq.broker")

RC_SERVER_SHUTTING_DOWN = 0x8B
RC_KEEP_ALIVE_TIMEOUT = 0x8D

__all__ = [
    "BrokerCore",
    "CLEAN_GROUP_PREFIX",
    "ClientInfo",
    "HookResult",
    "Outbound",
    "PERSIST_DELAY_S",
    "PublishHook",
    "RETAINED_OUT_HIGH",
    "SESSION_GROUP_PREFIX",
    "SHARE_GROUP_PREFIX",
    "STORE",
    "SessionState",
    "SharedGroup",
    "Subscription",
    "parse_share_key",
]


class _PubrecHandler(Protocol):
    def __call__(self, conn: Connection, pid: int, reason_code: int = 0) -> None: ...


class BrokerCore:
    """Broker state shared by all connections; see the module docstring for the guarantees.

    A composition of parts, each owning its state behind its methods (docs/LAYERS.md, "The
    broker core"): the :class:`~.router.Router`, the :class:`~.registry.SessionRegistry`,
    :class:`~.delivery.Delivery`, :class:`~.retain.Retained`, :class:`~.systopics.SysTopics`,
    :class:`~.qos.QosAcks`, :class:`~.publish.Ingest`, :class:`~.subscribe.Subscriptions` and
    :class:`~.connect.Connector`,
    wired here.  :meth:`receive` hands each event a connection makes of its bytes to the
    handling part's own bound method (``on_publish`` and the others below), one frame for a
    whole read.  The periodic work (timeouts,
    expiry, $SYS, session saves) and a connection's close, which every part takes part in, are
    here."""

    on_connect: Callable[[Connection, ConnectPacket], None]
    on_disconnect: Callable[[Connection, Disconnect], None]
    on_publish: Callable[[Connection, Publish], None]
    on_publishes: Callable[[Connection, Sequence[Publish]], None]
    on_publish_run: Callable[[Connection, PublishRun], None]
    on_puback: Callable[[Connection, int], None]
    on_pubacks: Callable[[Connection, Sequence[int]], None]
    on_pubrec: _PubrecHandler
    on_pubrel: Callable[[Connection, int], None]
    on_pubcomp: Callable[[Connection, int], None]
    on_subscribe: Callable[[Connection, Subscribe], None]
    on_unsubscribe: Callable[[Connection, Unsubscribe], None]
    mark_dirty: Callable[[Connection], None]
    flush: Callable[[], None]
    pump: Callable[[Connection], None]

    def __init__(
        self,
        queue: QueuePort,
        cache: TailCache,
        *,
        config: BrokerSection,
        store: SessionStore,
        retained: RetainedStore,
        stats: BrokerStats,
        acl: Acl,
        passwords: PasswordFile | None = None,
        publish_hook: PublishHook | None = None,
        group_factory: GroupFactory | None = None,
    ) -> None:
        self.queue = queue
        self.log: LogView = queue.log  # only its read side: a test fake stands in (compiled build)
        self.cache = cache
        self.config = config
        self.stats = stats
        self.conns: set[Connection] = set()  # every connection, connected or not yet
        self.next_timeout = math.inf  # the earliest keepalive / CONNECT deadline at the last check
        # The router: topic trie, shared groups, consumer groups (through the tail cache).
        # New groups start at the routed offset, as new subscriptions do (see on_subscribe).
        router = self.router = Router(queue, cache, self.log, group_factory or self._new_group)
        # The session registry: sessions in memory, their files, expiry, delayed wills.
        registry = self.registry = SessionRegistry(store, queue, acl)
        self.sessions = registry.sessions  # (the registry's dict: read by tests)
        self._publisher_map = new_publisher_map()
        # Delivery: pumping groups into connections, acks, the output path.
        delivery = self.delivery = Delivery(queue, cache, stats, router, registry, self._publisher_map)
        # $SYS topics; retained messages (the store, and what new subscriptions get).
        self.sys = SysTopics(router, stats, delivery.deliver_sys)
        retained_part = self.retained = Retained(retained, self.log, delivery, self.sys)
        delivery.wire_retained(retained_part.out, retained_part.after, retained_part.drain)
        # Ingest: PUBLISH admission, the append, acks behind the commit, routing once committed.
        # QoS 1/2 both ways: the acknowledgements of deliveries (PUBACK, PUBREC, PUBCOMP), inbound
        # QoS 2 (dedup of re-sent ids, PUBREC, PUBREL -> PUBCOMP), the re-send on reconnect.
        qos = self.qos = QosAcks(self.log, registry, delivery)
        ingest = self.ingest = Ingest(queue, cache, config, stats, publish_hook, router, registry, delivery,
                                      retained_part, self._publisher_map, qos)
        retained_part.routing = ingest
        registry.publish_internal = ingest.store_internal
        # Subscriptions: SUBSCRIBE / UNSUBSCRIBE.
        subscriptions = self.subscriptions = Subscriptions(self.log, config, router, registry, delivery,
                                                           retained_part, ingest)
        # Connect: CONNECT (authentication, sessions, CONNACK), DISCONNECT.
        connect = self.connect = Connector(config, acl, passwords, stats, router, registry, delivery, ingest, qos)
        self.connections = connect.connections  # (the connect part's dict: client id -> live connection)
        publishers = self._publisher_map
        publishers.sink = registry.own_published
        publishers.forget_sink = registry.own_forget
        # What receive() calls for each event: the handling part's methods themselves.
        connect.resume = self.resume
        self.on_connect = connect.on_connect
        self.on_disconnect = connect.on_disconnect
        self.on_publish = ingest.on_publish
        self.on_publishes = ingest.on_publishes
        self.on_publish_run = ingest.on_publish_run
        self.on_subscribe = subscriptions.on_subscribe
        self.on_unsubscribe = subscriptions.on_unsubscribe
        self.on_puback = qos.on_puback
        self.on_pubacks = qos.on_pubacks
        self.on_pubrec = qos.on_pubrec
        self.on_pubrel = qos.on_pubrel
        self.on_pubcomp = qos.on_pubcomp
        self.mark_dirty = delivery.mark_dirty
        self.flush = delivery.flush
        self.pump = delivery.pump

    def _new_group(self, name: str, filters: tuple[str, ...], durable: bool) -> ConsumerGroup:
        """The default group factory: a new group starts at the routed offset, as a new
        subscription does (see Subscriptions.on_subscribe)."""
        return self.queue.group(name, filters, durable=durable, start=self.ingest.routed_offset)

    # ---- what the server and the tests set and read ----------------------------------------

    @property
    def acl(self) -> Acl:
        """The ACL in force (the connect part's; :meth:`set_acl` to reload it)."""
        return self.connect.acl

    @acl.setter
    def acl(self, acl: Acl) -> None:
        self.connect.acl = self.registry.acl = acl

    @property
    def passwords(self) -> PasswordFile | None:
        return self.connect.passwords

    @passwords.setter
    def passwords(self, passwords: PasswordFile | None) -> None:
        self.connect.passwords = passwords

    @property
    def anonymous_allowed(self) -> bool:
        return self.connect.anonymous_allowed

    @anonymous_allowed.setter
    def anonymous_allowed(self, allowed: bool) -> None:
        self.connect.anonymous_allowed = allowed

    @property
    def connect_timeout(self) -> float:
        """Seconds from the accept to a complete CONNECT."""
        return self.connect.connect_timeout

    @connect_timeout.setter
    def connect_timeout(self, seconds: float) -> None:
        self.connect.connect_timeout = seconds

    def set_acl(self, acl: Acl) -> None:
        """Put a new ACL in force (reload): every connected client's rules are rebuilt at once,
        so its existing subscriptions deliver only what it may still read."""
        self.acl = acl
        for conn in self.conns:
            if conn.state == CONNECTED:
                conn.acl = acl.for_client(conn.username, conn.client_id)

    def new_connection(self, conn: Connection) -> None:
        self.conns.add(conn)

    # ---- a connection's events ---------------------------------------------------------------

    def receive(self, conn: Connection, events: Iterable[Event]) -> None:
        """Hand ``conn``'s events (:meth:`Connection.receive_data`) to the parts that handle
        them, in order: PUBLISHes to ingest, PUBACK/PUBREC/PUBREL/PUBCOMP to qos, CONNECT and
        DISCONNECT to connect, (UN)SUBSCRIBE to subscriptions.  A protocol violation, found by
        the connection or by a part, closes the connection (:meth:`Connection.protocol_error`);
        so does a bug, which costs only this connection.  (Types are compared with ``is``:
        exact, cheaper than isinstance, and mypy narrows on it.)"""
        try:
            for event in events:
                if type(event) is PublishRun:
                    self.on_publish_run(conn, event)
                elif type(event) is Acks:
                    self.on_pubacks(conn, event.ids)
                elif type(event) is Publish:
                    self.on_publish(conn, event)
                elif type(event) is Publishes:
                    self.on_publishes(conn, event.packets)
                elif type(event) is Puback:
                    self.on_puback(conn, event.packet_id)
                elif type(event) is Pubrec:
                    self.on_pubrec(conn, event.packet_id, event.reason_code)
                elif type(event) is Pubrel:
                    self.on_pubrel(conn, event.packet_id)
                elif type(event) is Pubcomp:
                    self.on_pubcomp(conn, event.packet_id)
                elif type(event) is Subscribe:
                    self.on_subscribe(conn, event)
                elif type(event) is Unsubscribe:
                    self.on_unsubscribe(conn, event)
                elif type(event) is ConnectPacket:
                    self.on_connect(conn, event)
                elif type(event) is Disconnect:
                    self.on_disconnect(conn, event)
                else:  # pragma: no cover - Connection makes only the events above
                    raise TypeError(f"unknown event {event!r}")
        except ProtocolError as exc:
            conn.protocol_error(exc)
        except Exception as err:  # not "exc": mypyc gives a name one type per function
            conn.internal_error(err)

    def resume(self, conn: Connection) -> None:
        """``conn``'s CONNECT was accepted after a wait (password check, session-file write):
        handle the bytes that arrived meanwhile, and let its shell read again."""
        self.receive(conn, conn.resume_after_auth())
        if conn.reading_changed is not None and not conn.closed:
            conn.reading_changed()

    def at_capacity(self) -> bool:
        return len(self.conns) >= self.config.max_connections

    @property
    def routed_offset(self) -> int:
        """Every committed record below this offset has been routed (and applied to retained)."""
        return self.ingest.routed_offset

    def publishers(self) -> PublisherRuns:
        """Who published the latest offsets (MQTT 5 publishers, for no local)."""
        return self._publisher_map

    @property
    def session_writer(self) -> SessionWriter:
        """How session files are written (the registry's; tests replace it)."""
        return self.registry.session_writer

    @session_writer.setter
    def session_writer(self, writer: SessionWriter) -> None:
        self.registry.session_writer = writer

    def release_expired_sessions(self) -> None:
        self.registry.release_expired_sessions()

    def expire_sessions(self, now: float) -> None:
        self.registry.expire_sessions(now)

    def save_sessions(self, off_loop: bool = False) -> None:
        self.registry.save_sessions(off_loop)

    async def session_writes_done(self) -> None:
        await self.registry.session_writes_done()

    # ---- periodic work ---------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """Once a second: keepalive and connect timeouts (MQTT 5: DISCONNECT 0x8D first),
        MQTT 5 session expiry and delayed wills, expired retained messages."""
        if now is None:
            now = time.monotonic()
        self.next_timeout = self._close_timed_out(now)
        registry = self.registry
        if registry.expiring or registry.wills_waiting:
            registry.expire_sessions(now)
        self.retained.expire()
        self.delivery.flush()

    def check_timeouts(self, now: float | None = None) -> float:
        """The keepalive and CONNECT deadlines alone, between ticks (the server calls this at
        :attr:`next_timeout`, so a silent client is closed at 1.5 x its keepalive, not up to a
        tick later, MQTT-3.1.2-24); returns the next deadline."""
        if now is None:
            now = time.monotonic()
        self.next_timeout = self._close_timed_out(now)
        self.delivery.flush()
        return self.next_timeout

    def _close_timed_out(self, now: float) -> float:
        """Close the connections past their deadline; the earliest deadline of the others."""
        earliest = math.inf
        for conn in list(self.conns):
            deadline = conn.deadline(self.connect_timeout)
            if deadline >= now:
                if deadline < earliest:
                    earliest = deadline
            elif conn.state == AWAITING_CONNECT:
                conn.close(f"no CONNECT within {self.connect_timeout:.0f} s", will=False)
            else:
                conn.close(f"keepalive expired (no packet for 1.5 x {conn.keepalive} s)", will=True,
                           reason_code=RC_KEEP_ALIVE_TIMEOUT)
        return earliest

    def on_close(self, conn: Connection, prev_state: str) -> None:
        """A connection closed: every part forgets it and its session is released
        (:meth:`_release_session`); then, MQTT 5: the session's expiry clock starts, and a will
        is published with its properties or held for its delay."""
        will = conn.will if conn.publish_will and conn.protocol_level == PROTOCOL_LEVEL_5 else None
        if will is not None:
            conn.publish_will = False  # (published here, with its will properties)
        self.conns.discard(conn)
        self.delivery.forget(conn)
        self.retained.forget(conn)
        if prev_state != CONNECTED:
            return
        self._release_session(conn)
        state = conn.session
        alive = (state is not None and state.conn is None and state.persistent
                 and self.sessions.get(state.client_id) is state)
        if alive and state is not None:
            self.registry.session_closed(state)
        if will is None:
            return
        conn.publish_will = True
        props = will.properties
        delay = 0 if props is None or props.will_delay_interval is None else props.will_delay_interval
        if delay and alive and state is not None:
            self.registry.hold_will(state, will, conn.acl, delay)
        else:
            self.registry.publish_will(conn.client_id, will, conn.acl)

    def _release_session(self, conn: Connection) -> None:
        """A connected client's connection closed: its subscriptions leave the router, a clean
        session ends, a persistent one is written if due; a 3.1.1 will is published."""
        self.stats.client_disconnected()
        cid = conn.client_id
        if self.connections.get(cid) is conn:
            del self.connections[cid]
        state = conn.session
        if state is not None and state.conn is conn:
            state.conn = None
            for sub in state.subs.values():
                self.router.unregister(conn, sub)
            for name in state.share_names():
                self.delivery.leave_share(conn, state, name)
            if state.persistent and state.expiry == 0 and self.registry.sessions.get(cid) is state:
                # MQTT 5 session expiry 0: the session ends with its network connection (3.1.2.11.2).
                self.registry.discard(cid)
            elif state.persistent:
                if state.save_due:
                    self.registry.save_soon(state)  # in a worker thread
            elif state.group is not None:
                self.router.drop_group(state.group.name)
                state.group = None
        will = conn.will
        if conn.publish_will and will is not None:
            self.registry.store_will(cid, will.topic, will.payload, will.qos, will.retain, b"", conn.acl)

    def publish_sys(self, messages: list[tuple[str, bytes]], *, replace: str | None = None) -> None:
        """Send ``$SYS`` messages to live subscribers (:meth:`SysTopics.publish`), then flush."""
        self.sys.publish(messages, replace=replace)
        self.delivery.flush()

    @property
    def sys_retained(self) -> dict[str, bytes]:
        """The latest ``$SYS`` message per topic (the $SYS part's)."""
        return self.sys.retained

    def pending_commits(self) -> list[asyncio.Future[None]]:
        """Commit futures that acks are still waiting for."""
        return self.delivery.pending_commits()

    async def stop_persisting(self) -> None:
        """Cancel the pending offset nudge; wait for offset and session-file writes in progress (shutdown)."""
        await self.delivery.stop_persisting()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.registry.session_writes_done(), 5.0)  # bounded: a stuck disk

    def close_all(self, reason: str) -> None:
        """Shutdown: every client closed without its will (MQTT 5: DISCONNECT 0x8B first);
        wills still waiting for their delay are published now (3.1.2.5 lets a server publish
        them at shutdown), not lost with the process."""
        for conn in list(self.conns):
            conn.close(reason, will=False, reason_code=RC_SERVER_SHUTTING_DOWN)
        self.registry.publish_pending_wills()
        self.delivery.flush()
        self.connect.shutdown()
