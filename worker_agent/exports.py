"""The agent's exports: each a durable consumer group ``export.NAME`` shipping the log to one
destination, a filemq collector (:class:`worker_agent.forwarder.Forwarder`, batches) or any
MQTT 3.1.1 broker (:class:`worker_agent.mqtt_export.MqttExport`, record by record).

What a caller may rely on:

* **Independent.** Every enabled export has its own group, task, connection and backoff; one
  down, slow or refusing export never blocks another, nor the local broker's accepting.
* **Shared uplink by priority.** All exports draw their bytes from one
  :class:`worker_agent.uplink.Uplink` (``uplink.rate_limit_bytes_per_s``); a higher
  ``priority`` export is served first.
* **Retention respects every enabled export.** Each enabled export's group counts in the
  queue's ``min_pending``, so age-based retention never deletes what it has not shipped; a
  disabled export's group is detached (kept on disk, position kept, not holding retention).
  When ``log.retention_bytes`` forces out records an export had not shipped, the export's
  ``lost_records`` counts them and one WARNING per export and deletion names the range.
* **Visible.** :meth:`Exports.status` (also written to ``<data_dir>/exports.json`` for
  ``filemq status``), ``$SYS/broker/export/NAME/...`` and Prometheus metrics labelled
  ``export="NAME"``.
* The group of an agent from before exports, ``forwarder``, becomes ``export.collector`` at
  its Pending offset on the first start (nothing re-sent, nothing skipped).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filemq.common.aio import cancel_and_wait
from filemq.common.config import Config, ConfigError, ExportSection, read_config_text
from filemq.mqtt.client import MQTTClient
from filemq.ops.status import EXPORTS_FILE as STATUS_FILE
from segments.fileio import atomic_write
from worker_agent.forwarder import Forwarder, ForwarderConfig, Upstream
from worker_agent.mqtt_export import (
    ExportStats,
    MqttExport,
    MqttExportSettings,
    mqtt_client_factory,
)
from worker_agent.uplink import Share, Uplink

if TYPE_CHECKING:
    from filemq.queue import Queue
    from filemq.queue.groups import ConsumerGroup

log = logging.getLogger(__name__)

LEGACY_GROUP = "forwarder"
UPSTREAM_MAX_PACKET = 1 << 20  # the collector only sends small packets back


def collector_settings(config: Config, spec: ExportSection) -> ForwarderConfig:
    """The forwarder settings of a collector export: the ``[agent]`` ones, overridden by its table."""
    a = config.agent
    assert a.device_id is not None
    return ForwarderConfig(
        device_id=a.device_id,
        stream=a.stream,
        batch_records=spec.batch_records or a.batch_records,
        batch_bytes=spec.batch_bytes or a.batch_bytes,
        linger_s=(a.linger_ms if spec.linger_ms is None else spec.linger_ms) / 1000,
        window=spec.window or a.window,
        compression=spec.compression or a.compression,
        rate_limit_bytes_per_s=None,  # the export's Share applies it
        backoff_initial_s=a.backoff_initial_ms / 1000,
        backoff_max_s=a.backoff_max_ms / 1000,
        ack_timeout_s=(a.ack_timeout_ms if spec.ack_timeout_ms is None else spec.ack_timeout_ms) / 1000,
        upstream_max_packet_size=spec.max_packet_size or a.upstream_max_packet_size,
    )


def collector_client_factory(config: Config, spec: ExportSection) -> Callable[[], Upstream]:
    """A function making a fresh client to a collector for each connection attempt."""
    device_id = config.agent.device_id
    assert device_id is not None
    password = spec.password
    if spec.password_file is not None:
        try:
            password = read_config_text(spec.password_file, "the upstream password file").splitlines()[0]
        except IndexError:
            raise ConfigError(f"the password file of export {spec.name!r} is empty", file=spec.password_file) from None
    context: ssl.SSLContext | None = None
    if spec.tls:
        try:
            context = ssl.create_default_context(cafile=spec.tls_ca)
            if spec.tls_cert is not None:
                context.load_cert_chain(spec.tls_cert, spec.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"export {spec.name!r}: cannot load its TLS files: {exc}", key="agent.tls_ca") from exc
    window = max(spec.window or config.agent.window, 1)
    client_id = spec.client_id or device_id

    def connect() -> Upstream:
        return MQTTClient(client_id, spec.host, spec.port, clean_session=True, keepalive=30, username=spec.username,
                          password=password, ssl=context, max_inflight=window, max_packet_size=UPSTREAM_MAX_PACKET)

    return connect


class _Watched:
    """A collector client that records why its connection attempts failed (for status)."""

    def __init__(self, inner: Upstream, stats: ExportStats) -> None:
        self.inner = inner
        self.stats = stats
        self.closed = inner.closed

    async def connect(self, timeout: float = 10.0) -> object:
        try:
            return await self.inner.connect(timeout=timeout)
        except Exception as exc:
            self.stats.last_error = f"cannot connect: {exc or type(exc).__name__}"
            raise

    def publish_nowait(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> asyncio.Future[None]:
        return self.inner.publish_nowait(topic, payload, qos, retain)

    async def disconnect(self, timeout: float = 5.0) -> None:
        reason = getattr(self.inner, "close_reason", None)
        if reason is not None:
            self.stats.last_error = f"connection lost: {reason}"
        await self.inner.disconnect(timeout=timeout)


@dataclass
class Export:
    """One configured export and, while the agent runs, its group and runner."""

    spec: ExportSection
    factory: Callable[[], Any]
    group: ConsumerGroup | None = None
    runner: Forwarder | MqttExport | None = None
    watch: ExportStats = field(default_factory=ExportStats)  # collector exports: last error
    lost_records: int = 0
    stopped: bool = False  # the agent stopped it (what the status file says after shutdown)

    @property
    def name(self) -> str:
        return self.spec.name

    def state(self) -> str:
        if not self.spec.enabled:
            return "disabled"
        if self.stopped:
            return "stopped"
        r = self.runner
        if isinstance(r, MqttExport):
            return r.stats.state
        if isinstance(r, Forwarder):
            if r.stats.connected:
                return "connected"
            return "backoff" if r.stats.connect_failures or r.stats.disconnects else "starting"
        return "stopped"

    def last_error(self) -> str | None:
        r = self.runner
        if isinstance(r, MqttExport):
            return r.stats.last_error
        if isinstance(r, Forwarder) and r.stats.connected:
            return None
        return self.watch.last_error

    def counters(self) -> dict[str, Any]:
        r = self.runner
        if isinstance(r, MqttExport):
            s = r.stats
            return {"records_sent": s.records_sent, "records_acked": s.records_acked, "bytes_sent": s.bytes_sent,
                    "bytes_acked": s.bytes_acked, "inflight_records": s.inflight, "connects": s.connects,
                    "connect_failures": s.connect_failures, "disconnects": s.disconnects,
                    "last_ack_unix": s.last_ack_unix, "oversized_skipped": s.oversized_skipped,
                    "ack_timeouts": s.ack_timeouts, "protocol": s.protocol, "expired_skipped": s.expired_skipped}
        if isinstance(r, Forwarder):
            f = r.stats
            return {"records_sent": f.records_sent, "records_acked": f.records_acked, "bytes_sent": f.bytes_sent,
                    "bytes_acked": f.bytes_acked, "inflight_records": sum(len(i.batch.offsets) for i in r._inflight),
                    "connects": f.connects, "connect_failures": f.connect_failures, "disconnects": f.disconnects,
                    "last_ack_unix": f.last_ack_unix, "oversized_skipped": f.oversized_records,
                    "ack_timeouts": f.ack_timeouts}
        return {}


class Exports:
    """Every export of one agent: built from the config, started on the agent's queue."""

    def __init__(self, config: Config, *, connect: Callable[[], Upstream] | None = None) -> None:
        """Check and prepare every export (ConfigError for unreadable password/TLS files).

        ``connect`` (tests) replaces the client factory of the export named ``collector``.
        """
        device_id = config.agent.device_id
        if device_id is None:
            raise ConfigError("the agent needs a device id (agent.device_id, flag --device-id)", key="agent.device_id")
        if not config.exports:
            raise ConfigError("the agent needs at least one export: --collector HOST:PORT, --export NAME=URL "
                              "or an [[export]] table", key="agent.export")
        self.config = config
        self.device_id = device_id
        self.uplink = Uplink(config.uplink.rate_limit_bytes_per_s)
        self.exports: list[Export] = []
        for spec in config.exports:
            factory: Callable[[], Any]
            if spec.kind == "filemq":
                factory = connect if (connect is not None and spec.name == "collector") else \
                    collector_client_factory(config, spec)
            else:
                factory = mqtt_client_factory(spec, device_id)
            self.exports.append(Export(spec, factory))
        self._queue: Queue | None = None
        self._first_offset = 0
        self._watch_task: asyncio.Task[None] | None = None

    @property
    def forwarder(self) -> Forwarder | None:
        """The runner of the first collector export (the agent's legacy ``forwarder``)."""
        return next((e.runner for e in self.exports if isinstance(e.runner, Forwarder)), None)

    def get(self, name: str) -> Export | None:
        return next((e for e in self.exports if e.name == name), None)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, queue: Queue, *, health: Callable[[], bytes] | None = None) -> None:
        """Start every enabled export on ``queue``; collector exports send ``health()`` reports
        (:mod:`worker_agent.health`) every ``agent.health_interval_s`` when it is given."""
        self._queue = queue
        self._migrate_legacy_group(queue)
        a = self.config.agent
        for export in self.exports:
            spec = export.spec
            if not spec.enabled:
                detach = getattr(queue, "detach_group", None)
                if detach is not None and queue.get_group(spec.group_name) is not None:
                    detach(spec.group_name)
                log.info("export %r (%s) is disabled; its position is kept", spec.name, spec.url)
                continue
            group = queue.group(spec.group_name, filters=spec.topics, start="earliest")
            export.group = group
            own_rate = spec.rate_limit_bytes_per_s
            if own_rate is None and spec.kind == "filemq":
                own_rate = a.rate_limit_bytes_per_s  # the [agent] default of collector exports
            share = Share(self.uplink, spec.priority, own_rate)
            limiter = share if share.limited else None
            if spec.kind == "filemq":
                inner = export.factory

                def watched(inner: Callable[[], Upstream] = inner, stats: ExportStats = export.watch) -> Upstream:
                    return _Watched(inner(), stats)

                export.runner = Forwarder(group, queue.wait_for_records, watched,
                                          collector_settings(self.config, spec), limiter=limiter,
                                          health=health, health_interval_s=a.health_interval_s)
            else:
                settings = MqttExportSettings.from_section(spec, self.device_id, a.backoff_initial_ms / 1000,
                                                           a.backoff_max_ms / 1000, a.ack_timeout_ms / 1000)
                export.runner = MqttExport(group, queue.wait_for_records, export.factory, settings, limiter=limiter)
            export.runner.start()
            log.info("export %r: %s, topics %s, priority %d; backlog %d records", spec.name, spec.url,
                     ",".join(spec.topics), spec.priority, group.lag)
        self._first_offset = queue.log.first_offset
        self._watch_task = asyncio.create_task(self._watch(), name="filemq-exports-watch")

    async def stop(self) -> None:
        if self._watch_task is not None:
            await cancel_and_wait(self._watch_task)
        await asyncio.gather(*(e.runner.stop() for e in self.exports if e.runner is not None))
        for e in self.exports:
            e.stopped = True
        self.uplink.close()
        self.write_status_file()

    def _migrate_legacy_group(self, queue: Queue) -> None:
        legacy = queue.get_group(LEGACY_GROUP)
        target = self.get("collector")
        if legacy is None or target is None or queue.get_group(target.spec.group_name) is not None:
            return
        start = legacy.pending_offset
        queue.group(target.spec.group_name, filters=target.spec.topics, start=start)
        queue.drop_group(LEGACY_GROUP)
        log.warning("consumer group %r is now %r (export 'collector'), starting at its Pending offset %d",
                    LEGACY_GROUP, target.spec.group_name, start)

    # -- retention accounting and status ----------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                self.note_retention()
                self.write_status_file()
            except Exception:
                log.exception("exports: status bookkeeping failed; continuing")

    def note_retention(self) -> None:
        """Count, per export, the records retention deleted before the export shipped them."""
        queue = self._queue
        if queue is None:
            return
        first = queue.log.first_offset
        before, self._first_offset = self._first_offset, first
        if first <= before:
            return
        for export in self.exports:
            if export.group is None:
                continue
            low = max(before, export.group.pending_offset)
            if first > low:
                export.lost_records += first - low
                log.warning("export %r: retention (log.retention_bytes) deleted offsets %d..%d (%d records) "
                            "before the export shipped them", export.name, low, first - 1, first - low)

    def _lag_bytes_and_age(self, group: ConsumerGroup) -> tuple[int, float | None]:
        queue = self._queue
        assert queue is not None
        pending = group.pending_offset
        committed = queue.log.committed_offset
        if pending >= committed:
            return 0, None
        lag_bytes = 0.0
        for seg in queue.log.segments():
            if seg.next_offset <= pending:
                continue
            count = max(seg.next_offset - seg.base_offset, 1)
            share = (seg.next_offset - max(pending, seg.base_offset)) / count
            lag_bytes += seg.size * share
        age: float | None = None
        with contextlib.suppress(Exception):
            found = queue.log.read(pending, 1)
            if found:
                age = max(0.0, time.time() - found[0].timestamp_us / 1e6)
        return int(lag_bytes), age

    def status(self) -> list[dict[str, Any]]:
        """One entry per export: destination, state, last error, lag, oldest unsent, last ack."""
        out: list[dict[str, Any]] = []
        for e in self.exports:
            entry: dict[str, Any] = {
                "name": e.name, "url": e.spec.url, "kind": e.spec.kind, "group": e.spec.group_name,
                "topics": list(e.spec.topics), "priority": e.spec.priority, "enabled": e.spec.enabled,
                "state": e.state(), "last_error": e.last_error(), "lost_records": e.lost_records,
            }
            if e.group is not None and self._queue is not None:
                lag_bytes, age = self._lag_bytes_and_age(e.group)
                entry.update(lag_records=e.group.lag, lag_bytes=lag_bytes, oldest_unsent_age_s=age,
                             pending=e.group.pending_offset)
            entry.update(e.counters())
            out.append(entry)
        return out

    def write_status_file(self) -> None:
        queue = self._queue
        if queue is None:
            return
        body = {"written_unix": time.time(), "exports": self.status()}
        data = json.dumps(body, indent=1).encode() + b"\n"
        try:
            atomic_write(Path(queue.data_dir) / STATUS_FILE, data)
        except OSError as exc:
            log.warning("exports: cannot write %s: %s", STATUS_FILE, exc)

    def sys_messages(self) -> list[tuple[str, bytes]]:
        """``$SYS/broker/export/NAME/...``: state, lag, oldest unsent, last ack, counters."""
        out: list[tuple[str, bytes]] = []
        for entry in self.status():
            prefix = f"$SYS/broker/export/{entry['name']}/"
            values: list[tuple[str, object]] = [
                ("state", entry["state"]), ("connected", int(entry["state"] == "connected")),
                ("last_error", entry["last_error"] or ""), ("lost_records", entry["lost_records"]),
                ("oversized_skipped", entry.get("oversized_skipped", 0)),
            ]
            if "lag_records" in entry:
                age = entry["oldest_unsent_age_s"]
                values += [("lag/records", entry["lag_records"]), ("lag/bytes", entry["lag_bytes"]),
                           ("oldest_unsent_age_s", "" if age is None else f"{age:.3f}"),
                           ("records/sent", entry.get("records_sent", 0)), ("records/acked", entry.get("records_acked", 0)),
                           ("last_ack_unix", "" if entry.get("last_ack_unix") is None else f"{entry['last_ack_unix']:.3f}")]
            out += [(prefix + k, str(v).encode()) for k, v in values]
        return out


def describe(exports: Exports) -> str:
    """``cloud=mqtts://h:8883 (p10), collector=filemq://h:1884``"""
    return ", ".join(f"{e.name}={e.spec.url}" + ("" if e.spec.enabled else " (disabled)") for e in exports.exports)

