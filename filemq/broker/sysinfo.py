"""Broker statistics and the ``$SYS/broker/...`` messages that publish them (no I/O).

The broker calls the counting methods of :class:`BrokerStats` as things happen and, every
``sys_interval_s``, publishes :meth:`BrokerStats.sys_messages` as retained messages.  Topic
names follow Mosquitto's where one exists.

What a caller may rely on:

* Memory is bounded whatever the traffic: the fsync latency samples live in a fixed ring
  (default the last 1,024 syncs) and the hot-topic tracker keeps at most ``hot_capacity``
  topics (default 256).
* Hot topics are ranked by an exponentially decaying publish count (time constant
  ``hot_window_s``, default 60 s): ``rate = count / window`` in messages per second, so a
  steady 5 msg/s topic converges to 5.  When the table is full, the less active half is
  dropped; a newly hot topic re-enters and overtakes within a few messages.  Counts are
  therefore approximate for the tail and close for the top topics, which is all a
  "what is busy" view needs.
* Times passed in (``now``) are ``time.monotonic()`` seconds, the same clock as
  ``started_at``.
"""

from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass, field

SYS_PREFIX = "$SYS/broker/"


class LatencyRing:
    """The last ``size`` latency samples (seconds) for percentiles."""

    def __init__(self, size: int = 1024) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self._samples = array("d", bytes(8 * size))
        self._next = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, seconds: float) -> None:
        self._samples[self._next] = seconds
        self._next = (self._next + 1) % len(self._samples)
        self._count = min(self._count + 1, len(self._samples))

    def percentile(self, p: float) -> float | None:
        """Nearest-rank percentile (0 < p <= 100) of the samples held, or None if empty."""
        if not self._count:
            return None
        ordered = sorted(self._samples[: self._count])
        rank = max(1, math.ceil(p / 100 * len(ordered)))
        return ordered[rank - 1]


class HotTopics:
    """Approximate top topics by publish rate over a decaying window, in bounded memory."""

    def __init__(self, window_s: float = 60.0, capacity: int = 256) -> None:
        if window_s <= 0 or capacity < 2:
            raise ValueError("window_s must be > 0 and capacity >= 2")
        self.window_s = window_s
        self.capacity = capacity
        self._counts: dict[str, list[float]] = {}  # topic -> [count at time t, t]

    def __len__(self) -> int:
        return len(self._counts)

    def _decayed(self, entry: list[float], now: float) -> float:
        return entry[0] * math.exp(-max(0.0, now - entry[1]) / self.window_s)

    def record(self, topic: str, now: float, count: int = 1) -> None:
        """Count ``count`` publishes to ``topic`` at time ``now``."""
        entry = self._counts.get(topic)
        if entry is None:
            if len(self._counts) >= self.capacity:
                self._prune(now)
            self._counts[topic] = [float(count), now]
            return
        entry[0] = self._decayed(entry, now) + count
        entry[1] = now

    def _prune(self, now: float) -> None:
        ranked = sorted(self._counts.items(), key=lambda kv: self._decayed(kv[1], now))
        for topic, _ in ranked[: len(ranked) - self.capacity // 2]:
            del self._counts[topic]

    def top(self, n: int, now: float) -> list[tuple[str, float]]:
        """Up to ``n`` ``(topic, messages per second)``, busiest first (ties by topic)."""
        rates = [(t, self._decayed(e, now) / self.window_s) for t, e in self._counts.items()]
        rates.sort(key=lambda tr: (-tr[1], tr[0]))
        return rates[:n]


@dataclass
class BrokerStats:
    """Counters and gauges of one broker run; see the module docstring."""

    started_at: float
    hot_window_s: float = 60.0
    hot_capacity: int = 256
    hot_top: int = 10
    latency_samples: int = 1024

    clients_connected: int = 0
    clients_maximum: int = 0
    connections_total: int = 0
    sessions_offline: int = 0
    messages_received: int = 0
    messages_sent: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    publish_dropped: int = 0
    store_bytes: int = 0
    sys_skipped: int = 0  # $SYS messages not published: their topic was not a valid topic name
    backlog: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fsync_latency = LatencyRing(self.latency_samples)
        self.hot_topics = HotTopics(self.hot_window_s, self.hot_capacity)

    # -- events --------------------------------------------------------------------------

    def client_connected(self) -> None:
        self.clients_connected += 1
        self.connections_total += 1
        self.clients_maximum = max(self.clients_maximum, self.clients_connected)

    def client_disconnected(self) -> None:
        self.clients_connected = max(0, self.clients_connected - 1)

    def publish_received(self, topic: str, now: float) -> None:
        """A PUBLISH arrived from a client (counted even if the ACL then drops it)."""
        self.messages_received += 1
        self.hot_topics.record(topic, now)

    def publish_sent(self, count: int = 1) -> None:
        """PUBLISH packets sent to subscribers."""
        self.messages_sent += count

    def publish_denied(self) -> None:
        """A PUBLISH the ACL (or the $-topic rule) denied: acked and dropped, or its connection closed."""
        self.publish_dropped += 1

    def received_bytes(self, n: int) -> None:
        self.bytes_received += n

    def sent_bytes(self, n: int) -> None:
        self.bytes_sent += n

    def fsync_done(self, seconds: float) -> None:
        """One group-commit fdatasync took ``seconds``."""
        self.fsync_latency.add(seconds)

    def set_backlog(self, group: str, records: int) -> None:
        """Records not yet acknowledged by consumer group ``group``."""
        self.backlog[group] = records

    def remove_backlog(self, group: str) -> None:
        self.backlog.pop(group, None)

    # -- publishing ----------------------------------------------------------------------

    def sys_messages(self, now: float) -> list[tuple[str, bytes]]:
        """``(topic, payload)`` pairs to publish (retained) under ``$SYS/broker/``.

        Latency topics appear only once a sync has been measured; backlog topics are per
        consumer group (``$SYS/broker/backlog/<group>``).
        """
        uptime = max(0, int(now - self.started_at))
        values: list[tuple[str, str]] = [
            ("uptime", f"{uptime} seconds"),
            ("clients/connected", str(self.clients_connected)),
            ("clients/disconnected", str(self.sessions_offline)),
            ("clients/total", str(self.clients_connected + self.sessions_offline)),
            ("clients/maximum", str(self.clients_maximum)),
            ("connections/total", str(self.connections_total)),
            ("messages/received", str(self.messages_received)),
            ("messages/sent", str(self.messages_sent)),
            ("publish/messages/dropped", str(self.publish_dropped)),
            ("bytes/received", str(self.bytes_received)),
            ("bytes/sent", str(self.bytes_sent)),
            ("store/bytes", str(self.store_bytes)),
        ]
        for name, p in (("p50", 50.0), ("p99", 99.0)):
            seconds = self.fsync_latency.percentile(p)
            if seconds is not None:
                values.append((f"fsync/latency_ms/{name}", f"{seconds * 1000:.3f}"))
        for group in sorted(self.backlog):
            values.append((f"backlog/{group}", str(self.backlog[group])))
        hot = [
            {"topic": t, "rate": round(r, 3)} for t, r in self.hot_topics.top(self.hot_top, now)
        ]
        values.append(("topics/hot", json.dumps(hot, separators=(",", ":"))))
        return [(SYS_PREFIX + name, text.encode("utf-8")) for name, text in values]
