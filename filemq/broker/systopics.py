"""The ``$SYS`` topics (:class:`SysTopics`): the broker's own messages to ``$SYS/...``
subscribers, never stored in the log.

One part of :class:`~filemq.broker.core.BrokerCore`: it owns the latest message per ``$SYS``
topic (what a new subscriber gets at once) and the topics already warned about; it finds
subscribers through the router's trie and sends each message through the delivery planner
(``Delivery.deliver_sys``: read rights, subscription identifiers, Maximum Packet Size, topic
aliases, as any delivery).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from filemq.broker.session.connection import Connection
from filemq.common.topics import InvalidTopic, topic_matches, validate_topic_name

if TYPE_CHECKING:
    from filemq.broker.router import Router
    from filemq.broker.session_state import SessionState, Subscription
    from filemq.broker.sysinfo import BrokerStats

SysDeliver = Callable[["Connection", "SessionState", str, bytes, "bytes | None"], None]
"""Delivery's planner entry for a ``$SYS`` message (``Delivery.deliver_sys``)."""

log = logging.getLogger("filemq.broker")


class SysTopics:
    """``$SYS`` messages: published to live subscribers, the latest per topic kept."""

    def __init__(self, router: Router, stats: BrokerStats, deliver: SysDeliver) -> None:
        self.router = router
        self.stats = stats
        self.deliver = deliver  # (the delivery planner's; wired by the core)
        self.retained: dict[str, bytes] = {}  # topic -> its latest payload
        self._warned: set[str] = set()  # invalid $SYS topics already warned about

    def send_retained(self, conn: Connection, state: SessionState, sub: Subscription) -> None:
        """Send ``conn`` the kept ``$SYS`` messages new subscription ``sub`` matches, as
        retained QoS 0 messages with its identifier (MQTT-3.3.1-6, MQTT-3.3.4-3); the planner
        checks the read rights."""
        ids = sub.identifier_property()
        for topic, payload in self.retained.items():
            if topic_matches(sub.plain, topic):
                self.deliver(conn, state, topic, payload, ids)

    def publish(self, messages: list[tuple[str, bytes]], *, replace: str | None = None) -> None:
        """Send ``$SYS`` messages (not stored in the log) to live subscribers as QoS 0 (the
        caller flushes).

        The latest value per topic is kept for new subscribers.  ``replace`` is a topic prefix
        that ``messages`` covers completely: kept topics under it that are missing from
        ``messages`` (e.g. the backlog of a session discarded since) are dropped.  Each delivery is
        checked against the receiver's ACL like any other; a topic that is not a valid topic
        name (e.g. over 65,535 UTF-8 bytes, from a huge client id) is skipped and counted in
        ``stats.sys_skipped``, with one warning per topic.
        """
        current = self.retained
        if replace is not None:
            current = {t: v for t, v in current.items() if not t.startswith(replace)}
        for topic, payload in messages:
            if not self._topic_ok(topic):
                continue
            current[topic] = payload
            for target in self.router.trie.match(topic):
                if isinstance(target, Connection) and not target.closed:
                    state = target.session
                    if state is not None:
                        self.deliver(target, state, topic, payload, None)
        self.retained = current

    def _topic_ok(self, topic: str) -> bool:
        try:
            validate_topic_name(topic)  # MQTT 1.5.3: at most 65,535 UTF-8 bytes, no U+0000
        except InvalidTopic as exc:
            self.stats.sys_skipped += 1
            warned = self._warned
            if topic not in warned and len(warned) < 1024:
                warned.add(topic)
                log.warning("$SYS message not published (invalid topic name): %s", exc)
            return False
        return True

