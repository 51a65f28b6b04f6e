"""The ingest job: landed Parquet files -> the curated table, exactly one row per key.

A Structured Streaming query over ``<landing>/incoming`` (explicit landing schema; Spark's
file source skips names starting with ``_`` or ``.``) tracks which files belong to which
micro-batch in its checkpoint. Each micro-batch is handled by :class:`BatchIngestor` in
``foreachBatch``:

1. a batch already appended (``_ingest/commit.json`` of the table) is skipped (replay);
2. every file's footer is checked; a bad file is quarantined and reported, not fatal;
3. the good files are read, copies of a key within the batch and keys already in the
   curated partitions the batch touches are dropped: found on the driver with pyarrow
   (:func:`~spark_ingest.key_dedup.find_duplicates`) up to a key budget, by a distributed
   Spark job (:meth:`CuratedTable.new_rows`) above it;
4. the payload is optionally parsed as JSON into typed columns;
5. the rows are appended idempotently (:meth:`CuratedTable.append`) and the batch is
   recorded as committed, then Spark records it in the checkpoint.

No watermark is used: nothing is dropped for being late. docs/INGEST.md explains the state
this keeps. This file is also the ``spark-submit`` entry script (see :func:`main`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from collector.landing import INCOMING_DIR, QUARANTINE_DIR, quarantine, visible_files
from spark_ingest.curated import CuratedTable, RowCountMismatch, partition_value
from spark_ingest.key_dedup import DROP_FILE, DROP_ROW, Duplicates, find_duplicates
from spark_ingest.landing_files import (
    LandingFileCheck,
    batch_files,
    check_landing_file,
    seen_files,
)
from spark_ingest.schema import (
    LANDING_COLUMNS,
    LANDING_SPARK_SCHEMA,
    PARTITION_COLUMN,
    PAYLOAD_ERROR,
    PAYLOAD_ERROR_COLUMN,
    PayloadSchema,
)

log = logging.getLogger(__name__)

_CORRUPT = "_filemq_corrupt_payload"
# Where each batch row comes from (its file, its position), in both dedup paths; named
# apart from the drop list's columns, which the anti join matches them against.
_FILE = "_filemq_batch_file"
_ROW = "_filemq_batch_row"
# Spark's file source forgets files older than maxFileAge relative to the newest file it
# has seen, and would then never ingest a landing file copied in later with an old mtime.
# Ten years means "never"; the cost is one entry per file in the driver (see INGEST.md).
_MAX_FILE_AGE = "3650d"
# Up to this many rows to drop are shipped to every task as a broadcast hash table
# (~100 bytes a row); above it Spark joins by shuffling.
_BROADCAST_DROPS = 2_000_000
_DROP_SCHEMA = f"{DROP_FILE} string, {DROP_ROW} long"


DRIVER_DEDUP_MAX_KEYS = 10_000_000
"""Default key budget of the driver-side dedup (batch rows + table rows of the touched
partitions; ~50 bytes each on the driver, so ~500 MB at the budget). Above it the dedup runs
distributed in Spark instead."""


class IngestError(RuntimeError):
    """The ingest query failed; the message names the batch or file at fault."""


@dataclass(frozen=True)
class IngestConfig:
    """Where the job reads and writes, and what it does to payloads.

    ``landing``, ``table``, ``checkpoint`` (and ``archive``) must be on storage every Spark
    process sees at the same path (local disk for ``local[*]``, a shared mount on a
    cluster). ``payload_schema`` is a Spark DDL field list; when set the payload is parsed
    as JSON into those columns plus ``payload_error``. ``driver_dedup_max_keys``: up to
    this many keys (batch rows plus table rows of the partitions the batch touches) the
    duplicates are found on the driver with pyarrow; above it by a distributed Spark job.
    Both give the same rows.
    """

    landing: Path
    table: Path
    checkpoint: Path
    payload_schema: str | None = None
    archive: Path | None = None
    max_files_per_batch: int = 1000
    driver_dedup_max_keys: int = DRIVER_DEDUP_MAX_KEYS



@dataclass
class BatchReport:
    """What one micro-batch did. ``replayed`` batches had already been appended."""

    batch_id: int
    files: int = 0
    rows_in: int = 0
    rows_written: int = 0
    duplicates_removed: int = 0
    quarantined: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    replayed: bool = False
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"event": "batch", **asdict(self)}


@dataclass
class IngestSummary:
    """Totals over the batches of one :func:`run_ingest` call."""

    batches: int = 0
    files: int = 0
    rows_in: int = 0
    rows_written: int = 0
    duplicates_removed: int = 0
    quarantined: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, report: BatchReport) -> None:
        self.batches += 1
        self.files += report.files
        self.rows_in += report.rows_in
        self.rows_written += report.rows_written
        self.duplicates_removed += report.duplicates_removed
        self.quarantined.extend(report.quarantined)
        self.missing.extend(report.missing)

    def as_dict(self) -> dict[str, Any]:
        return {"event": "summary", **asdict(self)}


def build_session(
    master: str | None = "local[2]",
    app_name: str = "filemq-ingest",
    shuffle_partitions: int = 4,
) -> SparkSession:
    """A SparkSession set up for the ingest: UTC, no UI, quiet logs, few shuffle partitions.

    ``master=None`` leaves the master to ``spark-submit``.
    """
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.log.structuredLogging.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        # Keys are nearly all unique: a map-side partial aggregation would only add work.
        .config("spark.sql.execution.bypassPartialAggregation", "true")
        # A batch touches few dt partitions: each task keeps one open Parquet writer per
        # partition (up to 4) instead of sorting all its rows by dt first, which cost ~25%
        # of the write. Spark adds that sort in the optimizer unless planned writes are off;
        # past 4 partitions in one task it falls back to sorting the rest.
        .config("spark.sql.optimizer.plannedWrite.enabled", "false")
        .config("spark.sql.maxConcurrentOutputFileWriters", "4")
        # A batch is read as a list of files: Spark would otherwise run a distributed job
        # just to stat them when there are more than 32 (~1 s of a 50-file batch).
        .config("spark.sql.sources.parallelPartitionDiscovery.threshold", "1024")
    )
    if master is not None:
        builder = builder.master(master)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


class BatchIngestor:
    """The ``foreachBatch`` function: one micro-batch of landing files into the table."""

    def __init__(
        self,
        spark: SparkSession,
        config: IngestConfig,
        on_batch: Callable[[BatchReport], None],
    ) -> None:
        self.spark = spark
        self.config = config
        self.table = CuratedTable(config.table)
        self.payload = (
            PayloadSchema.parse(config.payload_schema) if config.payload_schema else None
        )
        self.on_batch = on_batch
        self.failure: tuple[int, Exception] | None = None
        self._query_id: str | None = None
        self._ahead: Future[_FoundAhead | None] | None = None

    def find_ahead(self) -> None:
        """Start finding the duplicates of the first batch now, while Spark starts the query.

        That batch is predicted as every landing file the checkpoint has not seen (when they
        fit in one batch, are all valid and the driver dedups them); it uses the result only
        if its files, their sizes and mtimes, and the table files checked against are
        exactly the predicted ones. Otherwise the batch does the work itself, as always.
        """
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="filemq-dedup-ahead")
        self._ahead = pool.submit(self._find_ahead)
        pool.shutdown(wait=False)

    def _find_ahead(self) -> _FoundAhead | None:
        try:
            incoming = (self.config.landing / INCOMING_DIR).absolute()
            seen = seen_files(self.config.checkpoint)
            paths = sorted(
                (p for p in visible_files(incoming) if p not in seen), key=lambda p: p.name
            )
            if not paths or len(paths) > self.config.max_files_per_batch:
                return None
            stats = {p: _stat_key(p) for p in paths}
            files = [check_landing_file(p) for p in paths]
            if not all(c.ok and c.rows for c in files):
                return None
            partitions, table_files, on_driver = self._plan(files)
            if not on_driver:
                return None
            return _FoundAhead(stats, tuple(table_files), find_duplicates(paths, table_files))
        except Exception as exc:  # noqa: BLE001 - only a head start: the batch redoes it
            log.debug("finding duplicates ahead of the first batch failed: %s", exc)
            return None

    def _found_ahead(
        self, files: list[LandingFileCheck], table_files: list[Path]
    ) -> Duplicates | None:
        """The duplicates found ahead for exactly these files and table files, or None."""
        ahead, self._ahead = self._ahead, None
        result = ahead.result() if ahead is not None else None
        if result is None or result.table_files != tuple(table_files):
            return None
        paths = [c.path for c in files]
        if sorted(result.stats) != sorted(paths):
            return None
        if any(_stat_key(p) != result.stats[p] for p in paths):
            return None
        log.debug("using the duplicates found ahead of the batch")
        return result.found

    def __call__(self, _stream_batch: DataFrame, batch_id: int) -> None:
        # The streaming DataFrame is not used: it cannot skip a corrupt file. The batch's
        # file list comes from the checkpoint, and the good files are read directly.
        started = time.monotonic()
        report = BatchReport(batch_id)
        try:
            query_id = self.query_id()
            committed = self.table.committed_batch(query_id)
            if committed is not None and batch_id <= committed:
                report.replayed = True
                log.info("batch %d was already appended; replay skipped", batch_id)
            else:
                self._ingest(batch_id, query_id, report)
        except Exception as exc:
            # Kept so run_ingest can raise the real error rather than Spark's wrapper.
            self.failure = (batch_id, exc)
            raise
        report.seconds = round(time.monotonic() - started, 3)
        self.on_batch(report)

    def query_id(self) -> str:
        """The query's id from the checkpoint (stable across restarts of one checkpoint)."""
        if self._query_id is None:
            metadata = self.config.checkpoint / "metadata"
            self._query_id = str(json.loads(metadata.read_text(encoding="utf-8"))["id"])
        return self._query_id

    def _ingest(self, batch_id: int, query_id: str, report: BatchReport) -> None:
        started = time.monotonic()
        self.table.clear_tmp()
        good: list[LandingFileCheck] = []
        for path in batch_files(self.config.checkpoint, batch_id):
            if not path.exists():
                self._missing(path, report)
                continue
            check = check_landing_file(path)
            if check.ok:
                good.append(check)
            else:
                quarantine(path, check.reason or "invalid", self.config.landing)
                report.quarantined.append(str(path))
        report.files = len(good)
        report.rows_in = sum(c.rows for c in good)
        nonempty = [c for c in good if c.rows]
        checked = time.monotonic()
        deduped = written = checked
        if nonempty:
            rows, expected = self._new_rows(nonempty, batch_id)
            deduped = time.monotonic()
            try:
                report.rows_written = self.table.append(
                    rows, query_id, batch_id, expected_rows=expected
                )
            except RowCountMismatch as exc:
                raise IngestError(
                    f"{exc}: the rows dropped are not the duplicates found; nothing of the"
                    " batch was added to the table"
                ) from exc
            written = time.monotonic()
        report.duplicates_removed = report.rows_in - report.rows_written
        self.table.mark_committed(query_id, batch_id)
        # Where a batch's time goes, for whoever tunes it (the Spark UI is off).
        log.debug(
            "batch %d: file checks %.2fs, dedup %.2fs, write %.2fs, commit %.2fs",
            batch_id, checked - started, deduped - checked, written - deduped,
            time.monotonic() - written,
        )

    def _new_rows(
        self, files: list[LandingFileCheck], batch_id: int
    ) -> tuple[DataFrame, int | None]:
        """The batch's rows to append (duplicates removed, ``dt`` added), and how many rows
        that must be when the driver knows it in advance (else None)."""
        partitions, table_files, on_driver = self._plan(files)
        expected: int | None = None
        if on_driver:
            rows, _, expected = self._dedup_on_driver(files, table_files, batch_id)
        else:
            rows, _ = self._dedup_in_spark(files, partitions)
        rows = rows.withColumn(PARTITION_COLUMN, partition_value("publish_ts"))
        if self.payload is not None:
            rows = self._parse_payload(rows, self.payload)
        return rows, expected

    def _plan(self, files: list[LandingFileCheck]) -> tuple[list[Path], list[Path], bool]:
        """For non-empty ``files``: the table partitions that may hold their keys, the data
        files in them, and whether the driver dedups them (within the key budget)."""
        first = min(c.first_day for c in files if c.first_day)
        last = max(c.last_day for c in files if c.last_day)
        partitions = self.table.partitions_between(first, last)
        table_files = self.table.data_files(partitions)
        keys = sum(c.rows for c in files)
        if keys <= self.config.driver_dedup_max_keys:
            keys += sum(pq.read_metadata(f).num_rows for f in table_files)
        names = [c.path.name for c in files]
        on_driver = keys <= self.config.driver_dedup_max_keys and len(set(names)) == len(names)
        return partitions, table_files, on_driver

    def _dedup_on_driver(
        self, files: list[LandingFileCheck], table_files: list[Path], batch_id: int
    ) -> tuple[DataFrame, int, int]:
        """Duplicates found with pyarrow on the driver; Spark scans the batch once, to write.

        Returns the rows, the number of duplicated keys, and how many rows the result must
        hold.
        """
        found = self._found_ahead(files, table_files)
        # pyarrow and the Spark driver (planning the read, in the JVM) both work outside
        # the GIL: find the duplicates while Spark plans.
        with ThreadPoolExecutor(max_workers=1) as pool:
            finding = (
                pool.submit(find_duplicates, [c.path for c in files], table_files)
                if found is None
                else None
            )
            batch = self.spark.read.schema(LANDING_SPARK_SCHEMA).parquet(
                *[str(c.path) for c in files]
            )
            names = _names_in_spark(batch, files)
            if finding is not None:
                found = finding.result()
        if found is None:  # unreachable: keeps mypy and readers sure
            raise IngestError("no duplicate list for the batch")
        expected = sum(c.rows for c in files) - found.rows.num_rows
        if found.rows.num_rows == 0:
            return batch, 0, expected
        located = batch.select(
            *LANDING_COLUMNS,
            F.col("_metadata.file_name").alias(_FILE),
            F.col("_metadata.row_index").alias(_ROW),
        )
        drop = self._drop_frame(_rename_files(found.rows, files, names), batch_id)
        # The join key is the row index alone, a long: Spark probes a LongHashedRelation,
        # a plain array indexed by row index when the drops' indexes are compact, and rows
        # are probed in row-index order. Only for a row whose index is dropped in some file
        # is the file name compared, as a join condition. (Written as greatest == least so
        # that the optimizer does not turn it into a second join key: a key with a string
        # makes Spark hash every row's file name, which cost about a third of a plain
        # copy of the data.) Both names are never null, so this is plain equality.
        same_file = F.greatest(located[_FILE], drop[DROP_FILE]) == F.least(
            located[_FILE], drop[DROP_FILE]
        )
        rows = located.join(drop, (located[_ROW] == drop[DROP_ROW]) & same_file, "left_anti")
        return rows.drop(_FILE, _ROW), found.keys, expected

    def _drop_frame(self, drops: pa.Table, batch_id: int) -> DataFrame:
        """``drops`` as a DataFrame to anti-join with, broadcast unless large.

        The rows go to Spark as a small Parquet file under the table's _tmp (on the same
        storage as the table, so executors of a cluster read it too); append() removes _tmp
        when the batch is written.
        """
        drop_file = self.table.tmp_dir / f"duplicates-batch={batch_id}.parquet"
        drop_file.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(drops, drop_file)
        drop = self.spark.read.schema(_DROP_SCHEMA).parquet(str(drop_file))
        return F.broadcast(drop) if drops.num_rows <= _BROADCAST_DROPS else drop

    def _dedup_in_spark(
        self, files: list[LandingFileCheck], partitions: list[Path]
    ) -> tuple[DataFrame, int]:
        scan = self.spark.read.schema(LANDING_SPARK_SCHEMA).parquet(*[str(c.path) for c in files])
        names = _names_in_spark(scan, files)
        index = F.create_map(*[x for i, n in enumerate(names) for x in (F.lit(n), F.lit(i))])
        # A unique long per row that orders copies by landing file name (= landing time)
        # then position: the first landed copy of a key is the one kept.
        row_id = F.element_at(index, F.col(_FILE)).cast("long") * F.lit(1 << 32) + F.col(_ROW)
        batch = scan.select(
            *LANDING_COLUMNS,
            F.col("_metadata.file_name").alias(_FILE),
            F.col("_metadata.row_index").alias(_ROW),
        )
        return self.table.new_rows(
            self.spark, batch, row_id, partitions, helper_columns=(_FILE, _ROW)
        )

    def _parse_payload(self, rows: DataFrame, payload: PayloadSchema) -> DataFrame:
        parsed = F.from_json(
            F.col("payload").cast("string"),
            f"{payload.ddl}, {_CORRUPT} string",
            {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": _CORRUPT},
        )
        rows = rows.withColumn("_filemq_payload", parsed)
        typed = [F.col("_filemq_payload").getField(n).alias(n) for n in payload.names]
        error = F.when(
            F.col("_filemq_payload").getField(_CORRUPT).isNotNull(), F.lit(PAYLOAD_ERROR)
        ).alias(PAYLOAD_ERROR_COLUMN)
        return rows.select(*LANDING_COLUMNS, *typed, error, PARTITION_COLUMN)

    def _missing(self, path: Path, report: BatchReport) -> None:
        quarantined = self.config.landing / QUARANTINE_DIR / path.parent.name / path.name
        if quarantined.exists():
            # Quarantined by an earlier attempt at this batch (and reported then).
            return
        log.error(
            "landing file %s of batch listed in the checkpoint is gone (not quarantined);"
            " its rows are not in the table unless it was ingested before",
            path,
        )
        report.missing.append(str(path))


@dataclass(frozen=True)
class _FoundAhead:
    """:func:`find_duplicates` run before the first batch, on the files predicted for it."""

    stats: dict[Path, tuple[int, int]]
    table_files: tuple[Path, ...]
    found: Duplicates


def _stat_key(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _names_in_spark(batch: DataFrame, files: list[LandingFileCheck]) -> list[str]:
    """Each file's name as ``_metadata.file_name`` gives it for ``batch`` (read from ``files``).

    Spark gives the name URL-encoded (``a b#.parquet`` is ``a%20b%23.parquet``); matching
    rows to files by the plain name would silently match nothing for such a file.
    """
    spark_names: dict[str, str] = {}
    for uri in batch.inputFiles():
        encoded = uri.rstrip("/").rsplit("/", 1)[-1]
        spark_names[unquote(encoded)] = encoded
    missing = [str(c.path) for c in files if c.path.name not in spark_names]
    if missing:
        raise IngestError(f"Spark does not list landing file(s) {', '.join(missing)} it was given")
    return [spark_names[c.path.name] for c in files]


def _rename_files(drops: pa.Table, files: list[LandingFileCheck], names: list[str]) -> pa.Table:
    """``drops`` with each file named as Spark names it (only differs for unusual names)."""
    renamed = {c.path.name: n for c, n in zip(files, names, strict=True) if c.path.name != n}
    if not renamed:
        return drops
    column = [renamed.get(v, v) for v in drops.column(DROP_FILE).to_pylist()]
    index = drops.schema.get_field_index(DROP_FILE)
    return drops.set_column(index, DROP_FILE, pa.array(column, pa.string()))


def run_ingest(
    spark: SparkSession,
    config: IngestConfig,
    *,
    once: bool = True,
    every: float | None = None,
    on_batch: Callable[[BatchReport], None] | None = None,
    stop: threading.Event | None = None,
) -> IngestSummary:
    """Ingest landed files into the table and return the totals.

    ``once``: everything landed so far, then return (``availableNow`` trigger; cron).
    Otherwise a micro-batch every ``every`` seconds until ``stop`` is set (or forever).
    Each committed batch is logged and passed to ``on_batch``. Raises
    :class:`IngestError` if the query fails; batches committed before stay committed and
    the next run resumes after them.
    """
    if not once and (every is None or every <= 0):
        raise ValueError("give once=True or every=<seconds> > 0")
    if config.max_files_per_batch < 1:
        raise ValueError("max_files_per_batch must be at least 1")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    started = time.monotonic()
    summary = IngestSummary()

    def record(report: BatchReport) -> None:
        summary.add(report)
        _log_batch(report)
        if on_batch is not None:
            on_batch(report)

    ingestor = BatchIngestor(spark, config, record)
    incoming = config.landing / INCOMING_DIR
    incoming.mkdir(parents=True, exist_ok=True)
    table = CuratedTable(config.table)
    with table.lock():
        reader = (
            spark.readStream.schema(LANDING_SPARK_SCHEMA)
            # Files are found below incoming/dt=.../ without inferring `dt` as a partition
            # column: inferred, it would exist only if dt= directories were there when the
            # query started, and a query started on an empty landing dir would fail at its
            # first files ("Invalid batch"). The job derives dt from publish_ts itself.
            .option("recursiveFileLookup", "true")
            .option("maxFilesPerTrigger", config.max_files_per_batch)
            .option("maxFileAge", _MAX_FILE_AGE)
        )
        if config.archive is not None:
            config.archive.mkdir(parents=True, exist_ok=True)
            reader = reader.option("cleanSource", "archive").option(
                "sourceArchiveDir", str(config.archive)
            )
        writer = (
            reader.parquet(str(incoming))
            .writeStream.foreachBatch(ingestor)
            .option("checkpointLocation", str(config.checkpoint))
        )
        writer = (
            writer.trigger(availableNow=True)
            if once
            else writer.trigger(processingTime=f"{every} seconds")
        )
        ingestor.find_ahead()
        query = writer.start()
        try:
            while query.isActive:
                if stop is not None and stop.is_set():
                    query.stop()
                    break
                with contextlib.suppress(StreamingQueryException):
                    query.awaitTermination(1)
            failure = query.exception()
        finally:
            if query.isActive:
                query.stop()
    if ingestor.failure is not None:
        batch_id, exc = ingestor.failure
        raise IngestError(
            f"ingest of {incoming} into {config.table} failed in batch {batch_id}: {exc}"
        ) from exc
    if failure is not None:
        raise IngestError(f"ingest of {incoming} into {config.table} failed: {failure}")
    summary.seconds = round(time.monotonic() - started, 3)
    return summary


def _log_batch(report: BatchReport) -> None:
    if report.replayed:
        return
    rate = report.rows_in / report.seconds if report.seconds > 0 else 0.0
    log.info(
        "batch %d: %d files, %d rows in, %d written, %d duplicates removed, %.1fs (%.0f rows/s)",
        report.batch_id,
        report.files,
        report.rows_in,
        report.rows_written,
        report.duplicates_removed,
        report.seconds,
        rate,
    )
    for path in report.quarantined:
        log.warning("batch %d: quarantined %s", report.batch_id, path)


def main(argv: Sequence[str] | None = None) -> int:
    """``spark-submit [...] spark_ingest/job.py --landing DIR --table DIR --checkpoint DIR``.

    The same options as ``filemq ingest``; the master comes from spark-submit unless
    ``--master`` is given. Prints one JSON object per batch and a summary on stdout.
    """
    parser = argparse.ArgumentParser(prog="spark_ingest.job", description=__doc__.split("\n")[0])
    parser.add_argument("--landing", type=Path, required=True)
    parser.add_argument("--table", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--master", default=None)
    parser.add_argument("--every", type=float, default=None, help="seconds between batches")
    parser.add_argument("--payload-schema", default=None)
    parser.add_argument("--archive", type=Path, default=None)
    parser.add_argument("--max-files-per-batch", type=int, default=1000)
    parser.add_argument(
        "--driver-dedup-max-keys", type=int, default=DRIVER_DEDUP_MAX_KEYS,
        help="find duplicates on the driver up to this many keys, in Spark above it",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = IngestConfig(
        landing=args.landing,
        table=args.table,
        checkpoint=args.checkpoint,
        payload_schema=args.payload_schema,
        archive=args.archive,
        max_files_per_batch=args.max_files_per_batch,
        driver_dedup_max_keys=args.driver_dedup_max_keys,
    )
    spark = build_session(master=args.master)
    try:
        summary = run_ingest(
            spark,
            config,
            once=args.every is None,
            every=args.every,
            on_batch=lambda r: print(json.dumps(r.as_dict()), flush=True),
        )
    finally:
        spark.stop()
    print(json.dumps(summary.as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
