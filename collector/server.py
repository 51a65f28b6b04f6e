"""The collector: a filemq broker that receives device batches and lands them as Parquet.

A :class:`Collector` is a :class:`filemq.broker.Broker` (so its own segment log is the
write-ahead log, with the durable group commit before every PUBACK) plus:

* a publish hook at the door (:meth:`Collector.check_publish`) that, for every PUBLISH:
  rejects a batch whose CRC fails (no PUBACK, the connection is closed: the agent resends);
  rejects the same way a valid batch whose topic is not ``filemq/v1/<device>/<stream>`` of
  its CRC-covered header (the topic is outside the CRC: a byte flipped in it must not be
  acknowledged); quarantines a malformed one (written to ``<data_dir>/quarantine/``, acknowledged,
  counted; a version 2 batch whose record headers are not MQTT 5.0 message properties is one); acknowledges and drops a duplicate (its offsets are all held: committed to the
  WAL, as a WAL tail reader tracks, or landed); stores an overlapping one with the held
  records trimmed off (:mod:`collector.dedup`);
* a :class:`collector.lander.Lander` that rolls the WAL into landing files;
* a :class:`collector.fleet.FleetRegistry` of the devices it serves: fed by every PUBLISH at
  the door (a health report on ``filemq/v1/<device>/$fleet/health`` is checked, filed and
  stored in the WAL as a fleet event, never quarantined), swept every second for closed
  connections, saved to ``<data_dir>/fleet.json``; its connects and disconnects go into the WAL
  too, and the lander lands them with the health reports under ``<landing>/fleet_events/``
  (:mod:`collector.fleet_events`).

What a caller may rely on: a batch is acknowledged only when it is durable in the WAL (or is
a duplicate of records that are, or is malformed and durably quarantined). The collector's
clock at receipt is stored as the WAL record's timestamp and becomes ``received_at``.

Devices authenticate with the password file; the ACL should let each device write only under
its own id: ``pattern write filemq/v1/%u/#`` (see docs/FORWARDING.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collector.dedup import SNAPSHOT_FILE, HighWaterMarks, batch_ranges
from collector.fleet import FLEET_FILE, SAVE_INTERVAL_S, CachedBody, FleetRegistry, Thresholds, iso
from collector.fleet_events import LANDING_SUBDIR as EVENTS_LANDING_SUBDIR
from collector.fleet_events import event_payload, event_topic, health_event
from collector.headers import FULL_CHECKS_PER_BATCH, HeaderCheck
from collector.lander import Lander
from collector.landing import LandingWriter
from filemq.broker import Broker, ClientInfo, HookResult
from filemq.broker.budget import DEFAULT_COLLECTOR_BYTES
from filemq.common.aio import cancel_and_wait
from filemq.common.config import Config, ConfigError
from filemq.ops.fdlimit import FD_RESERVE, connection_capacity, raise_nofile_limit
from filemq.upstream.batch import (
    BatchCrcError,
    BatchError,
    MalformedBatch,
    batch_topic,
    decode_batch,
    encode_batch,
    parse_batch_topic,
    peek_header,
)
from filemq.upstream.health import (
    HealthCrcError,
    MalformedHealth,
    decode_health,
    parse_health_topic,
)
from segments.fileio import OS_FILE_IO, FileIO, atomic_write

if TYPE_CHECKING:
    from filemq.mqtt.packets import Publish

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"
MIN_PACKET_SIZE = 64 << 20  # batches are up to batch_bytes (1 MiB default) plus a header
DEFAULT_WAL_RETENTION_MS = 3_600_000  # landed WAL segments are kept an hour, then deleted
LANDING_SAMPLE_S = 10



@dataclass
class DoorStats:
    """What the publish hook decided (read only)."""

    batches_received: int = 0
    records_received: int = 0
    bytes_received: int = 0
    duplicate_batches: int = 0
    duplicate_records: int = 0
    trimmed_batches: int = 0
    trimmed_records: int = 0
    quarantined: int = 0
    crc_rejected: int = 0
    topic_rejected: int = 0  # a valid batch on a topic that disagrees with its header
    health_reports: int = 0  # health reports received (stored in the WAL)
    health_rejected: int = 0  # CRC mismatch or a device id that disagrees with the topic (connection closed)
    health_malformed: int = 0  # CRC fine, content not a report: dropped, logged


def broker_config(config: Config) -> Config:
    """The broker settings for a collector: listener and auth from ``[collector]``, the WAL
    from ``[log]``; a TLS listener comes from ``[broker]`` ``tls_cert``/``tls_key``/``tls_port``.
    ACL-denied batches are never acknowledged (``acl_denied_publish = "disconnect"``).
    The connection limit is ``collector.max_connections`` or, unset, sized from the process's
    file-descriptor limit (soft raised to hard where allowed; :mod:`filemq.ops.fdlimit`)."""
    c = config.collector
    max_connections = c.max_connections
    if max_connections is None:
        soft, _ = raise_nofile_limit()
        # Sockets still in their CONNECT (up to broker.max_connecting) hold descriptors too.
        max_connections = max(1, connection_capacity(soft) - config.broker.max_connecting)
    broker = dataclasses.replace(
        config.broker,
        max_connections=max_connections,
        host=c.host,
        port=c.port,
        password_file=c.password_file,
        acl_file=c.acl_file,
        allow_anonymous=c.allow_anonymous,
        max_packet_size=max(config.broker.max_packet_size, MIN_PACKET_SIZE),
        # Room for a window of 4 batches at MIN_PACKET_SIZE (Receive Maximum; filemq.broker.budget).
        max_uncommitted_bytes=config.broker.max_uncommitted_bytes or DEFAULT_COLLECTOR_BYTES,
        # A device writing outside its own id is misconfigured: never ack (and so lose) its batch.
        acl_denied_publish="disconnect",
    )
    log_section = config.log
    if log_section.retention_ms is None and log_section.retention_bytes is None:
        log_section = dataclasses.replace(log_section, retention_ms=DEFAULT_WAL_RETENTION_MS)
    return dataclasses.replace(config, broker=broker, log=log_section)


class Collector:
    """The collector process's parts, startable and stoppable in-process (tests, bench)."""

    def __init__(
        self,
        config: Config,
        *,
        fileio: FileIO = OS_FILE_IO,
        clock: Callable[[], float] = time.time,
    ) -> None:
        c = config.collector
        if config.data_dir is None:
            raise ConfigError("the collector needs a data directory (data_dir, flag --data-dir)", key="data_dir")
        if c.landing is None:
            raise ConfigError("the collector needs a landing directory (collector.landing, flag --landing)",
                              key="collector.landing")
        self.config = config
        self.data_dir = Path(config.data_dir)
        self.landing_dir = Path(c.landing)
        self.collector_id = c.collector_id or socket.gethostname().split(".")[0] or "collector"
        self.quarantine_dir = self.data_dir / QUARANTINE_DIR
        self.stats = DoorStats()
        # The lander's marks (durable, rows landed or buffered) and the door's marks (every
        # batch committed to the WAL, rebuilt at start by replaying the WAL from the lander's
        # position, kept in memory only): the door drops a resend of anything acked, even
        # while the lander is behind.
        self.marks = HighWaterMarks(self.data_dir / SNAPSHOT_FILE, fileio)
        self.door_marks = HighWaterMarks(None)
        self._tail_pos = 0
        self._tail_task: asyncio.Task[None] | None = None
        self.broker = Broker(broker_config(config), publish_hook=self.check_publish)
        self.lander: Lander | None = None
        self._fileio = fileio
        self._clock = clock
        self._quarantine_seq = 0
        self.fleet = FleetRegistry(
            self.data_dir / FLEET_FILE,
            Thresholds(behind_records=c.fleet_behind_records, behind_age_s=c.fleet_behind_age_s,
                       disk_low_bytes=c.fleet_disk_low_bytes, stale_intervals=c.fleet_stale_intervals),
            max_devices=c.fleet_max_devices, clock=clock)
        # /api/fleet's body (collector.ops): built on the loop when asked for, at most every 2 s.
        self.fleet_api = CachedBody(lambda: self.fleet.fleet_json({"collector_id": self.collector_id,
                                                                   "landing_rate": self.landing_rate()}))
        self._fleet_task: asyncio.Task[None] | None = None
        self._event_commits: set[asyncio.Future[None]] = set()  # fleet events not yet committed
        # (unix time, rows landed so far) every LANDING_SAMPLE_S for the last hour: /api/fleet's rate plot.
        self._landing_samples: deque[tuple[float, int]] = deque(maxlen=3600 // LANDING_SAMPLE_S + 1)

    @property
    def port(self) -> int:
        return self.broker.port

    async def start(self) -> None:
        """Recover (WAL, landing staging, high-water marks), listen, start landing."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        writer = LandingWriter(self.landing_dir, self.collector_id, self._fileio)
        events_writer = LandingWriter(self.landing_dir / EVENTS_LANDING_SUBDIR, self.collector_id, self._fileio)
        events_writer.recover_staging()
        await self.broker.start()
        assert self.broker.queue is not None
        c = self.config.collector
        loaded = self.fleet.load()
        if loaded:
            log.info("collector %s: fleet registry holds %d devices", self.collector_id, loaded)
        lander = Lander(self.broker.queue, writer, self.marks, roll_bytes=c.roll_bytes,
                        roll_seconds=c.roll_seconds, on_landed=self.fleet.landed, events_writer=events_writer)
        self.fleet.on_event = self._record_event
        recorded = self.fleet.flush_pending()
        if recorded:
            log.info("collector %s: recorded %d disconnects of devices connected when it last stopped",
                     self.collector_id, recorded)
        lander.recover()
        for (device, stream), ranges in self.marks.items():
            for first, last in ranges:
                self.door_marks.add(device, stream, first, last)
        self._tail_pos = lander.group.pending_offset
        lander.start()
        self.lander = lander
        self._tail_task = asyncio.create_task(self._tail_wal(), name="filemq-collector-wal-tail")
        self._fleet_task = asyncio.create_task(self._watch_fleet(), name="filemq-collector-fleet")
        log.info("collector %s listening on %s, landing in %s, WAL backlog %d batches",
                 self.collector_id, self.broker.listening, self.landing_dir, lander.lag)
        soft, hard = raise_nofile_limit()  # as broker_config left it (already raised)
        log.info("collector %s: serving up to %d device connections (max_connections; file descriptors:"
                 " soft limit %d, hard %d, %d kept for files)", self.collector_id,
                 self.broker.config.broker.max_connections, soft, hard, FD_RESERVE)

    async def stop(self) -> None:
        """Land what is buffered (bounded wait), then stop the broker (persists everything)."""
        if self._tail_task is not None:
            await cancel_and_wait(self._tail_task)
        if self._fleet_task is not None:
            await cancel_and_wait(self._fleet_task)
        if self.broker.queue is not None:
            # Every device's disconnect into the WAL while it is open, committed before the
            # lander's last roll lands it; the registry changes no more after this.
            self._sweep_fleet()
            self.fleet.disconnect_all("collector stopping")
            if self._event_commits:
                with contextlib.suppress(TimeoutError, OSError):
                    await asyncio.wait_for(asyncio.gather(*self._event_commits, return_exceptions=True), 5.0)
        if self.lander is not None:
            await self.lander.stop()
        await self.broker.stop()
        self._save_fleet()

    # -- the fleet registry ---------------------------------------------------------------------

    def _record_event(self, device_id: str, kind: str, when: float, details: Mapping[str, Any]) -> None:
        """The registry's event sink: a connect or disconnect into the WAL (the lander lands it
        as a fleet event); health reports are in the WAL already. Raises if the WAL refuses."""
        if kind not in ("connect", "disconnect"):
            return
        queue = self.broker.queue
        if queue is None:
            raise RuntimeError("the WAL is not open")
        payload = event_payload(kind, {**details, "collector_id": self.collector_id})
        _, commit = queue.publish_nowait(event_topic(device_id, kind), payload, 0, timestamp_us=int(when * 1e6))
        if commit not in self._event_commits:  # one commit future covers a whole group commit
            self._event_commits.add(commit)
            commit.add_done_callback(self._event_committed)

    def _event_committed(self, commit: asyncio.Future[None]) -> None:
        self._event_commits.discard(commit)
        if not commit.cancelled() and commit.exception() is not None:
            log.error("collector %s: a fleet event was not committed to the WAL: %s", self.collector_id,
                      commit.exception())

    def _sweep_fleet(self) -> None:
        core = self.broker.core
        self.fleet.sweep(core.connections if core is not None else {})

    def _save_fleet(self) -> None:
        try:
            self.fleet.save(lambda path, data: atomic_write(path, data, self._fileio))
        except OSError as exc:
            self.fleet.dirty = True  # try again next time
            log.warning("collector %s: saving the fleet registry failed: %s", self.collector_id, exc)

    def landing_rate(self) -> list[dict[str, object]]:
        """Rows landed per second over the last hour, one point per sample interval."""
        samples = list(self._landing_samples)
        return [{"t": iso(t1), "rows_per_s": round((n1 - n0) / (t1 - t0), 3) if t1 > t0 else 0.0}
                for (t0, n0), (t1, n1) in zip(samples, samples[1:], strict=False)]

    async def _watch_fleet(self) -> None:
        """Sweep the registry every second (closed connections show within a second) and save
        it every SAVE_INTERVAL_S when it changed (encoded on the loop, written off it)."""
        last_save = time.monotonic()
        last_sample = 0.0
        while True:
            await asyncio.sleep(1.0)
            try:
                self._sweep_fleet()
                if time.monotonic() - last_sample >= LANDING_SAMPLE_S:
                    last_sample = time.monotonic()
                    self._landing_samples.append((self._clock(), self.lander.stats.rows_landed if self.lander else 0))
                if self.fleet.dirty and time.monotonic() - last_save >= SAVE_INTERVAL_S:
                    last_save = time.monotonic()
                    data = self.fleet.encode()
                    self.fleet.dirty = False
                    path = self.fleet.path
                    assert path is not None
                    try:
                        await asyncio.to_thread(atomic_write, path, data, self._fileio)
                    except OSError as exc:
                        self.fleet.dirty = True
                        log.warning("collector %s: saving the fleet registry failed: %s", self.collector_id, exc)
            except Exception:
                log.exception("collector %s: fleet bookkeeping failed; continuing", self.collector_id)

    def reload(self) -> bool:
        """SIGHUP: re-read the device password file and the ACL file (:meth:`Broker.reload`)."""
        return self.broker.reload()

    async def _tail_wal(self) -> None:
        """Advance the door's marks from every batch header committed to the WAL, in order."""
        queue = self.broker.queue
        assert queue is not None
        wal = queue.log
        while True:
            end = wal.committed_offset
            while self._tail_pos < end:
                self._tail_pos = max(self._tail_pos, wal.first_offset)
                records = wal.read(self._tail_pos, 16, 16 << 20)
                if not records:
                    self._tail_pos = end  # the rest was corrupt or deleted: nothing to learn
                    break
                for record in records:
                    if parse_batch_topic(record.topic) is None:
                        continue
                    try:
                        # The WAL's record CRC already covers these bytes.
                        header = peek_header(record.payload, verify_crc=False)
                        ranges = batch_ranges(header, record.payload)
                    except BatchError:
                        continue
                    self.door_marks.add_ranges(header.device_id, header.stream, ranges)
                self._tail_pos = records[-1].offset + 1
                await asyncio.sleep(0)  # a long replay at start must not stall the listener
            await queue.wait_for_records(self._tail_pos)

    def mark(self, device_id: str, stream: str) -> int:
        """The highest offset of ``device_id``/``stream`` durably held (WAL or landed), or -1."""
        return max(self.door_marks.get(device_id, stream), self.marks.get(device_id, stream))

    def _held(self, device_id: str, stream: str, first: int, last: int) -> tuple[bool, list[tuple[int, int]]]:
        """Whether ``[first, last]`` is wholly held, and the held parts of it."""
        door, landed = self.door_marks, self.marks
        if door.holds(device_id, stream, first, last) or landed.holds(device_id, stream, first, last):
            return True, []
        return False, door.overlaps(device_id, stream, first, last) + landed.overlaps(device_id, stream, first, last)

    # -- the door -------------------------------------------------------------------------------

    def check_publish(self, client: ClientInfo, packet: Publish) -> HookResult:
        """The publish hook: CRC, structure, duplicate and overlap checks (see module doc)."""
        stats = self.stats
        payload = packet.payload
        foreign = None
        topic_device = parse_health_topic(packet.topic)
        if topic_device is not None:
            return self._health_report(client, packet, topic_device)
        if parse_batch_topic(packet.topic) is None:
            foreign = f"topic {packet.topic!r} is not filemq/v1/<device_id>/<stream>"
        try:
            header = peek_header(payload)
        except BatchCrcError as exc:
            if foreign is not None:  # not a batch on a batch topic: nothing a resend could fix
                return self._quarantine(client, packet, foreign)
            stats.crc_rejected += 1
            log.warning("client %r: batch on %r failed its CRC (%s); not acknowledged", client.client_id,
                        packet.topic, exc)
            return HookResult.reject(str(exc))
        except MalformedBatch as exc:
            return self._quarantine(client, packet, foreign or str(exc))
        if packet.topic != batch_topic(header.device_id, header.stream):
            # The topic is outside the CRC; the header (device, stream, offsets) is inside it
            # and decides where the records go. A topic that disagrees was damaged on the way
            # (or the sender is misconfigured): never acknowledge, so the agent resends.
            stats.topic_rejected += 1
            reason = (f"topic {packet.topic!r} does not match the batch header's device"
                      f" {header.device_id!r} stream {header.stream!r}")
            log.warning("client %r: %s; not acknowledged", client.client_id, reason)
            return HookResult.reject(reason)
        held, overlaps = self._held(header.device_id, header.stream, header.first_offset, header.last_offset)
        if held:
            stats.duplicate_batches += 1
            stats.duplicate_records += header.count
            self._seen(client, header.device_id)
            return HookResult.ack_drop(f"duplicate batch {header.first_offset}..{header.last_offset}")
        try:
            # Version 2 headers must be MQTT 5.0 message properties: the CRC matched, so
            # headers that are not are the sender's bug, quarantined like any malformed batch.
            checked = HeaderCheck()  # (its work bounded per batch, issue 33 item 19)
            batch = decode_batch(payload, check_headers=checked)
        except MalformedBatch as exc:
            return self._quarantine(client, packet, str(exc))
        if checked.deferred:
            log.warning("client %r: batch %d..%d of %r/%r: %d record headers of new layouts past the door's "
                        "%d full checks are left to landing", client.client_id, header.first_offset,
                        header.last_offset, header.device_id, header.stream, checked.deferred,
                        FULL_CHECKS_PER_BATCH)
        if overlaps:
            keep = [r for r in batch.records() if not any(lo <= r.offset <= hi for lo, hi in overlaps)]
            if not keep:
                stats.duplicate_batches += 1
                stats.duplicate_records += header.count
                self._seen(client, header.device_id)
                return HookResult.ack_drop(f"duplicate batch {header.first_offset}..{header.last_offset}")
            stats.batches_received += 1
            stats.bytes_received += len(payload)
            stats.trimmed_batches += 1
            stats.trimmed_records += header.count - len(keep)
            stats.records_received += len(keep)
            self._seen(client, header.device_id, header.stream, len(keep))
            return HookResult.store(
                encode_batch(header.device_id, header.stream, keep, compression=header.compression)
            )
        stats.batches_received += 1
        stats.bytes_received += len(payload)
        stats.records_received += header.count
        self._seen(client, header.device_id, header.stream, header.count)
        return HookResult.store()

    def _seen(self, client: ClientInfo, device_id: str, stream: str | None = None, records: int = 0) -> None:
        core = self.broker.core
        conn = core.connections.get(client.client_id) if core is not None else None
        self.fleet.seen(device_id, client.client_id, client.peer, conn, stream, records)

    def _health_report(self, client: ClientInfo, packet: Publish, topic_device: str) -> HookResult:
        """A health report (:mod:`filemq.upstream.health`): into the fleet registry, and into the
        WAL as a fleet event. A CRC mismatch closes the connection as for a batch (the link
        damages bytes); a report that is not one is dropped and counted, never quarantined."""
        stats = self.stats
        try:
            report = decode_health(packet.payload)
        except HealthCrcError as exc:
            stats.health_rejected += 1
            log.warning("client %r: health report on %r: %s", client.client_id, packet.topic, exc)
            return HookResult.reject(str(exc))
        except MalformedHealth as exc:
            stats.health_malformed += 1
            self.fleet.malformed_reports += 1
            log.warning("client %r: malformed health report on %r dropped: %s", client.client_id, packet.topic, exc)
            return HookResult.ack_drop(f"malformed health report: {exc}")
        if report.device_id != topic_device:
            stats.health_rejected += 1
            reason = (f"topic {packet.topic!r} does not match the health report's device {report.device_id!r}")
            log.warning("client %r: %s; connection closed", client.client_id, reason)
            return HookResult.reject(reason)
        stats.health_reports += 1
        self._seen(client, report.device_id)
        d = self.fleet.health(report.device_id, report.body, report.sent_at_us, report.sequence, report.body_json)
        # Into the WAL as the fleet event the lander lands as it is (collector.fleet_events).
        return HookResult.store(health_event(report.body, report.body_json, report.sequence, report.sent_at_us,
                                             None if d is None else (d.lag_records(), d.oldest_unacked_age_s())))

    def _quarantine(self, client: ClientInfo, packet: Publish, reason: str) -> HookResult:
        """Write the PUBLISH payload and the reason under ``quarantine/``, then ack it."""
        self.stats.quarantined += 1
        self._quarantine_seq += 1
        stamp = datetime.fromtimestamp(self._clock(), UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        who = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in client.client_id)[:64] or "anonymous"
        name = f"{stamp}-{who}-{self._quarantine_seq:06d}"
        text = (f"client {client.client_id!r} user {client.username!r} peer {client.peer}\n"
                f"topic {packet.topic!r}\n{reason}\n")
        try:
            self.quarantine_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.quarantine_dir / f"{name}.reason", text.encode(), self._fileio)
            atomic_write(self.quarantine_dir / f"{name}.batch", bytes(packet.payload), self._fileio)
        except OSError as exc:
            # Not acknowledged: the agent resends and we try again once the disk allows.
            log.error("client %r: could not quarantine a malformed batch (%s): %s", client.client_id, reason, exc)
            return HookResult.reject(f"quarantine failed: {exc}")
        log.warning("client %r: malformed batch on %r quarantined as %s: %s", client.client_id,
                    packet.topic, self.quarantine_dir / f"{name}.batch", reason)
        return HookResult.ack_drop(f"quarantined: {reason}")
