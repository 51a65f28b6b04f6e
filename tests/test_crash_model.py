"""The log and a consumer group against an in-memory model, across simulated power cuts.

A Hypothesis ``RuleBasedStateMachine`` (as Vector's disk-buffer model test) drives the real
:class:`segments.Log` (directly and through the real :class:`segments.GroupCommitter` on an
event loop) and a real :class:`filemq.queue.groups.ConsumerGroup`, all writing through
:class:`tests.faults.FaultyFileIO`, with small segments so rolling, sealing and the index are
exercised.  It crashes (drop / tear / flip, optionally in the middle of an operation), reopens,
and checks after every step:

* every record whose append was acknowledged (``sync`` returned, or its commit future
  resolved) is recovered byte-identical, in order, at its offset;
* no record is ever returned that was not appended (offset, topic, payload, flags, timestamp);
* readable offsets are gap-free, except records skipped as corrupt after a bit flip, which
  are counted in ``log.stats``; and a flip costs at most the one record it hit;
* the group hands out exactly the next matching records in order (never skips one), never
  hands out an acked record again within a process, and after a reopen resumes exactly at
  the last persisted Pending (acks after it are the documented redelivery window).

``FILEMQ_HYPOTHESIS_PROFILE=long`` runs many more, longer examples.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from filemq.common.topics import topic_matches
from filemq.queue.groups import ConsumerGroup, GroupConfig
from filemq.queue.offsets import ProgressJournal
from segments import GroupCommitter, Log, LogConfig, Record
from segments.fileio import DiskFull
from segments.record import HEADER_SIZE, LENGTH
from tests.faults import FaultyFileIO, PowerCut, default_flip_filter

PROFILES = {
    # < 60 s on a busy 2-core machine.
    "default": settings(
        max_examples=30, stateful_step_count=35, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    ),
    # Finding without shrinking, for debugging (FILEMQ_HYPOTHESIS_PROFILE=noshrink).
    "noshrink": settings(
        max_examples=60, stateful_step_count=35, deadline=None, phases=[Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    ),
    "long": settings(
        max_examples=1000, stateful_step_count=100, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    ),
}
PROFILE = os.environ.get("FILEMQ_HYPOTHESIS_PROFILE", "default")
# The long profile runs for many minutes: lift pytest-timeout's default 300 s for it.
pytestmark = pytest.mark.timeout(0 if PROFILE == "long" else 300)

TOPICS = ["a/b", "a/c/d", "b/x", "$SYS/load", "ünï/çødé", "b"]
FILTERS = ("a/#", "b/+")
GROUP = "g/1 weird:name"

payloads = st.one_of(
    st.just(b""),
    st.binary(max_size=40),
    st.integers(min_value=300, max_value=900).map(lambda n: random.Random(n).randbytes(n)),
)
# Record headers (MQTT 5 message properties, opaque to the log): b"" is a format 1 record,
# anything else format 2 (issue 13); the model mixes both in every segment.
headers = st.one_of(st.just(b""), st.binary(min_size=1, max_size=60))
entries = st.tuples(
    st.sampled_from(TOPICS), payloads, st.integers(0, 2), st.booleans(), st.integers(0, 2**62), headers
)
EntryArgs = tuple[str, bytes, int, bool, int, bytes]


@dataclass(frozen=True)
class Entry:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    timestamp_us: int
    headers: bytes = b""

    def same_as(self, record: Record) -> bool:
        return (record.topic, record.payload, record.qos, record.retain, record.timestamp_us, record.headers) == (
            self.topic, self.payload, self.qos, self.retain, self.timestamp_us, self.headers,
        )


def aim_at_headers(path: str, image: bytes, rng: random.Random) -> int:
    """Half of the flips in a segment hit a record's header (length, CRC, offset, ...): the
    bytes whose damage is hardest to recover from; the rest land anywhere."""
    if path.endswith(".log") and rng.random() < 0.5:
        starts: list[int] = []
        pos = 0
        while pos + HEADER_SIZE <= len(image) and len(starts) < 10_000:
            starts.append(pos)
            pos += LENGTH.unpack_from(image, pos)[0] + LENGTH.size
        if starts:
            return min(rng.choice(starts) + rng.randrange(HEADER_SIZE), len(image) - 1)
    return rng.randrange(len(image))


def flip_targets(path: str) -> bool:
    """Segments, their indexes and seals (damage there must cost no record), offset files."""
    return default_flip_filter(path) or path.endswith((".index", ".seal"))


def matches(topic: str) -> bool:
    return any(topic_matches(f, topic) for f in FILTERS)


class CrashModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="filemq-crash-"))
        self.io = FaultyFileIO(self.tmp)
        self.log_dir = self.tmp / "log"
        self.groups_dir = self.tmp / "groups"
        self.groups_dir.mkdir()
        # Log model: entries[o] is what offset o holds (appended, possibly not yet durable).
        self.entries: list[Entry] = []
        self.durable_end = 0  # every offset below is acknowledged
        self.committed_end = 0  # readable in the running process
        self.first = 0  # log.first_offset
        self.missing: set[int] = set()  # offsets lost to bit flips (unreadable, counted as corrupt)
        # Group model.
        self.acked: set[int] = set()
        self.in_flight: dict[int, bool] = {}  # offset -> handed out now (False: nacked, waiting)
        self.next_new = 0  # next offset the group must hand out for the first time
        self.persisted: set[int] = {0}  # possible Pending values on disk (two while a write was cut)
        self.log: Log | None = None
        self.group: ConsumerGroup | None = None

    # -- setup -----------------------------------------------------------------------------

    @initialize(
        segment_bytes=st.sampled_from([1024, 2048, 4096]),
        index_interval=st.sampled_from([64, 200, 1000]),
        retention=st.sampled_from([None, 3, 6]),
    )
    def open_everything(self, segment_bytes: int, index_interval: int, retention: int | None) -> None:
        self.config = LogConfig(
            segment_bytes=segment_bytes, index_interval_bytes=index_interval,
            retention_bytes=None if retention is None else retention * segment_bytes,
        )
        self.log = Log.open(self.log_dir, self.config, fileio=self.io)
        self.group = ConsumerGroup.create(
            GROUP, self.log, self.groups_dir, filters=FILTERS, start="earliest",
            config=GroupConfig(persist_every_acks=10**9, persist_interval_ms=10**9), fileio=self.io,
        )
        self.journal = ProgressJournal(self.groups_dir / "progress.journal", self.io)

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------------------

    def _append(self, e: Entry) -> None:
        assert self.log is not None
        offset = self.log.append(e.topic, e.payload, qos=e.qos, retain=e.retain, timestamp_us=e.timestamp_us,
                                 headers=e.headers)
        assert offset == self.log.next_offset - 1
        assert offset <= len(self.entries), "offsets must be gap-free"
        del self.entries[offset:]  # an offset of a failed commit is reused
        self.entries.append(e)

    def _failed_commit(self) -> None:
        """The log discarded what was buffered: nothing of it readable now."""
        assert self.log is not None
        assert self.log.committed_offset == self.committed_end
        assert self.log.next_offset == self.committed_end

    def _entry(self, args: EntryArgs) -> Entry:
        return Entry(*args)

    # -- log rules -------------------------------------------------------------------------

    @rule(batch=st.lists(entries, min_size=1, max_size=12))
    def append(self, batch: list[EntryArgs]) -> None:
        for args in batch:
            self._append(self._entry(args))

    @rule()
    def flush(self) -> None:
        assert self.log is not None
        self.log.flush()
        self.committed_end = self.log.next_offset

    @rule()
    def sync(self) -> None:
        assert self.log is not None
        self.log.sync()
        self.committed_end = self.durable_end = self.log.next_offset

    @rule(
        per_producer=st.lists(st.lists(entries, min_size=1, max_size=8), min_size=1, max_size=4),
        cut_after=st.one_of(st.none(), st.integers(0, 12)),
        mode=st.sampled_from(["drop", "tear", "flip"]),
        seed=st.integers(0, 2**32),
    )
    def group_commit(
        self, per_producer: list[list[EntryArgs]],
        cut_after: int | None, mode: str, seed: int,
    ) -> None:
        """Producers append through the real GroupCommitter; maybe the power dies mid-way."""
        assert self.log is not None
        log = self.log
        if cut_after is not None:
            self.io.power_cut_after(cut_after)
        outcome: dict[int, bool] = {}

        async def producer(items: list[EntryArgs], gc: GroupCommitter) -> None:
            for args in items:
                if self.io.power_is_cut:
                    return  # the machine is dead: nothing appended after the cut can reach a disk
                e = self._entry(args)
                offset, future = gc.append_nowait(
                    e.topic, e.payload, qos=e.qos, retain=e.retain, timestamp_us=e.timestamp_us, headers=e.headers)
                assert offset <= len(self.entries)
                del self.entries[offset:]
                self.entries.append(e)
                try:
                    await asyncio.shield(future)
                    outcome[offset] = True
                except OSError:
                    outcome[offset] = False
                await asyncio.sleep(0)

        async def main() -> None:
            gc = GroupCommitter(log)
            await gc.start()
            try:
                await asyncio.gather(*(producer(items, gc) for items in per_producer))
            finally:
                try:
                    await gc.close()
                except OSError:
                    assert self.io.power_is_cut

        asyncio.run(main())
        acked = sorted(o for o, ok in outcome.items() if ok)
        if acked:
            # Commit order is offset order: a resolved future means every earlier one resolved.
            assert all(ok for o, ok in outcome.items() if o <= acked[-1]), outcome
            self.durable_end = max(self.durable_end, acked[-1] + 1)
        if self.io.power_is_cut:
            self.committed_end = log.committed_offset
            self._crash_and_reopen(mode, seed)
        else:
            # close() synced everything that did not fail.
            self.committed_end = self.durable_end = log.next_offset
            self.io.power_cut_after(None)

    @rule(offset=st.integers(0, 400), max_records=st.integers(1, 50))
    def read(self, offset: int, max_records: int) -> None:
        assert self.log is not None
        records = self.log.read(offset, max_records)
        self._check_records(records, self._readable(max(offset, self.first), self.committed_end)[:max_records])

    @rule()
    def retention(self) -> None:
        assert self.log is not None and self.group is not None
        needed = self.group.pending_offset
        before = self.log.first_offset
        report = self.log.enforce_retention(min_needed_offset=needed)
        self.first = self.log.first_offset
        assert report.first_offset == self.first >= before
        if self.first > max(needed, before):  # this call deleted offsets the group still needs
            assert report.dropped_needed == self.first - max(needed, before)
            assert report.dropped_range == (max(needed, before), self.first)
            assert self.config.retention_bytes is not None and self.log.size_bytes() <= self.config.retention_bytes + self.config.segment_bytes
        else:
            assert report.dropped_needed == 0
        if self.config.retention_bytes is None:
            assert report.segments_deleted == 0
        self.next_new = max(self.next_new, self.first)

    # -- group rules -----------------------------------------------------------------------

    @rule(n=st.integers(1, 20), consumer=st.sampled_from(["c1", "c2"]))
    def fetch(self, n: int, consumer: str) -> None:
        assert self.group is not None and self.log is not None
        got = self.group.fetch(n, consumer)
        waiting = sorted(o for o, out in self.in_flight.items() if not out)
        redelivered = [r.offset for r in got[: len(waiting)] if r.offset in waiting]
        assert redelivered == waiting[: len(redelivered)], "redeliveries first, lowest offset first"
        new = got[len(redelivered):]
        expected = [
            o for o in self._readable(max(self.next_new, self.first), self.committed_end)
            if matches(self.entries[o].topic)
        ]
        assert [r.offset for r in new] == expected[: len(new)], "the group skipped a record"
        assert len(got) == n or len(new) == len(expected), "fetch returned less than available"
        for o in redelivered:
            assert self.group.redelivered(o), "a redelivery carries the DUP flag"
        for r in got:
            assert r.offset not in self.acked, f"acked offset {r.offset} handed out again"
            assert self.entries[r.offset].same_as(r)
            self.in_flight[r.offset] = True
        if new:
            self.next_new = new[-1].offset + 1
        elif len(got) < n:
            self.next_new = max(self.next_new, self.committed_end)

    @precondition(lambda self: any(self.in_flight.values()))
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        assert self.group is not None
        out = sorted(o for o, v in self.in_flight.items() if v)
        chosen = data.draw(st.lists(st.sampled_from(out), min_size=1, unique=True))
        for o in chosen:
            assert self.group.ack(o)
            del self.in_flight[o]
            self.acked.add(o)
        assert not self.group.ack(chosen[0]), "a duplicate ack is refused"
        self._check_pending()

    @precondition(lambda self: any(self.in_flight.values()))
    @rule(data=st.data())
    def nack(self, data: st.DataObject) -> None:
        assert self.group is not None
        o = data.draw(st.sampled_from(sorted(o for o, v in self.in_flight.items() if v)))
        assert self.group.nack(o)
        self.in_flight[o] = False

    @rule(cut_after=st.one_of(st.none(), st.integers(0, 12)), mode=st.sampled_from(["drop", "tear", "flip"]),
          seed=st.integers(0, 2**32))
    def persist_group(self, cut_after: int | None, mode: str, seed: int) -> None:
        assert self.group is not None
        pending = self.group.pending_offset
        if cut_after is not None:
            self.io.power_cut_after(cut_after)
        try:
            self.group.persist()
        except PowerCut:
            self.persisted.add(pending)  # old or new, the crash decides
            self._crash_and_reopen(mode, seed)
            return
        self.io.power_cut_after(None)
        self.persisted = {pending}

    @rule(sync=st.booleans(), cut_after=st.one_of(st.none(), st.integers(0, 3)),
          mode=st.sampled_from(["drop", "tear", "flip"]), seed=st.integers(0, 2**32))
    def journal_progress(self, sync: bool, cut_after: int | None, mode: str, seed: int) -> None:
        """The broker's per-loop-turn journal write of the group's progress, maybe fdatasynced
        (as the group commit does), maybe cut by a power loss."""
        assert self.group is not None and self.group.directory is not None
        pending = self.group.pending_offset
        if cut_after is not None:
            self.io.power_cut_after(cut_after)
        try:
            self.journal.record([(self.group.directory.name, pending, self.group.doing_offset)])
            if sync:
                self.journal.sync()
        except PowerCut:
            self.persisted.add(pending)  # the record may or may not have reached the disk
            self._crash_and_reopen(mode, seed)
            return
        self.io.power_cut_after(None)
        if sync:
            self.persisted = {pending}  # journal values only grow: the replay yields exactly this
        else:
            self.persisted.add(pending)

    # -- crashes and reopening ---------------------------------------------------------------

    @rule(
        mode=st.sampled_from(["drop", "tear", "flip"]), seed=st.integers(0, 2**32),
        recovery_cut=st.one_of(st.none(), st.integers(0, 10)),
    )
    def crash(self, mode: str, seed: int, recovery_cut: int | None) -> None:
        """A power cut; with ``recovery_cut`` the power fails again during (or right after) the
        recovery of the next open, before the log is used."""
        self._crash_and_reopen(mode, seed, recovery_cut)

    @rule(
        cut_after=st.integers(0, 20), batch=st.lists(entries, min_size=1, max_size=20),
        mode=st.sampled_from(["drop", "tear", "flip"]), seed=st.integers(0, 2**32),
    )
    def crash_during_sync(
        self, cut_after: int, batch: list[EntryArgs], mode: str, seed: int
    ) -> None:
        """The power dies at the ``cut_after``-th file operation of append+sync (rolls included)."""
        assert self.log is not None
        for args in batch:
            self._append(self._entry(args))
        self.io.power_cut_after(cut_after)
        try:
            self.log.sync()
            self.committed_end = self.durable_end = self.log.next_offset
            self.io.power_cut_after(None)
        except PowerCut:
            self._failed_commit()
            self._crash_and_reopen(mode, seed)

    @rule()
    def clean_close_and_reopen(self) -> None:
        assert self.log is not None and self.group is not None
        pending = self.group.pending_offset
        self.group.close()
        self.persisted = {pending}
        self.log.close()
        self.committed_end = self.durable_end = len(self.entries)
        self._reopen(crashed=False)

    @rule(n=st.integers(1, 4000))
    def disk_full(self, n: int) -> None:
        """ENOSPC after ``n`` bytes: the sync fails, nothing of it is readable; then space is back."""
        assert self.log is not None
        for i in range(10):
            self._append(Entry("a/b", bytes([i]) * 200, 1, False, i))
        self.io.fail_writes_after(n)
        try:
            self.log.sync()
            self.committed_end = self.durable_end = self.log.next_offset
        except DiskFull:
            self._failed_commit()
            del self.entries[self.log.next_offset:]
        finally:
            self.io.fail_writes_after(None)

    def _crash_and_reopen(self, mode: str, seed: int, recovery_cut: int | None = None) -> None:
        report = self.io.crash(
            mode, random.Random(seed), flip_filter=flip_targets, flip_position=aim_at_headers,  # type: ignore[arg-type]
        )
        self.last_crash = report
        event(f"crash: {mode}")
        if report.torn:
            event("crash: a write was torn")
        if report.dir_ops_lost:
            event("crash: a namespace change was lost")
        if report.flipped is not None:
            event(f"crash: flipped a bit in a {os.path.splitext(report.flipped[0])[1] or os.path.basename(report.flipped[0])} file")
        flipped = report.flipped
        segment_flipped = flipped is not None and flipped[0].endswith(".log")
        if recovery_cut is not None:
            self.io.power_cut_after(recovery_cut)
            try:
                Log.open(self.log_dir, self.config, fileio=self.io)  # abandoned: the power fails
                event("crash: again right after recovery")
            except PowerCut:
                event("crash: again during recovery")
            rng = random.Random(seed + 1)
            self.io.crash(rng.choice(["drop", "tear"]), rng)
        self._reopen(
            crashed=True, segment_flipped=segment_flipped,
            pending_flipped=flipped is not None and flipped[0].endswith("pending"),
        )

    def _reopen(self, *, crashed: bool, segment_flipped: bool = False, pending_flipped: bool = False) -> None:
        log = self.log = Log.open(self.log_dir, self.config, fileio=self.io)
        n = log.next_offset
        assert log.first_offset == self.first, "retention deletions are durable once it returned"
        assert n <= len(self.entries), "the log has offsets that were never appended"
        records = log.read(0, 100_000, 1 << 30)
        readable = {r.offset for r in records}
        self._check_records(records, sorted(readable))  # content, order, never-appended
        assert readable <= set(range(self.first, n))
        # Acknowledged records that are gone: cut off the end, or skipped as corrupt.  Only a
        # bit flip in a segment may cost one (the record it hit), and it must be counted.
        lost = {o for o in range(self.first, self.durable_end) if o not in readable} - self.missing
        assert len(lost) <= int(segment_flipped), (
            f"acknowledged records lost: {sorted(lost)[:10]} (log ends at {n}, acknowledged up to "
            f"{self.durable_end}; crash: {getattr(self, 'last_crash', None)})"
        )
        newly_missing = set(range(self.first, n)) - readable - self.missing
        assert len(newly_missing) <= int(segment_flipped), f"readable offsets not gap-free: {sorted(newly_missing)[:10]}"
        assert not newly_missing or log.stats.corrupt_skipped > 0, "a skipped corrupt record must be counted"
        self.missing = (self.missing | newly_missing) & set(range(self.first, n))
        event(f"reopen: {len(log.segments())} segments, tail cut: {log.recovery.tail_bytes_truncated > 0}, corrupt: {len(self.missing)}")
        if n < len(self.entries):
            event("reopen: unacknowledged records lost")
        # What survived is the new truth: durable and readable.
        del self.entries[n:]
        self.durable_end = self.committed_end = n
        # The group resumes exactly at the last persisted Pending (clamped to the log).
        assert self.group is not None
        self.journal = ProgressJournal(self.groups_dir / "progress.journal", self.io)
        [directory] = [p for p in self.groups_dir.iterdir() if p.is_dir()]
        self.group = ConsumerGroup.load(
            directory, log,
            config=GroupConfig(persist_every_acks=10**9, persist_interval_ms=10**9), fileio=self.io,
            journaled=self.journal.replayed.get(directory.name),
        )
        # Compaction, as Queue.open does it: the replayed values into the files, then empty.
        self.group.persist()
        self.journal.reset()
        pending = self.group.pending_offset
        allowed = {min(max(p, self.first), n) for p in self.persisted}
        if pending_flipped:
            allowed.add(self.first)
        assert pending in allowed, f"group resumed at {pending}, persisted Pending was {self.persisted}"
        unacked = [
            o for o in self._readable(self.first, min(pending, n))
            if o not in self.acked and matches(self.entries[o].topic)
        ]
        assert not unacked, f"resuming at {pending} skips unacked records {unacked[:5]}"
        self.persisted = {pending} if not pending_flipped else {pending, *self.persisted}
        self.acked = {o for o in self.acked if o < pending}
        self.in_flight = {}
        self.next_new = pending

    # -- checks ----------------------------------------------------------------------------

    def _readable(self, start: int, end: int) -> list[int]:
        """Offsets in [start, end) a reader must get: all of them except those lost to flips."""
        return [o for o in range(start, end) if o not in self.missing]

    def _check_records(self, records: list[Record], expected: list[int]) -> None:
        offsets = [r.offset for r in records]
        for r in records:
            assert r.offset < len(self.entries), f"offset {r.offset} was never appended"
            assert self.entries[r.offset].same_as(r), f"record at {r.offset} differs from what was appended"
        assert offsets == expected, "readable offsets are not the expected gap-free run"

    def _check_pending(self) -> None:
        assert self.group is not None
        unacked = [o for o in self.in_flight]
        expected = min(unacked) if unacked else None
        pending = self.group.pending_offset
        if expected is not None:
            assert pending == expected, f"pending {pending}, lowest unacked {expected}"
        else:
            assert pending == self.group.doing_offset

    @invariant()
    def log_offsets_consistent(self) -> None:
        if self.log is None:
            return
        assert self.log.committed_offset == self.committed_end
        assert self.log.first_offset == self.first
        assert self.log.next_offset == len(self.entries)


CrashModel.TestCase.settings = PROFILES[PROFILE]
TestCrashModel = CrashModel.TestCase


# -- cases the model found, kept as plain regression tests ------------------------------------


def test_group_does_not_skip_records_after_the_log_lost_its_unsynced_tail(tmp_path: Path) -> None:
    """Found by the model: Pending persisted beyond the log's end stayed on disk (persists never
    move offsets backwards), so after new records reused those offsets, the next restart skipped them.

    Reachable when a group reads records before they are fdatasync'ed (fsync = "interval" or
    "never") and the power fails."""
    io = FaultyFileIO(tmp_path)
    cfg = GroupConfig(persist_every_acks=10**9, persist_interval_ms=10**9)
    log = Log.open(tmp_path / "log", fileio=io)
    groups_dir = tmp_path / "groups"
    group = ConsumerGroup.create("g", log, groups_dir, start="earliest", config=cfg, fileio=io)
    for i in range(3):
        log.append("a/b", b"old %d" % i)
    log.flush()  # readable, not yet durable
    for r in group.fetch(10):
        group.ack(r.offset)
    group.persist()  # Pending 3 is durable, the records are not
    io.crash("drop", random.Random(0))

    log = Log.open(tmp_path / "log", fileio=io)
    assert log.next_offset == 0
    group = ConsumerGroup.load(groups_dir / os.listdir(groups_dir)[0], log, config=cfg, fileio=io)
    assert group.pending_offset == 0
    for i in range(5):
        log.append("a/b", b"new %d" % i)
    log.sync()
    got = group.fetch(2)
    assert [r.payload for r in got] == [b"new 0", b"new 1"]
    for r in got:
        group.ack(r.offset)
    group.close()
    log.close()

    log = Log.open(tmp_path / "log", fileio=io)
    group = ConsumerGroup.load(groups_dir / os.listdir(groups_dir)[0], log, config=cfg, fileio=io)
    assert group.pending_offset == 2, "records 2.. were never acked and must be delivered again"
    assert [r.payload for r in group.fetch(10)] == [b"new 2", b"new 3", b"new 4"]
    log.close()


def test_failed_commit_does_not_come_back_after_a_power_cut(tmp_path: Path) -> None:
    """A batch that fails after its first segment was sealed (fdatasync'ed by the roll) is cut
    back; the cut must be durable, or a power cut brings the failed records back."""
    io = FaultyFileIO(tmp_path)
    cfg = LogConfig(segment_bytes=1024, index_interval_bytes=200)
    log = Log.open(tmp_path / "log", cfg, fileio=io)
    for _ in range(5):
        log.append("t", b"a" * 100)
    log.sync()
    for _ in range(10):  # two fit the segment, then it rolls
        log.append("t", b"b" * 100)
    io.fail_writes_after(700)  # enough for the first part and the seal, not the new segment
    with pytest.raises(DiskFull):
        log.sync()
    io.fail_writes_after(None)
    assert log.next_offset == log.committed_offset == 5
    io.crash("drop", random.Random(0))
    log = Log.open(tmp_path / "log", cfg, fileio=io)
    assert [r.payload[:1] for r in log.read(0, 100)] == [b"a"] * 5
    log.close()


@pytest.mark.parametrize("field_byte", [0, 3, 5, 12, 40])  # length, length, crc, offset, payload
def test_bit_flip_in_the_unsealed_tail_costs_only_that_record(tmp_path: Path, field_byte: int) -> None:
    """Found by the model (flip mode): a flipped bit in the *length field* of a record in the
    active segment made recovery treat everything after it as a torn tail and cut it off,
    destroying acknowledged records.  Only the damaged record may be lost, and it is counted."""
    log = Log.open(tmp_path, LogConfig(segment_bytes=64 * 1024))
    for i in range(10):
        log.append("t", bytes([i]) * 50)
    log.close()
    segment = tmp_path / "00000000000000000000.log"
    data = bytearray(segment.read_bytes())
    record_size = len(data) // 10
    data[3 * record_size + field_byte] ^= 0x10
    segment.write_bytes(bytes(data))
    log = Log.open(tmp_path, LogConfig(segment_bytes=64 * 1024))
    records = log.read(0, 100)
    assert [r.offset for r in records] == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert all(r.payload == bytes([r.offset]) * 50 for r in records)
    assert log.recovery.corrupt_records == 1 and log.recovery.tail_bytes_truncated == 0
    assert log.append("t", b"next") == 10  # appends continue after the last good record
    log.close()


def test_group_committer_close_releases_its_thread_when_the_final_sync_fails(tmp_path: Path) -> None:
    """Found while writing the model: close() left its commit thread running if log.sync raised."""
    import threading

    io = FaultyFileIO(tmp_path)
    log = Log.open(tmp_path / "log", fileio=io)

    async def main() -> None:
        gc = GroupCommitter(log)
        await gc.start()
        await gc.append("t", b"x")
        log.append("t", b"appended outside the committer, synced by close()")
        io.disk_full = True
        with pytest.raises(DiskFull):
            await gc.close()

    before = {t.ident for t in threading.enumerate()}
    asyncio.run(main())
    leaked = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("filemq-commit")]
    assert not leaked


@pytest.mark.parametrize("mode", ["drop", "tear"])
def test_power_cut_at_every_step_of_dropping_a_group(tmp_path: Path, mode: str) -> None:
    """After a power cut anywhere in ConsumerGroup.drop(), the group is either gone or intact
    (its persisted Pending), never half there; drops that returned are final."""
    from filemq.queue.groups import group_directories, purge_dropped

    cfg = GroupConfig(persist_every_acks=10**9, persist_interval_ms=10**9)
    step = 0
    outcomes = set()
    while True:
        root = tmp_path / f"{step}"
        io = FaultyFileIO(root)
        log = Log.open(root / "log", fileio=io)
        for i in range(20):
            log.append("a/b", b"%d" % i)
        log.sync()
        groups_dir = root / "groups"
        group = ConsumerGroup.create("doomed", log, groups_dir, start="earliest", config=cfg, fileio=io)
        for r in group.fetch(7):
            group.ack(r.offset)
        group.persist()
        io.power_cut_after(step)
        try:
            group.drop()
            finished = True
        except PowerCut:
            finished = False
        io.crash(mode, random.Random(step))  # type: ignore[arg-type]
        log = Log.open(root / "log", fileio=io)
        purge_dropped(groups_dir, io)
        dirs = list(group_directories(groups_dir))
        if finished:
            assert dirs == [], "a drop that returned came back after a power cut"
        if dirs:
            again = ConsumerGroup.load(dirs[0], log, config=cfg, fileio=io)
            assert (again.name, again.pending_offset) == ("doomed", 7)
        outcomes.add(bool(dirs))
        log.close()
        if finished:
            break
        step += 1
    assert step >= 3 and outcomes == {True, False}


@pytest.mark.parametrize("mode", ["drop", "tear", "flip"])
@pytest.mark.parametrize("seed", range(12))
def test_power_loss_on_a_log_with_v2_records_keeps_exactly_the_intact_prefix(
    tmp_path: Path, mode: str, seed: int,
) -> None:
    """Issue 13: a segment mixing format 1 and format 2 (headers) records, some synced, the
    rest only written, loses power.  Unsynced bytes dropped: exactly the synced records come
    back.  A torn last write (cut, zero- or garbage-filled, anywhere: inside a topic, a
    headers_len field, headers, a payload): exactly the records whose bytes all survived.
    A flipped bit: every synced record but the one it hit, which is counted as corrupt."""
    from segments.record import encode_record

    io = FaultyFileIO(tmp_path)
    cfg = LogConfig(segment_bytes=1 << 20)
    log = Log.open(tmp_path / "log", cfg, fileio=io)
    rng = random.Random(seed)
    written: list[Record] = []
    for i in range(30):
        h = rng.choice([b"", b"\x02\x00\x00\x00\x3c", rng.randbytes(rng.randint(1, 200))])
        topic = rng.choice(TOPICS)
        payload = rng.randbytes(rng.choice([0, 5, 100]))
        qos, retain, ts = i % 3, i % 4 == 0, 1_700_000_000_000_000 + i
        assert log.append(topic, payload, qos=qos, retain=retain, timestamp_us=ts, headers=h) == i
        written.append(Record(i, ts, topic, payload, qos, retain, h))
        if i == 19:
            log.sync()  # 0..19 durable
    log.flush()  # 20..29 written to the OS, not synced
    assert sum(1 for r in written if r.headers) >= 10
    report = io.crash(mode, random.Random(seed))  # type: ignore[arg-type]
    segment = tmp_path / "log" / "00000000000000000000.log"
    survived = segment.read_bytes()
    original = b"".join(encode_record(r) for r in written)
    ends = [0]
    for r in written:
        ends.append(ends[-1] + len(encode_record(r)))
    log = Log.open(tmp_path / "log", cfg, fileio=io)
    got = log.read(0, 1000, 1 << 30)
    if mode == "flip":
        assert report.flipped is not None and report.flipped[0] == str(segment)
        pos = report.flipped[1]
        hit = next(i for i in range(20) if ends[i] <= pos < ends[i + 1])
        assert got == written[:hit] + written[hit + 1 : 20]
        assert log.recovery.corrupt_records + int(log.recovery.tail_bytes_truncated > 0) >= 1
    else:
        intact = max(k for k in range(31) if survived[: ends[k]] == original[: ends[k]])
        assert intact >= 20, "a synced record was lost"
        if mode == "drop":
            assert intact == 20
        assert got == written[:intact]
        assert log.recovery.corrupt_records == 0
    assert log.append("after", b"x", headers=b"\x01\x00") == len(got) + int(mode == "flip" and hit < 19)
    log.close()
