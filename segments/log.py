"""The log: an ordered list of segments with one append buffer, rolling, recovery and retention.

Offsets are assigned by :meth:`Log.append` (gap-free, starting at 0) and become readable once
a flush writes them to the OS (:attr:`Log.committed_offset`).  Writing is split in three steps
so a group committer can run the slow part off the event loop:

* :meth:`Log.take_batch` swaps the in-memory buffer out (cheap, under the append lock);
* :meth:`Log.write_batch` writes it, rolling and sealing segments, optionally fdatasyncs,
  then advances ``committed_offset`` (slow; holds only the write lock, never the append lock);
* :meth:`Log.discard_pending` drops whatever was appended after a failed write, so offsets stay
  gap-free and nothing from a failed commit is ever readable.

:meth:`Log.flush` and :meth:`Log.sync` chain these for callers without a committer.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate, repeat
from pathlib import Path
from typing import Literal, Protocol, cast

from segments.errors import SegmentError
from segments.fileio import OS_FILE_IO, DiskFull, FileIO
from segments.index import SparseIndex
from segments.record import (
    LENGTH,
    LENGTH_SIZE,
    MAX_RECORD_BYTES,
    MAX_TOPIC_BYTES,
    Record,
    decode_at,
    encode_run_v1,
    encode_run_v2,
    encode_v1,
    encode_v2,
)
from segments.segment import NO_TIMESTAMP, Segment, parse_segment_name

log = logging.getLogger(__name__)

_TOPIC_CACHE_MAX = 4096
# Free space is read again (statfs) at least this often, and at every commit once the estimate
# (the last reading less what this log wrote since) comes within FREE_SLACK of min_free_bytes.
FREE_RECHECK_S = 1.0
FREE_SLACK = 64 * 1024 * 1024


@dataclass
class LogConfig:
    """Tuning of one log.  Sizes in bytes, times in milliseconds."""

    segment_bytes: int = 64 * 1024 * 1024
    index_interval_bytes: int = 4096
    fsync: Literal["always", "interval", "never"] = "always"
    fsync_interval_ms: int = 1000
    retention_bytes: int | None = None
    retention_ms: int | None = None
    min_free_bytes: int = 0
    # Group commits run on the event loop while fdatasync takes at most this long (ms), else on
    # a thread (segments.commit.GroupCommitter); 0 = always on the thread.
    commit_on_loop_max_ms: float = 20.0
    # Sealed segments whose sparse index stays in memory after a read (least recently read
    # dropped first); the active segment's is always kept.  Memory stays flat with log size.
    index_cache_segments: int = 4

    def __post_init__(self) -> None:
        if not 1024 <= self.segment_bytes < 1 << 32:
            raise ValueError(f"segment_bytes must be in [1024, 2**32), not {self.segment_bytes}")
        if self.index_interval_bytes <= 0:
            raise ValueError("index_interval_bytes must be positive")
        if self.fsync not in ("always", "interval", "never"):
            raise ValueError(f"fsync must be always, interval or never, not {self.fsync!r}")
        if self.fsync_interval_ms <= 0:
            raise ValueError("fsync_interval_ms must be positive")
        if self.min_free_bytes < 0:
            raise ValueError("min_free_bytes must be >= 0")
        if self.commit_on_loop_max_ms < 0:
            raise ValueError(f"commit_on_loop_max_ms must be >= 0, not {self.commit_on_loop_max_ms}")
        if self.index_cache_segments < 1:
            raise ValueError(f"index_cache_segments must be >= 1, not {self.index_cache_segments}")


@dataclass
class RecoveryReport:
    """What :meth:`Log.open` found: counts and the time it took to be ready."""

    segments: int = 0
    tail_bytes_truncated: int = 0
    corrupt_records: int = 0
    scanned_bytes: int = 0
    seconds: float = 0.0


@dataclass
class RetentionReport:
    """What one :meth:`Log.enforce_retention` call deleted.

    ``dropped_needed`` counts records at or above ``min_needed_offset`` that the byte cap
    forced out (``dropped_range`` is their half-open offset range); 0 / None when none.
    """

    segments_deleted: int = 0
    bytes_deleted: int = 0
    records_deleted: int = 0
    first_offset: int = 0
    dropped_needed: int = 0
    dropped_range: tuple[int, int] | None = None


@dataclass
class LogStats:
    """Running counters since open (``corrupt_skipped`` counts each bad spot once)."""

    appended: int = 0
    corrupt_skipped: int = 0
    tail_truncated_bytes: int = 0
    dropped_by_retention: int = 0
    fsyncs: int = 0
    fsync_seconds_total: float = 0.0


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    base_offset: int
    path: Path
    size: int
    sealed: bool
    next_offset: int


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    """One step of :meth:`Log.scan`: a record, or a corrupt spot (``record`` None, ``crc_ok`` False)."""

    record: Record | None
    segment: str
    position: int
    length: int
    crc_ok: bool


class _Group:
    """Buffered records bound for one segment, starting at byte ``start_pos``."""

    __slots__ = ("base_offset", "new_segment", "start_pos", "chunks", "nbytes", "end_offset",
                 "index", "max_ts", "last_index_pos", "first_offset")

    def __init__(self, base_offset: int, new_segment: bool, start_pos: int, last_index_pos: int,
                 first_offset: int) -> None:
        self.base_offset = base_offset
        self.first_offset = first_offset  # its first record's (chunks may hold several records)
        self.new_segment = new_segment
        self.start_pos = start_pos
        self.chunks: list[bytes] = []
        self.nbytes = 0
        self.end_offset = 0
        self.index: list[tuple[int, int]] = []
        self.max_ts = NO_TIMESTAMP
        self.last_index_pos = last_index_pos


@dataclass(frozen=True, slots=True)
class Batch:
    """Records [first_offset, end_offset) taken from the buffer by :meth:`Log.take_batch`."""

    groups: list[_Group]
    first_offset: int
    end_offset: int
    nbytes: int


class LogView(Protocol):
    """The read side of a :class:`Log`, as consumers see it (a protocol so a cache over the
    log, or a test fake, can stand in): ``read`` returns what ``Log.read`` would, records
    ``>= offset`` and ``< committed_offset``, in order."""

    @property
    def first_offset(self) -> int: ...

    @property
    def next_offset(self) -> int: ...

    @property
    def committed_offset(self) -> int: ...

    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> list[Record]: ...


class Log:
    """A durable, segmented, CRC-checked append-only log in one directory.

    Thread-safety: :meth:`append` may run on one thread (the event loop) while
    :meth:`write_batch` / :meth:`flush` / :meth:`sync` run on another; the fdatasync never
    holds the lock that :meth:`append` needs.  Reads may run on any thread.
    """

    # Slots, not a __dict__: CPython 3.11 keeps attribute loads and method calls on an instance
    # specialized only while its attributes fit the class's shared key table (29); at 30 every
    # append paid dict lookups instead (+0.3-0.5k instructions per record in `bench append`).
    # A new attribute is named here too.
    __slots__ = (
        "directory", "config", "fileio", "stats", "recovery", "_lock", "_write_lock", "_delete_lock",
        "_segments", "_bases", "_hot_indexes", "_groups", "_next_offset", "_committed_offset",
        "_tail_base", "_tail_pos", "_tail_last_index_pos", "_pending_bytes", "_free_budget",
        "_free_seen", "_free_seen_at", "_written_since", "_writing_bytes", "_dirty", "_closed", "_broken",
        "_topics", "_segment_bytes", "_interval", "_min_free", "_max_record",
    )

    def __init__(self, directory: Path, config: LogConfig, fileio: FileIO) -> None:
        self.directory = directory
        self.config = config
        self.fileio = fileio
        self.stats = LogStats()
        self.recovery = RecoveryReport()
        self._lock = threading.Lock()  # the append buffer and offset counter
        self._write_lock = threading.RLock()  # segment files and the segment list
        # Held by read() and by retention while it closes files: a read never preads a
        # descriptor that was closed (and possibly reused for another file) under it.
        self._delete_lock = threading.Lock()
        self._segments: list[Segment] = []
        self._bases: list[int] = []
        # Sealed segments whose index is loaded, least recently read first (under _delete_lock).
        self._hot_indexes: OrderedDict[Segment, None] = OrderedDict()
        self._groups: list[_Group] = []
        self._next_offset = 0
        self._committed_offset = 0
        self._tail_base = 0
        self._tail_pos = 0
        self._tail_last_index_pos = 0
        self._pending_bytes = 0
        self._writing_bytes = 0  # the batch taken and being written
        self._free_budget = 0
        # The last free-space reading (statfs) and what this log wrote since: see _free_now.
        self._free_seen = 0
        self._free_seen_at = -FREE_RECHECK_S
        self._written_since = 0
        self._dirty = False
        self._closed = False
        self._broken: str | None = None
        self._topics: dict[str, bytes] = {}
        # Copied out of config: append is the hot path and attribute chains cost.
        self._segment_bytes = config.segment_bytes
        self._interval = config.index_interval_bytes
        self._min_free = config.min_free_bytes
        self._max_record = min(config.segment_bytes, MAX_RECORD_BYTES)

    # -- open and recovery ---------------------------------------------------------------

    @classmethod
    def open(
        cls, directory: str | Path, config: LogConfig | None = None, fileio: FileIO | None = None
    ) -> Log:
        """Open (creating if needed) the log in ``directory`` and recover it.

        Never refuses to start because of damaged data: a torn tail is cut, corrupt
        records are skipped, bad indexes are rebuilt; :attr:`recovery` says what happened.
        """
        path = Path(directory)
        io = fileio if fileio is not None else OS_FILE_IO
        os.makedirs(path, exist_ok=True)
        self = cls(path, config or LogConfig(), io)
        self._recover()
        return self

    def _recover(self) -> None:
        started = time.perf_counter()
        report = RecoveryReport()
        names = set(os.listdir(self.directory))
        bases = sorted(b for b in (parse_segment_name(n) for n in names) if b is not None)
        self._remove_orphans(names, set(bases))
        interval = self.config.index_interval_bytes
        segments: list[Segment] = []
        for i, base in enumerate(bases):
            segment, found = Segment.recover(self.directory, base, self.fileio, interval)
            report.scanned_bytes += found.scanned_bytes
            report.tail_bytes_truncated += found.truncated_bytes
            report.corrupt_records += found.corrupt_records
            if segments and base != segments[-1].next_offset:
                log.warning(
                    "%s: segment starts at offset %d but the previous one ends at %d; "
                    "offsets in between are missing",
                    segment.log_path, base, segments[-1].next_offset,
                )
            if i < len(bases) - 1 and not segment.sealed:
                # A crash during a roll; seal it so the next open trusts it without a scan.
                segment.seal_now()
                segment.release_index()  # reloaded from disk if it is ever read
            segments.append(segment)
        if not segments or segments[-1].sealed:
            start = segments[-1].next_offset if segments else 0
            segments.append(Segment.create(self.directory, start, self.fileio))
        self._set_segments(segments)
        tail = segments[-1]
        self._next_offset = self._committed_offset = tail.next_offset
        self._tail_base = tail.base_offset
        self._tail_pos = tail.size
        self._tail_last_index_pos = tail.last_index_position
        try:
            self._refresh_free_budget(0)
        except DiskFull as exc:
            # Open anyway: the backlog must still be read and delivered; appends re-check
            # the floor and keep raising DiskFull until space is freed.
            log.warning("%s: free space below min_free_bytes (%s): opened read-mostly, appends refused until space is freed", self.directory, exc)
        report.segments = len(segments)
        report.seconds = time.perf_counter() - started
        self.recovery = report
        self.stats.tail_truncated_bytes = report.tail_bytes_truncated
        self.stats.corrupt_skipped = report.corrupt_records
        if report.tail_bytes_truncated or report.corrupt_records:
            log.warning("%s: recovered with %s", self.directory, report)
        else:
            log.info("%s: opened %s", self.directory, report)

    def _remove_orphans(self, names: set[str], bases: set[int]) -> None:
        """Delete ``.index``/``.seal`` files whose ``.log`` is gone (a crash during retention)."""
        removed = False
        for name in names:
            stem, _, suffix = name.partition(".")
            if suffix in ("index", "seal") and stem.isdigit() and int(stem) not in bases:
                self.fileio.unlink(self.directory / name)
                removed = True
        if removed:
            self.fileio.fsync_dir(self.directory)

    def _set_segments(self, segments: list[Segment]) -> None:
        # Replaced, never mutated, so readers can iterate a snapshot without the lock.
        self._segments = segments
        self._bases = [s.base_offset for s in segments]

    # -- properties ----------------------------------------------------------------------

    @property
    def first_offset(self) -> int:
        """Lowest offset still on disk (records below it were deleted by retention)."""
        return self._segments[0].base_offset

    @property
    def next_offset(self) -> int:
        """The offset the next :meth:`append` gets."""
        return self._next_offset

    @property
    def uncommitted_bytes(self) -> int:
        """Bytes appended and not yet written by a commit (buffered, or being written)."""
        return self._pending_bytes + self._writing_bytes

    @property
    def committed_offset(self) -> int:
        """Records below this offset are written to the OS; readers see only these."""
        return self._committed_offset

    # -- appending -----------------------------------------------------------------------

    def append(
        self, topic: str, payload: bytes, *, qos: int = 0, retain: bool = False,
        timestamp_us: int | None = None, headers: bytes = b"",
    ) -> int:
        """Buffer one record in memory and return its offset.

        ``headers`` are stored as they are and read back in :attr:`Record.headers` (MQTT 5
        message properties, opaque here); b"" writes the record in format 1, as before
        headers existed, anything else in format 2 (docs/FORMAT.md).
        It becomes readable after the next :meth:`flush` and durable after :meth:`sync`.
        Raises DiskFull (assigning no offset) when free space is below ``min_free_bytes``,
        ValueError on a bad QoS, a topic over 65535 bytes or a record (headers included)
        over the segment size.
        """
        return self.append_positional(topic, payload, qos, retain, timestamp_us, headers)

    def append_positional(self, topic: str, payload: bytes, qos: int, retain: bool, timestamp_us: int | None,
                          headers: bytes) -> int:
        """:meth:`append` with every argument positional, for the group committer's per-record
        call: CPython specializes a call without keywords (no name matching per argument),
        which the keyword-only :meth:`append` cannot get."""
        topic_bytes = self._topics.get(topic)
        if topic_bytes is None:
            topic_bytes = self._topic_bytes(topic)
        if qos.__class__ is not int or not 0 <= qos <= 2:
            raise ValueError(f"qos must be 0, 1 or 2, not {qos!r}")
        flags = qos | 4 if retain else qos
        ts = time.time_ns() // 1000 if timestamp_us is None else timestamp_us
        with self._lock:
            if self._closed or self._broken:
                raise SegmentError(str(self.directory), self._broken or "log is closed")
            offset = self._next_offset
            if headers:
                data = encode_v2(offset, ts, topic_bytes, payload, flags, headers)
            else:
                data = encode_v1(offset, ts, topic_bytes, payload, flags)
            n = len(data)
            if n > self._max_record:
                raise ValueError(f"record of {n} bytes does not fit a segment of {self.config.segment_bytes}")
            if self._min_free:
                self._free_budget -= n
                if self._free_budget < 0:
                    self._refresh_free_budget(n)
            pos = self._tail_pos
            groups = self._groups
            if pos + n > self._segment_bytes and pos > 0:
                group = _Group(offset, True, 0, 0, offset)
                groups.append(group)
                self._tail_base = offset
                pos = 0
                self._tail_last_index_pos = 0
            else:
                if groups:
                    group = groups[-1]
                else:
                    group = _Group(self._tail_base, False, pos, self._tail_last_index_pos, offset)
                    groups.append(group)
                if pos - self._tail_last_index_pos >= self._interval:
                    group.index.append((offset, pos))
                    self._tail_last_index_pos = group.last_index_pos = pos
            group.chunks.append(data)
            group.nbytes += n
            group.end_offset = offset + 1
            if ts > group.max_ts:
                group.max_ts = ts
            self._tail_pos = pos + n
            self._next_offset = offset + 1
            self._pending_bytes += n
        return offset

    def append_many(self, topics: list[str], payloads: list[bytes], retains: list[bool], qos: int,
                    timestamp_us: int, headers: list[bytes] | None = None) -> int:
        """Buffer format 1 records (no headers), one per ``(topic, payload, retain)``, all with
        ``qos`` and ``timestamp_us``; return the first one's offset.  The same records (and
        bytes) as that many :meth:`append` calls, for the cost of one call when the run needs
        nothing special (the broker's run of a read's PUBLISHes); otherwise (a topic not seen
        yet, a roll, a free-space re-check, an error) it is exactly that many :meth:`append`
        calls: on an error the records before the failing one stay buffered with their
        offsets, the failing one and those after it are not.  ``headers``: one per record
        (``b""`` for none), the same as :meth:`append` calls with them (in one call too when
        every record has some)."""
        if qos.__class__ is not int or not 0 <= qos <= 2:
            raise ValueError(f"qos must be 0, 1 or 2, not {qos!r}")
        n = len(topics)
        if len(payloads) != n or len(retains) != n or (headers is not None and len(headers) != n):
            raise ValueError(f"{n} topics, {len(payloads)} payloads and {len(retains)} retain flags"
                             + ("" if headers is None else f", {len(headers)} headers"))
        with self._lock:
            if self._closed or self._broken:
                raise SegmentError(str(self.directory), self._broken or "log is closed")
            first = self._next_offset
            if not n or ((headers is None or all(headers))
                         and self._append_run(topics, payloads, retains, qos, timestamp_us, headers)):
                return first
        append = self.append_positional
        for topic, payload, retain, header in zip(topics, payloads, retains, headers or repeat(b"", n),
                                                  strict=True):
            append(topic, payload, qos, retain, timestamp_us, header)
        return first

    def _append_run(self, topics: list[str], payloads: list[bytes], retains: list[bool], qos: int, ts: int,
                    headers: list[bytes] | None = None) -> bool:
        """:meth:`append_many` without bytecode per record, if every topic was encoded before,
        every record fits, no roll and no free-space re-check are due; else False, having
        changed nothing.  ``headers``: every record's, none empty (format 2).  Under ``_lock``."""
        topic_bytes = list(map(self._topics.get, topics))
        if None in topic_bytes:
            return False
        first = self._next_offset
        n = len(topics)
        if headers is None:
            data, sizes = encode_run_v1(first, ts, cast("list[bytes]", topic_bytes), payloads,
                                        map((qos, qos | 4).__getitem__, retains))
        else:
            data, sizes = encode_run_v2(first, ts, cast("list[bytes]", topic_bytes), payloads,
                                        map((qos, qos | 4).__getitem__, retains), headers)
        total = len(data)
        pos = self._tail_pos
        if max(sizes) > self._max_record or pos + total > self._segment_bytes or (
                self._min_free and self._free_budget < total):
            return False
        if self._min_free:
            self._free_budget -= total
        groups = self._groups
        last_index = self._tail_last_index_pos
        if groups:
            group = groups[-1]
        else:
            group = _Group(self._tail_base, False, pos, last_index, first)
            groups.append(group)
        interval = self._interval
        if pos + total - last_index > interval:
            # Index entries where append adds them: at each record that starts at least
            # ``interval`` bytes after the previous entry.
            starts = list(accumulate(sizes, initial=pos))
            i = bisect.bisect_left(starts, last_index + interval, 0, n)
            while i < n:
                last_index = starts[i]
                group.index.append((first + i, last_index))
                i = bisect.bisect_left(starts, last_index + interval, i + 1, n)
            group.last_index_pos = self._tail_last_index_pos = last_index
        group.chunks.append(data)
        group.nbytes += total
        group.end_offset = first + n
        if ts > group.max_ts:
            group.max_ts = ts
        self._tail_pos = pos + total
        self._next_offset = first + n
        self._pending_bytes += total
        return True

    def _topic_bytes(self, topic: str) -> bytes:
        encoded = topic.encode("utf-8")
        if len(encoded) > MAX_TOPIC_BYTES:
            raise ValueError(f"topic is {len(encoded)} bytes, more than {MAX_TOPIC_BYTES}")
        if len(self._topics) >= _TOPIC_CACHE_MAX:
            self._topics.clear()
        self._topics[topic] = encoded
        return encoded

    def _refresh_free_budget(self, wanted: int) -> None:
        """Re-read free space; raise DiskFull if ``wanted`` more bytes would cross the floor.

        Called with the append lock held (or before any append).  Free space is read again
        only after the budget is used up, so appends cost no system call.
        """
        floor = self.config.min_free_bytes
        if not floor:
            return
        free = self._free_now(self._pending_bytes + wanted, force=True)
        self._free_budget = free - floor - self._pending_bytes - wanted
        if self._free_budget < 0:
            self._free_budget = 0
            raise DiskFull(
                self.directory,
                f"{free} bytes free, floor is {floor}, {self._pending_bytes + wanted} bytes waiting",
            )

    def _free_now(self, need: int, *, force: bool = False) -> int:
        """Free bytes on the log's file system, without a statfs per commit: the last reading
        less what this log wrote since, read again when ``force``, when the last reading is
        FREE_RECHECK_S old, or when the estimate less ``need`` comes within FREE_SLACK of the
        floor (near the floor every commit reads it). The estimate only errs low for this log's
        own writes (space freed by retention shows at the next reading); another process filling
        the disk shows within FREE_RECHECK_S, and a write that meets a full disk fails anyway
        (ENOSPC: the batch is not acknowledged)."""
        now = time.monotonic()
        free = self._free_seen - self._written_since
        if force or now - self._free_seen_at >= FREE_RECHECK_S or \
                free - need - self.config.min_free_bytes < FREE_SLACK:
            free = self._free_seen = self.fileio.free_bytes(self.directory)
            self._free_seen_at, self._written_since = now, 0
        return free

    # -- writing -------------------------------------------------------------------------

    def take_batch(self) -> Batch | None:
        """Swap out everything appended so far (None if nothing).  Cheap; call then :meth:`write_batch`."""
        with self._lock:
            groups = self._groups
            if not groups:
                return None
            self._groups = []
            nbytes = self._pending_bytes
            self._pending_bytes = 0
            self._writing_bytes = nbytes
            first = groups[0].first_offset
            return Batch(groups, first, self._next_offset, nbytes)

    def write_batch(self, batch: Batch, sync: bool) -> None:
        """Write ``batch`` (rolling and sealing segments as needed), fdatasync if ``sync``,
        then advance :attr:`committed_offset` past it.

        On any error (DiskFull, OSError) every byte of the batch is removed again, files and
        segments created for it are deleted, the error is raised, and the caller must call
        :meth:`discard_pending` (records appended meanwhile carry offsets that no longer follow).
        """
        with self._write_lock:
            if self._broken:
                raise SegmentError(str(self.directory), self._broken)
            floor = self.config.min_free_bytes
            if floor:
                with self._lock:
                    free = self._free_now(batch.nbytes)
                if free - batch.nbytes < floor:
                    raise DiskFull(self.directory, f"{free} bytes free, floor is {floor}, batch is {batch.nbytes}")
            original = self._segments[-1]
            undo = (original.size, original.next_offset, original.max_timestamp_us,
                    original.last_index_position)
            created: list[Segment] = []
            sealed: list[Segment] = []
            active = original
            try:
                for group in batch.groups:
                    if group.new_segment:
                        active.seal_now()
                        sealed.append(active)
                        active = Segment.create(self.directory, group.base_offset, self.fileio)
                        created.append(active)
                    chunks = group.chunks
                    active.write(chunks[0] if len(chunks) == 1 else b"".join(chunks), group.start_pos)
                    active.next_offset = group.end_offset
                    if group.max_ts > active.max_timestamp_us:
                        active.max_timestamp_us = group.max_ts
                    index = active.index
                    assert index is not None
                    for offset, position in group.index:
                        index.add(offset, position)
                    active.last_index_position = group.last_index_pos
                if sync:
                    self._datasync(active)
                else:
                    self._dirty = True
            except BaseException:
                self._undo_write(original, undo, created)
                raise
            if created:
                self._set_segments(self._segments + created)
            for segment in sealed:
                # Its index is on disk now; keeping every sealed index would grow with the log.
                segment.release_index()
            self._committed_offset = batch.end_offset
            self._writing_bytes = 0
            self.stats.appended += batch.end_offset - batch.first_offset
            if floor:
                with self._lock:
                    self._written_since += batch.nbytes
                    # Read again near the floor: the file system spends more than nbytes (blocks,
                    # index entries, new segment files), which only a reading shows.
                    self._free_budget = self._free_now(0) - floor - self._pending_bytes

    def _undo_write(self, original: Segment, undo: tuple[int, int, int, int], created: list[Segment]) -> None:
        log.error("%s: write failed; removing the partial batch (offsets from %d)", self.directory, undo[1])
        try:
            for segment in created:
                segment.delete()
            original.unseal()
            original.cut(*undo)
            # Make the cut durable before anything is written over it: otherwise a power cut
            # could bring back bytes of the failed batch, under offsets that are reused next.
            original.handle.datasync()
            self.fileio.fsync_dir(self.directory)
        except OSError as exc:
            # Files and memory now disagree; writing on would interleave reused offsets with
            # the leftovers.  Refuse further writes: reopening runs recovery, which cleans up.
            self._broken = f"could not undo a failed write ({exc}); reopen the log to recover"
            log.exception("%s: %s", self.directory, self._broken)

    def discard_pending(self) -> int:
        """After a failed :meth:`write_batch`: drop all buffered records; the next append
        reuses the first uncommitted offset.  Returns how many records were dropped."""
        with self._lock:
            dropped = self._next_offset - self._committed_offset
            tail = self._segments[-1]
            self._groups = []
            self._pending_bytes = 0
            self._writing_bytes = 0
            self._next_offset = self._committed_offset
            self._tail_base = tail.base_offset
            self._tail_pos = tail.size
            self._tail_last_index_pos = tail.last_index_position
        if dropped:
            log.warning("%s: dropped %d records of a failed commit", self.directory, dropped)
        return dropped

    def _datasync(self, segment: Segment) -> None:
        started = time.perf_counter()
        segment.handle.datasync()
        self.stats.fsyncs += 1
        self.stats.fsync_seconds_total += time.perf_counter() - started
        self._dirty = False

    def flush(self) -> None:
        """Write buffered records to the OS (rolling segments as needed) and make them readable.

        On failure the buffered records are dropped (none of them readable) and the error raised.
        """
        self._write(sync=False)

    def sync(self) -> None:
        """:meth:`flush`, then fdatasync the active segment: everything appended before is durable."""
        self._write(sync=True)

    def _write(self, sync: bool) -> None:
        batch = self.take_batch()
        if batch is None:
            if sync:
                self.datasync()
            return
        try:
            self.write_batch(batch, sync)
        except BaseException:
            self.discard_pending()
            raise

    def datasync(self) -> None:
        """fdatasync what :meth:`write_batch` wrote without syncing (no-op if nothing)."""
        with self._write_lock:
            if self._dirty and not self._closed:
                self._datasync(self._segments[-1])

    # -- reading -------------------------------------------------------------------------

    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> list[Record]:
        """Records with offsets >= ``offset`` and < :attr:`committed_offset`, in order.

        At most ``max_records``; at most ``max_bytes`` framed bytes except that one record is
        always returned if any is available.  Offsets lost to corruption or retention are
        simply absent; corrupt records are skipped, logged once and counted in :attr:`stats`.
        """
        with self._delete_lock:
            return self._read(offset, max_records, max_bytes)

    def _read(self, offset: int, max_records: int, max_bytes: int) -> list[Record]:
        limit = self._committed_offset
        segments, bases = self._segments, self._bases
        offset = max(offset, segments[0].base_offset)
        out: list[Record] = []
        if offset >= limit or max_records <= 0:
            return out
        total = 0
        i = max(bisect.bisect_right(bases, offset) - 1, 0)
        while i < len(segments):
            segment = segments[i]
            i += 1
            if segment.next_offset <= offset:
                continue
            start = self._index_of(segment).lookup(offset)
            pos, expected, total, full = segment.read_run(start, offset, limit, out, max_records, max_bytes, total)
            if full:
                return out
            if pos >= segment.size:
                continue
            # The bytes at ``pos`` are not the next valid record: the general walk reports
            # the bad spot, resyncs and reads on (the slow path, only after damage).
            max_offset = segment.next_offset if segment.sealed else limit
            walk = segment.walk(pos, segment.size, expected if expected >= 0 else None,
                                resync=True, max_offset=max_offset)
            for frame in walk:
                if frame.framed <= 0:
                    if segment.note_corrupt(frame):
                        self.stats.corrupt_skipped += 1
                    continue
                if frame.offset >= limit:
                    return out
                if frame.offset < offset:
                    continue
                if out and total + frame.framed > max_bytes:
                    return out
                out.append(decode_at(frame.buf, frame.rel, frame.framed))
                total += frame.framed
                if len(out) >= max_records:
                    return out
        return out

    def _index_of(self, segment: Segment) -> SparseIndex:
        """The segment's index, loading a sealed one and keeping at most
        ``index_cache_segments`` sealed ones loaded (caller holds ``_delete_lock``)."""
        index = segment.index
        if segment.seal is None and index is not None:
            return index  # the active segment: always in memory
        hot = self._hot_indexes
        if index is None:
            index = segment.ensure_index(self._interval)
        hot[segment] = None
        hot.move_to_end(segment)
        while len(hot) > self.config.index_cache_segments:
            cold, _ = hot.popitem(last=False)
            cold.release_index()
        return index

    def loaded_indexes(self) -> int:
        """How many segments have their sparse index in memory now (the active one included)."""
        return sum(1 for s in self._segments if s.index is not None)

    def scan(self, offset: int = 0) -> Iterator[ScannedRecord]:
        """Every record from ``offset`` on (up to :attr:`committed_offset`), and every corrupt spot.

        For ``filemq inspect`` / ``verify``: CRC-checks every byte; does not change stats.
        Do not run :meth:`enforce_retention` while a scan is being iterated.
        """
        limit = self._committed_offset
        for segment in self._segments:
            if segment.next_offset <= offset:
                continue
            name = segment.log_path.name
            max_offset = segment.next_offset if segment.sealed else limit
            for frame in segment.walk(0, segment.size, None, resync=True, max_offset=max_offset):
                if frame.framed <= 0:
                    length = 0
                    if len(frame.buf) - frame.rel >= LENGTH_SIZE:
                        length = LENGTH.unpack_from(frame.buf, frame.rel)[0] + LENGTH_SIZE
                    yield ScannedRecord(None, name, frame.position, length, False)
                    continue
                if frame.offset >= limit:
                    return
                if frame.offset >= offset:
                    record = decode_at(frame.buf, frame.rel, frame.framed)
                    yield ScannedRecord(record, name, frame.position, frame.framed, True)

    # -- retention and introspection -----------------------------------------------------

    def enforce_retention(self, min_needed_offset: int | None = None) -> RetentionReport:
        """Delete whole sealed segments, oldest first, past ``retention_ms`` (by the newest
        timestamp in the segment) or while the log exceeds ``retention_bytes``.

        Age never deletes a segment holding offsets >= ``min_needed_offset``; the byte cap
        does if it must, and then the dropped range is counted in the report and in
        ``stats.dropped_by_retention`` and logged as a WARNING.  The active segment is never deleted.
        """
        cfg = self.config
        with self._write_lock:
            segments = self._segments
            total = sum(s.size for s in segments)
            now_us = time.time_ns() // 1000
            doomed: list[Segment] = []
            for segment in segments[:-1]:
                over_bytes = cfg.retention_bytes is not None and total > cfg.retention_bytes
                too_old = (
                    cfg.retention_ms is not None
                    and segment.max_timestamp_us < now_us - cfg.retention_ms * 1000
                )
                needed = min_needed_offset is not None and segment.next_offset > min_needed_offset
                if not (over_bytes or (too_old and not needed)):
                    break
                doomed.append(segment)
                total -= segment.size
            report = RetentionReport(first_offset=self.first_offset)
            if not doomed:
                return report
            with self._delete_lock:
                self._set_segments(segments[len(doomed):])
                for segment in doomed:
                    self._hot_indexes.pop(segment, None)
                    segment.delete()
            for segment in doomed:
                report.segments_deleted += 1
                report.bytes_deleted += segment.size
                report.records_deleted += segment.next_offset - segment.base_offset
            self.fileio.fsync_dir(self.directory)
            report.first_offset = self.first_offset
            if min_needed_offset is not None and report.first_offset > min_needed_offset:
                low = max(min_needed_offset, doomed[0].base_offset)
                report.dropped_range = (low, report.first_offset)
                report.dropped_needed = report.first_offset - low
                self.stats.dropped_by_retention += report.dropped_needed
                log.warning(
                    "%s: retention_bytes=%s forced deletion of needed offsets [%d, %d) (%d records)",
                    self.directory, cfg.retention_bytes, low, report.first_offset, report.dropped_needed,
                )
            log.info("%s: retention deleted %s", self.directory, report)
            return report

    def size_bytes(self) -> int:
        """Bytes of all segment files (records only; index and seal files are not counted)."""
        return sum(s.size for s in self._segments)

    def segments(self) -> list[SegmentInfo]:
        return [SegmentInfo(s.base_offset, s.log_path, s.size, s.sealed, s.next_offset) for s in self._segments]

    def close(self) -> None:
        """Flush, sync and close every file.  Later appends raise SegmentError."""
        if self._closed:
            return
        try:
            self.sync()
        finally:
            with self._write_lock, self._lock:
                self._closed = True
                for segment in self._segments:
                    segment.close()

    def __enter__(self) -> Log:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Log({str(self.directory)!r}, offsets [{self.first_offset}, {self._next_offset}))"


__all__ = [
    "Batch", "Log", "LogConfig", "LogStats", "RecoveryReport", "RetentionReport",
    "ScannedRecord", "SegmentInfo",
]
