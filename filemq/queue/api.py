"""The queue: one segment log under ``<data_dir>/log`` plus its consumer groups under ``<data_dir>/groups``.

What a caller may rely on:

* :meth:`Queue.publish` returns only once the record is committed under the log's fsync
  policy (group commit: one fdatasync covers every publish that arrived meanwhile);
  :meth:`Queue.publish_nowait` returns the offset and the shared commit future at once.
* :meth:`Queue.open` loads every durable group found on disk; a group whose directory is
  damaged beyond use is logged (ERROR) and skipped, never fatal.
* While started, a background task writes dirty group offsets (batched, on a worker thread)
  and runs retention with ``min_needed_offset`` = :meth:`Queue.min_pending`, so age-based
  retention never deletes a record some group has not acked. :meth:`Queue.close` persists
  every group, then commits and closes the log.
* Acked progress between two offset-file writes goes to ``groups/progress.journal``
  (:class:`filemq.queue.offsets.ProgressJournal`): :meth:`Queue.journal_progress` appends the
  groups acked into since its last call, the group commit fdatasyncs it, :meth:`Queue.open`
  replays it into the offset files and empties it, housekeeping compacts it past 1 MiB.
* Everything except :meth:`start`, :meth:`close`, :meth:`publish` and
  :meth:`wait_for_records` is a plain method to be called on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from filemq.common.aio import cancel_and_wait
from filemq.common.topics import validate_topic_name
from filemq.queue.groups import (
    ConsumerGroup,
    CorruptGroup,
    GroupConfig,
    OffsetSnapshot,
    Start,
    escape_group_name,
    group_directories,
    purge_dropped,
)
from filemq.queue.offsets import ProgressJournal
from segments import GroupCommitter, Log, LogConfig, RetentionReport
from segments.fileio import OS_FILE_IO, FileIO

log = logging.getLogger(__name__)

LOG_DIR = "log"
GROUPS_DIR = "groups"
JOURNAL_FILE = "progress.journal"  # in the groups directory, see ProgressJournal


@dataclass
class QueueConfig:
    """The log's settings plus how groups persist and how often housekeeping runs."""

    log: LogConfig = field(default_factory=LogConfig)
    group: GroupConfig = field(default_factory=GroupConfig)
    housekeeping_interval_ms: int = 50  # how often dirty groups are checked
    retention_interval_ms: int = 1000  # how often retention runs


class Queue:
    """A log and its consumer groups in one data directory. Use :meth:`open`."""

    def __init__(self, data_dir: Path, log_: Log, config: QueueConfig, fileio: FileIO) -> None:
        self.data_dir = data_dir
        self.groups_dir = data_dir / GROUPS_DIR
        self.log = log_
        self.config = config
        self._fileio = fileio
        self._groups: dict[str, ConsumerGroup] = {}
        self._journal: ProgressJournal | None = None
        self._progress_dirty: set[ConsumerGroup] = set()  # acked since last journaled
        self._committer: GroupCommitter | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self._closed = False
        self.last_retention: RetentionReport | None = None

    @classmethod
    def open(
        cls, data_dir: str | os.PathLike[str], config: QueueConfig | None = None,
        fileio: FileIO | None = None,
    ) -> Queue:
        """Open (creating if needed) ``data_dir``: recover the log, load durable groups."""
        cfg = config or QueueConfig()
        io = fileio if fileio is not None else OS_FILE_IO
        root = Path(data_dir)
        lg = Log.open(root / LOG_DIR, cfg.log, io)
        queue = cls(root, lg, cfg, io)
        if not queue.groups_dir.is_dir():
            os.makedirs(queue.groups_dir)
            # Make the new directory's name durable: losing it would lose every group.
            io.fsync_dir(root)
        purge_dropped(queue.groups_dir, io)
        journal = queue._journal = _open_journal(queue.groups_dir / JOURNAL_FILE, io)
        for directory in group_directories(queue.groups_dir):
            try:
                group = ConsumerGroup.load(directory, lg, config=cfg.group, fileio=io,
                                           journaled=journal.replayed.get(directory.name))
            except CorruptGroup as exc:
                log.error("%s; skipped (run `filemq verify`)", exc)
                continue
            if group.name in queue._groups:
                log.error("two directories hold consumer group %r; using the first, skipping %s", group.name, directory)
                continue
            queue._groups[group.name] = group
            group.report_progress_to(queue._progress_dirty)
        if journal.size:
            queue._compact_journal([(g, g.snapshot()) for g in queue._groups.values() if g.durable])
        journal.replayed.clear()
        log.info("opened queue %s: %r, %d durable groups", root, lg, len(queue._groups))
        return queue

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start group commit and the housekeeping task on the running loop."""
        if self._committer is not None:
            return
        self._committer = GroupCommitter(self.log)
        if self._journal is not None:
            self._committer.add_sync_companion(self._journal.sync, self._journal.needs_sync)
        await self._committer.start()
        self._housekeeping = asyncio.get_running_loop().create_task(
            self._run_housekeeping(), name="filemq-queue-housekeeping"
        )

    async def close(self) -> None:
        """Stop housekeeping, persist every group, commit and close the log. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._housekeeping is not None:
            await cancel_and_wait(self._housekeeping)
        persisted = True
        for group in self._groups.values():
            try:
                group.close()
            except OSError as exc:  # e.g. a full disk: close the rest, keep the journal
                persisted = False
                log.error("could not persist the offsets of consumer group %r at close: %s "
                          "(the progress journal keeps its acked progress)", group.name, exc)
        if self._committer is not None:
            await self._committer.close()
        try:
            self.log.close()
        except OSError as exc:
            log.error("closing the log %s: %s", self.log.directory, exc)
        if self._journal is not None:
            if persisted:
                # Every group was just persisted: the journal holds nothing the files lack.
                with contextlib.suppress(OSError):
                    self._journal.reset()
            self._journal.close()

    async def __aenter__(self) -> Queue:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- publishing ------------------------------------------------------------------------

    def publish_nowait(
        self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
        timestamp_us: int | None = None, *, validated: bool = False, headers: bytes = b"",
    ) -> tuple[int, asyncio.Future[None]]:
        """Append a record; returns its offset and the (shared) future of its commit.

        ``headers``: the message's MQTT 5.0 message properties
        (:func:`filemq.mqtt.properties.encode_message_headers`), stored with the record and
        read back in ``Record.headers``; b"" (none, every 3.1.1 message) stores it as before.

        Raises :class:`filemq.common.topics.InvalidTopic` for a bad topic name, ``RuntimeError``
        before :meth:`start`; the future raises DiskFull/OSError if the commit fails.
        ``validated=True`` skips the topic-name check: only for callers that already
        enforced :func:`filemq.common.topics.validate_topic_name`'s rules (the broker: its MQTT
        decoder and CONNECT handling do), since a wildcard or U+0000 stored in the log
        would break every subscriber's matching.
        """
        if self._committer is None:
            raise RuntimeError(f"queue {self.data_dir} is not started")
        if not validated:
            validate_topic_name(topic)
        return self._committer.append_nowait(topic, payload, qos=qos, retain=retain, timestamp_us=timestamp_us,
                                             headers=headers)

    def publish_many_nowait(
        self, topics: list[str], payloads: list[bytes], retains: list[bool], qos: int, timestamp_us: int,
        headers: list[bytes] | None = None,
    ) -> tuple[int, asyncio.Future[None]]:
        """Append several records, topics already validated (as ``publish_nowait(...,
        validated=True)`` each, in order, all with ``qos`` and ``timestamp_us``; ``headers``
        one per record, or None for none); returns the first one's offset and the commit
        future they share.
        On an error the records before the failing one stay appended (they commit with the
        next batch), the failing one and those after it are not."""
        if self._committer is None:
            raise RuntimeError(f"queue {self.data_dir} is not started")
        return self._committer.append_many_nowait(topics, payloads, retains, qos, timestamp_us, headers)

    async def publish(
        self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
        timestamp_us: int | None = None, *, headers: bytes = b"",
    ) -> int:
        """Append a record and wait until it is committed; returns its offset."""
        offset, future = self.publish_nowait(topic, payload, qos, retain, timestamp_us, headers=headers)
        await asyncio.shield(future)
        return offset

    async def wait_for_records(self, offset: int) -> None:
        """Return once the record at ``offset`` is readable (``committed_offset > offset``).

        Typical use: ``await queue.wait_for_records(group.doing_offset)`` when a fetch came
        back empty. Wrap in ``asyncio.wait_for`` for a timeout.
        """
        if self.log.committed_offset > offset:
            return
        if self._committer is None:
            raise RuntimeError(f"queue {self.data_dir} is not started")
        await self._committer.wait_committed(offset)

    def add_commit_listener(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(committed_offset)`` on the loop after each commit (after :meth:`start`)."""
        if self._committer is None:
            raise RuntimeError(f"queue {self.data_dir} is not started")
        self._committer.add_commit_listener(callback)

    # ---- groups --------------------------------------------------------------------------

    def group(
        self, name: str, filters: Sequence[str] | None = None, durable: bool = True,
        start: Start | int = "latest",
    ) -> ConsumerGroup:
        """The group ``name``, created if missing (filters default to ``("#",)``).

        For an existing group, ``filters`` (if given and different) replace its filters;
        ``start`` only applies at creation. Durability is fixed at creation: asking for an
        existing group with the other durability raises ValueError (drop it first).
        """
        group = self._groups.get(name)
        if group is None:
            if durable and self._journal is not None:
                self._journal.forget(escape_group_name(name))  # a dropped namesake's progress
            group = ConsumerGroup.create(
                name, self.log, self.groups_dir, filters=filters or ("#",), durable=durable,
                start=start, config=self.config.group, fileio=self._fileio,
            )
            self._groups[name] = group
            if durable:
                group.report_progress_to(self._progress_dirty)
            return group
        if group.durable != durable:
            raise ValueError(
                f"consumer group {name!r} exists with durable={group.durable}; drop it before "
                f"re-creating it with durable={durable}"
            )
        if filters is not None and tuple(dict.fromkeys(filters)) != group.filters:
            group.set_filters(filters)
        return group

    def drop_group(self, name: str) -> bool:
        """Forget the group and delete its files; False if there was no such group."""
        group = self._groups.pop(name, None)
        if group is None:
            return False
        self._progress_dirty.discard(group)  # never journaled after its FORGET record
        if group.durable and group.directory is not None and self._journal is not None:
            self._journal.forget(group.directory.name)
        group.drop()
        return True

    def detach_group(self, name: str) -> bool:
        """Persist and close the group but keep its files: it no longer holds back retention
        (a disabled agent export) and is loaded again by the next :meth:`open`. False if absent."""
        group = self._groups.pop(name, None)
        if group is None:
            return False
        group.close()
        return True

    def groups(self) -> list[ConsumerGroup]:
        """Every open group (durable and not), in creation/load order."""
        return list(self._groups.values())

    def get_group(self, name: str) -> ConsumerGroup | None:
        """The open group ``name`` or None (never creates one)."""
        return self._groups.get(name)

    def min_pending(self) -> int | None:
        """The lowest Pending offset over all open groups (None without groups).

        Non-durable groups are included while they exist: a live clean session still needs
        its unacked records, it only forgets them when it ends.
        """
        return min((g.pending_offset for g in self._groups.values()), default=None)

    # ---- housekeeping ----------------------------------------------------------------------

    def groups_acked(self) -> int:
        """How many durable groups were acked into since the last :meth:`journal_progress`
        (loop thread)."""
        return len(self._progress_dirty)

    def journal_progress(self) -> int:
        """Append every durable group's changed (Pending, Doing) to the progress journal with
        one write (loop thread; the broker calls it after each loop turn that processed acks).
        Returns how many groups were journaled. A failed write is logged: it only means more
        redeliveries after a crash."""
        journal = self._journal
        dirty = self._progress_dirty
        if journal is None or not dirty:
            return 0
        entries: list[tuple[str, int, int]] = []
        for g in dirty:  # only groups acked into since the last call: O(busy groups)
            g.progress_dirty = False
            if g.directory is not None and self._groups.get(g.name) is g:
                now = (g.pending_offset, g.doing_offset)
                if now != g.journaled:
                    g.journaled = now
                    entries.append((g.journal_key, now[0], now[1]))
        dirty.clear()
        if entries:
            try:
                journal.record(entries)
            except OSError as exc:
                log.warning("could not append to the progress journal %s: %s", journal.path, exc)
        return len(entries)

    def _compact_journal(self, snapshots: list[tuple[ConsumerGroup, OffsetSnapshot]]) -> None:
        """Write ``snapshots`` (every durable group, taken after the journal's last record
        that matters) into the offset files, then empty the journal. Any thread.

        The journal is emptied even if a write failed: that only loses acked progress (more
        redeliveries), never skips a record, while a kept journal could hold a Pending beyond
        a log that lost its tail."""
        self.write_snapshots(snapshots)
        if self._journal is not None:
            self._journal.reset()

    def persist_due(self, now: float | None = None) -> list[tuple[ConsumerGroup, OffsetSnapshot]]:
        """Snapshots of every group whose offsets should be written now (loop thread)."""
        if now is None:
            now = time.monotonic()
        return [(g, g.snapshot(now)) for g in self._groups.values() if g.needs_persist(now)]

    @staticmethod
    def write_snapshots(snapshots: list[tuple[ConsumerGroup, OffsetSnapshot]]) -> None:
        """Write snapshots from :meth:`persist_due`; may run on a worker thread.

        A failure (a full disk) is logged with its traceback once per group until a write
        succeeds again, then at DEBUG: on a full disk the retries every interval would otherwise
        fill the log. The recovery is logged once too."""
        for group, snap in snapshots:
            try:
                group.write_snapshot(snap)
            except OSError as exc:
                # Offsets stay in memory and are retried next round; a crash meanwhile only
                # re-delivers more.
                if group.persist_failing:
                    log.debug("still cannot persist offsets of consumer group %r: %s", group.name, exc)
                else:
                    group.persist_failing = True
                    log.exception("could not persist offsets of consumer group %r (retried every "
                                  "interval; logged again once it works)", group.name)
            else:
                if group.persist_failing:
                    group.persist_failing = False
                    log.info("offsets of consumer group %r persisted again", group.name)

    def run_retention(self) -> RetentionReport:
        """Apply the log's retention, never deleting by age what a group still needs."""
        report = self.log.enforce_retention(self.min_pending())
        self.last_retention = report
        return report

    async def _run_housekeeping(self) -> None:
        persist_every = self.config.housekeeping_interval_ms / 1000
        retention_every = self.config.retention_interval_ms / 1000
        next_retention = time.monotonic() + retention_every
        while True:
            await asyncio.sleep(persist_every)
            try:
                journal = self._journal
                if journal is not None and journal.size > journal.compact_bytes:
                    snaps = [(g, g.snapshot()) for g in self._groups.values() if g.durable]
                    await asyncio.to_thread(self._compact_journal, snaps)
                snapshots = self.persist_due()
                if snapshots:
                    await asyncio.to_thread(self.write_snapshots, snapshots)
                now = time.monotonic()
                if now >= next_retention:
                    next_retention = now + retention_every
                    min_needed = self.min_pending()
                    self.last_retention = await asyncio.to_thread(self.log.enforce_retention, min_needed)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("queue housekeeping failed; retrying in %.3f s", persist_every)


def _open_journal(path: Path, io: FileIO) -> ProgressJournal:
    """Open the progress journal; one that cannot be opened or read (not a file, an I/O
    error) never blocks start-up: it is moved aside and a new one started, so the groups
    resume from their offset files (more redeliveries, nothing skipped)."""
    try:
        return ProgressJournal(path, io)
    except OSError as exc:
        aside = path.with_name(f"{path.name}.damaged-{time.time_ns()}")
        log.error("progress journal %s unusable (%s); moved aside to %s: acked progress since the "
                  "offset files' last write is re-delivered", path, exc, aside.name)
        os.rename(path, aside)
        io.fsync_dir(path.parent)
        return ProgressJournal(path, io)
