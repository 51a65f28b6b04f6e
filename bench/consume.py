"""`filemq bench consume`: consumer-group fetch+ack throughput against raw ``Log.read`` in the same run.

* filemq: G durable consumer groups each fetch every record (``fetch(1000)``), ack each one
  individually (as a subscriber's PUBACKs would) and persist offsets batched as in
  production: every 1000 acks or 100 ms, written on a worker thread like the Queue does.
* baseline: ``Log.read`` over the same records, nothing else: the floor the groups stand on.

The log is filled once (flushed, not fsync'ed per record: this bench measures consumption).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.workdir import bench_workdir
from filemq.queue.groups import ConsumerGroup, GroupConfig
from segments import Log, LogConfig

Progress = Callable[[str], None]
FETCH = 1000


@dataclass
class ConsumeResult:
    impl: str
    records: int  # records delivered (and acked) in total, over all groups
    seconds: float
    offset_writes: int = 0

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(bench="consume", records_per_s=round(self.rate))
        return out


def _fill(lg: Log, records: int, size: int, progress: Progress) -> None:
    payload = os.urandom(size)
    step = max(records // 10, 1)
    append = lg.append
    for i in range(records):
        append("bench/consume", payload, qos=1)
        if i % 10_000 == 9_999:
            lg.flush()
        if i % step == step - 1:
            progress(f"  filled {i + 1:,} records")
    lg.sync()


def _raw_read(lg: Log) -> ConsumeResult:
    started = time.perf_counter()
    offset = lg.first_offset
    total = 0
    read = lg.read
    while True:
        batch = read(offset, FETCH)
        if not batch:
            break
        total += len(batch)
        offset = batch[-1].offset + 1
    return ConsumeResult("Log.read (baseline)", total, time.perf_counter() - started)


def _consume(lg: Log, groups_dir: Path, groups: int, config: GroupConfig, prefix: str = "bench") -> ConsumeResult:
    """Consume like the broker does: acks on the loop thread, offset files written by one
    worker thread (as :class:`filemq.queue.Queue` housekeeping does), one write at a time,
    each taking the latest snapshot, so slow fsyncs coalesce instead of stalling consumers."""
    members = [
        ConsumerGroup.create(f"{prefix}-{i}", lg, groups_dir, start="earliest", config=config)
        for i in range(groups)
    ]
    started = time.perf_counter()
    total = 0
    with ThreadPoolExecutor(1, thread_name_prefix="bench-persist") as writer:
        for group in members:
            fetch, ack = group.fetch, group.ack
            writing: Future[None] | None = None
            while True:
                batch = fetch(FETCH, "bench-consumer")
                if not batch:
                    break
                for record in batch:
                    ack(record.offset)
                total += len(batch)
                if writing is None or writing.done():
                    if writing is not None:
                        writing.result()
                    if group.needs_persist():
                        writing = writer.submit(group.write_snapshot, group.snapshot())
            if writing is not None:
                writing.result()
            group.close()
    seconds = time.perf_counter() - started
    writes = sum(g.stats.persists for g in members)
    for group in members:
        assert group.pending_offset == lg.committed_offset, group
    return ConsumeResult(f"ConsumerGroup x{groups} fetch+ack", total, seconds, writes)


def run_consume_bench(
    data_dir: str | None, records: int, size: int, groups: int, keep: bool, progress: Progress,
    rounds: int = 3,
) -> tuple[list[ConsumeResult], float]:
    """Fill a log, then time raw reads and group consumption, alternating, ``rounds`` times
    each; returns the best of each (a shared machine makes single runs noisy) and the ratio.

    The ratio is group records/s over raw-read records/s (1.0 would mean groups cost nothing).
    """
    with bench_workdir(data_dir, "consume", keep, progress) as root:
        lg = Log.open(root / "log", LogConfig())
        progress(f"filling {root / 'log'} with {records:,} records of {size} bytes")
        _fill(lg, records, size, progress)
        _raw_read(lg)  # warm the page cache so every run reads from memory
        baselines: list[ConsumeResult] = []
        results: list[ConsumeResult] = []
        for i in range(rounds):
            baselines.append(_raw_read(lg))
            progress(f"round {i + 1}/{rounds}: raw Log.read {baselines[-1].rate:,.0f} records/s")
            results.append(_consume(lg, root / "groups", groups, GroupConfig(), prefix=f"bench{i}"))
            progress(
                f"round {i + 1}/{rounds}: {groups} group(s) fetch({FETCH}) + ack each + batched persist "
                f"{results[-1].rate:,.0f} records/s, {results[-1].offset_writes} offset-file writes"
            )
        lg.close()
    baseline = max(baselines, key=lambda r: r.rate)
    result = max(results, key=lambda r: r.rate)
    ratio = result.rate / baseline.rate if baseline.rate else 0.0
    return [result, baseline], ratio
