"""The broker core's shared state (:class:`CoreBase`): what every concern of
:class:`~filemq.broker.core.BrokerCore` reads and writes, and the output path
(one transport write per connection per event).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from filemq.broker.auth import LoginThrottle
from filemq.broker.registry import SessionRegistry
from filemq.broker.router import Router
from filemq.broker.session import CONNECTED, Connection
from filemq.broker.sessions import SessionStore
from filemq.broker.state import (
    PublisherRuns,
    PublishHook,
    SessionState,
    Subscription,
)
from segments.record import Record

if TYPE_CHECKING:
    from filemq.broker.acl import Acl
    from filemq.broker.auth import PasswordFile
    from filemq.broker.delivery import Delivery
    from filemq.broker.sysinfo import BrokerStats
    from filemq.broker.tailcache import TailCache
    from filemq.common.config import BrokerSection
    from filemq.queue import Queue
    from filemq.queue.groups import ConsumerGroup
    from filemq.queue.retained import RetainedMessage, RetainedStore
    from segments.log import LogView

log = logging.getLogger("filemq.broker")

CONNECT_TIMEOUT = 10.0
"""Seconds from the accept to a complete CONNECT (a TLS handshake included)."""
AUTH_THREADS = 2
"""Worker threads for password checks.  They are the broker's own, not the loop's default
executor: wrong-password CONNECTs (one PBKDF2 each) never queue ahead of the session-file and
offset writes that acks wait for."""


class CoreBase:
    """Broker state shared by all connections; :class:`~filemq.broker.core.BrokerCore`
    combines it with one mixin per concern."""


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
        self.log: LogView = queue.log  # only its read side: a test fake stands in (compiled build)
        # Topics reaching _append passed the codec's and CONNECT's topic-name checks already.
        self._append = functools.partial(queue.publish_nowait, validated=True)
        self._append_many = queue.publish_many_nowait  # the same, for a run of PUBLISHes
        self.cache = cache
        self.config = config
        # The session registry: sessions in memory, their files, expiry, delayed wills.
        self.registry = SessionRegistry(store, queue, acl)
        self.sessions = self.registry.sessions  # (the registry's dict: read by tests and $SYS)
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
        # Retained replays of SUBSCRIBEs that came while records appended before them were not
        # routed yet (MQTT-3.3.1-6/-8): sent once the routed offset reaches theirs.
        self._retained_after: dict[Connection, list[tuple[SessionState, Subscription, int]]] = {}
        self.stats = stats
        self.acl = acl
        self.passwords = passwords
        self.hook = publish_hook
        # The router: topic trie, shared groups, consumer groups (through the tail cache).
        # New groups start at the routed offset, as new subscriptions do (see on_subscribe).
        self.router = Router(queue, cache, self.log, group_factory or (
            lambda n, f, d: queue.group(n, f, durable=d, start=self._routed)))
        self.connect_timeout = CONNECT_TIMEOUT
        self._auth_pool: ThreadPoolExecutor | None = None  # created at the first password check
        self._login_throttle = LoginThrottle(config.login_failures_before_delay, config.login_failure_delay_ms / 1000)
        self.conns: set[Connection] = set()
        self.connections: dict[str, Connection] = {}  # client id -> live connection
        self.sys_retained: dict[str, bytes] = {}
        self._sys_warned: set[str] = set()  # invalid $SYS topics already warned about
        # Appended, not yet routed: runs of records with consecutive offsets (one per
        # on_publish, or per run of on_publishes), each with its commit future.
        self._pending: deque[tuple[list[Record], asyncio.Future[None]]] = deque()
        self._routed = self.log.committed_offset
        cache.limit = self._routed  # groups see a record only once it is routed
        self.anonymous_allowed = config.anonymous_allowed()
        queue.add_commit_listener(self._on_committed)

    @property
    def routed_offset(self) -> int:
        """Every committed record below this offset has been routed (and applied to retained)."""
        return self._routed

    def set_acl(self, acl: Acl) -> None:
        """Put a new ACL in force (reload): every connected client's rules are rebuilt at once,
        so its existing subscriptions deliver only what it may still read."""
        self.acl = self.registry.acl = acl
        for conn in self.conns:
            if conn.state == CONNECTED:
                conn.acl = acl.for_client(conn.username, conn.client_id)

    def new_connection(self, conn: Connection) -> None:
        self.conns.add(conn)

    def at_capacity(self) -> bool:
        return len(self.conns) >= self.config.max_connections

    delivery: Delivery  # (made by BrokerCore.__init__)

    # Methods of the concern mixins that other concerns call (defined there).
    if TYPE_CHECKING:


            def _on_committed(self, committed: int) -> None: ...





            def _track(self, record: Record, fut: asyncio.Future[None]) -> None: ...











            def _send_retained(self, conn: Connection, state: SessionState, sub: Subscription, below: int) -> None: ...
            def _send_retained_after(self) -> None: ...


            def _drain_retained(self, conn: Connection, state: SessionState) -> bool: ...

            def publishers(self) -> PublisherRuns: ...







