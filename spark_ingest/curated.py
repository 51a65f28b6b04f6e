"""The curated table on disk: dedup against it, and an idempotent per-batch append.

Layout (plain Parquet, readable with ``spark.read.parquet(table)``)::

    <table>/dt=YYYY-MM-DD/b<batch>-<query>-part-....parquet   the rows
    <table>/_tmp/batch=<id>/                                 a batch being written
    <table>/_ingest/commit.json                              last batch fully appended
    <table>/_ingest/lock                                     one ingest at a time

Spark skips names starting with ``_``, so readers see only the partitions. A batch is
written to ``_tmp`` first and its files are then renamed into the partitions; only after the
last rename is ``commit.json`` replaced (atomically) with that batch id. A replay of a batch
whose ``commit.json`` entry exists is skipped. A replay after a crash in the middle of the
renames finds the already-renamed rows in the table and the key dedup drops them, so the
table never holds a row twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import shutil
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import IO

import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from segments.fileio import OS_FILE_IO, FileIO, atomic_write
from spark_ingest.schema import KEYS, LANDING_SPARK_SCHEMA, PARTITION_COLUMN

log = logging.getLogger(__name__)

ROW_ID = "_filemq_row_id"
_KEEP = "_filemq_keep"
_COPIES = "_filemq_copies"
_HASH = "_filemq_key_hash"
_IN_TABLE = -1  # row id given to keys already in the table: smaller than any batch row id


class TableLockedError(RuntimeError):
    """Another ingest holds the table's lock."""


class RowCountMismatch(RuntimeError):
    """A batch written to ``_tmp`` does not hold the number of rows it must; nothing of it
    was moved into the table."""


# Parquet writer options of the table's files. Dictionary encoding pays for columns with
# few distinct values in a row group (device_id, stream, topic, qos, received_at: one value
# per upstream batch) and never for the ones nearly unique per row: for those the writer
# would hash every value into a dictionary only to fall back to plain encoding once it is
# full, which cost ~20% of writing the table. (parquet-mr's per-column option.)
WRITE_OPTIONS: dict[str, str] = {
    f"parquet.enable.dictionary#{column}": "false"
    for column in ("offset", "publish_ts", "payload")
}


class CuratedTable:
    """One curated table directory. Not thread-safe; one ingest per table (see :meth:`lock`)."""

    def __init__(self, root: Path, fileio: FileIO = OS_FILE_IO) -> None:
        self.root = root
        self.meta_dir = root / "_ingest"
        self.tmp_dir = root / "_tmp"
        self._fileio = fileio

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold an exclusive lock on the table for the duration (flock on ``_ingest/lock``)."""
        self.meta_dir.mkdir(parents=True, exist_ok=True)
        handle: IO[bytes] = open(self.meta_dir / "lock", "ab")  # noqa: SIM115 - held open
        try:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise TableLockedError(
                    f"another ingest is writing {self.root} (lock {self.meta_dir / 'lock'})"
                ) from exc
            yield
        finally:
            handle.close()

    # -- commit marker -------------------------------------------------------------------

    def committed_batch(self, query_id: str) -> int | None:
        """The last batch id of query ``query_id`` fully appended, or None."""
        try:
            marker = json.loads((self.meta_dir / "commit.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            # A torn marker cannot happen (atomic_write); anything else is treated as "no
            # marker": the key dedup still keeps a replay from adding rows twice.
            log.warning("ignoring unreadable %s: %s", self.meta_dir / "commit.json", exc)
            return None
        if marker.get("query_id") != query_id:
            return None
        batch = marker.get("batch_id")
        return batch if isinstance(batch, int) else None

    def mark_committed(self, query_id: str, batch_id: int) -> None:
        body = {
            "query_id": query_id,
            "batch_id": batch_id,
            "committed_at": datetime.now(UTC).isoformat(),
        }
        atomic_write(self.meta_dir / "commit.json", json.dumps(body).encode(), self._fileio)

    # -- dedup ---------------------------------------------------------------------------

    def partitions_between(self, first: date, last: date) -> list[Path]:
        """Existing partition directories for the UTC days ``first``..``last``."""
        found = []
        day = first
        while day <= last:
            path = self.root / f"{PARTITION_COLUMN}={day.isoformat()}"
            if path.is_dir():
                found.append(path)
            day += timedelta(days=1)
        return found

    def data_files(self, partitions: list[Path]) -> list[Path]:
        """The Parquet data files in ``partitions`` (hidden names, e.g. Hadoop's ``.crc``, skipped)."""
        return sorted(
            f for part in partitions for f in part.glob("*.parquet")
            if not f.name.startswith(("_", "."))
        )

    def new_rows(
        self,
        spark: SparkSession,
        batch: DataFrame,
        row_id: Column,
        partitions: list[Path],
        helper_columns: tuple[str, ...] = (),
    ) -> tuple[DataFrame, int]:
        """Rows of ``batch`` whose key is neither in ``partitions`` nor earlier in the batch.

        ``row_id`` is an expression over ``batch`` giving a unique long per row that orders
        the copies of a key (the smallest is kept); it is evaluated only for rows whose key
        hash repeats. Returns the new rows without ``helper_columns`` and how many keys were
        duplicated.

        Cost: pass 1 shuffles only a 64-bit hash of each key and keeps the hashes seen more
        than once; pass 2 compares the full keys of just those rows (so a hash collision
        never drops a row) and picks the copy to keep; the few duplicated keys are then
        joined back, broadcast when small.
        """
        key_hash = F.xxhash64(*KEYS).alias(_HASH)
        hashes = batch.select(key_hash)
        existing: DataFrame | None = None
        if partitions:
            existing = (
                spark.read.schema(LANDING_SPARK_SCHEMA)
                .parquet(*[str(p) for p in partitions])
                .select(*KEYS)
            )
            hashes = hashes.unionByName(existing.select(key_hash))
        repeated = (
            hashes.groupBy(_HASH)
            .count()
            .where(F.col("count") > 1)
            .select(_HASH)
            .localCheckpoint(eager=True)
        )
        plain = batch.drop(*helper_columns)
        if repeated.isEmpty():
            return plain, 0
        candidates = (
            batch.select(*KEYS, key_hash, *helper_columns)
            .join(F.broadcast(repeated), _HASH, "left_semi")
            .select(*KEYS, row_id.alias(ROW_ID))
        )
        if existing is not None:
            candidates = candidates.unionByName(
                existing.select(*KEYS, key_hash)
                .join(F.broadcast(repeated), _HASH, "left_semi")
                .select(*KEYS, F.lit(_IN_TABLE).cast("long").alias(ROW_ID))
            )
        duplicated = (
            candidates.groupBy(*KEYS)
            .agg(F.count(F.lit(1)).alias(_COPIES), F.min(ROW_ID).alias(_KEEP))
            .where(F.col(_COPIES) > 1)
            .drop(_COPIES)
            .localCheckpoint(eager=True)
        )
        duplicated_keys = duplicated.count()
        if duplicated_keys == 0:
            return plain, 0
        if duplicated_keys <= _BROADCAST_KEYS:
            duplicated = F.broadcast(duplicated)
        # OR short-circuits: row_id is computed only for rows that have a duplicated key.
        keep: Column = F.col(_KEEP).isNull() | (F.col(_KEEP) == row_id)
        rows = batch.join(duplicated, KEYS, "left").where(keep).drop(_KEEP, *helper_columns)
        return rows, duplicated_keys

    # -- append --------------------------------------------------------------------------

    def clear_tmp(self) -> None:
        """Remove what an interrupted batch left in ``_tmp`` (never visible to readers)."""
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)

    def append(
        self, rows: DataFrame, query_id: str, batch_id: int, expected_rows: int | None = None
    ) -> int:
        """Write ``rows`` (with a ``dt`` column) into the table; return rows written.

        Files are written under ``_tmp/batch=<id>`` and renamed into their partitions with
        a ``b<batch>-<query>-`` prefix, each partition directory fsync'ed. The caller
        records the batch with :meth:`mark_committed` afterwards. If ``expected_rows`` is
        given and the written files hold another number of rows, :class:`RowCountMismatch`
        is raised before anything is renamed (and ``_tmp`` is cleared).
        """
        staging = self.tmp_dir / f"batch={batch_id}"
        writer = rows.write.mode("overwrite").partitionBy(PARTITION_COLUMN)
        for key, value in WRITE_OPTIONS.items():
            writer = writer.option(key, value)
        writer.parquet(str(staging))
        parts: list[tuple[Path, int]] = [
            (part, int(pq.read_metadata(part).num_rows))
            for part in sorted(staging.glob(f"{PARTITION_COLUMN}=*/*.parquet"))
            if not part.name.startswith(("_", "."))
        ]
        written = sum(n for _, n in parts)
        if expected_rows is not None and written != expected_rows:
            self.clear_tmp()
            raise RowCountMismatch(
                f"batch {batch_id} was written with {written} rows, expected {expected_rows}"
            )
        prefix = f"b{batch_id:010d}-{query_id[:8]}-"
        touched: set[Path] = set()
        for part, _ in parts:
            target_dir = self.root / part.parent.name
            if target_dir not in touched:
                target_dir.mkdir(parents=True, exist_ok=True)
                touched.add(target_dir)
            self._fileio.rename(part, target_dir / (prefix + part.name))
        for directory in sorted(touched):
            self._fileio.fsync_dir(directory)
        if touched:
            self._fileio.fsync_dir(self.root)
        self.clear_tmp()
        return written


# Up to this many duplicated keys are shipped to every task as a broadcast hash table
# (~100 bytes a key); above it Spark joins by shuffling.
_BROADCAST_KEYS = 2_000_000


def partition_value(column: str) -> Column:
    """The UTC date of a timestamp column (the session time zone must be UTC).

    A date, not a formatted string: cheaper per row, and the directory name is the same
    ``dt=YYYY-MM-DD``.
    """
    return F.to_date(F.col(column))

