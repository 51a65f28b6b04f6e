"""Durable retained messages: an in-memory map rebuilt from a snapshot plus the log.

A retained PUBLISH is appended to the log like every message (with the retain flag), so it
is durable before it is acknowledged; this module only keeps the *latest* retained message
per topic in memory and makes restarts cheap with a snapshot file.

What a caller may rely on:

* :meth:`RetainedStore.apply` takes log records in offset order; a retained record with an
  empty payload clears its topic; records without the retain flag are ignored.  The broker
  applies a record *after* the group commit that made it durable, so the map never holds a
  message the log could lose.
* :meth:`RetainedStore.snapshot` writes ``<data_dir>/retained.snap`` with
  :func:`segments.fileio.atomic_write` (old or new file, never a mix), CRC-32C checked, with
  ``covered_offset``: every log record below it is reflected in the snapshot.  Call it
  periodically and at shutdown, never per message.
* :meth:`RetainedStore.recover` loads the snapshot, then replays the log from
  ``covered_offset`` to its end, so nothing acknowledged is lost however old the snapshot
  is.  A torn or corrupt snapshot is ignored with a warning and the whole log is replayed.
* Retention and old snapshots: the snapshot is the only source for retained messages whose
  log segments retention has deleted.  If retention deleted segments *past* the snapshot's
  ``covered_offset`` (the snapshot is older than the oldest segment), retained changes in the
  deleted range are lost; recovery logs that with the offset range.  Snapshotting every few
  seconds (the broker's default) keeps this from happening unless retention deletes data
  seconds after it was written.
* **Expired messages are removed** (MQTT 5 message expiry interval, MQTT-3.3.2-5):
  :meth:`RetainedStore.expire` drops every retained message whose interval has passed since
  it was published (the broker calls it from its once-a-second tick, then snapshots), and
  :meth:`RetainedStore.recover` does the same after its replay, so a restart never brings an
  expired one back.  Only messages with an expiry interval are looked at.
* Under ``fsync = "interval"`` or ``"never"`` a snapshot may be ahead of the log after a power
  cut; recovery then drops the snapshot entries the log no longer has (such messages were
  inside the documented loss window).

Snapshot layout (big-endian), format 1: ``b"FMQRSNP1"``, u64 covered_offset, u32 count, then
per entry u64 offset, i64 timestamp_us, u8 qos, u16 topic length, u32 payload length, topic
(UTF-8), payload; finally u32 CRC-32C of every byte before it.  Format 2 (``b"FMQRSNP2"``,
issue 13) adds each message's headers (its MQTT 5 message properties, ``Record.headers``):
per entry u64 offset, i64 timestamp_us, u8 qos, u16 topic length, u32 payload length, u32
headers length, topic, headers, payload.  A snapshot is written in format 1 when no message
has headers (byte for byte as before format 2, so an older release still loads it), else in
format 2; both are read.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from crc32c import crc32c

from filemq.common.topics import parse_shared, topic_matches
from segments.fileio import OS_FILE_IO, FileIO, atomic_write
from segments.log import LogView
from segments.record import Record

log = logging.getLogger(__name__)

SNAPSHOT_NAME = "retained.snap"
MAGIC = b"FMQRSNP1"  # format 1: no headers
MAGIC_HEADERS = b"FMQRSNP2"  # format 2: every entry carries its headers
_HEADER = struct.Struct(">8sQI")
_ENTRY = struct.Struct(">QqBHI")
_ENTRY_HEADERS = struct.Struct(">QqBHII")
_CRC = struct.Struct(">I")
_REPLAY_BATCH = 1000


def expires_at_us(headers: bytes, timestamp_us: int) -> int | None:
    """When (Unix µs) a message with these headers (``Record.headers``: its MQTT 5 message
    properties in identifier order) expires; None without a message expiry interval."""
    if not headers:
        return None
    if headers[0] == 0x02:
        i = 1
    elif headers[0] == 0x01 and len(headers) > 2 and headers[2] == 0x02:
        i = 3
    else:
        return None
    return timestamp_us + int.from_bytes(headers[i:i + 4], "big") * 1_000_000


class CorruptSnapshot(ValueError):
    """The snapshot file is torn or damaged; ``path`` and ``reason`` say where and why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: corrupt retained snapshot: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RetainedMessage:
    """The latest retained message on ``topic`` and the log offset it was stored at."""

    topic: str
    payload: bytes
    qos: int
    offset: int
    timestamp_us: int
    headers: bytes = b""  # the message's MQTT 5 message properties (Record.headers)


@dataclass
class RetainedRecovery:
    """What :meth:`RetainedStore.recover` found."""

    snapshot_loaded: bool = False
    snapshot_corrupt: bool = False
    snapshot_entries: int = 0
    replay_from: int = 0
    replayed_records: int = 0
    applied: int = 0
    lost_range: tuple[int, int] | None = None  # [first, end) deleted by retention, never seen
    dropped_ahead: int = 0  # snapshot entries beyond the log's end


def encode_snapshot(messages: list[RetainedMessage], covered_offset: int) -> bytes:
    """The snapshot bytes for ``messages`` (see the module docstring for the layout): format 1
    when no message has headers, else format 2."""
    with_headers = any(m.headers for m in messages)
    parts = [_HEADER.pack(MAGIC_HEADERS if with_headers else MAGIC, covered_offset, len(messages))]
    for m in messages:
        topic = m.topic.encode("utf-8")
        if with_headers:
            parts.append(_ENTRY_HEADERS.pack(
                m.offset, m.timestamp_us, m.qos, len(topic), len(m.payload), len(m.headers)))
            parts.append(topic)
            parts.append(m.headers)
        else:
            parts.append(_ENTRY.pack(m.offset, m.timestamp_us, m.qos, len(topic), len(m.payload)))
            parts.append(topic)
        parts.append(m.payload)
    body = b"".join(parts)
    return body + _CRC.pack(crc32c(body))


def decode_snapshot(data: bytes, path: str = "<snapshot>") -> tuple[list[RetainedMessage], int]:
    """``(messages, covered_offset)``; raises :class:`CorruptSnapshot` on any damage."""
    if len(data) < _HEADER.size + _CRC.size:
        raise CorruptSnapshot(path, f"only {len(data)} bytes")
    body, (crc,) = data[: -_CRC.size], _CRC.unpack(data[-_CRC.size :])
    if crc32c(body) != crc:
        raise CorruptSnapshot(path, "CRC-32C mismatch")
    magic, covered, count = _HEADER.unpack_from(body, 0)
    if magic not in (MAGIC, MAGIC_HEADERS):
        raise CorruptSnapshot(path, f"unknown format {magic!r}")
    with_headers = magic == MAGIC_HEADERS
    pos = _HEADER.size
    out: list[RetainedMessage] = []
    try:
        for _ in range(count):
            headers = b""
            if with_headers:
                offset, ts, qos, tlen, plen, hlen = _ENTRY_HEADERS.unpack_from(body, pos)
                pos += _ENTRY_HEADERS.size
            else:
                offset, ts, qos, tlen, plen = _ENTRY.unpack_from(body, pos)
                pos += _ENTRY.size
                hlen = 0
            topic = body[pos : pos + tlen].decode("utf-8")
            pos += tlen
            if with_headers:
                headers = body[pos : pos + hlen]
                pos += hlen
            payload = body[pos : pos + plen]
            pos += plen
            if len(payload) != plen or len(headers) != hlen or qos > 2:
                raise CorruptSnapshot(path, f"entry {len(out)} is inconsistent")
            out.append(RetainedMessage(topic, payload, qos, offset, ts, headers))
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptSnapshot(path, f"entry {len(out)}: {exc}") from None
    if pos != len(body):
        raise CorruptSnapshot(path, f"{len(body) - pos} unexpected trailing bytes")
    return out, covered


class RetainedStore:
    """The latest retained message per topic, snapshotted to ``<data_dir>/retained.snap``."""

    def __init__(self, data_dir: str | os.PathLike[str], fileio: FileIO = OS_FILE_IO) -> None:
        self.path = Path(data_dir) / SNAPSHOT_NAME
        self.fileio = fileio
        self.covered_offset = 0
        self._messages: dict[str, RetainedMessage] = {}
        self._payload_bytes = 0
        self._expiring: dict[str, int] = {}  # topic -> expiry (Unix µs) of its message, if it has one
        self.expired = 0  # retained messages removed because their expiry interval passed

    def __len__(self) -> int:
        return len(self._messages)

    @property
    def payload_bytes(self) -> int:
        """Sum of the retained payload sizes held in memory."""
        return self._payload_bytes

    def get(self, topic: str) -> RetainedMessage | None:
        """The retained message on exactly ``topic``, if any."""
        return self._messages.get(topic)

    def apply(self, record: Record) -> None:
        """Update from one log record (non-retained records are ignored).

        An empty payload clears the topic.  A record older than the one already held for its
        topic changes nothing, so replaying an overlapping range is harmless.
        """
        # covered_offset is left alone: only advance() may move it, because the broker may
        # apply records from one group commit out of order.
        if not record.retain:
            return
        current = self._messages.get(record.topic)
        if current is not None:
            if current.offset >= record.offset:
                return
            self._payload_bytes -= len(current.payload)
            del self._messages[record.topic]
            self._expiring.pop(record.topic, None)
        if record.payload:
            self._messages[record.topic] = RetainedMessage(
                record.topic, record.payload, record.qos, record.offset, record.timestamp_us,
                record.headers,
            )
            self._payload_bytes += len(record.payload)
            if record.headers:
                due = expires_at_us(record.headers, record.timestamp_us)
                if due is not None:
                    self._expiring[record.topic] = due

    def expire(self, now_us: int) -> int:
        """Remove the retained messages whose MQTT 5 message expiry interval has passed by
        ``now_us`` (Unix µs); returns how many."""
        gone = [t for t, due in self._expiring.items() if due <= now_us]
        for topic in gone:
            del self._expiring[topic]
            m = self._messages.pop(topic, None)
            if m is not None:
                self._payload_bytes -= len(m.payload)
        self.expired += len(gone)
        return len(gone)

    def advance(self, offset: int) -> None:
        """Declare that every retained record below ``offset`` has been applied.

        The broker calls this (with the log's committed offset) before :meth:`snapshot` so
        a restart replays only what came after, not everything since the last retained message.
        """
        self.covered_offset = max(self.covered_offset, offset)

    def match(self, topic_filter: str) -> list[RetainedMessage]:
        """Retained messages whose topic ``topic_filter`` matches (``$`` rule applies), by topic.

        ``$share/<group>/<f>`` is matched as ``f``.
        """
        _, plain = parse_shared(topic_filter)
        if "+" not in plain and "#" not in plain:
            hit = self._messages.get(plain)
            return [hit] if hit is not None else []
        return sorted(
            (m for t, m in self._messages.items() if topic_matches(plain, t)),
            key=lambda m: m.topic,
        )

    def snapshot(self) -> None:
        """Write the snapshot atomically and durably (covering :attr:`covered_offset`)."""
        data = encode_snapshot(list(self._messages.values()), self.covered_offset)
        atomic_write(self.path, data, self.fileio)
        log.debug(
            "%s: %d retained messages, covered offset %d", self.path, len(self), self.covered_offset
        )

    def _load_snapshot(self) -> bytes | None:
        try:
            handle = self.fileio.open(self.path)
        except FileNotFoundError:
            return None
        try:
            return handle.pread(handle.size(), 0)
        finally:
            handle.close()

    def recover(self, log_: LogView) -> RetainedRecovery:
        """Rebuild the map: snapshot, then the log from ``covered_offset`` to its end."""
        report = RetainedRecovery()
        self._messages.clear()
        self._payload_bytes = 0
        self._expiring.clear()
        self.covered_offset = 0
        first, end = log_.first_offset, log_.committed_offset
        data = self._load_snapshot()
        if data is not None:
            try:
                messages, covered = decode_snapshot(data, str(self.path))
            except CorruptSnapshot as exc:
                log.warning("%s; rebuilding retained messages from the log at offset %d", exc, first)
                report.snapshot_corrupt = True
            else:
                report.snapshot_loaded = True
                if covered > end:
                    kept = [m for m in messages if m.offset < end]
                    report.dropped_ahead = len(messages) - len(kept)
                    log.warning(
                        "%s covers offsets up to %d but the log ends at %d (unsynced records "
                        "lost in a crash); dropping %d retained messages the log no longer has",
                        self.path, covered, end, report.dropped_ahead,
                    )
                    messages, covered = kept, end
                for m in messages:
                    self._messages[m.topic] = m
                    self._payload_bytes += len(m.payload)
                    due = expires_at_us(m.headers, m.timestamp_us) if m.headers else None
                    if due is not None:
                        self._expiring[m.topic] = due
                report.snapshot_entries = len(messages)
                self.covered_offset = covered
        start = self.covered_offset if report.snapshot_loaded else first
        if start < first:
            report.lost_range = (start, first)
            log.warning(
                "%s: retention deleted log offsets %d..%d before a retained snapshot covered "
                "them; retained changes published there are lost",
                self.path, start, first - 1,
            )
            start = first
        report.replay_from = start
        self.covered_offset = max(self.covered_offset, start)
        offset = start
        while offset < end:
            batch = log_.read(offset, _REPLAY_BATCH)
            if not batch:
                break
            for record in batch:
                report.replayed_records += 1
                if record.retain:
                    report.applied += 1
                self.apply(record)
            offset = batch[-1].offset + 1
        self.covered_offset = max(self.covered_offset, end)
        expired = self.expire(time.time_ns() // 1000)  # never back after a restart
        if expired:
            log.info("%s: %d expired retained messages removed", self.path, expired)
        log.info(
            "%s: %d retained messages (snapshot %d, replayed %d records from offset %d)",
            self.path, len(self), report.snapshot_entries, report.replayed_records, start,
        )
        return report
