"""Group commit: futures resolve only after the covering fdatasync, batches share one fsync."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from segments import DiskFull, GroupCommitter, Log, LogConfig
from segments.commit import ON_LOOP_MAX_BYTES, ON_LOOP_MAX_RECORDS
from segments.fileio import FileHandle
from tests.loops import run
from tests.storage_faults import InjectingFileIO

_MODE: dict[str, float | None] = {"on_loop_max_ms": None}


@pytest.fixture(autouse=True, params=["on_loop", "thread"])
def commit_mode(request: pytest.FixtureRequest) -> str:
    """Every test here twice: with commits on the event loop (the default while syncs are
    quick and batches small) and with every commit on the commit thread (on_loop_max_ms=0,
    where a slow sync or a big batch sends it). Tests build their committer with
    :func:`committer`, which passes the mode (a keyword, not a patched class: the compiled
    build's classes cannot be patched)."""
    _MODE["on_loop_max_ms"] = None if request.param == "on_loop" else 0
    return str(request.param)


def make_committer(log: Log, **kw: Any) -> GroupCommitter:
    if _MODE["on_loop_max_ms"] is not None:
        kw.setdefault("on_loop_max_ms", _MODE["on_loop_max_ms"])
    return GroupCommitter(log, **kw)


class SlowSyncIO(InjectingFileIO):
    """Syncs that take ``delay`` seconds (a slow SD card) while ``delay`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.delay = 0.0

    def open(self, path: str | os.PathLike[str], *, create: bool = False) -> FileHandle:
        handle = super().open(path, create=create)
        inner_sync = handle.datasync

        def datasync() -> None:
            if self.delay:
                time.sleep(self.delay)
            inner_sync()

        handle.datasync = datasync  # type: ignore[method-assign]
        return handle


def test_small_batches_commit_on_the_loop_big_ones_on_the_thread(tmp_path: Path, commit_mode: str) -> None:
    """Everyday load (a record or a few per loop pass) commits on the event loop, no thread
    hand-off; a pass that appended more than ON_LOOP_MAX_RECORDS records or ON_LOOP_MAX_BYTES
    bytes goes to the thread (load:
    the loop reads on while it writes). Either way each future resolves after its fdatasync."""
    io = InjectingFileIO()
    # (a bound no sync reaches on a loaded machine: the move on a slow sync is the next test's)
    log = Log.open(tmp_path, LogConfig(fsync="always", commit_on_loop_max_ms=10_000), fileio=io)

    async def main() -> tuple[int, int, int]:
        committer = make_committer(log)
        await committer.start()
        for _ in range(20):
            offset, future = committer.append_nowait("t", b"x" * 10)
            await future
            assert log.committed_offset == offset + 1 and io.synced_sizes, "resolved before its sync"
        small = committer.commits_on_loop
        pairs = [committer.append_nowait("t", b"y") for _ in range(ON_LOOP_MAX_RECORDS + 1)]
        await pairs[-1][1]
        await committer.append_nowait("t", b"z" * (ON_LOOP_MAX_BYTES + 1))[1]  # one record, many bytes
        big = committer.commits_on_loop - small
        await committer.close()
        return small, big, committer.commits

    small, big, commits = run(main())
    assert small == (20 if commit_mode == "on_loop" else 0)
    assert big == 0
    assert commits >= 22 and log.stats.fsyncs >= 22
    log.close()
    reopened = Log.open(tmp_path, LogConfig())
    assert reopened.next_offset == 20 + ON_LOOP_MAX_RECORDS + 1 + 1
    reopened.close()


def test_a_slow_sync_moves_commits_to_the_thread_until_syncs_are_quick_again(
        tmp_path: Path, commit_mode: str, caplog: pytest.LogCaptureFixture) -> None:
    """A sync slower than commit_on_loop_max_ms holds the loop once: the next commits run on
    the thread (the loop keeps running meanwhile: a timer fires during the slow sync), and come
    back to the loop once a sync there takes at most half the bound."""
    if commit_mode == "thread":
        pytest.skip("the move is from the loop to the thread; the thread mode has no loop commits to move")
    io = SlowSyncIO()
    log = Log.open(tmp_path, LogConfig(fsync="always", commit_on_loop_max_ms=100), fileio=io)

    async def main() -> None:
        committer = make_committer(log)
        await committer.start()
        await committer.append_nowait("t", b"quick")[1]
        assert committer.commits_on_loop == 1 and committer.moves_to_thread == 0
        io.delay = 0.25  # (bound 100 ms: quick syncs stay under it on a loaded machine)
        await committer.append_nowait("t", b"slow on the loop")[1]
        assert committer.commits_on_loop == 2 and committer.moves_to_thread == 1
        ticks = 0

        def tick() -> None:
            nonlocal ticks
            ticks += 1

        handles = [asyncio.get_running_loop().call_later(0.05 * k, tick) for k in range(1, 4)]
        await committer.append_nowait("t", b"slow on the thread")[1]
        assert committer.commits_on_loop == 2, "a commit ran on the loop after a slow sync"
        assert ticks >= 2, "the loop was held during a sync on the thread"
        for h in handles:
            h.cancel()
        io.delay = 0.0
        # Quick again: the first thread commit that takes at most half the bound brings them
        # back (bounded: on a loaded machine one thread write can take longer than 10 ms).
        quick = 0
        while committer.commits_on_loop == 2 and quick < 50:
            quick += 1
            await committer.append_nowait("t", b"quick %d" % quick)[1]
        assert committer.commits_on_loop == 3, "commits never came back to the loop"
        assert committer.moves_to_thread == 1
        await committer.close()

    run(main())
    assert any("commits move to the commit thread" in r.getMessage() for r in caplog.records)
    log.close()
    reopened = Log.open(tmp_path, LogConfig())
    payloads = [r.payload for r in reopened.read(0)]
    assert payloads[:3] == [b"quick", b"slow on the loop", b"slow on the thread"]
    assert payloads[3:] == [b"quick %d" % k for k in range(1, len(payloads) - 2)]
    reopened.close()


def test_futures_resolve_only_after_datasync(tmp_path: Path) -> None:
    io = InjectingFileIO()
    log = Log.open(tmp_path, LogConfig(fsync="always"), fileio=io)

    async def main() -> list[tuple[int, int]]:
        committer = make_committer(log)
        await committer.start()
        resolved: list[tuple[int, int]] = []  # (offset, bytes durable when its future resolved)
        futures = []
        for i in range(500):
            offset, future = committer.append_nowait("t", b"x" * 100)
            def record(_f: asyncio.Future[None], o: int = offset) -> None:
                resolved.append((o, max(io.synced_sizes, default=0)))

            future.add_done_callback(record)
            futures.append(future)
            if i % 50 == 0:
                await asyncio.sleep(0)  # let the commit task run between bursts
        await asyncio.gather(*futures)
        await committer.close()
        return resolved

    resolved = run(main())
    framed = 4 + 24 + 1 + 100  # one segment, equal records: offset o ends at (o + 1) * framed
    assert sorted(o for o, _ in resolved) == list(range(500))
    assert all(durable >= (o + 1) * framed for o, durable in resolved)
    assert log.stats.fsyncs < 500
    log.close()


def test_many_appends_share_one_fsync(tmp_path: Path) -> None:
    log = Log.open(tmp_path, LogConfig(fsync="always"))

    async def main() -> tuple[int, int]:
        committer = make_committer(log)
        await committer.start()
        pairs = [committer.append_nowait("t", b"p") for _ in range(2000)]
        assert len({id(f) for _, f in pairs}) == 1  # one shared future, not one per record
        await pairs[-1][1]
        fsyncs = log.stats.fsyncs
        await committer.close()
        return fsyncs, committer.commits

    fsyncs, commits = run(main())
    assert fsyncs == 1 and commits == 1
    assert len(log.read(0, 5000, 1 << 30)) == 2000
    log.close()


def test_append_during_fsync_goes_to_next_batch(tmp_path: Path) -> None:
    log = Log.open(tmp_path)

    async def main() -> None:
        committer = make_committer(log)
        await committer.start()
        _, first = committer.append_nowait("t", b"a")
        await asyncio.sleep(0)  # the commit task takes the first batch
        _, second = committer.append_nowait("t", b"b")
        assert first is not second
        await asyncio.gather(first, second)
        await committer.close()

    run(main())
    assert log.stats.fsyncs >= 2
    log.close()


def test_interval_policy_acknowledges_before_fsync(tmp_path: Path) -> None:
    log = Log.open(tmp_path)

    async def main() -> tuple[int, int, int]:
        committer = make_committer(log, policy="interval", interval_ms=1000)
        await committer.start()
        await committer.append("t", b"a")  # the first commit syncs (the interval has elapsed)
        synced = log.stats.fsyncs
        await committer.append("t", b"b")  # well within the interval: acknowledged unsynced
        after_ack = log.stats.fsyncs
        for _ in range(40):  # the periodic fdatasync must follow within about one interval
            if log.stats.fsyncs > after_ack:
                break
            await asyncio.sleep(0.05)
        periodic = log.stats.fsyncs
        await committer.close()
        return synced, after_ack, periodic

    synced, after_ack, periodic = run(main())
    assert after_ack == synced  # acknowledged before any fsync covered it
    assert periodic == after_ack + 1  # then the periodic fdatasync, without waiting for close
    log.close()


def test_never_policy_does_not_fsync_until_close(tmp_path: Path) -> None:
    log = Log.open(tmp_path)

    async def main() -> int:
        committer = make_committer(log, policy="never")
        await committer.start()
        for _ in range(5):
            await committer.append("t", b"a")
        syncs = log.stats.fsyncs
        await committer.close()
        return syncs

    assert run(main()) == 0 and log.stats.fsyncs == 1
    log.close()


def test_failed_commit_fails_every_waiter_and_hides_records(tmp_path: Path) -> None:
    io = InjectingFileIO()
    log = Log.open(tmp_path, fileio=io)

    async def main() -> None:
        committer = make_committer(log)
        await committer.start()
        assert await committer.append("t", b"ok") == 0
        io.full = True
        pairs = [committer.append_nowait("t", b"lost") for _ in range(10)]
        with pytest.raises(DiskFull):
            await pairs[0][1]
        assert all(f.done() and isinstance(f.exception(), DiskFull) for _, f in pairs)
        assert log.committed_offset == 1 and log.read(0) and len(log.read(0)) == 1
        io.full = False
        assert await committer.append("t", b"back") == 1  # the failed offsets are reused
        await committer.close()

    run(main())
    assert [r.payload for r in log.read(0)] == [b"ok", b"back"]
    log.close()


def test_wait_committed_and_listeners(tmp_path: Path) -> None:
    log = Log.open(tmp_path)

    async def main() -> list[int]:
        committer = make_committer(log)
        seen: list[int] = []
        committer.add_commit_listener(seen.append)
        await committer.start()
        waiter = asyncio.ensure_future(committer.wait_committed(4))
        await asyncio.sleep(0)
        assert not waiter.done()
        for _ in range(5):
            committer.append_nowait("t", b"x")
        await asyncio.wait_for(waiter, 5)
        assert log.committed_offset > 4
        await committer.wait_committed(0)  # already committed: returns at once
        await committer.close()
        return seen

    seen = run(main())
    assert seen and seen[-1] == 5 and seen == sorted(seen)
    log.close()


def test_max_batch_bytes_splits_futures(tmp_path: Path) -> None:
    log = Log.open(tmp_path)

    async def main() -> int:
        committer = make_committer(log, max_batch_bytes=1000)
        await committer.start()
        futures = {id(committer.append_nowait("t", b"x" * 100)[1]) for _ in range(50)}
        await committer.close()
        return len(futures)

    assert run(main()) >= 5
    log.close()


@pytest.mark.parametrize("policy", ["always", "never"])
def test_sync_companion_runs_after_synced_commits_only_and_never_fails_one(tmp_path: Path, policy: str) -> None:
    """The progress journal's fdatasync rides on commits that synced the log; a failing
    companion is logged and the commit still succeeds."""
    log = Log.open(tmp_path, LogConfig(fsync=policy))  # type: ignore[arg-type]
    calls: list[int] = []

    def companion() -> None:
        calls.append(log.committed_offset)
        raise OSError(5, "companion I/O error")

    async def main() -> None:
        gc = make_committer(log)
        gc.add_sync_companion(companion)
        await gc.start()
        for i in range(3):
            await gc.append("t", b"%d" % i)
        await gc.close()

    run(main())
    assert log.committed_offset == 3
    if policy == "always":
        assert 1 <= len(calls) <= 3  # commits during a running companion coalesce
    else:
        assert calls == []
    log.close()
