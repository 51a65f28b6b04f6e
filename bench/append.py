"""`filemq bench append`: group-commit append throughput against two baselines in the same run.

* filemq: K asyncio producers, each with up to M appends in flight through a GroupCommitter.
* baseline A: a plain file, write + fdatasync per record (what "durable per message" costs naively).
* baseline B: persist-queue's SQLiteAckQueue with its default (durable) settings.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.workdir import bench_workdir
from segments import GroupCommitter, Log, LogConfig

Progress = Callable[[str], None]


@dataclass
class AppendResult:
    impl: str
    records: int
    seconds: float
    payload_bytes: int
    fsyncs: int = 0

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.records * self.payload_bytes / self.seconds / 1e6 if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(bench="append", records_per_s=round(self.rate), mb_per_s=round(self.mb_per_s, 2),
                   mean_batch=round(self.records / self.fsyncs, 1) if self.fsyncs else None)
        return out


async def _produce(committer: GroupCommitter, count: int, payload: bytes, inflight: int) -> None:
    pending: deque[tuple[asyncio.Future[None], int]] = deque()  # (shared future, records in it)
    in_flight = 0
    append = committer.append_nowait
    for _ in range(count):
        _, future = append("bench/append", payload, qos=1)
        if pending and pending[-1][0] is future:
            pending[-1] = (future, pending[-1][1] + 1)
        else:
            pending.append((future, 1))
        in_flight += 1
        while in_flight >= inflight:
            oldest, n = pending.popleft()
            await oldest
            in_flight -= n
    for future, _ in pending:
        await future


async def _filemq(directory: Path, records: int, size: int, producers: int, inflight: int, fsync: str,
                  on_loop_max_ms: float | None = None) -> AppendResult:
    config = LogConfig(fsync=fsync)  # type: ignore[arg-type]
    if on_loop_max_ms is not None:
        config.commit_on_loop_max_ms = on_loop_max_ms
    log = Log.open(directory, config)
    committer = GroupCommitter(log)
    await committer.start()
    payload = os.urandom(size)
    share = [records // producers + (1 if i < records % producers else 0) for i in range(producers)]
    fsyncs_before = log.stats.fsyncs
    started = time.perf_counter()
    await asyncio.gather(*(_produce(committer, n, payload, inflight) for n in share))
    seconds = time.perf_counter() - started
    fsyncs = log.stats.fsyncs - fsyncs_before
    await committer.close()
    log.close()
    assert log.committed_offset == records
    return AppendResult("filemq", records, seconds, size, fsyncs)


def _baseline_fsync_per_record(directory: Path, size: int, seconds: float) -> AppendResult:
    payload = os.urandom(size)
    fd = os.open(directory / "baseline-a.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    count = 0
    started = time.perf_counter()
    try:
        while time.perf_counter() - started < seconds:
            os.write(fd, payload)
            os.fdatasync(fd)
            count += 1
    finally:
        os.close(fd)
    return AppendResult("fdatasync-per-record", count, time.perf_counter() - started, size, count)


def _baseline_sqlite_ack_queue(directory: Path, size: int, max_records: int, seconds: float) -> AppendResult:
    from persistqueue import SQLiteAckQueue

    queue = SQLiteAckQueue(str(directory / "baseline-b"))  # defaults: auto_commit, synchronous FULL
    payload = os.urandom(size)
    count = 0
    started = time.perf_counter()
    while count < max_records and time.perf_counter() - started < seconds:
        queue.put(payload)
        count += 1
    elapsed = time.perf_counter() - started
    return AppendResult("persistqueue.SQLiteAckQueue", count, elapsed, size)


def run_append_bench(
    data_dir: str | None, records: int, size: int, producers: int, inflight: int, fsync: str,
    keep: bool, progress: Progress, baseline_seconds: float = 2.0, on_loop_max_ms: float | None = None,
) -> tuple[list[AppendResult], dict[str, float]]:
    """Run filemq and both baselines; returns the results and filemq's ratios to each baseline.
    ``on_loop_max_ms``: the log's ``commit_on_loop_max_ms`` (None: its default; 0: the commit thread)."""
    with bench_workdir(data_dir, "append", keep, progress) as work:
        progress(f"filemq: {records:,} records of {size} B, {producers} producers x {inflight} in flight, fsync={fsync}")
        ours = asyncio.run(_filemq(work / "log", records, size, producers, inflight, fsync, on_loop_max_ms))
        progress(f"  {ours.rate:,.0f} records/s, {ours.fsyncs} fsyncs")
        progress(f"baseline A: write+fdatasync per record for {baseline_seconds:.0f} s")
        base_a = _baseline_fsync_per_record(work, size, baseline_seconds)
        progress(f"  {base_a.rate:,.0f} records/s")
        progress(f"baseline B: persist-queue SQLiteAckQueue.put for up to {baseline_seconds:.0f} s")
        base_b = _baseline_sqlite_ack_queue(work, size, records, baseline_seconds)
        progress(f"  {base_b.rate:,.0f} records/s")
    ratios = {"vs_fdatasync_per_record": ours.rate / base_a.rate, "vs_sqlite_ack_queue": ours.rate / base_b.rate}
    return [ours, base_a, base_b], ratios
