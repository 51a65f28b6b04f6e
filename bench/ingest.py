"""`filemq bench ingest`: the Spark ingest against a plain Parquet copy of the same files.

Generates landing files with pyarrow through the real :class:`~collector.landing.LandingWriter`
(a known fraction of rows duplicated, within and across files), then in the same run and the
same SparkSession times

* the baseline: ``spark.read.parquet(landing).write.parquet(out)``, and
* our ingest: ``run_ingest(..., once=True)`` into an empty table,

and reports both times and their ratio (acceptance: ingest <= 1.5x the copy). It also checks
that the curated table holds exactly the unique keys, so a fast but wrong ingest fails.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from bench.harness.cpu import process_cpu_seconds
from collector.landing import LandingWriter

if TYPE_CHECKING:
    from spark_ingest.job import IngestSummary

log = logging.getLogger(__name__)

_BASE_US = int(datetime(2026, 3, 1, 18, tzinfo=UTC).timestamp() * 1_000_000)
# A prime: i -> i * P mod n is a permutation of range(n) whenever n is not a multiple of P;
# it scatters the duplicate rows over all files without numpy.
_SCATTER = 1_000_003


@dataclass(frozen=True)
class GeneratedLanding:
    """What :func:`generate_landing` wrote."""

    files: int
    rows: int
    unique_keys: int
    duplicates: int
    seconds: float


def generate_landing(
    landing_dir: Path, rows: int, files: int, dup_frac: float, devices: int = 100
) -> GeneratedLanding:
    """Write ``rows`` landing rows in ``files`` files; ``dup_frac`` of them repeat a key.

    Keys are ``device-<n>``/``telemetry``/offset for ``devices`` devices, one message a
    second per device from 2026-03-01 18:00 UTC (so large runs span two days); each duplicate is an exact copy of an earlier
    row (as a re-sent batch would be), scattered over all files.
    """
    if rows < 1 or files < 1 or not 0 <= dup_frac < 1:
        raise ValueError("need rows >= 1, files >= 1 and 0 <= dup_frac < 1")
    started = time.monotonic()
    duplicates = int(rows * dup_frac)
    unique = rows - duplicates
    ids = pa.array(range(unique), pa.int64())
    if duplicates:
        # Every (unique // duplicates)-th row appears twice.
        step = max(1, unique // duplicates)
        ids = pa.concat_arrays([ids, pa.array(range(0, step * duplicates, step), pa.int64())])
    multiplier = _SCATTER if math.gcd(rows, _SCATTER) == 1 else 1
    scatter = pc.remainder(pc.multiply(pa.array(range(rows), pa.int64()), multiplier), rows)
    ids = ids.take(scatter)
    writer = LandingWriter(landing_dir, "bench")
    per_file = -(-rows // files)
    written = 0
    for start in range(0, rows, per_file):
        chunk = ids.slice(start, per_file)
        writer.write(_rows_for(chunk, devices))
        written += 1
    seconds = time.monotonic() - started
    return GeneratedLanding(written, rows, unique, duplicates, seconds)


def _rows_for(ids: pa.Array, devices: int) -> pa.Table:
    n = len(ids)
    device = pc.cast(pc.remainder(ids, devices), pa.string())
    offset = pc.divide(ids, devices)
    device_id = pc.binary_join_element_wise("device-", device, "")
    publish_us = pc.add(pc.multiply(offset, 1_000_000), _BASE_US)
    # A reading that varies like a real sensor's (not a handful of values that dictionary
    # encoding would shrink to nothing): centi-degrees from a multiplicative hash of the id.
    centi = pc.remainder(pc.multiply(ids, 7919), 4000)
    temperature = pc.binary_join_element_wise(
        pc.cast(pc.divide(centi, 100), pa.string()),
        pc.utf8_lpad(pc.cast(pc.remainder(centi, 100), pa.string()), 2, "0"),
        ".",
    )
    payload = pc.binary_join_element_wise(
        '{"temperature": ', temperature, ', "humidity": 41.5, "seq": ',
        pc.cast(offset, pa.string()), "}", "",
    )
    return pa.table(
        {
            "device_id": device_id,
            "stream": pa.repeat("telemetry", n),
            "offset": offset,
            "topic": pc.binary_join_element_wise("sensors/", device_id, "/env", ""),
            "qos": pa.repeat(pa.scalar(1, pa.int8()), n),
            "publish_ts": pc.cast(publish_us, pa.timestamp("us", tz="UTC")),
            "received_at": pc.cast(pc.add(publish_us, 250_000), pa.timestamp("us", tz="UTC")),
            "payload": pc.cast(payload, pa.binary()),
        }
    )


@dataclass(frozen=True)
class IngestBenchResult:
    """Figures of one `filemq bench ingest` run (seconds are wall-clock)."""

    rows: int
    files: int
    duplicates: int
    generate_seconds: float
    copy_seconds: float
    ingest_seconds: float
    ratio: float
    copy_cpu_seconds: float | None
    ingest_cpu_seconds: float | None
    cpu_ratio: float | None
    rows_written: int
    duplicates_removed: int
    passed: bool
    copy_runs: list[float] = field(default_factory=list)
    ingest_runs: list[float] = field(default_factory=list)
    round_ratios: list[float] = field(default_factory=list)
    """ingest / copy of each round (the two runs of a round are back to back)."""

    def as_dict(self) -> dict[str, Any]:
        return {"bench": "ingest", **asdict(self)}


ACCEPTANCE_RATIO = 1.5


def run_ingest_bench(
    work_dir: Path,
    rows: int = 5_000_000,
    files: int = 50,
    dup_frac: float = 0.01,
    master: str = "local[2]",
    rounds: int = 5,
) -> IngestBenchResult:
    """Generate the landing files, time the plain copy and our ingest, compare.

    Method (the same for both sides, so neither gains from running second): one untimed
    warm-up run of each on all the files (JVM class loading and JIT of the read, write, join
    and partitioned-write paths; a warm-up on a few files left the first timed round up to
    60% slower), then ``rounds`` timed rounds that alternate the order
    (copy, ingest; ingest, copy; ...). Each ingest goes into a fresh empty table and
    checkpoint, each copy into a fresh directory. The best time of each side is compared;
    every run is reported too. The baseline is exactly
    ``spark.read.parquet(landing).write.parquet(out)``.
    """
    from spark_ingest.job import build_session

    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    # Only what this bench writes: --work-dir may be a directory that holds other things.
    subdirs = ["landing", "copy", "table", "checkpoint", "warmup"]
    subdirs += [f"{side}-{n}" for n in range(rounds) for side in ("copy", "ingest")]
    for sub in subdirs:
        shutil.rmtree(work_dir / sub, ignore_errors=True)
    log.warning("generating %d rows in %d landing files (%.1f%% duplicates)...",
                rows, files, dup_frac * 100)
    generated = generate_landing(work_dir / "landing", rows, files, dup_frac)
    incoming = work_dir / "landing" / "incoming"
    log.warning("generated in %.1fs; starting Spark (%s)", generated.seconds, master)
    spark = build_session(master=master, app_name="filemq-bench-ingest")
    copies: list[_Run] = []
    ingests: list[_Run] = []
    correct = True
    summary_rows = summary_dups = 0
    try:
        cpu = _jvm_cpu_clock(spark, master)
        # Untimed warm-up of both sides on all the files.
        log.warning("warm-up: one untimed run of each side")
        _copy(spark, incoming, work_dir / "warmup" / "copy", cpu)
        _ingest(spark, work_dir / "landing", work_dir / "warmup", cpu)
        shutil.rmtree(work_dir / "warmup", ignore_errors=True)
        for round_no in range(rounds):
            order = ("copy", "ingest") if round_no % 2 == 0 else ("ingest", "copy")
            for side in order:
                out = work_dir / f"{side}-{round_no}"
                if side == "copy":
                    run = _copy(spark, incoming, out / "copy", cpu)
                    copies.append(run)
                    log.warning("round %d plain copy: %.1fs", round_no, run.seconds)
                    shutil.rmtree(out, ignore_errors=True)
                    continue
                run = _ingest(spark, work_dir / "landing", out, cpu)
                ingests.append(run)
                log.warning("round %d ingest: %.1fs", round_no, run.seconds)
                if run.summary is None:  # _ingest always sets it; keeps mypy honest
                    raise RuntimeError("ingest run without a summary")
                table_rows = spark.read.parquet(str(out / "table")).count()
                summary_rows = run.summary.rows_written
                summary_dups = run.summary.duplicates_removed
                if not table_rows == generated.unique_keys == summary_rows:
                    correct = False
                    log.error(
                        "curated table has %d rows (summary says %d), expected %d unique keys",
                        table_rows, summary_rows, generated.unique_keys,
                    )
                shutil.rmtree(out, ignore_errors=True)
    finally:
        spark.stop()
    copy = min(copies, key=lambda r: r.seconds)
    ingest = min(ingests, key=lambda r: r.seconds)
    ratio = ingest.seconds / copy.seconds if copy.seconds > 0 else float("inf")
    copy_cpu = min((r.cpu for r in copies if r.cpu is not None), default=None)
    ingest_cpu = min((r.cpu for r in ingests if r.cpu is not None), default=None)
    return IngestBenchResult(
        rows=rows,
        files=generated.files,
        duplicates=generated.duplicates,
        generate_seconds=round(generated.seconds, 3),
        copy_seconds=round(copy.seconds, 3),
        ingest_seconds=round(ingest.seconds, 3),
        ratio=round(ratio, 3),
        copy_cpu_seconds=copy_cpu,
        ingest_cpu_seconds=ingest_cpu,
        cpu_ratio=round(ingest_cpu / copy_cpu, 3) if ingest_cpu and copy_cpu else None,
        rows_written=summary_rows,
        duplicates_removed=summary_dups,
        passed=correct and ratio <= ACCEPTANCE_RATIO,
        copy_runs=[round(r.seconds, 3) for r in copies],
        ingest_runs=[round(r.seconds, 3) for r in ingests],
        round_ratios=[round(i.seconds / c.seconds, 3) for c, i in zip(copies, ingests, strict=True)],
    )


@dataclass(frozen=True)
class _Run:
    seconds: float
    cpu: float | None
    summary: IngestSummary | None = None


def _copy(spark: Any, incoming: Path, out: Path, cpu: Callable[[], float | None]) -> _Run:
    """The baseline, exactly: ``spark.read.parquet(landing).write.parquet(out)``."""
    started, cpu_started = time.monotonic(), cpu()
    spark.read.parquet(str(incoming)).write.parquet(str(out))
    return _Run(time.monotonic() - started, _elapsed(cpu_started, cpu()))


def _ingest(
    spark: Any, landing: Path, root: Path, cpu: Callable[[], float | None]
) -> _Run:
    """``run_ingest(once=True)`` of ``landing`` into the empty ``root/table``."""
    from spark_ingest.job import IngestConfig, run_ingest

    config = IngestConfig(
        landing=landing, table=root / "table", checkpoint=root / "checkpoint"
    )
    started, cpu_started = time.monotonic(), cpu()
    summary = run_ingest(spark, config, once=True)
    return _Run(time.monotonic() - started, _elapsed(cpu_started, cpu()), summary)


def _jvm_cpu_clock(spark: Any, master: str) -> Callable[[], float | None]:
    """CPU seconds (user + system) used so far by the local Spark JVM and this process, or None.

    With a ``local[*]`` master the executors are threads of the driver JVM, so its CPU time
    is the job's work; unlike wall-clock time it does not grow when other processes compete
    for the cores. The Python driver's own CPU time is added because the ingest does part of
    its work there (the pyarrow key dedup); the copy uses next to none. Other masters (and
    non-Linux systems) report None.
    """
    if not master.startswith("local"):
        return lambda: None
    pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())

    def read() -> float | None:
        jvm = process_cpu_seconds(pid)
        if jvm is None:
            return None
        driver = os.times()
        return jvm + driver.user + driver.system

    return read


def _elapsed(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 2)
