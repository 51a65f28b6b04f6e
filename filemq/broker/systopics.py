"""The ``$SYS`` topics (:class:`SysTopics`): the broker's own messages to ``$SYS/...``
subscribers, never stored in the log.

One part of :class:`~filemq.broker.core.BrokerCore`: it owns the latest message per ``$SYS``
topic (what a new subscriber gets at once) and the topics already warned about; it reaches
subscribers through the router's trie, each delivery checked against the receiver's ACL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from filemq.broker.session.connection import Connection
from filemq.common.topics import InvalidTopic, topic_matches, validate_topic_name
from filemq.mqtt.codec import publish_bytes

if TYPE_CHECKING:
    from filemq.broker.router import Router
    from filemq.broker.sysinfo import BrokerStats

log = logging.getLogger("filemq.broker")


class SysTopics:
    """``$SYS`` messages: published to live subscribers, the latest per topic kept."""

    def __init__(self, router: Router, stats: BrokerStats,
                 too_large: Callable[[Connection, str, int, int], None]) -> None:
        self.router = router
        self.stats = stats
        # What a PUBLISH over the client's Maximum Packet Size gets (delivery's: counted,
        # logged, not sent; MQTT-3.1.2-25), as for any other delivery.
        self.too_large = too_large
        self.retained: dict[str, bytes] = {}  # topic -> its latest payload
        self._warned: set[str] = set()  # invalid $SYS topics already warned about

    def send_retained(self, conn: Connection, topic_filter: str) -> None:
        """Queue on ``conn`` the kept ``$SYS`` messages ``topic_filter`` matches (a new
        subscription's), as retained QoS 0 messages its ACL lets it read."""
        acl = conn.acl
        for topic, payload in self.retained.items():
            if topic_matches(topic_filter, topic) and (acl is None or acl.can_receive(topic)):
                self._send(conn, topic, conn.publish_bytes(topic, payload, 0, False, None, True))

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
            data = None
            for target in self.router.trie.match(topic):
                if isinstance(target, Connection) and not target.closed:
                    acl = target.acl
                    if acl is not None and not acl.can_receive(topic):
                        continue
                    if target.protocol_level != 4:
                        self._send(target, topic, target.publish_bytes(topic, payload, 0, False, None))
                        continue
                    if data is None:
                        data = publish_bytes(topic, payload, 0, False, None)
                    target.send(data)
        self.retained = current

    def _send(self, conn: Connection, topic: str, data: bytes) -> None:
        """``data`` (a $SYS PUBLISH encoded for ``conn``) to ``conn``, unless larger than its
        MQTT 5 Maximum Packet Size (MQTT-3.1.2-25: not sent, as any delivery)."""
        limit = conn.client_max_packet
        if limit is not None and len(data) > limit:
            self.too_large(conn, topic, len(data), limit)
            return
        conn.send(data)

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

