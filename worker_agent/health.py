"""The agent's health report (:mod:`filemq.upstream.health`): what it says and when it is sent.

:class:`HealthReporter` builds a report from the agent's broker and exports: version and
build, uptime, log size and free disk, per export its lag (records, bytes), oldest
unacknowledged age and state, connected local clients and the counters an operator needs
(messages in, dropped, oversized records skipped, records cut at the last recovery).

Every collector export's :class:`worker_agent.forwarder.Forwarder` sends one right after each
(re)connect and then every ``agent.health_interval_s`` seconds (0: never), as a QoS 0 PUBLISH on
its existing connection: it takes no in-flight slot and is not acknowledged, so it never
delays or reorders the data batches (docs/FORWARDING.md).

What a caller may rely on: :meth:`HealthReporter.report` never raises for a figure it cannot
read (that figure is left out, with a DEBUG log); it raises only if the report cannot be
encoded at all.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from filemq.ops.build import version
from filemq.upstream.health import encode_health

if TYPE_CHECKING:
    from filemq.broker import Broker
    from worker_agent.exports import Exports

log = logging.getLogger(__name__)


def build_name() -> str:
    """``pure`` or ``compiled`` (the mypyc hot path), as :mod:`filemq.ops.build` finds it."""
    from filemq.ops.build import compiled_modules

    return "compiled" if compiled_modules() else "pure"


class HealthReporter:
    """Builds this agent's health reports (one sequence number per report, from 1)."""

    def __init__(self, device_id: str, stream: str, broker: Broker, exports: Exports, interval_s: int, *,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.device_id = device_id
        self.stream = stream
        self.broker = broker
        self.exports = exports
        self.interval_s = interval_s
        self._clock = clock
        self._monotonic = monotonic
        self._started = monotonic()
        self._sequence = 0
        self._version = version()
        self._build = build_name()
        self.reports = 0

    def body(self) -> dict[str, Any]:
        """The report's fields (docs/FORMAT.md, "Health report")."""
        body: dict[str, Any] = {
            "agent_version": self._version, "build": self._build, "stream": self.stream,
            "uptime_s": round(self._monotonic() - self._started, 3), "interval_s": self.interval_s,
        }
        stats = self.broker.stats
        body.update(clients_connected=stats.clients_connected, messages_received=stats.messages_received,
                    messages_dropped=stats.publish_dropped)
        queue = self.broker.queue
        if queue is not None:
            wal = queue.log
            body.update(log_bytes=wal.size_bytes(), recovery_corrupt_records=wal.recovery.corrupt_records,
                        recovery_truncated_bytes=wal.recovery.tail_bytes_truncated)
            try:
                body["disk_free_bytes"] = shutil.disk_usage(queue.data_dir).free
            except OSError as exc:
                log.debug("health: free disk not read: %s", exc)
        exports: list[dict[str, Any]] = []
        oversized = 0
        try:
            entries = self.exports.status()
        except Exception as exc:  # a figure we cannot read is left out, never fatal
            log.debug("health: export status not read: %r", exc)
            entries = []
        for e in entries:
            skipped = int(e.get("oversized_skipped") or 0)
            oversized += skipped
            age = e.get("oldest_unsent_age_s")
            exports.append({
                "name": e["name"], "kind": e.get("kind"), "state": e.get("state"),
                "lag_records": e.get("lag_records"), "lag_bytes": e.get("lag_bytes"),
                "oldest_unacked_age_s": None if age is None else round(float(age), 3),
                "records_acked": e.get("records_acked"), "lost_records": e.get("lost_records"),
                "oversized_skipped": skipped,
            })
        body["exports"] = exports
        body["oversized_skipped"] = oversized
        return body

    def report(self) -> bytes:
        """The next report's bytes."""
        self._sequence += 1
        self.reports += 1
        return encode_health(self.device_id, int(self._clock() * 1_000_000), self._sequence, self.body())
