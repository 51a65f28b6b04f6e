"""The lander: rolls the collector's write-ahead log into Parquet landing files.

A :class:`Lander` reads the collector's queue through the durable consumer group ``lander``.
Each WAL record is one upstream batch (its timestamp is the collector's clock at receipt).
Rows are buffered until ``roll_bytes`` of batch bodies or ``roll_seconds`` since the oldest
buffered row, then landed with :class:`collector.landing.LandingWriter` (``_staging/`` ->
fdatasync -> rename into ``incoming/dt=YYYY-MM-DD/`` -> directory fsync). Only then are the
WAL records acked and the group's offset persisted, and then the high-water-mark snapshot
saved (:mod:`collector.dedup`).

What a caller may rely on:

* Every row acknowledged upstream lands: the WAL offset moves past a record only after the
  file holding its rows was renamed into ``incoming/`` and the rename made durable.
* A crash between the rename and the offset write lands the same rows again on restart
  (at most one roll's worth); the Spark ingest removes them by ``(device_id, stream,
  offset)``. That is the only source of duplicate rows besides a lost dedup snapshot.
* Within the collector, rows whose offsets are already held (:mod:`collector.dedup`) are
  dropped, so a batch the door stored twice lands once.
* A failure to land (full disk, I/O error) is logged and retried every
  ``retry_seconds``; the rows stay buffered and the WAL is not advanced.
* ``received_at`` is the WAL record's timestamp (the collector's clock when the batch
  arrived); ``publish_ts`` is kept exactly as the device sent it, however far off its clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from collector.dedup import HighWaterMarks, batch_ranges, offset_runs
from collector.fleet_events import event_rows, fleet_record
from collector.headers import property_columns
from collector.landing import LANDING_SCHEMA, SCHEMA_VERSION, LandingWriter
from filemq.upstream.batch import Batch, BatchError, decode_batch, parse_batch_topic, peek_header

if TYPE_CHECKING:
    from filemq.queue import Queue
    from filemq.queue.groups import ConsumerGroup
    from segments import Record

log = logging.getLogger(__name__)

GROUP_NAME = "lander"
CONSUMER = "lander"
FETCH_RECORDS = 8  # WAL records (batches, up to ~1 MiB each) taken per fetch

_TS = pa.timestamp("us", tz="UTC")


@dataclass
class LanderStats:
    """Counters for metrics and tests (read only)."""

    batches_read: int = 0
    rows_landed: int = 0
    files_landed: int = 0
    duplicate_rows_dropped: int = 0
    non_batch_records: int = 0
    land_failures: int = 0
    buffered_rows: int = 0
    last_land_seconds: float = 0.0
    events_landed: int = 0  # fleet events (connects, disconnects, health reports)
    buffered_events: int = 0


def batch_to_arrow(batch: Batch, received_at_us: int, collector_id: str) -> pa.RecordBatch:
    """The landing rows of ``batch`` as an Arrow record batch in :data:`LANDING_SCHEMA` order.

    Columns are wrapped from the batch's arrays without a per-record Python step, except the
    MQTT 5.0 property columns of records that carry headers (:mod:`collector.headers`).
    """
    n = len(batch)
    deltas = pa.Array.from_buffers(pa.uint32(), n, [None, pa.py_buffer(batch.offset_deltas)])
    offsets = pc.add(deltas.cast(pa.int64()), pa.scalar(batch.first_offset, pa.int64()))
    publish_ts = pa.Array.from_buffers(_TS, n, [None, pa.py_buffer(batch.timestamps_us)])
    qos = pa.Array.from_buffers(pa.int8(), n, [None, pa.py_buffer(batch.qos)])
    index = pa.Array.from_buffers(pa.uint32(), n, [None, pa.py_buffer(batch.topic_index)])
    topics = pa.DictionaryArray.from_arrays(index.cast(pa.int32()), pa.array(batch.topics, pa.string()))
    starts = pa.py_buffer(binary_offsets(batch))
    payload = pa.Array.from_buffers(pa.binary(), n, [None, starts, pa.py_buffer(batch.payloads)])
    return pa.RecordBatch.from_arrays(
        [
            pa.repeat(pa.scalar(batch.device_id, pa.string()), n),
            pa.repeat(pa.scalar(batch.stream, pa.string()), n),
            offsets,
            topics.cast(pa.string()),
            qos,
            publish_ts,
            pa.repeat(pa.scalar(received_at_us, _TS), n),
            pa.repeat(pa.scalar(collector_id, pa.string()), n),
            payload,
            pa.repeat(pa.scalar(SCHEMA_VERSION, pa.int16()), n),
            *property_columns(batch),
        ],
        schema=LANDING_SCHEMA,
    )


def binary_offsets(batch: Batch) -> array[int]:
    """Arrow binary offsets (n + 1 int32, native order) from the batch's payload lengths."""
    return array("i", accumulate(batch.payload_lengths, initial=0))


class Lander:
    """Moves rows from the WAL (the collector's queue) into landing files. See the module doc."""

    def __init__(
        self,
        queue: Queue,
        writer: LandingWriter,
        marks: HighWaterMarks,
        *,
        roll_bytes: int = 64 << 20,
        roll_seconds: float = 60.0,
        retry_seconds: float = 1.0,
        on_landed: Callable[[dict[tuple[str, str], int]], None] | None = None,
        events_writer: LandingWriter | None = None,
    ) -> None:
        self.queue = queue
        # Told the rows of each roll per (device, stream), once the file is landed (the fleet registry).
        self.on_landed = on_landed
        self._landing_counts: dict[tuple[str, str], int] = {}
        # Fleet events (collector.fleet_events): landed by their own writer in the same roll.
        self.events_writer = events_writer
        self._events: list[tuple[str, str, bytes, int, int]] = []
        self.writer = writer
        self.marks = marks
        self.roll_bytes = roll_bytes
        self.roll_seconds = roll_seconds
        self.retry_seconds = retry_seconds
        self.stats = LanderStats()
        self.group: ConsumerGroup = queue.group(GROUP_NAME, start="earliest")
        self._buffer: list[pa.RecordBatch] = []
        self._buffer_bytes = 0
        self._buffer_since: float | None = None
        self._taken: list[int] = []  # WAL offsets read since the last roll
        self._task: asyncio.Task[None] | None = None
        self._roll_now = asyncio.Event()
        self._stopping = False

    # -- start-up ------------------------------------------------------------------------

    def recover(self) -> None:
        """Rebuild the high-water marks for the lander's position (call before :meth:`start`).

        Loads the snapshot, then replays the WAL's batch headers from the snapshot's
        ``covered`` offset up to the group's Pending offset (records landed after the
        snapshot was written). A snapshot covering more than Pending (possible only if the
        Pending file was lost) is kept: its marks describe rows that are already landed.
        """
        self.writer.recover_staging()
        self.marks.load()
        pending = self.group.pending_offset
        start = max(self.marks.covered, self.queue.log.first_offset)
        replayed = self._replay(start, pending)
        if replayed:
            log.info("lander: rebuilt high-water marks from %d WAL records (%d..%d)", replayed, start, pending)

    def _replay(self, start: int, end: int) -> int:
        count = 0
        read = self.queue.log.read
        while start < end:
            records = read(start, min(FETCH_RECORDS, end - start))
            if not records:
                break
            for record in records:
                if record.offset >= end:
                    return count
                key = parse_batch_topic(record.topic)
                if key is None:
                    continue
                try:
                    header = peek_header(record.payload, verify_crc=False)  # the WAL CRC covers it
                    ranges = batch_ranges(header, record.payload)
                except BatchError:
                    continue
                self.marks.add_ranges(header.device_id, header.stream, ranges)
                count += 1
            start = records[-1].offset + 1
        return count

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="filemq-lander")

    async def stop(self, *, land: bool = True, timeout: float = 30.0) -> None:
        """Stop; with ``land`` (default) first land what is buffered, waiting up to ``timeout``.

        Rows not landed by then stay in the WAL (not acked) and land after the restart.
        """
        task, self._task = self._task, None
        if task is None:
            return
        if land:
            self._stopping = True
            self._roll_now.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), timeout)
        if not task.done():
            log.warning("lander: stopping with %d rows not landed; they land after the restart",
                        self.stats.buffered_rows)
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def request_roll(self) -> None:
        """Land what is buffered as soon as possible (tests, shutdown)."""
        self._roll_now.set()

    @property
    def lag(self) -> int:
        """WAL records not yet landed."""
        return self.group.lag

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        group = self.group
        while True:
            records = group.fetch(FETCH_RECORDS, CONSUMER)
            for record in records:
                self._take(record)
            if self._taken and self._roll_due():
                await self._roll_until_landed()
                if self._stopping:
                    return
                continue
            if records:
                await asyncio.sleep(0)  # a long WAL backlog must not starve the broker
                continue
            if self._stopping:
                return
            timeout: float | None = None
            if self._taken:
                assert self._buffer_since is not None
                timeout = max(0.0, self._buffer_since + self.roll_seconds - time.monotonic())
            waiter = asyncio.ensure_future(self.queue.wait_for_records(group.doing_offset))
            roller = asyncio.ensure_future(self._roll_now.wait())
            try:
                await asyncio.wait({waiter, roller}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                roller.cancel()

    def _roll_due(self) -> bool:
        if self._roll_now.is_set() or self._buffer_bytes >= self.roll_bytes:
            return True
        return self._buffer_since is not None and time.monotonic() - self._buffer_since >= self.roll_seconds

    def _take(self, record: Record) -> None:
        if not self._taken:
            self._buffer_since = time.monotonic()
        self._taken.append(record.offset)
        key = parse_batch_topic(record.topic)
        if key is None:
            event = fleet_record(record.topic, record.payload) if self.events_writer is not None else None
            if event is None:
                self.stats.non_batch_records += 1
            else:
                self._events.append((*event, record.offset, record.timestamp_us))
                self.stats.buffered_events += 1
            return
        try:
            batch = decode_batch(record.payload)
        except BatchError as exc:
            # The door validated it; this is a WAL record from elsewhere. Never fatal.
            self.stats.non_batch_records += 1
            log.error("lander: WAL record %d on %r is not a valid batch (%s); skipped", record.offset, record.topic, exc)
            return
        self.stats.batches_read += 1
        device, stream, first, last = batch.device_id, batch.stream, batch.first_offset, batch.last_offset
        n = len(batch)
        if self.marks.holds(device, stream, first, last):
            self.stats.duplicate_rows_dropped += n
            return
        rows = batch_to_arrow(batch, record.timestamp_us, self.writer.collector_id)
        overlaps = self.marks.overlaps(device, stream, first, last)
        if overlaps:
            offsets = rows.column(2)
            held = None
            for lo, hi in overlaps:
                inside = pc.and_(pc.greater_equal(offsets, lo), pc.less_equal(offsets, hi))
                held = inside if held is None else pc.or_(held, inside)
            rows = rows.filter(pc.invert(held))
            self.stats.duplicate_rows_dropped += n - rows.num_rows
        if n == last - first + 1:
            self.marks.add(device, stream, first, last)
        else:  # exactly the offsets the batch carries, never the gaps between them
            self.marks.add_ranges(device, stream, offset_runs(first, batch.offset_deltas))
        if rows.num_rows:
            counts = self._landing_counts
            counts[(device, stream)] = counts.get((device, stream), 0) + rows.num_rows
            self._buffer.append(rows)
            self._buffer_bytes += batch.header.body_length
            self.stats.buffered_rows += rows.num_rows

    async def _roll_until_landed(self) -> None:
        while True:
            try:
                await self._roll()
                return
            except OSError as exc:
                self.stats.land_failures += 1
                log.error("lander: landing %d rows failed: %s; retrying in %.1f s",
                          self.stats.buffered_rows, exc, self.retry_seconds)
            except Exception:
                # Not expected (the rows were built from validated batches); keep the rows
                # and the WAL position, say so loudly, and try again rather than stop landing.
                self.stats.land_failures += 1
                log.exception("lander: unexpected error landing %d rows; retrying in %.1f s",
                              self.stats.buffered_rows, self.retry_seconds)
            await asyncio.sleep(self.retry_seconds)

    async def _roll(self) -> None:
        """Land the buffer, then ack the WAL records, persist the offset, save the marks.

        Safe to call again after a failure: once the file is landed the buffer is emptied,
        so a retry after a failed offset write does not land the rows twice.
        """
        started = time.monotonic()
        rows = sum(b.num_rows for b in self._buffer)
        if rows:
            table = pa.Table.from_batches(self._buffer, schema=LANDING_SCHEMA)
            path = await asyncio.to_thread(self.writer.write, table)
            self.stats.files_landed += 1
            self.stats.rows_landed += rows
            log.info("lander: landed %d rows in %s", rows, path)
            # Emptied once landed, before the events' file: a retry after a failure there
            # must not land these rows again.
            self._buffer.clear()
            self._buffer_bytes = 0
            self.stats.buffered_rows = 0
        if self._events:
            assert self.events_writer is not None
            events = event_rows(self._events, self.events_writer.collector_id)
            path = await asyncio.to_thread(self.events_writer.write, pa.Table.from_batches([events]))
            self.stats.events_landed += len(self._events)
            log.info("lander: landed %d fleet events in %s", len(self._events), path)
            self._events = []  # emptied once landed: a retry after a failed offset write skips them
            self.stats.buffered_events = 0
        counts, self._landing_counts = self._landing_counts, {}
        if counts and self.on_landed is not None:
            try:
                self.on_landed(counts)
            except Exception:
                log.exception("lander: reporting landed rows failed; landing goes on")
        self._buffer.clear()
        self._buffer_bytes = 0
        self.stats.buffered_rows = 0
        group = self.group
        for offset in self._taken:
            group.ack(offset)  # False for one acked by an earlier, failed attempt: harmless
        # Offset after the rename (guarantee 3); marks after the offset, so the snapshot
        # never covers rows that are not landed.
        snap = group.snapshot()
        await asyncio.to_thread(group.write_snapshot, snap)
        data = self.marks.encode(snap.pending)
        await asyncio.to_thread(self.marks.save_encoded, data, snap.pending)
        self._taken.clear()
        self._buffer_since = None
        self._roll_now.clear()
        self.stats.last_land_seconds = time.monotonic() - started
