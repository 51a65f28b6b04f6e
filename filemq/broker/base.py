"""The broker core's shared state (:class:`CoreBase`): what every concern of
:class:`~filemq.broker.core.BrokerCore` reads and writes, and the output path
(one transport write per connection per event).
"""

from __future__ import annotations

import logging
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
)

if TYPE_CHECKING:
    from filemq.broker.acl import Acl
    from filemq.broker.auth import PasswordFile
    from filemq.broker.delivery import Delivery
    from filemq.broker.publish import Ingest
    from filemq.broker.retain import Retained
    from filemq.broker.sysinfo import BrokerStats
    from filemq.broker.tailcache import TailCache
    from filemq.common.config import BrokerSection
    from filemq.queue import Queue
    from filemq.queue.groups import ConsumerGroup
    from filemq.queue.retained import RetainedStore
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
        self.cache = cache
        self.config = config
        # The session registry: sessions in memory, their files, expiry, delayed wills.
        self.registry = SessionRegistry(store, queue, acl)
        self.sessions = self.registry.sessions  # (the registry's dict: read by tests and $SYS)
        self.stats = stats
        self.acl = acl
        self.passwords = passwords
        # The router: topic trie, shared groups, consumer groups (through the tail cache).
        # New groups start at the routed offset, as new subscriptions do (see on_subscribe).
        self.router = Router(queue, cache, self.log, group_factory or (
            lambda n, f, d: queue.group(n, f, durable=d, start=self.ingest.routed_offset)))
        self.connect_timeout = CONNECT_TIMEOUT
        self._auth_pool: ThreadPoolExecutor | None = None  # created at the first password check
        self._login_throttle = LoginThrottle(config.login_failures_before_delay, config.login_failure_delay_ms / 1000)
        self.conns: set[Connection] = set()
        self.connections: dict[str, Connection] = {}  # client id -> live connection
        self.anonymous_allowed = config.anonymous_allowed()

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
    retained: Retained  # (likewise)
    ingest: Ingest  # (likewise)

    # Methods of the concern mixins that other concerns call (defined there).
    if TYPE_CHECKING:





















            def publishers(self) -> PublisherRuns: ...







