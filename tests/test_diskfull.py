"""DiskFull on a real, small file system (a 2 MiB tmpfs), through the group-commit path.

tests/test_log.py covers ENOSPC injected through a FileIO and a plain ``Log.flush`` on a tmpfs;
here the log fills a real tmpfs through :class:`segments.GroupCommitter` (as the broker does),
then space is freed by deleting a filler file, and the same data dir is reopened and used again.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from segments import DiskFull, GroupCommitter, Log, LogConfig
from tests.storage_faults import small_tmpfs

CONFIG = LogConfig(segment_bytes=64 * 1024, index_interval_bytes=1024)


def payload(offset: int) -> bytes:
    return offset.to_bytes(8, "big") * 40  # 320 bytes, checkable


async def fill_until_disk_full(log: Log) -> tuple[int, BaseException]:
    """Append through a GroupCommitter until a commit fails; returns (acked high-water, error)."""
    gc = GroupCommitter(log)
    await gc.start()
    acked = log.next_offset
    error: BaseException | None = None
    try:
        while error is None:
            batch = []
            for _ in range(50):
                offset = log.next_offset
                got, future = gc.append_nowait("fill/t", payload(offset), qos=1)
                assert got == offset
                batch.append((got, future))
            for got, future in batch:
                try:
                    await asyncio.shield(future)
                    assert error is None, "a commit succeeded after an earlier one failed in the same run"
                    acked = got + 1
                except DiskFull as exc:
                    error = exc
                    break
    finally:
        await gc.close()
    assert error is not None
    return acked, error


async def append_some(log: Log, n: int) -> list[int]:
    gc = GroupCommitter(log)
    await gc.start()
    try:
        offsets = []
        for _ in range(n):
            offset = log.next_offset
            offsets.append(await gc.append("after/t", payload(offset)))
        return offsets
    finally:
        await gc.close()


def assert_records(log: Log, end: int) -> None:
    records = log.read(0, 100_000, 1 << 30)
    assert [r.offset for r in records] == list(range(end))
    for r in records:
        assert r.payload == payload(r.offset), f"record {r.offset} damaged"


@pytest.mark.slow
def test_real_enospc_through_group_commit_then_space_comes_back(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "mnt") as mnt:
        filler = mnt / "filler"
        filler.write_bytes(b"\0" * (768 * 1024))
        log = Log.open(mnt / "log", CONFIG)
        acked, error = asyncio.run(fill_until_disk_full(log))
        assert isinstance(error, DiskFull) and str(mnt) in str(error), error
        assert acked > 1000, f"only {acked} records fit in ~1.2 MiB"
        # Nothing of the failed commit is visible; the offsets after it are reused.
        assert log.committed_offset == log.next_offset == acked
        assert_records(log, acked)
        log.close()

        log = Log.open(mnt / "log", CONFIG)
        assert log.next_offset == acked, "a partial record of the failed commit survived the reopen"
        assert log.recovery.tail_bytes_truncated == 0 and log.recovery.corrupt_records == 0
        assert_records(log, acked)
        again, error = asyncio.run(fill_until_disk_full(log))  # still full: fails the same clean way
        assert isinstance(error, DiskFull)
        assert again == log.next_offset == acked

        filler.unlink()
        assert asyncio.run(append_some(log, 200)) == list(range(acked, acked + 200))
        log.close()
        log = Log.open(mnt / "log", CONFIG)
        assert_records(log, acked + 200)
        log.close()


@pytest.mark.slow
def test_free_space_floor_stops_appends_before_the_disk_is_full(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "mnt") as mnt:
        floor = 1024 * 1024
        log = Log.open(mnt / "log", LogConfig(segment_bytes=64 * 1024, min_free_bytes=floor))
        written = 0
        with pytest.raises(DiskFull):
            while True:
                offset = log.append("t", payload(log.next_offset))
                written = offset + 1
                if written % 100 == 0:
                    log.sync()
        accepted = log.next_offset
        assert accepted == written
        log.sync()
        st = os.statvfs(mnt)
        assert st.f_bavail * st.f_frsize >= floor // 2, "the floor must stop appends well before ENOSPC"
        log.close()
        log = Log.open(mnt / "log", LogConfig(segment_bytes=64 * 1024))
        assert_records(log, accepted)
        log.close()


def test_broker_data_dir_opens_below_the_free_space_floor_and_serves_its_backlog(tmp_path: Path) -> None:
    """issue 10 item 12: free space below ``min_free_bytes`` with an acknowledged backlog: the
    queue opens (the broker starts), the backlog is read and delivered, acks are kept; only new
    appends are refused with DiskFull (the broker then closes a 3.1.1 publisher without ack)."""
    from filemq.queue import Queue, QueueConfig
    from tests.faults import FaultyFileIO

    io = FaultyFileIO(tmp_path)
    floor = 1 << 20

    async def fill() -> None:
        q = Queue.open(tmp_path, QueueConfig(log=CONFIG), fileio=io)
        await q.start()
        q.group("sub", ["#"], start="earliest")
        for i in range(20):
            await q.publish("t", payload(i), qos=1)
        await q.close()

    asyncio.run(fill())
    io.free_bytes_value = floor // 2  # the disk filled up while the broker was down

    async def serve() -> None:
        cfg = QueueConfig(log=LogConfig(segment_bytes=64 * 1024, index_interval_bytes=1024, min_free_bytes=floor))
        q = Queue.open(tmp_path, cfg, fileio=io)
        await q.start()
        g = q.group("sub")
        got = g.fetch(100, "c")
        assert [r.payload for r in got] == [payload(i) for i in range(20)]
        for r in got:
            g.ack(r.offset)
        with pytest.raises(DiskFull):
            q.publish_nowait("t", b"new")
        await q.close()

    asyncio.run(serve())
    assert io.free_bytes_value == floor // 2
