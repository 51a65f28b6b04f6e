"""Consumer groups over the real segment log: delivery, acks, redelivery, persistence, reopen."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from filemq.queue.groups import (
    DOING_FILE,
    GROUP_FILE,
    PENDING_FILE,
    ConsumerGroup,
    CorruptGroup,
    GroupClosed,
    GroupConfig,
    InvalidGroupName,
    escape_group_name,
    group_directories,
    purge_dropped,
    read_group_file,
    remove_group_directory,
    unescape_group_name,
)
from filemq.queue.offsets import OffsetFile, encode_offset
from segments import Log, LogConfig, LogView
from segments.fileio import OS_FILE_IO, FileHandle

SMALL = LogConfig(segment_bytes=4096, fsync="never")


@pytest.fixture
def log(tmp_path: Path) -> Iterator[Log]:
    lg = Log.open(tmp_path / "log", SMALL)
    yield lg
    lg.close()


def fill(lg: Log, topics: list[str]) -> list[int]:
    offsets = [lg.append(t, f"payload {i}".encode()) for i, t in enumerate(topics)]
    lg.flush()
    return offsets


def offsets_of(records: list) -> list[int]:  # type: ignore[type-arg]
    return [r.offset for r in records]


# ---- names ---------------------------------------------------------------------------------

WEIRD_NAMES = [
    "client-1",
    "Client-1",
    "client_1",
    "CLIENT-1",
    ".",
    "..",
    "a/b",
    "../../etc/passwd",
    "%41",
    "A",
    "a",
    "nul\x00byte",
    "tab\tnew\nline",
    "space name",
    "ünïcødé",
    "😀",
    "$share-group",
    "~tilde",
    "con",
    "x" * 300,
    "é" * 200,
    "x" * 299 + "y",
    "lone\ud800surrogate",
]


def test_escaped_names_are_safe_unique_and_reversible(tmp_path: Path) -> None:
    escaped = [escape_group_name(n) for n in WEIRD_NAMES]
    # Unique even where the file system ignores case (FAT/exFAT SD cards).
    assert len({e.casefold() for e in escaped}) == len(WEIRD_NAMES)
    for name, esc in zip(WEIRD_NAMES, escaped, strict=True):
        assert esc not in (".", "..")
        assert "/" not in esc and "\x00" not in esc and "." not in esc
        assert len(esc.encode()) <= 255
        assert escape_group_name(name) == esc  # stable
        (tmp_path / esc).mkdir()  # a real, distinct directory
        if len(name.encode("utf-8", "surrogatepass")) * 3 <= 120:
            assert "~" not in esc and unescape_group_name(esc) == name
        elif len(name) > 120:
            assert "~" in esc and unescape_group_name(esc) is None  # hashed: group.json has it
    assert len(list(tmp_path.iterdir())) == len(WEIRD_NAMES)


@pytest.mark.parametrize("bad", ["", "%4", "%ZZ", "a.b", "%C3", "%61", "A"])
def test_unescape_rejects_what_escape_never_produces(bad: str) -> None:
    assert unescape_group_name(bad) is None


def test_empty_group_name_is_refused() -> None:
    with pytest.raises(InvalidGroupName):
        escape_group_name("")


# ---- delivery ----------------------------------------------------------------------------


def test_fetch_ack_and_pending_is_lowest_unacked(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 10)
    g = ConsumerGroup.create("g", log, tmp_path / "groups", start="earliest")
    got = g.fetch(4, "c1")
    assert offsets_of(got) == [0, 1, 2, 3]
    assert g.doing_offset == 4 and g.pending_offset == 0
    assert g.ack(2) and g.ack(1)
    assert g.pending_offset == 0  # 0 still unacked
    assert g.ack(0)
    assert g.pending_offset == 3
    assert not g.ack(0)  # duplicate ack
    assert not g.ack(99)  # never delivered
    assert g.ack(3)
    assert g.pending_offset == 4
    assert g.lag == 6
    rest = g.fetch(100, "c1")
    assert offsets_of(rest) == list(range(4, 10))
    assert g.fetch(100, "c1") == []
    for r in rest:
        g.ack(r.offset)
    assert g.pending_offset == g.doing_offset == 10 and g.lag == 0
    assert g.stats.acked == 10 and g.stats.delivered == 10


def test_records_carry_log_content(tmp_path: Path, log: Log) -> None:
    log.append("s/1", b"\x00\xffbin", qos=1, retain=True)
    log.flush()
    g = ConsumerGroup.create("g", log, tmp_path / "groups", start="earliest")
    [r] = g.fetch(10)
    assert (r.topic, r.payload, r.qos, r.retain) == ("s/1", b"\x00\xffbin", 1, True)


def test_filters_skip_records_and_count_them_as_acked(tmp_path: Path, log: Log) -> None:
    fill(log, ["a/1", "b/1", "a/2", "$SYS/x", "b/2", "a/3/4"])
    g = ConsumerGroup.create("g", log, tmp_path / "groups", filters=["a/+"], start="earliest")
    got = g.fetch(10)
    assert [r.topic for r in got] == ["a/1", "a/2"]
    assert g.stats.skipped == 4
    for r in got:
        g.ack(r.offset)
    assert g.pending_offset == 6  # the skipped tail does not hold pending back
    hash_group = ConsumerGroup.create("h", log, None, durable=False, start="earliest")
    assert [r.topic for r in hash_group.fetch(10)] == ["a/1", "b/1", "a/2", "b/2", "a/3/4"]
    sys_group = ConsumerGroup.create("s", log, None, durable=False, start="earliest", filters=["$SYS/#", "b/2"])
    assert [r.topic for r in sys_group.fetch(10)] == ["$SYS/x", "b/2"]


def test_fetch_keeps_reading_past_non_matching_records(tmp_path: Path, log: Log) -> None:
    fill(log, ["other"] * 50 + ["want"] * 3)
    g = ConsumerGroup.create("g", log, None, durable=False, filters=["want"], start="earliest")
    assert offsets_of(g.fetch(2)) == [50, 51]
    assert offsets_of(g.fetch(2)) == [52]


def test_fetch_work_is_bounded_when_few_records_match(tmp_path: Path) -> None:
    log = Log.open(tmp_path / "biglog", LogConfig(fsync="never"))  # one segment: no seals
    fill(log, ["other"] * 20000 + ["want"])
    g = ConsumerGroup.create("g", log, None, durable=False, filters=["want"], start="earliest")
    first = g.fetch(1)
    assert first == [] and g.has_work()  # budget spent on non-matching records: call again
    assert 0 < g.doing_offset < 20000
    assert offsets_of(g.fetch(1)) == [20000]
    assert not g.has_work()
    assert g.pending_offset == 20000  # everything skipped before it counts as acked
    assert g.ack(20000) and g.pending_offset == 20001
    log.close()


def test_one_consumer_at_a_time_within_a_group_and_broadcast_across_groups(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 6)
    g1 = ConsumerGroup.create("g1", log, tmp_path / "groups", start="earliest")
    g2 = ConsumerGroup.create("g2", log, tmp_path / "groups", start="earliest")
    a = offsets_of(g1.fetch(3, "alice"))
    b = offsets_of(g1.fetch(10, "bob"))
    assert set(a).isdisjoint(b) and sorted(a + b) == list(range(6))
    assert g1.in_flight("alice") == 3 and g1.in_flight("bob") == 3 and g1.in_flight() == 6
    assert offsets_of(g2.fetch(10, "carol")) == list(range(6))


def test_nack_redelivers_before_new_records_with_dup(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 6)
    g = ConsumerGroup.create("g", log, None, durable=False, start="earliest")
    assert offsets_of(g.fetch(3, "c")) == [0, 1, 2]
    assert not g.redelivered(1)
    assert g.nack(2) and g.nack(1)
    assert not g.nack(1)  # already waiting for redelivery
    assert not g.nack(42)
    got = g.fetch(3, "d")
    assert offsets_of(got) == [1, 2, 3]  # redeliveries first, lowest first
    assert g.redelivered(1) and g.redelivered(2) and not g.redelivered(3)
    assert g.stats.redelivered == 2
    assert g.pending_offset == 0


def test_release_gives_a_gone_consumers_records_to_others(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 5)
    g = ConsumerGroup.create("g", log, None, durable=False, start="earliest")
    g.fetch(2, "alice")
    g.fetch(2, "bob")
    g.ack(0)
    assert g.release("alice") == 1  # offset 1; offset 0 was acked
    assert g.release("nobody") == 0
    assert offsets_of(g.fetch(10, "bob")) == [1, 4]
    assert g.in_flight("bob") == 4 and g.in_flight("alice") == 0


def test_ack_of_a_released_record_still_counts(tmp_path: Path, log: Log) -> None:
    # A PUBACK can race with the disconnect that released the record.
    fill(log, ["t"] * 2)
    g = ConsumerGroup.create("g", log, None, durable=False, start="earliest")
    g.fetch(2, "alice")
    g.release("alice")
    assert g.ack(0)
    assert offsets_of(g.fetch(10, "bob")) == [1]
    assert g.pending_offset == 1


class CountingReader:
    """A reader in front of the log (like the broker's tail cache) that counts its reads."""

    def __init__(self, lg: Log) -> None:
        self.log = lg
        self.reads = 0

    @property
    def first_offset(self) -> int:
        return self.log.first_offset

    @property
    def next_offset(self) -> int:
        return self.log.next_offset

    @property
    def committed_offset(self) -> int:
        return self.log.committed_offset

    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> list:  # type: ignore[type-arg]
        self.reads += 1
        return self.log.read(offset, max_records, max_bytes)


def test_use_reader_switches_reads_and_keeps_offsets(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 10)
    g = ConsumerGroup.create("g", log, tmp_path / "groups", start="earliest")
    assert g.reader is log
    first = g.fetch(4, "c")
    g.ack(first[0].offset)
    g.nack(first[1].offset)
    reader = CountingReader(log)
    g.use_reader(reader)
    assert cast(LogView, g.reader) is reader  # (mypy still has g.reader as the log, from above)
    again = g.fetch(100, "c")  # the nacked record first, then the rest: state kept
    assert offsets_of(again) == [1, *range(4, 10)]
    assert reader.reads >= 2  # the redelivery and the new records both came through it
    assert g.pending_offset == 1 and g.lag == 9


def test_start_positions(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 5)
    latest = ConsumerGroup.create("l", log, tmp_path / "groups")
    assert latest.doing_offset == latest.pending_offset == 5
    assert latest.fetch(10) == []
    fill(log, ["t"])
    assert offsets_of(latest.fetch(10)) == [5]
    at = ConsumerGroup.create("n", log, None, durable=False, start=2)
    assert at.doing_offset == 2
    clamped = ConsumerGroup.create("c", log, None, durable=False, start=10**9)
    assert clamped.doing_offset == log.next_offset


def test_non_durable_group_writes_nothing(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 3)
    g = ConsumerGroup.create("clean", log, tmp_path / "groups", durable=False)
    assert g.doing_offset == 3
    fill(log, ["t"] * 2)
    for r in g.fetch(10):
        g.ack(r.offset)
    assert not g.maybe_persist(now=1e12)
    g.close()
    assert not (tmp_path / "groups").exists()


def test_closed_group_refuses_fetch(tmp_path: Path, log: Log) -> None:
    g = ConsumerGroup.create("g", log, tmp_path / "groups")
    g.close()
    g.close()  # idempotent
    with pytest.raises(GroupClosed, match="'g'"):
        g.fetch(1)


def test_set_filters_rewrites_group_file(tmp_path: Path, log: Log) -> None:
    g = ConsumerGroup.create("dev/1", log, tmp_path / "groups", filters=["a/#"])
    g.set_filters(["b/+", "c", "b/+"])
    assert g.filters == ("b/+", "c")
    info = read_group_file(g.directory)  # type: ignore[arg-type]
    assert info is not None and info[0] == "dev/1" and info[1] == ("b/+", "c")
    with pytest.raises(ValueError, match="whole level"):
        g.set_filters(["bad#"])


# ---- persistence ---------------------------------------------------------------------------


class CountingIO:
    """The real file layer, counting renames (one per atomic write of an offset file)."""

    def __init__(self) -> None:
        self.writes = 0

    def open(self, path: str | os.PathLike[str], *, create: bool = False) -> FileHandle:
        return OS_FILE_IO.open(path, create=create)

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        self.writes += 1
        OS_FILE_IO.rename(src, dst)

    def unlink(self, path: str | os.PathLike[str]) -> None:
        OS_FILE_IO.unlink(path)

    def fsync_dir(self, path: str | os.PathLike[str]) -> None:
        OS_FILE_IO.fsync_dir(path)

    def free_bytes(self, path: str | os.PathLike[str]) -> int:
        return OS_FILE_IO.free_bytes(path)


def test_persistence_is_batched_by_ack_count_and_interval(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 100)
    io = CountingIO()
    cfg = GroupConfig(persist_every_acks=10, persist_interval_ms=100)
    g = ConsumerGroup.create("g", log, tmp_path / "groups", start="earliest", config=cfg, fileio=io)
    created_writes = io.writes
    t0 = 1000.0
    g.snapshot(now=t0)  # restart the batching clock at a known time
    records = g.fetch(100)
    for r in records[:9]:
        g.ack(r.offset)
    assert not g.maybe_persist(now=t0 + 0.001)  # 9 acks, 1 ms: not yet
    assert io.writes == created_writes
    g.ack(records[9].offset)
    assert g.maybe_persist(now=t0 + 0.002)  # 10th ack
    assert io.writes == created_writes + 2  # doing and pending, one write each
    assert OffsetFile(g.directory / PENDING_FILE).read() == 10  # type: ignore[operator]
    assert OffsetFile(g.directory / DOING_FILE).read() == 100  # type: ignore[operator]
    g.ack(records[10].offset)
    assert not g.maybe_persist(now=t0 + 0.05)
    assert g.maybe_persist(now=t0 + 0.103)  # interval elapsed, 1 ack
    assert io.writes == created_writes + 3  # doing unchanged: only pending written
    assert not g.maybe_persist(now=t0 + 10)  # nothing changed
    assert g.persisted.pending == 11


def test_many_acks_cost_few_writes(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 3000)
    io = CountingIO()
    g = ConsumerGroup.create("g", log, tmp_path / "groups", start="earliest", fileio=io)
    before = io.writes
    now = 0.0
    while True:
        batch = g.fetch(100)
        if not batch:
            break
        for r in batch:
            g.ack(r.offset)
        g.maybe_persist(now=now)  # a frozen clock: only the ack count triggers
    g.close()
    # 3000 acks at persist_every_acks=1000: 3 persists of at most 2 files each.
    assert io.writes - before <= 6
    assert OffsetFile(g.directory / PENDING_FILE).read() == 3000  # type: ignore[operator]


def test_journaled_group_rewrites_its_offset_files_at_most_once_per_interval(tmp_path: Path, log: Log) -> None:
    """Issue 16 item 2: once the queue's progress journal makes a group's acks durable
    (``report_progress_to``), the ack-count trigger is off: the offset files are rewritten at
    most once per ``journaled_persist_interval_ms``, however many acks arrive."""
    fill(log, ["t"] * 3000)
    io = CountingIO()
    cfg = GroupConfig(persist_every_acks=10, persist_interval_ms=100, journaled_persist_interval_ms=1000)
    g = ConsumerGroup.create("g", log, tmp_path / "groups", start="earliest", config=cfg, fileio=io)
    g.report_progress_to(set())
    before = io.writes
    t0 = 1000.0
    g.snapshot(now=t0)
    wrote = []
    for i in range(1, 31):  # 3000 acks in 0.3 s
        for r in g.fetch(100):
            g.ack(r.offset)
        wrote.append(g.maybe_persist(now=t0 + 0.01 * i))
    assert not any(wrote)
    assert io.writes == before
    assert g.maybe_persist(now=t0 + 1.0)  # the interval elapsed: one rewrite of both files
    assert io.writes == before + 2
    assert g.persisted.pending == 3000


def test_reopen_resumes_from_pending_and_flags_dup(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 10)
    groups = tmp_path / "groups"
    g = ConsumerGroup.create("dev", log, groups, start="earliest", filters=["t"])
    g.fetch(6, "c")
    g.ack(0)
    g.ack(1)
    g.ack(4)  # out of order: pending stays at 2
    g.close()
    [directory] = group_directories(groups)
    again = ConsumerGroup.load(directory, log)
    assert again.name == "dev" and again.filters == ("t",)
    assert again.doing_offset == again.pending_offset == 2
    got = again.fetch(100, "c")
    # Every record not below Pending comes again; 4 was acked but above Pending.
    assert offsets_of(got) == list(range(2, 10))
    # Offsets handed out before the restart (below the old Doing, 6) carry DUP.
    assert [again.redelivered(o) for o in range(2, 10)] == [True] * 4 + [False] * 4
    assert again.stats.redelivered == 4


def test_crash_without_persist_redelivers_everything_since_last_write(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 10)
    g = ConsumerGroup.create("g", log, tmp_path / "groups", start="earliest")
    for r in g.fetch(10):
        g.ack(r.offset)
    # no persist: simulated crash
    again = ConsumerGroup.load(g.directory, log)  # type: ignore[arg-type]
    assert offsets_of(again.fetch(100)) == list(range(10))


@pytest.mark.parametrize("damage", ["missing", "torn", "bitflip", "garbage"])
def test_damaged_pending_falls_back_to_first_offset_never_skips(tmp_path: Path, damage: str) -> None:
    lg = Log.open(tmp_path / "log", SMALL)
    fill(lg, ["t"] * 300)  # several segments
    g = ConsumerGroup.create("g", lg, tmp_path / "groups", start="earliest")
    for r in g.fetch(250):
        g.ack(r.offset)
    g.close()
    lg.enforce_retention(min_needed_offset=100)  # nothing dropped: no caps configured
    pending = g.directory / PENDING_FILE  # type: ignore[operator]
    good = encode_offset(250)
    assert pending.read_bytes() == good
    if damage == "missing":
        pending.unlink()
    elif damage == "torn":
        pending.write_bytes(good[:8])
    elif damage == "bitflip":
        pending.write_bytes(good[:7] + bytes([good[7] ^ 0x10]) + good[8:])
    else:
        pending.write_bytes(b"garbage-garbage-!")
    again = ConsumerGroup.load(g.directory, lg)  # type: ignore[arg-type]
    assert again.pending_offset == lg.first_offset == 0  # safe side: re-deliver all
    lg.close()


def test_pending_outside_the_log_is_clamped(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 5)
    g = ConsumerGroup.create("g", log, tmp_path / "groups", start="earliest")
    g.close()
    OffsetFile(g.directory / PENDING_FILE).write(50)  # type: ignore[operator]
    assert ConsumerGroup.load(g.directory, log).pending_offset == 5  # type: ignore[arg-type]


def test_retention_gap_is_skipped_and_counted(tmp_path: Path) -> None:
    cfg = LogConfig(segment_bytes=1024, fsync="never", retention_bytes=3000)
    lg = Log.open(tmp_path / "log", cfg)
    g = ConsumerGroup.create("g", lg, tmp_path / "groups", start="earliest")
    fill(lg, ["t"] * 200)
    lg.enforce_retention(min_needed_offset=0)  # the byte cap forces a drop past pending
    first = lg.first_offset
    assert first > 0
    got = g.fetch(1000)
    assert got[0].offset == first
    assert g.stats.missing == first
    g.close()
    OffsetFile(g.directory / PENDING_FILE).write(0)  # type: ignore[operator]
    assert ConsumerGroup.load(g.directory, lg).pending_offset == first  # type: ignore[arg-type]
    lg.close()


def test_damaged_group_file_recovers_name_from_directory(tmp_path: Path, log: Log) -> None:
    fill(log, ["t"] * 3)
    g = ConsumerGroup.create("Dev/1", log, tmp_path / "groups", filters=["t"], start="earliest")
    g.fetch(1)
    g.ack(0)
    g.close()
    (g.directory / GROUP_FILE).write_text("{not json")  # type: ignore[operator]
    again = ConsumerGroup.load(g.directory, log)  # type: ignore[arg-type]
    assert again.name == "Dev/1" and again.filters == ("#",) and again.pending_offset == 1


def test_damaged_group_file_with_hashed_name_is_an_error(tmp_path: Path, log: Log) -> None:
    g = ConsumerGroup.create("z" * 500, log, tmp_path / "groups")
    g.close()
    (g.directory / GROUP_FILE).unlink()  # type: ignore[operator]
    with pytest.raises(CorruptGroup) as info:
        ConsumerGroup.load(g.directory, log)  # type: ignore[arg-type]
    assert str(g.directory) in str(info.value)


def test_remove_group_directory_and_interrupted_drop(tmp_path: Path, log: Log) -> None:
    groups = tmp_path / "groups"
    a = ConsumerGroup.create("a", log, groups)
    b = ConsumerGroup.create("b", log, groups)
    remove_group_directory(a.directory)  # type: ignore[arg-type]
    assert [p.name for p in group_directories(groups)] == ["b"]
    # A crash mid-drop leaves a tombstone: never loaded, purged later.
    tomb = groups / "b.dropped"
    os.rename(b.directory, tomb)  # type: ignore[arg-type]
    assert list(group_directories(groups)) == []
    assert purge_dropped(groups) == 1
    assert list(groups.iterdir()) == []


# ---- model-based: ConsumerGroup against a simple in-memory model ---------------------------

TOPICS = ["a", "a/x", "b"]
CONSUMERS = ["c1", "c2", "c3"]


class GroupModel(RuleBasedStateMachine):
    """Random fetch/ack/nack/release/persist/reopen, checked against sets in memory.

    Checked: a record is with one consumer at a time; an acked record is never delivered
    again, except after a reopen when it was at or above the persisted Pending (then it must
    carry DUP); every record unacked at a reopen is delivered again; pending_offset is always
    the lowest unacked delivered offset.
    """

    offsets = Bundle("offsets")

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = Path(tempfile.mkdtemp(prefix="groupmodel-"))
        self.log = Log.open(self.tmp / "log", SMALL)
        self.groups = self.tmp / "groups"
        self.cfg = GroupConfig(persist_every_acks=3, persist_interval_ms=10**9)
        self.group = ConsumerGroup.create(
            "m", self.log, self.groups, filters=["a/#"], start="earliest", config=self.cfg
        )
        self.inflight: dict[int, str] = {}  # offset -> consumer
        self.waiting: set[int] = set()  # nacked/released, not yet redelivered
        self.acked: set[int] = set()  # acked since the last reopen
        self.must_redeliver: set[int] = set()  # unacked at the last reopen, not yet seen again
        self.must_dup: set[int] = set()  # of those, handed out before the persisted Doing
        self.delivered_ever: set[int] = set()

    def teardown(self) -> None:
        import shutil

        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @initialize(topics=st.lists(st.sampled_from(TOPICS), min_size=1, max_size=30))
    def seed(self, topics: list[str]) -> None:
        fill(self.log, topics)

    @rule(topics=st.lists(st.sampled_from(TOPICS), min_size=1, max_size=10))
    def publish(self, topics: list[str]) -> None:
        fill(self.log, topics)

    @rule(target=offsets, n=st.integers(1, 8), consumer=st.sampled_from(CONSUMERS))
    def fetch(self, n: int, consumer: str) -> int:
        got = self.group.fetch(n, consumer)
        assert len(got) <= n
        # What fetch tells about its list (the broker's run path relies on it): when
        # run_start says so, the list is the gap-free run from there with those topics.
        assert self.group.last_run is got
        if self.group.run_start >= 0:
            assert [r.offset for r in got] == list(range(self.group.run_start, self.group.run_start + len(got)))
            assert set(self.group.run_topics) == {r.topic for r in got}
        for r in got:
            o = r.offset
            assert r.topic.startswith("a"), r  # filters respected
            assert o not in self.inflight, f"{o} already with {self.inflight[o]}"
            assert o not in self.acked, f"acked record {o} delivered again"
            if o in self.must_dup:
                assert self.group.redelivered(o), f"{o} redelivered without DUP"
            self.must_dup.discard(o)
            self.must_redeliver.discard(o)
            self.waiting.discard(o)
            self.inflight[o] = consumer
            self.delivered_ever.add(o)
        return got[0].offset if got else -1

    @rule(o=offsets)
    def ack(self, o: int) -> None:
        expected = o in self.inflight or o in self.waiting
        assert self.group.ack(o) == expected
        if expected:
            self.inflight.pop(o, None)
            self.waiting.discard(o)
            self.acked.add(o)

    @rule(data=st.data())
    @precondition(lambda self: bool(self.inflight))
    def ack_some_inflight(self, data: st.DataObject) -> None:
        o = data.draw(st.sampled_from(sorted(self.inflight)))
        assert self.group.ack(o)
        del self.inflight[o]
        self.acked.add(o)

    @rule(o=offsets)
    def nack(self, o: int) -> None:
        expected = o in self.inflight
        assert self.group.nack(o) == expected
        if expected:
            del self.inflight[o]
            self.waiting.add(o)

    @rule(consumer=st.sampled_from(CONSUMERS))
    def release(self, consumer: str) -> None:
        mine = {o for o, c in self.inflight.items() if c == consumer}
        assert self.group.release(consumer) == len(mine)
        for o in mine:
            del self.inflight[o]
        self.waiting |= mine

    @rule()
    def maybe_persist(self) -> None:
        self.group.maybe_persist()

    @rule(clean=st.booleans())
    def reopen(self, clean: bool) -> None:
        old_pending = self.group.pending_offset
        if clean:
            self.group.close()
        persisted_pending = self.group.persisted.pending
        persisted_doing = self.group.persisted.doing
        unacked = set(self.inflight) | self.waiting | self.must_redeliver
        self.group = ConsumerGroup.load(self.group.directory, self.log, config=self.cfg)  # type: ignore[arg-type]
        if clean:
            assert persisted_pending == old_pending  # a clean close persists the latest
        assert self.group.pending_offset == persisted_pending
        assert all(o >= persisted_pending for o in unacked)
        # Acked records at or above the persisted Pending come again: forget those acks.
        self.acked = {o for o in self.acked if o < persisted_pending}
        self.must_redeliver = unacked
        self.must_dup = {o for o in unacked if o < persisted_doing}
        self.inflight.clear()
        self.waiting.clear()

    @invariant()
    def pending_is_lowest_unacked(self) -> None:
        unacked = set(self.inflight) | self.waiting
        expected = min(unacked, default=None)
        pending = self.group.pending_offset
        if expected is None:
            # Nothing outstanding: pending is where reading resumes.
            assert pending == self.group.doing_offset
        else:
            assert pending == expected
        assert pending <= self.group.doing_offset

    def drain_and_check(self) -> None:
        for consumer in CONSUMERS:  # every consumer leaves; their records must come back
            self.group.release(consumer)
        while True:
            got = self.group.fetch(100, "drain")
            if not got:
                break
            for r in got:
                assert r.offset not in self.acked
                self.must_redeliver.discard(r.offset)
                self.group.ack(r.offset)
        assert not self.must_redeliver, f"never redelivered: {sorted(self.must_redeliver)}"
        assert self.group.pending_offset == self.group.doing_offset == self.log.committed_offset
        matching = {r.offset for r in self.log.read(0, 10**6) if r.topic.startswith("a")}
        assert self.delivered_ever | self.acked <= matching


class GroupModelTest(GroupModel):
    def teardown(self) -> None:
        self.drain_and_check()
        super().teardown()


TestGroupModel = GroupModelTest.TestCase
TestGroupModel.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 40), max_size=12)), max_size=12))
def test_ack_many_leaves_the_group_as_acking_one_by_one(tmp_path: Path, steps: list[tuple[int, list[int]]]) -> None:
    """``ack_many`` (the MQTT export's batch of PUBACKs) is ``ack`` of each offset, whatever the
    order, duplicates, offsets never fetched, nacked or redelivered ones: same return count,
    same pending/doing offsets, same outstanding set, same DUP answers."""
    import uuid

    base = tmp_path / uuid.uuid4().hex
    lg = Log.open(base / "log", SMALL)
    try:
        fill(lg, ["t"] * 40)
        one = ConsumerGroup.create("one", lg, base / "g1", start="earliest", durable=False)
        many = ConsumerGroup.create("many", lg, base / "g2", start="earliest", durable=False)
        for action, offsets in steps:
            if action == 0:
                assert offsets_of(one.fetch(len(offsets) + 1, "c")) == offsets_of(many.fetch(len(offsets) + 1, "c"))
            elif action == 1:
                for o in offsets[:2]:
                    assert one.nack(o) == many.nack(o)
            else:
                assert sum(map(one.ack, offsets)) == many.ack_many(offsets)
            assert one.pending_offset == many.pending_offset and one.doing_offset == many.doing_offset
            assert one.stats.acked == many.stats.acked
            for o in range(41):
                assert one.redelivered(o) == many.redelivered(o)
                if many.redelivered(o):
                    assert many.may_be_redelivered(min(o, 40))
    finally:
        lg.close()


def test_fetch_says_when_its_list_is_one_gap_free_run(tmp_path: Path, log: Log) -> None:
    """run_start / run_topics (what the broker's run path takes instead of a pass over the
    records): set for a gap-free matching piece, -1 once a redelivery or a skipped record
    is in the list."""
    fill(log, ["a/1", "a/2", "a/1", "b/x", "a/3", "a/3"])
    g = ConsumerGroup.create("r", log, tmp_path / "g", filters=["a/#"], start="earliest")
    got = g.fetch(3, "c")
    assert g.last_run is got and g.run_start == 0 and set(g.run_topics) == {"a/1", "a/2"}
    assert g.nack(1)
    got = g.fetch(3, "c")  # the redelivery of 1 first, then 4 and 5 (3 is skipped: b/x)
    assert offsets_of(got) == [1, 4, 5]
    assert g.last_run is got and g.run_start == -1
    assert g.fetch(3, "c") == [] and g.run_start == -1


def test_may_be_redelivered_after_a_reopen_and_a_nack(tmp_path: Path, log: Log) -> None:
    """A reopened group's records below the persisted doing offset may have been sent before
    (MQTT-3.3.1-1: DUP on a re-delivery), later ones not; a nacked one may be."""
    fill(log, ["t"] * 10)
    g = ConsumerGroup.create("g", log, tmp_path / "groups", start="earliest")
    assert not g.may_be_redelivered(0)
    g.fetch(6, "c")
    assert g.ack_many([1, 0, 1, 99]) == 2
    g.close()
    [directory] = group_directories(tmp_path / "groups")
    g = ConsumerGroup.load(directory, log)
    assert g.may_be_redelivered(2) and g.redelivered(2) is False  # not outstanding yet
    got = g.fetch(10, "c")
    assert [g.redelivered(r.offset) for r in got] == [True] * 4 + [False] * 4
    assert g.may_be_redelivered(2) and not g.may_be_redelivered(6)
    assert g.nack(7) and g.fetch(1, "c")[0].offset == 7
    assert g.redelivered(7) and g.may_be_redelivered(6)
