"""The queue: log + groups in one data directory, group commit, housekeeping, reopen."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from filemq.common.topics import InvalidTopic
from filemq.queue import Queue as FQueue
from filemq.queue import QueueConfig
from filemq.queue.groups import GROUP_FILE, GroupConfig, escape_group_name
from filemq.queue.offsets import OffsetFile
from segments import LogConfig
from tests.loops import run


def cfg(**log_kw: object) -> QueueConfig:
    log_cfg = LogConfig(segment_bytes=4096, **log_kw)  # type: ignore[arg-type]
    return QueueConfig(
        log=log_cfg,
        group=GroupConfig(persist_every_acks=5, persist_interval_ms=20),
        housekeeping_interval_ms=5,
        retention_interval_ms=10,
    )


def test_publish_fetch_ack_and_reopen(tmp_path: Path) -> None:
    async def first() -> None:
        q = FQueue.open(tmp_path, cfg())
        await q.start()
        g = q.group("sub", ["s/#"], start="earliest")
        offsets = [await q.publish(f"s/{i}", b"x" * i, qos=1) for i in range(10)]
        assert offsets == list(range(10))
        off, fut = q.publish_nowait("other", b"y")
        await fut
        got = g.fetch(100, "c")
        assert [r.topic for r in got] == [f"s/{i}" for i in range(10)]
        for r in got[:4]:
            g.ack(r.offset)
        await q.close()

    run(first())
    assert OffsetFile(tmp_path / "groups" / "sub" / "pending").read() == 4

    async def second() -> None:
        q = FQueue.open(tmp_path, cfg())
        assert [g.name for g in q.groups()] == ["sub"]
        g = q.group("sub")
        assert g.filters == ("s/#",)
        assert g.pending_offset == 4
        assert [r.offset for r in g.fetch(100)] == list(range(4, 10))
        assert g.redelivered(4)
        await q.close()

    run(second())


def test_publish_stores_headers_through_a_restart(tmp_path: Path) -> None:
    """Issue 13: a message's MQTT 5 properties (Record.headers) are stored with it by
    publish/publish_nowait and read back by groups, also after a reopen; none: b""."""
    from filemq.mqtt.packets import Properties
    from filemq.mqtt.properties import decode_message_headers, encode_message_headers

    headers = encode_message_headers(Properties(content_type="a/b", user_properties=[("k", "v"), ("k", "w")]))

    async def first() -> None:
        q = FQueue.open(tmp_path, cfg())
        await q.start()
        assert await q.publish("m/5", b"p", 1, headers=headers) == 0
        offset, fut = q.publish_nowait("m/5", b"q", 1, True, headers=b"\x02\x00\x00\x00\x09")
        await fut
        assert offset == 1
        await q.publish("m/3", b"r")
        await q.close()

    run(first())

    async def second() -> None:
        q = FQueue.open(tmp_path, cfg())
        got = q.group("g", start="earliest").fetch(10)
        assert [(r.topic, r.payload, r.headers) for r in got] == [
            ("m/5", b"p", headers), ("m/5", b"q", b"\x02\x00\x00\x00\x09"), ("m/3", b"r", b"")]
        props = decode_message_headers(got[0].headers)
        assert props is not None and props.content_type == "a/b"
        assert list(props.user_properties or ()) == [("k", "v"), ("k", "w")]
        await q.close()

    run(second())


def test_housekeeping_persists_dirty_groups_without_close(tmp_path: Path) -> None:
    async def body() -> None:
        q = FQueue.open(tmp_path, cfg())
        await q.start()
        g = q.group("g", start="earliest")
        for i in range(3):
            await q.publish("t", bytes([i]))
        for r in g.fetch(10):
            g.ack(r.offset)
        pending = OffsetFile(g.directory / "pending")  # type: ignore[operator]
        for _ in range(200):  # the interval (20 ms) elapses; the 5 ms housekeeping writes it
            if pending.read() == 3:
                break
            await asyncio.sleep(0.01)
        assert pending.read() == 3
        await q.close()

    run(body())


def test_wait_for_records_wakes_on_commit(tmp_path: Path) -> None:
    async def body() -> None:
        q = FQueue.open(tmp_path, cfg())
        await q.start()
        g = q.group("g")
        waiter = asyncio.create_task(q.wait_for_records(g.doing_offset))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        seen: list[int] = []
        q.add_commit_listener(seen.append)
        await q.publish("t", b"1")
        await asyncio.wait_for(waiter, 5)
        assert [r.payload for r in g.fetch(10)] == [b"1"]
        assert seen and seen[-1] == 1
        await q.wait_for_records(0)  # already readable: returns at once
        await q.close()

    run(body())


def test_broadcast_to_groups_and_durable_vs_clean(tmp_path: Path) -> None:
    async def body() -> None:
        q = FQueue.open(tmp_path, cfg())
        await q.start()
        a = q.group("a", start="earliest")
        b = q.group("b", durable=False)
        for i in range(5):
            await q.publish("t", bytes([i]))
        assert len(a.fetch(10)) == len(b.fetch(10)) == 5
        assert q.group("a") is a
        with pytest.raises(ValueError, match="durable"):
            q.group("a", durable=False)
        q.group("a", ["t", "u"])
        assert a.filters == ("t", "u")
        assert q.min_pending() == 0
        assert q.drop_group("b") and not q.drop_group("b")
        await q.close()
        q2 = FQueue.open(tmp_path, cfg())
        assert [g.name for g in q2.groups()] == ["a"]  # clean group left nothing
        q2.log.close()

    run(body())


def test_drop_group_removes_its_files(tmp_path: Path) -> None:
    async def body() -> None:
        q = FQueue.open(tmp_path, cfg())
        await q.start()
        name = "client/with weird%id"
        q.group(name)
        directory = tmp_path / "groups" / escape_group_name(name)
        assert (directory / GROUP_FILE).exists()
        assert q.drop_group(name)
        assert not directory.exists()
        assert q.get_group(name) is None
        await q.close()

    run(body())


def test_bad_topic_and_not_started(tmp_path: Path) -> None:
    async def body() -> None:
        q = FQueue.open(tmp_path, cfg())
        with pytest.raises(RuntimeError, match="not started"):
            q.publish_nowait("t", b"")
        await q.start()
        with pytest.raises(InvalidTopic):
            await q.publish("a/+", b"")
        for bad in ("", "a/#", "nul\x00", "\ud800"):  # direct callers always get the check
            with pytest.raises(InvalidTopic, match="topic"):
                q.publish_nowait(bad, b"")
        offset, fut = q.publish_nowait("ok/topic", b"x", validated=True)  # the broker's fast path
        await fut
        assert [r.topic for r in q.log.read(offset)] == ["ok/topic"]
        await q.close()
        await q.close()  # idempotent

    run(body())


def test_retention_never_deletes_by_age_what_a_group_needs(tmp_path: Path) -> None:
    async def body() -> None:
        q = FQueue.open(tmp_path, cfg(retention_ms=1))
        await q.start()
        g = q.group("slow", start="earliest")
        for _ in range(200):  # several 4 KiB segments
            await q.publish("t", b"p" * 50)
        await asyncio.sleep(0.05)  # retention runs every 10 ms; every segment is "old"
        assert q.log.first_offset == 0  # the group still needs offset 0
        for r in g.fetch(150):
            g.ack(r.offset)
        for _ in range(100):
            if q.log.first_offset > 0:
                break
            await asyncio.sleep(0.01)
        assert 0 < q.log.first_offset <= 150
        assert q.last_retention is not None
        await q.close()

    run(body())


def test_damaged_group_directory_is_skipped_not_fatal(tmp_path: Path) -> None:
    async def body() -> None:
        q = FQueue.open(tmp_path, cfg())
        await q.start()
        q.group("x" * 300)  # hashed directory name: group.json is the only copy of the name
        q.group("ok")
        await q.close()

    run(body())
    [hashed] = [p for p in (tmp_path / "groups").iterdir() if "~" in p.name]
    (hashed / GROUP_FILE).write_text("garbage")
    q = FQueue.open(tmp_path, cfg())
    assert [g.name for g in q.groups()] == ["ok"]
    q.log.close()


@pytest.mark.parametrize("seed", range(12))
def test_power_cut_while_persisting_never_skips_and_keeps_completed_writes(tmp_path: Path, seed: int) -> None:
    import random

    from filemq.queue.groups import ConsumerGroup, group_directories
    from segments import Log

    faults = pytest.importorskip("tests.faults", reason="needs the fault-injection file layer")
    rng = random.Random(seed)
    io = faults.FaultyFileIO(tmp_path)
    lg = Log.open(tmp_path / "log", LogConfig(segment_bytes=4096), io)
    for i in range(100):
        lg.append("t", bytes([i]))
    lg.sync()
    g = ConsumerGroup.create("g", lg, tmp_path / "groups", start="earliest", fileio=io)
    records = g.fetch(100, "c")
    acked_prefix = rng.randrange(0, 60)
    for r in records[:acked_prefix]:
        g.ack(r.offset)
    g.persist()  # completes: durable
    durable = acked_prefix
    for r in records[acked_prefix : acked_prefix + rng.randrange(1, 40)]:
        g.ack(r.offset)
    io.power_cut_after(rng.randrange(0, 10))  # somewhere inside the next persist (or after it)
    try:
        g.persist()
        durable = g.pending_offset
    except faults.PowerCut:
        pass
    io.crash(rng.choice(["drop", "tear"]), rng)
    lg2 = Log.open(tmp_path / "log", LogConfig(segment_bytes=4096))
    [directory] = group_directories(tmp_path / "groups")
    again = ConsumerGroup.load(directory, lg2)
    # Never beyond what was acked (no skip); never before a write that completed.
    assert durable <= again.pending_offset <= g.pending_offset
    assert [r.offset for r in again.fetch(1000)] == list(range(again.pending_offset, 100))
    lg2.close()


# ---- the progress journal: acked progress between two writes of the offset files ----------

NO_FILE_WRITES = GroupConfig(persist_every_acks=10**9, persist_interval_ms=10**9)


def _quiet_cfg() -> QueueConfig:
    """Offset files are never written by housekeeping: only the journal carries progress."""
    return QueueConfig(log=LogConfig(segment_bytes=1 << 16), group=NO_FILE_WRITES,
                       housekeeping_interval_ms=10**6, retention_interval_ms=10**6)


def test_acked_progress_survives_a_process_crash_through_the_journal(tmp_path: Path) -> None:
    """issue 11 item 8: a kill -9 re-delivers only what was acked after the last journal
    write, not everything since the offset files' last (~100 ms / 1 s) rewrite."""

    async def crashing() -> None:
        q = FQueue.open(tmp_path, _quiet_cfg())
        await q.start()
        g = q.group("sub", ["#"], start="earliest")
        for i in range(100):
            await q.publish("t", bytes([i]), qos=1)
        other = q.group("idle", ["#"], start="earliest")
        assert q.groups_acked() == 0
        for r in g.fetch(100, "c")[:60]:
            g.ack(r.offset)
        assert other.fetch(10, "d")  # handed out, not acked: nothing to journal for it
        assert q.groups_acked() == 1  # what scales the broker's journal cadence (JOURNAL_MAX_ACKS)
        assert q.journal_progress() == 1
        assert q.groups_acked() == 0
        assert q.journal_progress() == 0, "unchanged progress is not journaled again"
        # kill -9: no close, no persist; the journal's write is in the page cache.

    run(crashing())
    assert OffsetFile(tmp_path / "groups" / "sub" / "pending").read() == 0
    q = FQueue.open(tmp_path, _quiet_cfg())
    g = q.group("sub")
    assert g.pending_offset == 60
    assert [r.offset for r in g.fetch(1000)] == list(range(60, 100))
    # Opening compacted the journal into the offset files.
    assert OffsetFile(tmp_path / "groups" / "sub" / "pending").read() == 60
    assert (tmp_path / "groups" / "progress.journal").stat().st_size == 0
    q.log.close()


@pytest.mark.parametrize("mode", ["drop", "tear"])
def test_journaled_progress_is_durable_with_the_next_group_commit(tmp_path: Path, mode: str) -> None:
    """Power loss: acks journaled before a group commit that fdatasynced the log are kept;
    acks journaled after it may be lost (more redeliveries) but never skip a record."""
    import random

    faults = pytest.importorskip("tests.faults", reason="needs the fault-injection file layer")
    io = faults.FaultyFileIO(tmp_path)

    async def crashing() -> None:
        q = FQueue.open(tmp_path, _quiet_cfg(), fileio=io)
        await q.start()
        g = q.group("sub", ["#"], start="earliest")
        for i in range(100):
            await q.publish("t", bytes([i]), qos=1)
        got = g.fetch(100, "c")
        for r in got[:40]:
            g.ack(r.offset)
        q.journal_progress()
        await q.publish("t", b"commit")  # a synced commit: it starts the journal's fdatasync
        for r in got[40:70]:
            g.ack(r.offset)
        q.journal_progress()  # not synced by any commit before the power cut (maybe by the running sync)

    run(crashing())  # asyncio.run waits for the journal sync the commit started
    io.crash(mode, random.Random(7))
    q = FQueue.open(tmp_path, _quiet_cfg(), fileio=io)
    g = q.group("sub")
    assert 40 <= g.pending_offset <= 70
    assert [r.offset for r in g.fetch(1000)] == list(range(g.pending_offset, 101))
    q.log.close()


def test_a_recreated_group_does_not_inherit_a_dropped_namesakes_journal(tmp_path: Path) -> None:
    """Dropping a group durably forgets its journaled progress: a new group of the same name
    starting at the earliest offset must get every record, even after a power cut."""
    import random

    faults = pytest.importorskip("tests.faults", reason="needs the fault-injection file layer")
    io = faults.FaultyFileIO(tmp_path)

    async def crashing() -> None:
        q = FQueue.open(tmp_path, _quiet_cfg(), fileio=io)
        await q.start()
        g = q.group("sub", ["#"], start="earliest")
        for i in range(50):
            await q.publish("t", bytes([i]), qos=1)
        got = g.fetch(100, "c")
        for r in got[:25]:
            g.ack(r.offset)
        q.journal_progress()
        await q.publish("t", b"commit")
        for r in got[25:]:
            g.ack(r.offset)  # not journaled yet when the group is dropped
        assert q.drop_group("sub")
        q.group("sub", ["#"], start="earliest")
        assert q.journal_progress() == 0, "a dropped group is never journaled after its FORGET"
        await q.publish("t", b"commit")

    run(crashing())
    io.crash("drop", random.Random(3))
    q = FQueue.open(tmp_path, _quiet_cfg(), fileio=io)
    assert q.group("sub").pending_offset == 0
    q.log.close()


def test_housekeeping_compacts_a_grown_journal_into_the_offset_files(tmp_path: Path) -> None:
    """Past ``compact_bytes`` the journal is folded into the offset files and emptied."""

    async def body() -> None:
        q = FQueue.open(tmp_path, QueueConfig(log=LogConfig(segment_bytes=1 << 16), group=NO_FILE_WRITES,
                                              housekeeping_interval_ms=5, retention_interval_ms=10**6))
        journal = q._journal
        assert journal is not None
        journal.compact_bytes = 200
        await q.start()
        g = q.group("sub", ["#"], start="earliest")
        for i in range(30):
            await q.publish("t", bytes([i]), qos=1)
        for r in g.fetch(30, "c"):
            g.ack(r.offset)
            q.journal_progress()  # one record per ack: the journal passes 200 bytes
        assert journal.records == 30
        for _ in range(400):  # bounded: housekeeping runs every 5 ms
            if journal.size == 0:
                break
            await asyncio.sleep(0.005)
        assert journal.size == 0, "the journal was not compacted"
        assert OffsetFile(tmp_path / "groups" / "sub" / "pending").read() == 30
        await q.close()

    run(body())


# ---- a damaged progress journal never blocks start-up and never skips a record --------------


def _sixty_acked_of_hundred(tmp_path: Path) -> None:
    """100 records, the first 60 acked and journaled, then a kill -9 (no close)."""
    async def crashing() -> None:
        q = FQueue.open(tmp_path, _quiet_cfg())
        await q.start()
        g = q.group("sub", ["#"], start="earliest")
        for i in range(100):
            await q.publish("t", bytes([i]), qos=1)
        for r in g.fetch(100, "c")[:60]:
            g.ack(r.offset)
        assert q.journal_progress() == 1
    run(crashing())


@pytest.mark.parametrize("damage", ["garbage_tail", "torn_tail", "bit_flips", "missing", "not_a_file", "empty"])
def test_a_damaged_journal_never_blocks_start_up_or_skips_a_record(tmp_path: Path, damage: str) -> None:
    """issue 11 item 8: whatever happened to groups/progress.journal (a torn or garbage tail, a
    flipped bit, deleted, replaced by something that is not a file), the queue opens and the
    group resumes at or before its first unacknowledged record (more redeliveries at worst)."""
    import random
    import shutil

    _sixty_acked_of_hundred(tmp_path)
    path = tmp_path / "groups" / "progress.journal"
    data = path.read_bytes()
    assert data
    cases: list[bytes | None] = []
    if damage == "garbage_tail":
        cases = [data + bytes(random.Random(1).randrange(256) for _ in range(37))]
    elif damage == "torn_tail":
        cases = [data[:n] for n in range(len(data))]
    elif damage == "bit_flips":
        cases = [data[:i] + bytes([data[i] ^ (1 << b)]) + data[i + 1:] for i in range(len(data)) for b in (0, 7)]
    elif damage in ("missing", "not_a_file"):
        cases = [None]
    else:
        cases = [b""]
    saved = tmp_path.parent / (tmp_path.name + "-saved")
    shutil.copytree(tmp_path, saved)
    for case in cases:
        shutil.rmtree(tmp_path)
        shutil.copytree(saved, tmp_path)
        path.unlink()
        if case is not None:
            path.write_bytes(case)
        elif damage == "not_a_file":
            path.mkdir()
        q = FQueue.open(tmp_path, _quiet_cfg())
        g = q.group("sub")
        assert 0 <= g.pending_offset <= 60, (case, g.pending_offset)
        assert [r.offset for r in g.fetch(1000)] == list(range(g.pending_offset, 100))
        q.log.close()


def test_a_journal_beyond_the_log_end_resumes_at_the_end_and_skips_no_new_record(tmp_path: Path) -> None:
    """issue 11 item 8, fsync = "never": the log lost its unsynced tail but the journal (written
    later) survived and names a Pending beyond the log's end.  The group resumes at the end,
    and records appended afterwards at the reused offsets are delivered, also after a restart."""
    from filemq.queue.offsets import encode_journal_record

    _sixty_acked_of_hundred(tmp_path)
    path = tmp_path / "groups" / "progress.journal"
    path.write_bytes(path.read_bytes() + encode_journal_record(escape_group_name("sub"), 500, 510))

    async def reopen() -> list[int]:
        q = FQueue.open(tmp_path, _quiet_cfg())
        await q.start()
        g = q.group("sub")
        assert g.pending_offset == 100
        for i in range(5):
            await q.publish("t", b"new%d" % i, qos=1)
        got = [r.offset for r in g.fetch(1000, "c")]
        await q.close()
        return got

    assert run(reopen()) == list(range(100, 105))
    q = FQueue.open(tmp_path, _quiet_cfg())
    assert [r.offset for r in q.group("sub").fetch(1000)] == list(range(100, 105))
    q.log.close()


def test_enospc_while_appending_the_journal_is_logged_not_raised(tmp_path: Path) -> None:
    """issue 11 item 8: a journal append that fails (disk full) costs redeliveries, nothing else."""
    faults = pytest.importorskip("tests.faults", reason="needs the fault-injection file layer")
    io = faults.FaultyFileIO(tmp_path)

    async def full() -> None:
        q = FQueue.open(tmp_path, _quiet_cfg(), fileio=io)
        await q.start()
        g = q.group("sub", ["#"], start="earliest")
        for i in range(10):
            await q.publish("t", bytes([i]), qos=1)
        for r in g.fetch(5, "c"):
            g.ack(r.offset)
        io.disk_full = True
        assert q.journal_progress() == 1  # logged, not raised
        io.disk_full = False
        for r in g.fetch(5, "c"):
            g.ack(r.offset)
        assert q.journal_progress() == 1

    run(full())
    q = FQueue.open(tmp_path, _quiet_cfg(), fileio=io)
    assert q.group("sub").pending_offset == 10
    q.log.close()


def test_close_on_a_full_disk_closes_everything_and_keeps_the_journal(tmp_path: Path) -> None:
    """issue 10 items 12/14: stopping on a full disk (offset files cannot be written) must not
    abort the close half-way (every group, the committer and the log are closed; no exception
    out of close), and the journal, which then holds progress the files lack, is kept."""
    faults = pytest.importorskip("tests.faults", reason="needs the fault-injection file layer")
    io = faults.FaultyFileIO(tmp_path)

    async def main() -> None:
        q = FQueue.open(tmp_path, _quiet_cfg(), fileio=io)
        await q.start()
        groups = [q.group(n, ["#"], start="earliest") for n in ("a", "b")]
        for i in range(10):
            await q.publish("t", bytes([i]), qos=1)
        for g in groups:
            for r in g.fetch(5, "c"):
                g.ack(r.offset)
        assert q.journal_progress() == 2
        io.disk_full = True
        await q.close()
        assert q.log._closed

    run(main())
    io.disk_full = False
    q = FQueue.open(tmp_path, _quiet_cfg(), fileio=io)
    assert [q.group(n).pending_offset for n in ("a", "b")] == [5, 5]
    q.log.close()


def test_a_failing_offset_write_is_logged_once_until_it_works_again(caplog: pytest.LogCaptureFixture) -> None:
    """On a full disk the offset files are retried every interval: the failure is logged with
    its traceback once per group (not every retry, which filled the log), and the recovery once."""
    import errno
    import logging

    class Group:
        name = "mqtt-session:full-disk-test"
        persist_failing = False

        def __init__(self) -> None:
            self.failures = 3
            self.written = 0

        def write_snapshot(self, snap: object) -> None:
            if self.failures:
                self.failures -= 1
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += 1

    group = Group()
    with caplog.at_level(logging.DEBUG, logger="filemq.queue"):
        for _ in range(5):
            FQueue.write_snapshots([(group, object())])  # type: ignore[list-item]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None and group.name in errors[0].getMessage()
    assert sum("still cannot persist" in r.getMessage() for r in caplog.records) == 2
    assert sum("persisted again" in r.getMessage() for r in caplog.records) == 1
    assert group.written == 2
    caplog.clear()
    group.failures = 1
    with caplog.at_level(logging.DEBUG, logger="filemq.queue"):
        FQueue.write_snapshots([(group, object())])  # type: ignore[list-item]
    assert [r.levelno for r in caplog.records] == [logging.ERROR]  # a new outage is reported again
