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
import logging
import math
import time
from typing import TYPE_CHECKING

from filemq.broker.connect import ConnectMixin
from filemq.broker.delivery import Delivery
from filemq.broker.publish import Ingest, new_publisher_map
from filemq.broker.registry import SessionWriter
from filemq.broker.retain import Retained
from filemq.broker.session import AWAITING_CONNECT, CONNECTED, Connection
from filemq.broker.state import (
    CLEAN_GROUP_PREFIX,
    PERSIST_DELAY_S,
    RETAINED_OUT_HIGH,
    SESSION_GROUP_PREFIX,
    SHARE_GROUP_PREFIX,
    STORE,
    ClientInfo,
    HookResult,
    Outbound,
    PublisherRuns,
    PublishHook,
    SessionState,
    SharedGroup,
    Subscription,
    parse_share_key,
)
from filemq.broker.subscribe import Subscriptions
from filemq.broker.systopics import SysTopics
from filemq.common.native import mypyc_attr
from filemq.mqtt.packets import PROTOCOL_LEVEL_5

if TYPE_CHECKING:
    from filemq.broker.acl import Acl
    from filemq.broker.auth import PasswordFile
    from filemq.broker.router import GroupFactory
    from filemq.broker.sessions import SessionStore
    from filemq.broker.sysinfo import BrokerStats
    from filemq.broker.tailcache import TailCache
    from filemq.common.config import BrokerSection
    from filemq.queue import Queue
    from filemq.queue.retained import RetainedStore

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


@mypyc_attr(native_class=False)
class BrokerCore(ConnectMixin):
    """Broker state shared by all connections; see the module docstring for the guarantees.

    One mixin per concern (:mod:`.connect`, :mod:`.subscribe`, :mod:`.publish`,
    :mod:`.delivery`) over the shared state of :class:`~filemq.broker.base.CoreBase`;
    the periodic work ($SYS, session saves, shutdown) is here."""

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
        group_factory: GroupFactory | None = None,
    ) -> None:
        super().__init__(queue, cache, config=config, store=store, retained=retained, stats=stats, acl=acl,
                         passwords=passwords, publish_hook=publish_hook, group_factory=group_factory)
        self.next_timeout = math.inf  # the earliest keepalive / CONNECT deadline at the last check
        registry = self.registry
        self._publisher_map = new_publisher_map()
        # Delivery: pumping groups into connections, acks, the output path.
        delivery = self.delivery = Delivery(queue, cache, stats, self.router, registry, self._publisher_map)
        # $SYS topics; retained messages (the store, and what new subscriptions get).
        self.sys = SysTopics(self.router, stats)
        retained_part = self.retained = Retained(retained, self.log, stats, delivery, registry, self.sys)
        delivery.wire_retained(retained_part.out, retained_part.after, retained_part.drain)
        # Ingest: PUBLISH admission, the append, acks behind the commit, routing once committed.
        ingest = self.ingest = Ingest(queue, cache, config, stats, publish_hook, self.router, registry, delivery,
                                      retained_part, self._publisher_map)
        retained_part.routing = ingest
        registry.publish_internal = ingest.store_internal
        self.on_publish = ingest.on_publish
        self.on_publishes = ingest.on_publishes
        self.on_publish_run = ingest.on_publish_run
        # Subscriptions: SUBSCRIBE / UNSUBSCRIBE.
        subscriptions = self.subscriptions = Subscriptions(self.log, config, self.router, registry, delivery,
                                                           retained_part, ingest)
        self.on_subscribe = subscriptions.on_subscribe
        self.on_unsubscribe = subscriptions.on_unsubscribe
        # What connections call that delivery handles: its methods themselves (no frame here).
        self.mark_dirty = delivery.mark_dirty
        self.flush = delivery.flush
        self.pump = delivery.pump
        self.on_puback = delivery.on_puback
        self.on_pubacks = delivery.on_pubacks
        self.on_pubrec = delivery.on_pubrec
        self.on_pubrel = delivery.on_pubrel
        self.on_pubcomp = delivery.on_pubcomp
        publishers = self.publishers()
        publishers.sink = registry.own_published
        publishers.forget_sink = registry.own_forget

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
            deadline = conn.deadline()
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
        if alive:
            self.registry.session_closed(state)
        if will is None:
            return
        conn.publish_will = True
        props = will.properties
        delay = 0 if props is None or props.will_delay_interval is None else props.will_delay_interval
        if delay and alive:
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
        if self._auth_pool is not None:
            self._auth_pool.shutdown(wait=False, cancel_futures=True)
            self._auth_pool = None
