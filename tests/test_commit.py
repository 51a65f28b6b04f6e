"""Group commit: futures resolve only after the covering fdatasync, batches share one fsync."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from segments import DiskFull, GroupCommitter, Log, LogConfig
from tests.test_log import InjectingFileIO


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_futures_resolve_only_after_datasync(tmp_path: Path) -> None:
    io = InjectingFileIO()
    log = Log.open(tmp_path, LogConfig(fsync="always"), fileio=io)

    async def main() -> list[tuple[int, int]]:
        committer = GroupCommitter(log)
        await committer.start()
        resolved: list[tuple[int, int]] = []  # (offset, bytes durable when its future resolved)
        futures = []
        for i in range(500):
            offset, future = committer.append_nowait("t", b"x" * 100)
            future.add_done_callback(
                lambda _f, o=offset: resolved.append((o, max(io.synced_sizes, default=0)))
            )
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
        committer = GroupCommitter(log)
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
        committer = GroupCommitter(log)
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
        committer = GroupCommitter(log, policy="interval", interval_ms=1000)
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
        committer = GroupCommitter(log, policy="never")
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
        committer = GroupCommitter(log)
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
        committer = GroupCommitter(log)
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
        committer = GroupCommitter(log, max_batch_bytes=1000)
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
        gc = GroupCommitter(log)
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
