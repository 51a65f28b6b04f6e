"""A consumer group: one reader of the log with its own Doing/Pending offsets and redelivery.

What a caller may rely on:

* **At-least-once.** Every record whose topic matches the group's filters is handed out by
  :meth:`ConsumerGroup.fetch` until it is acked. After a restart the group resumes from
  *Pending* (the lowest offset not yet acked when offsets were last persisted), so every
  record not acked by then is delivered again; nothing is ever skipped to recover from a
  damaged offset file (see :meth:`ConsumerGroup.load`).
* **One consumer at a time.** Within a group a record is in flight with at most one consumer;
  :meth:`nack` and :meth:`release` put records back for redelivery (lowest offset first,
  before any new record). Several groups each receive every record (broadcast).
* ``pending_offset`` is always the lowest offset not yet acked, whatever order acks arrive in;
  records whose topic does not match the filters count as acked.
* **Batched persistence.** :meth:`ack` only touches memory; :meth:`maybe_persist` writes the
  offset files when at least ``persist_every_acks`` acks arrived or ``persist_interval_ms``
  elapsed since the last write; :meth:`persist` forces it and :meth:`close` calls it. So a
  crash re-delivers at most the records acked since the last write (the DUP flag is set on
  them, see :meth:`redelivered`). A group whose acks the queue's progress journal records
  (:meth:`report_progress_to`) is rewritten on ``journaled_persist_interval_ms`` alone: the
  journal, not the files, then bounds what a crash re-delivers.
* Non-durable groups (MQTT clean sessions) write nothing and start at the log's end.

On disk, per durable group: ``<groups>/<escaped name>/doing``, ``.../pending`` (offset files,
:mod:`filemq.queue.offsets`) and ``.../group.json`` (name, filters, created), each replaced with
:func:`segments.fileio.atomic_write`. :func:`escape_group_name` makes any client id or share
name a safe, case-insensitively unique directory name.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from filemq.common.native import mypyc_attr
from filemq.common.topics import topic_matches, validate_topic_filter
from filemq.queue.offsets import OffsetFile
from segments.fileio import OS_FILE_IO, FileIO, atomic_write
from segments.log import LogView
from segments.record import record_topic

if TYPE_CHECKING:
    from segments import Record

log = logging.getLogger(__name__)

GROUP_FILE = "group.json"
DOING_FILE = "doing"
PENDING_FILE = "pending"
DROPPED_SUFFIX = ".dropped"
GROUP_FORMAT = 1

_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")
_MAX_PLAIN_ESCAPED = 120  # longer escaped names are shortened with a hash (NAME_MAX is 255)
_MATCH_CACHE_SIZE = 4096
_MIN_READ = 256  # records per log read in fetch, however few are wanted

Start = Literal["earliest", "latest"]


class InvalidGroupName(ValueError):
    """A consumer-group name that cannot be stored (only the empty name)."""


class CorruptGroup(ValueError):
    """A group directory whose group.json is unreadable and whose name cannot be recovered."""

    def __init__(self, directory: str, reason: str) -> None:
        super().__init__(f"consumer group directory {directory}: {reason}")
        self.directory = directory
        self.reason = reason


@mypyc_attr(native_class=False)
class GroupClosed(RuntimeError):
    """The group was closed or dropped; ``name`` says which."""

    def __init__(self, name: str) -> None:
        super().__init__(f"consumer group {name!r} is closed")
        self.name = name


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """How often a group writes its offsets (never once per ack: a write costs ~0.4 ms)."""

    persist_every_acks: int = 1000
    persist_interval_ms: int = 100
    # A group whose acks the queue's progress journal makes durable (report_progress_to)
    # rewrites its offset files at most this often, whatever the ack count: a crash then
    # re-delivers only what the journal lacks, not what the files lack (docs/DURABILITY.md).
    journaled_persist_interval_ms: int = 1000


def escape_group_name(name: str) -> str:
    """A file-system-safe directory name for ``name``, the same on every call.

    Lower-case ASCII letters, digits, ``_`` and ``-`` stay; every other UTF-8 byte becomes
    ``%XX`` (upper-case hex). So the result never contains ``/``, ``.``, NUL or upper-case
    letters outside escapes, which makes it unique even on case-insensitive file systems
    (FAT/exFAT SD cards). Names whose escaped form would exceed 120 characters become
    ``<first 80 escaped chars>~<32 hex of SHA-256>`` (``~`` never appears otherwise).
    """
    if not name:
        raise InvalidGroupName("a consumer group name must not be empty")
    out: list[str] = []
    for ch in name:
        if ch in _SAFE:
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
    escaped = "".join(out)
    if len(escaped) <= _MAX_PLAIN_ESCAPED:
        return escaped
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return escaped[:80] + "~" + digest


def unescape_group_name(escaped: str) -> str | None:
    """The name :func:`escape_group_name` turned into ``escaped``, or None if not recoverable."""
    if "~" in escaped:
        return None  # hashed long name: group.json is the only record of it
    raw = bytearray()
    i = 0
    try:
        while i < len(escaped):
            ch = escaped[i]
            if ch == "%":
                raw.append(int(escaped[i + 1 : i + 3], 16))
                i += 3
            else:
                raw.extend(ch.encode("ascii"))
                i += 1
        name = raw.decode("utf-8", "surrogatepass")
    except (ValueError, IndexError):
        return None
    return name if name and escape_group_name(name) == escaped else None


# Value of an outstanding offset waiting for redelivery (no consumer holds it). MQTT strings
# cannot contain U+0000, so no client id or share name can be equal to it.
_WAITING = "\x00"


@dataclass(frozen=True, slots=True)
class OffsetSnapshot:
    """Offsets taken on the event-loop thread, to be written elsewhere by :meth:`write_snapshot`."""

    pending: int
    doing: int


@dataclass(slots=True)
class GroupStats:
    delivered: int = 0  # records handed out, redeliveries included
    redelivered: int = 0  # of which redeliveries (nack, release, or after a restart)
    acked: int = 0
    skipped: int = 0  # records whose topic did not match the filters
    missing: int = 0  # offsets absent from the log (dropped by retention or corrupt)
    persists: int = 0  # offset-file writes (a persist writes up to two files)


class ConsumerGroup:
    """A group of consumers sharing one position in the log. Not thread-safe: use it from one
    thread (the event loop); only :meth:`write_snapshot` may run on another thread."""

    def __init__(
        self,
        name: str,
        log_view: LogView,
        *,
        filters: Sequence[str] = ("#",),
        start_offset: int,
        durable: bool = True,
        directory: Path | None = None,
        redelivered_below: int = 0,
        persisted: OffsetSnapshot | None = None,
        created: str | None = None,
        config: GroupConfig | None = None,
        fileio: FileIO = OS_FILE_IO,
    ) -> None:
        """Prefer :meth:`create` and :meth:`load`, which also handle the files."""
        if durable and directory is None:
            raise ValueError(f"durable consumer group {name!r} needs a directory")
        self.name = name
        self.durable = durable
        self.directory = directory
        # Its key in the progress journal (the directory's name; read per journal append).
        self.journal_key = directory.name if directory is not None else ""
        self.created = created or datetime.now(UTC).isoformat(timespec="seconds")
        self.config = config or GroupConfig()
        self._stats = GroupStats()
        self._log = log_view
        self._fileio = fileio
        self._filters: tuple[str, ...] = ()
        self._match_all = False
        self._match_cache: dict[str, bool] = {}
        self._matching: set[str] = set()  # the topics of _match_cache that match (one C subset test per run)
        self._set_filters_in_memory(filters)
        self._doing = start_offset
        # Offsets below this were possibly handed out before a restart: flag them DUP.
        self._redelivered_below = redelivered_below
        # Fetched, not yet acked: offset -> consumer holding it (or _WAITING). Records are
        # not kept: a redelivery reads the log again, so memory does not grow with the window.
        # Its keys are in ascending order: a key is only ever added by fetch(), at an offset
        # beyond every earlier one (doing_offset never goes back), and a dict keeps insertion
        # order; so its first key is the pending offset (no ordered copy of the offsets).
        self._outstanding: dict[int, str] = {}
        self._again: set[int] = set()  # outstanding offsets delivered more than once
        self._redeliver: list[int] = []  # heap of offsets waiting for redelivery
        # What the last fetch() knew of the list it returned, so a caller need not find it out
        # again record by record: when that list (``last_run``, compared by identity) is the
        # gap-free offsets [run_start, run_start + len) read in one piece, run_start and the
        # set of its topics (run_topics); otherwise run_start is -1.
        self.last_run: list[Record] | None = None
        self.run_start = -1
        self.run_topics: frozenset[str] = frozenset()
        self._acks = 0
        self._acks_at_persist = 0
        self._last_persist = time.monotonic()
        self._persisted = persisted or OffsetSnapshot(-1, -1)
        self.journaled = (-1, -1)  # (pending, doing) last appended to the progress journal
        self.progress_dirty = False  # acked since the queue last journaled this group
        self._dirty_sink: set[ConsumerGroup] | None = None
        self._write_lock = threading.Lock()
        self._closed = False
        self._dropped = False
        # The last write_snapshot failed (a full disk): the queue logs the next failures quietly.
        self.persist_failing = False
        if durable:
            assert directory is not None
            self._pending_file = OffsetFile(directory / PENDING_FILE, fileio)
            self._doing_file = OffsetFile(directory / DOING_FILE, fileio)

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        name: str,
        log_view: LogView,
        groups_dir: Path | None,
        *,
        filters: Sequence[str] = ("#",),
        durable: bool = True,
        start: Start | int = "latest",
        config: GroupConfig | None = None,
        fileio: FileIO = OS_FILE_IO,
    ) -> ConsumerGroup:
        """A new group starting at ``start`` (``"latest"``: the log's next offset).

        A durable group's files are written before this returns, offsets first and
        group.json last, so a crash mid-way leaves a directory :meth:`load` can still use.
        An existing directory of the same name is overwritten: callers load groups first.
        """
        if start == "earliest":
            offset = log_view.first_offset
        elif start == "latest":
            offset = log_view.next_offset
        else:
            offset = max(log_view.first_offset, min(int(start), log_view.next_offset))
        directory = None
        if durable:
            if groups_dir is None:
                raise ValueError(f"durable consumer group {name!r} needs a groups directory")
            directory = groups_dir / escape_group_name(name)
            os.makedirs(directory, exist_ok=True)
            fileio.fsync_dir(groups_dir)
        group = cls(
            name,
            log_view,
            filters=filters,
            start_offset=offset,
            durable=durable,
            directory=directory,
            config=config,
            fileio=fileio,
        )
        if durable:
            group.persist()
            group._write_group_file()
        log.info("created consumer group %r at offset %d (durable=%s)", name, offset, durable)
        return group

    @classmethod
    def load(
        cls,
        directory: Path,
        log_view: LogView,
        *,
        config: GroupConfig | None = None,
        fileio: FileIO = OS_FILE_IO,
        journaled: tuple[int, int] | None = None,
    ) -> ConsumerGroup:
        """Reopen a durable group from ``directory``; resumes at Pending (doing := pending).

        ``journaled``: (Pending, Doing) replayed from the queue's progress journal
        (:class:`filemq.queue.offsets.ProgressJournal`); each is used where it is ahead of the file's.

        The safe side is always taken, never the one that skips records:

        * Pending missing or damaged: resume at the log's ``first_offset`` (every record
          still on disk is delivered again). Doing is *not* used: it may be ahead of records
          that were never acked.
        * Pending below ``first_offset`` (retention dropped records): resume at
          ``first_offset``, logged as WARNING. Pending beyond ``next_offset`` (the log lost
          its unsynced tail, e.g. under ``fsync = "never"``): resume at ``next_offset``.
        * group.json damaged: the name is recovered from the directory name and the filters
          default to ``("#",)`` until the owner sets them again; if the name cannot be
          recovered (hashed long name) :class:`CorruptGroup` is raised.
        """
        info = read_group_file(directory)
        if info is None:
            name = unescape_group_name(directory.name)
            if name is None:
                raise CorruptGroup(str(directory), "group.json missing or damaged and the name is not recoverable from the directory name")
            log.warning("consumer group %r: %s missing or damaged; filters reset to '#'", name, directory / GROUP_FILE)
            filters: Sequence[str] = ("#",)
            created = None
        else:
            name, filters, created = info
        first, end = log_view.first_offset, log_view.next_offset
        pending_file = OffsetFile(directory / PENDING_FILE, fileio)
        doing_file = OffsetFile(directory / DOING_FILE, fileio)
        pending = pending_file.read()
        doing = doing_file.read()
        on_disk = OffsetSnapshot(pending if pending is not None else -1, doing if doing is not None else -1)
        if journaled is not None:
            # Acked progress written after the offset files (a Pending too: never past an unacked record).
            if pending is None or journaled[0] > pending:
                pending = journaled[0]
            if doing is None or journaled[1] > doing:
                doing = journaled[1]
        if pending is None:
            log.warning(
                "consumer group %r: Pending offset file %s unusable; re-delivering from the log's first offset %d",
                name, pending_file.path, first,
            )
            start = first
        elif pending < first:
            log.warning(
                "consumer group %r: Pending %d is below the log's first offset %d; offsets %d..%d were dropped by retention",
                name, pending, first, pending, first - 1,
            )
            start = first
        elif pending > end:
            log.warning(
                "consumer group %r: Pending %d is beyond the log's end %d (log lost its unsynced tail); resuming at %d",
                name, pending, end, end,
            )
            start = end
            # Rewrite it now: persists never move Pending backwards, so the stale value would
            # stay on disk and, once new records reuse those offsets, skip them at next restart.
            pending_file.write(end)
            pending = end
            on_disk = OffsetSnapshot(end, on_disk.doing)
        else:
            start = pending
        # Records between Pending and the last persisted Doing were handed out before.
        redelivered_below = max(start, min(doing, end)) if doing is not None else start
        group = cls(
            name,
            log_view,
            filters=filters,
            start_offset=start,
            durable=True,
            directory=directory,
            redelivered_below=redelivered_below,
            persisted=on_disk,
            created=created,
            config=config,
            fileio=fileio,
        )
        log.info("loaded consumer group %r at offset %d (first %d, end %d)", name, start, first, end)
        return group

    # ---- reading -------------------------------------------------------------------------

    @property
    def reader(self) -> LogView:
        """Where :meth:`fetch` reads records (the log, unless :meth:`use_reader` changed it)."""
        return self._log

    def use_reader(self, reader: LogView) -> None:
        """Read through ``reader`` from now on, e.g. a cache in front of the same log.

        ``reader`` must serve the log this group was created or loaded on (same offsets,
        same records): offsets, outstanding records and redeliveries are kept as they
        are, so a reader of another log would hand out wrong records.
        """
        self._log = reader

    # ---- filters -------------------------------------------------------------------------

    @property
    def filters(self) -> tuple[str, ...]:
        return self._filters

    def set_filters(self, filters: Sequence[str]) -> None:
        """Replace the filters (validated); durable groups rewrite group.json atomically.

        Only records fetched from now on are filtered with the new set.
        """
        self._set_filters_in_memory(filters)
        if self.durable:
            self._write_group_file()

    def _set_filters_in_memory(self, filters: Sequence[str]) -> None:
        if isinstance(filters, str):
            filters = (filters,)
        unique = tuple(dict.fromkeys(filters))
        for f in unique:
            validate_topic_filter(f)
        self._filters = unique
        self._match_all = "#" in unique
        self._match_cache = {}
        self._matching = set()

    def matches(self, topic: str) -> bool:
        """True if a record on ``topic`` is delivered by this group."""
        if self._match_all and topic[:1] != "$":
            if len(self._matching) < _MATCH_CACHE_SIZE:
                self._matching.add(topic)
            return True
        cached = self._match_cache.get(topic)
        if cached is None:
            cached = any(topic_matches(f, topic) for f in self._filters)
            if len(self._match_cache) >= _MATCH_CACHE_SIZE:
                self._match_cache.clear()  # bounded memory with unbounded distinct topics
                self._matching.clear()
            self._match_cache[topic] = cached
            if cached:
                self._matching.add(topic)
        return cached

    def _write_group_file(self) -> None:
        assert self.directory is not None
        body = {"format": GROUP_FORMAT, "name": self.name, "filters": list(self._filters), "created": self.created}
        data = json.dumps(body, ensure_ascii=True, indent=1).encode("ascii") + b"\n"
        atomic_write(self.directory / GROUP_FILE, data, self._fileio)

    # ---- offsets ---------------------------------------------------------------------------

    @property
    def doing_offset(self) -> int:
        """The next offset :meth:`fetch` reads from the log."""
        return self._doing

    @property
    def pending_offset(self) -> int:
        """The lowest offset not yet acked (== doing_offset when nothing is outstanding)."""
        for offset in self._outstanding:
            return offset  # (the first key: the lowest, see __init__)
        return self._doing

    @property
    def lag(self) -> int:
        """Records committed to the log and not yet acked (filtered-out ones included)."""
        return max(0, self._log.committed_offset - self.pending_offset)

    @property
    def persisted(self) -> OffsetSnapshot:
        """The offsets last written to disk (-1: never written)."""
        return self._persisted

    @property
    def stats(self) -> GroupStats:
        """Counters since this group object was created (not persisted)."""
        self._stats.acked = self._acks  # counted outside the dataclass: ack() is the hot path
        return self._stats

    def in_flight(self, consumer: str | None = None) -> int:
        """Records handed out and not acked, for one consumer or (None) for all."""
        if consumer is None:
            return sum(1 for c in self._outstanding.values() if c != _WAITING)
        return sum(1 for c in self._outstanding.values() if c == consumer)

    def has_work(self) -> bool:
        """True if :meth:`fetch` might return something now."""
        return bool(self._redeliver) or self._doing < self._log.committed_offset

    # ---- delivery ------------------------------------------------------------------------

    def fetch(self, max_records: int = 100, consumer: str = "") -> list[Record]:
        """Up to ``max_records`` records for ``consumer``: redeliveries first, then new ones.

        Returned records are in flight with ``consumer`` until :meth:`ack`, :meth:`nack` or
        :meth:`release`. Records whose topic does not match the filters are skipped and
        count as acked. Never blocks and reads a bounded number of records per call, so an
        empty list with :meth:`has_work` still True means: call again.
        """
        if self._closed:
            raise GroupClosed(self.name)
        out: list[Record] = []
        run_start = -1
        run_topics: frozenset[str] = frozenset()
        stats = self._stats
        outstanding = self._outstanding
        if self._redeliver:
            self._take_redeliveries(out, max_records, consumer)
        first_new = len(out)
        remaining = max_records - first_new
        read = self._log.read
        match_all = self._match_all
        # Bound the work of one call (it runs on the event loop) when few records match.
        scan_budget = max(16 * max_records, 16384)
        least = 0  # records per read: just what is wanted until some record was skipped
        while remaining > 0 and scan_budget > 0:
            doing = self._doing
            committed = self._log.committed_offset
            if doing >= committed:
                break
            # Once a record was skipped, read at least a modest batch: with a narrow filter
            # most records are skipped, and one read() per wanted record would cost an index
            # lookup each.
            records = read(doing, max(remaining, least))
            if not records:
                if committed > doing:
                    # read() returns a record whenever one is readable below its limit
                    # (>= ours), so [doing, committed) holds only corrupt records: move on.
                    self._note_missing(doing, committed)
                    self._doing = committed
                break
            batch = records if len(records) <= remaining else records[:remaining]
            n = len(batch)
            if batch[0].offset == doing and batch[-1].offset == doing + n - 1:
                topics = frozenset(map(record_topic, batch))
                if topics <= self._matching or all(map(self.matches, topics)):
                    # Fast path (the common case): gap-free and every topic matches, so the
                    # bookkeeping runs in C over the whole batch.
                    fresh = dict.fromkeys(range(doing, doing + n), consumer)
                    outstanding.update(fresh)
                    if not out:
                        run_start = doing
                        run_topics = topics
                    else:
                        run_start = -1  # (after redeliveries, or a second piece)
                    out.extend(batch)
                    self._doing = doing + n
                    remaining -= n
                    scan_budget -= n
                    continue
            run_start = -1
            least = _MIN_READ
            scanned = 0
            for record in records:
                if not remaining:
                    break  # records read beyond what was asked for stay unconsumed
                scanned += 1
                offset = record.offset
                if offset != doing:
                    self._note_missing(doing, offset)
                doing = offset + 1
                topic = record.topic
                if (match_all and topic[:1] != "$") or self.matches(topic):
                    outstanding[offset] = consumer
                    out.append(record)
                    remaining -= 1
                else:
                    stats.skipped += 1
            self._doing = doing
            scan_budget -= scanned
        below = self._redelivered_below
        if len(out) > first_new and out[first_new].offset < below:
            # New to this process but possibly handed out before the restart.
            stats.redelivered += sum(1 for r in out[first_new:] if r.offset < below)
        stats.delivered += len(out)
        self.last_run = out
        self.run_start = run_start
        self.run_topics = run_topics
        return out

    def _take_redeliveries(self, out: list[Record], max_records: int, consumer: str) -> None:
        heap = self._redeliver
        outstanding = self._outstanding
        while heap and len(out) < max_records:
            offset = heapq.heappop(heap)
            if outstanding.get(offset) != _WAITING:
                continue  # acked while waiting, or already handed out again
            found = self._log.read(offset, 1)
            if not found or found[0].offset != offset:
                # Gone since it was first delivered (retention under a byte cap, or damage).
                del outstanding[offset]
                self._note_missing(offset, offset + 1)
                continue
            outstanding[offset] = consumer
            self._again.add(offset)
            self._stats.redelivered += 1
            out.append(found[0])

    def _note_missing(self, expected: int, got: int) -> None:
        if got < expected:
            raise AssertionError(f"log returned offset {got} before requested {expected}")
        self._stats.missing += got - expected
        log.warning(
            "consumer group %r: offsets %d..%d are not in the log (dropped by retention or corrupt); skipped",
            self.name, expected, got - 1,
        )

    def ack(self, offset: int) -> bool:
        """Mark ``offset`` done (any order). False if it was not outstanding (duplicate ack)."""
        outstanding = self._outstanding
        if outstanding.pop(offset, None) is None:
            return False
        self._acks += 1
        if not self.progress_dirty:
            self._mark_progress()
        if self._again:
            self._again.discard(offset)
        return True

    def ack_many(self, offsets: Sequence[int]) -> int:
        """:meth:`ack` of each of ``offsets`` (any order, duplicates counted once), with the
        bookkeeping done once for the batch; returns how many were outstanding."""
        outstanding = self._outstanding
        before = len(outstanding)
        deque(map(outstanding.pop, offsets, repeat(None)), maxlen=0)  # (consumed in C)
        acked = before - len(outstanding)
        if not acked:
            return 0
        self._acks += acked
        if not self.progress_dirty:
            self._mark_progress()
        if self._again:
            self._again.difference_update(offsets)
        return acked

    def may_be_redelivered(self, lowest: int) -> bool:
        """False when :meth:`redelivered` is False for every outstanding offset >= ``lowest``
        (one test for a batch instead of one call per record)."""
        return bool(self._again) or lowest < self._redelivered_below

    def _mark_progress(self) -> None:
        """The first ack since :attr:`progress_dirty` was cleared: note it, and tell the
        queue's progress journal (:meth:`report_progress_to`), once per clearing."""
        self.progress_dirty = True
        if self._dirty_sink is not None:
            self._dirty_sink.add(self)

    def report_progress_to(self, sink: set[ConsumerGroup]) -> None:
        """Add this group to ``sink`` at its first ack after :attr:`progress_dirty` was
        cleared (the queue's progress journal then looks at these groups only)."""
        self._dirty_sink = sink

    def nack(self, offset: int) -> bool:
        """Give ``offset`` back for redelivery soon (before new records). False if not in flight."""
        holder = self._outstanding.get(offset)
        if holder is None or holder == _WAITING:
            return False
        self._outstanding[offset] = _WAITING
        heapq.heappush(self._redeliver, offset)
        return True

    def release(self, consumer: str) -> int:
        """The consumer is gone: its in-flight records go back for redelivery. Returns how many."""
        mine = [offset for offset, holder in self._outstanding.items() if holder == consumer]
        for offset in mine:
            self._outstanding[offset] = _WAITING
            heapq.heappush(self._redeliver, offset)
        return len(mine)

    def redelivered(self, offset: int) -> bool:
        """True if the outstanding record ``offset`` may have been delivered before (MQTT DUP)."""
        if offset not in self._outstanding:
            return False
        return offset in self._again or offset < self._redelivered_below

    # ---- persistence -----------------------------------------------------------------------

    def needs_persist(self, now: float | None = None) -> bool:
        """True if offsets changed and the ack count or the interval says write them now."""
        if not self.durable or self._closed:
            return False
        if self._dirty_sink is not None:  # journaled: the interval alone
            if now is None:
                now = time.monotonic()
            if (now - self._last_persist) * 1000.0 < self.config.journaled_persist_interval_ms:
                return False
        elif self._acks - self._acks_at_persist < self.config.persist_every_acks:
            if now is None:
                now = time.monotonic()
            if (now - self._last_persist) * 1000.0 < self.config.persist_interval_ms:
                return False
        persisted = self._persisted
        return self.pending_offset != persisted.pending or self._doing != persisted.doing

    def maybe_persist(self, now: float | None = None) -> bool:
        """Write the offsets if :meth:`needs_persist`; True if it wrote. ``now``: time.monotonic()."""
        if not self.needs_persist(now):
            return False
        self.write_snapshot(self.snapshot(now))
        return True

    def persist(self) -> None:
        """Write the offsets now if they changed (durable groups only)."""
        if self.durable:
            self.write_snapshot(self.snapshot())

    def snapshot(self, now: float | None = None) -> OffsetSnapshot:
        """Take the offsets to persist and restart the batching counters (event-loop thread)."""
        self._acks = 0
        self._acks_at_persist = 0
        self._last_persist = time.monotonic() if now is None else now
        return OffsetSnapshot(self.pending_offset, self._doing)

    def write_snapshot(self, snap: OffsetSnapshot) -> None:
        """Write ``snap`` to the offset files; safe to run on a worker thread.

        Doing is written before Pending so the files on disk keep pending <= doing. Offsets
        never move backwards on disk: an older snapshot arriving late is ignored.
        """
        if not self.durable:
            return
        with self._write_lock:
            if self._dropped:
                return
            old = self._persisted
            doing = snap.doing if snap.doing > old.doing else old.doing
            pending = snap.pending if snap.pending > old.pending else old.pending
            if doing != old.doing:
                self._doing_file.write(doing)
                self._stats.persists += 1
            if pending != old.pending:
                self._pending_file.write(pending)
                self._stats.persists += 1
            self._persisted = OffsetSnapshot(pending, doing)

    def close(self) -> None:
        """Persist (durable groups) and refuse further fetches. Idempotent."""
        if self._closed:
            return
        self.persist()
        self._closed = True

    def drop(self) -> None:
        """Close without persisting and delete the group's files (see remove_group_directory)."""
        with self._write_lock:  # waits for a snapshot being written on another thread
            self._closed = True
            self._dropped = True
            if self.durable and self.directory is not None:
                remove_group_directory(self.directory, self._fileio)
        log.info("dropped consumer group %r", self.name)

    def __repr__(self) -> str:
        return (
            f"ConsumerGroup({self.name!r}, doing={self._doing}, pending={self.pending_offset}, "
            f"durable={self.durable}, filters={list(self._filters)!r})"
        )


def read_group_file(directory: Path) -> tuple[str, tuple[str, ...], str | None] | None:
    """(name, filters, created) from ``directory``/group.json, or None if missing or invalid."""
    try:
        raw: Any = json.loads((directory / GROUP_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    name, filters, created = raw.get("name"), raw.get("filters"), raw.get("created")
    if not isinstance(name, str) or not name or not isinstance(filters, list):
        return None
    if not all(isinstance(f, str) for f in filters):
        return None
    try:
        for f in filters:
            validate_topic_filter(f)
    except ValueError:
        return None
    return name, tuple(filters), created if isinstance(created, str) else None


def remove_group_directory(directory: Path, fileio: FileIO = OS_FILE_IO) -> None:
    """Delete a group's files so that a crash at any point never resurrects it.

    The directory is first renamed to ``<name>.dropped`` (atomic, and skipped by
    :func:`group_directories`), then its files are unlinked and the directory removed.
    """
    parent = directory.parent
    tombstone = directory.with_name(directory.name + DROPPED_SUFFIX)
    _purge(tombstone, fileio)  # a drop of the same name interrupted by a crash
    if directory.exists():
        fileio.rename(directory, tombstone)
        fileio.fsync_dir(parent)
        _purge(tombstone, fileio)


def purge_dropped(groups_dir: Path, fileio: FileIO = OS_FILE_IO) -> int:
    """Finish drops interrupted by a crash (``*.dropped`` directories). Returns how many."""
    if not groups_dir.is_dir():
        return 0
    leftovers = [p for p in groups_dir.iterdir() if p.name.endswith(DROPPED_SUFFIX)]
    for tombstone in leftovers:
        _purge(tombstone, fileio)
    return len(leftovers)


def _purge(tombstone: Path, fileio: FileIO) -> None:
    if not tombstone.is_dir():
        return
    for child in tombstone.iterdir():
        fileio.unlink(child)
    # FileIO has no rmdir; an empty directory left by a crash here is harmless (skipped).
    os.rmdir(tombstone)
    fileio.fsync_dir(tombstone.parent)


def group_directories(groups_dir: Path) -> Iterable[Path]:
    """Directories under ``groups_dir`` that hold a group (dropped ones excluded), sorted."""
    if not groups_dir.is_dir():
        return []
    return sorted(
        p for p in groups_dir.iterdir() if p.is_dir() and not p.name.endswith(DROPPED_SUFFIX)
    )
