"""`filemq bench recover`: time to ready after a torn tail, against a full CRC scan of the log.

Builds a log of the requested size, cuts the active segment at a random byte (as a power cut
might), then times ``Log.open`` (which trusts sealed segments by their seal and scans only
the tail) and, in the same run, the same open with every seal removed, which CRC-scans
every record of every segment with the same recovery code (the baseline: what opening costs
when nothing is trusted).  The build tops the tail segment up to >= 90% of ``segment_bytes``
so the timed tail scan is close to its worst case.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.workdir import bench_workdir
from segments import Log, LogConfig

Progress = Callable[[str], None]


@dataclass
class RecoverResult:
    log_bytes: int
    segments: int
    records: int
    tail_bytes_truncated: int
    tail_scanned_bytes: int
    open_seconds: float
    full_scan_seconds: float
    full_scan_records: int

    @property
    def ratio(self) -> float:
        return self.full_scan_seconds / self.open_seconds if self.open_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(bench="recover", full_scan_over_open=round(self.ratio, 1))
        return out


def build_log(directory: Path, size_bytes: int, payload_size: int, config: LogConfig, progress: Progress) -> int:
    """Append records through the public API (fsync=never while building) until ``size_bytes``."""
    log = Log.open(directory, LogConfig(segment_bytes=config.segment_bytes,
                                        index_interval_bytes=config.index_interval_bytes, fsync="never"))
    payload = os.urandom(payload_size)
    append = log.append
    step = 10_000
    next_report = 0
    while log.size_bytes() < size_bytes or log.segments()[-1].size < config.segment_bytes * 0.9:
        for _ in range(step):
            append("bench/recover", payload)
        log.flush()
        if log.size_bytes() >= next_report:
            progress(f"  built {log.size_bytes() / 2**20:,.0f} MiB")
            next_report += 128 << 20
    records = log.next_offset
    log.close()
    return records


def run_recover_bench(
    data_dir: str | None, size_mb: int, payload_size: int, segment_bytes: int, keep: bool,
    progress: Progress, seed: int | None = None,
) -> RecoverResult:
    config = LogConfig(segment_bytes=segment_bytes)
    with bench_workdir(data_dir, "recover", keep, progress) as work:
        progress(f"building a {size_mb} MiB log of {payload_size}-byte payloads in {work}")
        records = build_log(work, size_mb << 20, payload_size, config, progress)
        tail = sorted(work.glob("*.log"))[-1]
        size = tail.stat().st_size
        cut = random.Random(seed).randrange(1, size) if size > 1 else 0
        with open(tail, "r+b") as f:
            f.truncate(cut)
        progress(f"cut {tail.name} from {size:,} to {cut:,} bytes; timing Log.open")
        started = time.perf_counter()
        log = Log.open(work, config)
        open_seconds = time.perf_counter() - started
        report = log.recovery
        progress(f"  ready in {open_seconds:.3f} s ({report})")
        log.close()
        for seal in work.glob("*.seal"):
            seal.unlink()
        progress("baseline: Log.open with every seal removed (full CRC scan of every segment)")
        started = time.perf_counter()
        log = Log.open(work, config)
        full_seconds = time.perf_counter() - started
        scanned = log.next_offset - log.first_offset
        progress(f"  {log.recovery.scanned_bytes / 2**20:,.0f} MiB, {scanned:,} records in {full_seconds:.2f} s")
        result = RecoverResult(
            log_bytes=log.size_bytes(), segments=report.segments, records=records,
            tail_bytes_truncated=report.tail_bytes_truncated, tail_scanned_bytes=report.scanned_bytes,
            open_seconds=open_seconds, full_scan_seconds=full_seconds, full_scan_records=scanned,
        )
        log.close()
        return result
