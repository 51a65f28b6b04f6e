"""Durable landing of Parquet files for the Spark ingest (the collector -> Spark contract).

A :class:`LandingWriter` turns one batch of rows into one Parquet file with the exact
:data:`LANDING_SCHEMA`, written under ``<landing>/_staging/``, fdatasync'ed, renamed into
``<landing>/incoming/dt=YYYY-MM-DD/`` and made durable with directory fsyncs
(ARCHITECTURE.md, guarantee 4). A reader of ``incoming/`` therefore sees a landing file whole
or not at all. :func:`quarantine` moves a bad landing file aside with a reason next to it.

This module needs pyarrow and is imported only by the collector and the ingest job, never by
device code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeAlias

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from segments.fileio import OS_FILE_IO, FileIO, atomic_write

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
"""Value of the ``schema_version`` column for files written by this module.

History (docs/INGEST.md): 1, the ten columns of :data:`LANDING_SCHEMA_V1`; 2 (issue 13), the
same ten then the nullable MQTT 5.0 message property columns :data:`PROPERTY_FIELDS`."""

USER_PROPERTY_TYPE = pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.string())]))
"""``user_properties``: the MQTT 5.0 user properties in wire order, repeats kept."""

PROPERTY_FIELDS: tuple[pa.Field, ...] = (
    pa.field("payload_format_indicator", pa.int8()),  # 0x01: 0 unspecified bytes, 1 UTF-8
    pa.field("message_expiry_s", pa.int64()),  # 0x02: the interval in seconds, as published
    pa.field("content_type", pa.string()),  # 0x03
    pa.field("response_topic", pa.string()),  # 0x08
    pa.field("correlation_data", pa.binary()),  # 0x09
    pa.field("user_properties", USER_PROPERTY_TYPE),  # 0x26
)
"""The MQTT 5.0 message properties of a row (schema version 2): each null when the message
did not carry it (every MQTT 3.1.1 message, and every row of a version 1 file)."""

PROPERTY_COLUMNS: tuple[str, ...] = tuple(f.name for f in PROPERTY_FIELDS)

LANDING_SCHEMA_V1: pa.Schema = pa.schema(
    [
        pa.field("device_id", pa.string()),
        pa.field("stream", pa.string()),
        pa.field("offset", pa.int64()),
        pa.field("topic", pa.string()),
        pa.field("qos", pa.int8()),
        pa.field("publish_ts", pa.timestamp("us", tz="UTC")),
        pa.field("received_at", pa.timestamp("us", tz="UTC")),
        pa.field("collector_id", pa.string()),
        pa.field("payload", pa.binary()),
        pa.field("schema_version", pa.int16()),
    ]
)
"""The columns of a schema version 1 landing file (every release before issue 13)."""

LANDING_SCHEMA: pa.Schema = pa.schema([*LANDING_SCHEMA_V1, *PROPERTY_FIELDS])
"""The landing file columns, in order (ARCHITECTURE.md, "Landing file"): the version 1
columns, then :data:`PROPERTY_FIELDS`."""

KEY_COLUMNS: tuple[str, ...] = ("device_id", "stream", "offset")
"""The idempotency key: at most one curated row per value of these columns."""

REQUIRED_COLUMNS: tuple[str, ...] = (*KEY_COLUMNS, "publish_ts", "received_at")
"""Columns that may never be null in a landing file (the ingest partitions by publish_ts)."""

STAGING_DIR = "_staging"
INCOMING_DIR = "incoming"
QUARANTINE_DIR = "quarantine"

# Collector ids end up in file names: keep them to characters that are safe in a path and
# that Spark's file listing does not treat specially ('_' or '.' first means hidden).
_COLLECTOR_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

Rows: TypeAlias = pa.Table | Sequence[Mapping[str, Any]] | Mapping[str, Sequence[Any]]
"""What :meth:`LandingWriter.write` accepts: an Arrow table, a list of row dicts, or columns."""


class LandingError(ValueError):
    """A batch cannot be landed as given (bad rows or columns); nothing was written."""


class LandingWriter:
    """Writes batches as landing files under one landing directory for one collector.

    Callers may rely on:

    * a file appears in ``incoming/dt=YYYY-MM-DD/`` only complete and fdatasync'ed, and the
      rename into it is durable when :meth:`write` returns;
    * ``dt`` is the UTC date of the earliest ``received_at`` in the batch;
    * file names are ``<UTC write time>-<collector_id>-<run>-<seq>.parquet``: they sort by
      the time they were written, are unique per writer (the write time is strictly
      increasing within a writer, ``run`` is random per writer instance) and differ between
      collectors, so several collectors can share one landing directory;
    * ``collector_id`` and ``schema_version`` columns are filled in when the rows lack them,
      the :data:`PROPERTY_COLUMNS` with nulls.
    """

    def __init__(
        self,
        landing_dir: str | os.PathLike[str],
        collector_id: str,
        fileio: FileIO = OS_FILE_IO,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        compression: str = "snappy",
    ) -> None:
        if not _COLLECTOR_ID.fullmatch(collector_id):
            raise LandingError(
                f"collector id {collector_id!r} must be 1-64 characters of letters, digits,"
                " '_', '.', '-' and start with a letter or digit"
            )
        self.landing_dir = Path(landing_dir)
        self.collector_id = collector_id
        self._fileio = fileio
        self._clock = clock
        self._compression = compression
        self._run = secrets.token_hex(3)
        self._seq = 0
        self._last_stamp: datetime | None = None
        self._lock = threading.Lock()
        self.staging_dir = self.landing_dir / STAGING_DIR
        self.incoming_dir = self.landing_dir / INCOMING_DIR
        for directory in (self.landing_dir, self.staging_dir, self.incoming_dir):
            self._make_dir(directory)

    def write(self, rows: Rows) -> Path:
        """Land ``rows`` as one Parquet file and return its path under ``incoming/``.

        Raises :class:`LandingError` (nothing written) for an empty batch, a missing column,
        a null in a :data:`REQUIRED_COLUMNS` column or a value that does not fit its type.
        """
        table = self._to_table(rows)
        received = table.column("received_at")
        earliest = pc.min(received).as_py()
        dt = earliest.astimezone(UTC).strftime("%Y-%m-%d")
        name = self._next_name()
        staged = self.staging_dir / name
        target_dir = self.incoming_dir / f"dt={dt}"
        try:
            pq.write_table(table, staged, compression=self._compression)
            # pyarrow closes the file without syncing; reopen it to fdatasync the bytes
            # before the rename can make them visible.
            handle = self._fileio.open(staged)
            try:
                handle.datasync()
            finally:
                handle.close()
            self._make_dir(target_dir)
            target = target_dir / name
            self._fileio.rename(staged, target)
        except Exception:
            # An ordinary failure (disk full, bad value): leave nothing behind in staging;
            # the caller still holds the rows (or its WAL does) and may retry. A crash leaves
            # the staging file for recover_staging().
            self._remove_quietly(staged)
            raise
        self._fileio.fsync_dir(target_dir)
        self._fileio.fsync_dir(self.staging_dir)
        log.debug("landed %d rows in %s", table.num_rows, target)
        return target

    def recover_staging(self) -> list[Path]:
        """Remove this collector's files left in ``_staging/`` by a crash; return them.

        Call once at collector start-up, before the first :meth:`write`. Only files named
        by a writer with this ``collector_id`` (any earlier run of it) are removed: several
        collectors may share one landing directory, and a staging file of another collector
        may be one it is writing right now. A staging file was never renamed into
        ``incoming/``, so no reader has seen it, and the collector has not acknowledged its
        rows upstream: they are still in the collector's WAL and will be landed again, so
        deleting the partial file loses nothing. Files whose names this module did not
        produce are left alone too.
        """
        removed: list[Path] = []
        for entry in sorted(self.staging_dir.iterdir()):
            if entry.is_file() and staging_owner(entry.name) == self.collector_id:
                self._fileio.unlink(entry)
                removed.append(entry)
        if removed:
            self._fileio.fsync_dir(self.staging_dir)
            log.warning(
                "removed %d partial landing file(s) from %s after a crash; their rows will be"
                " landed again from the WAL",
                len(removed),
                self.staging_dir,
            )
        return removed

    def _next_name(self) -> str:
        with self._lock:
            stamp = self._clock().astimezone(UTC)
            # Strictly increasing per writer even if the clock stands still or steps back,
            # so names from one writer sort in write order.
            if self._last_stamp is not None and stamp <= self._last_stamp:
                stamp = self._last_stamp + _ONE_MICROSECOND
            self._last_stamp = stamp
            self._seq += 1
            seq = self._seq
        return (
            f"{stamp.strftime('%Y%m%dT%H%M%S.%fZ')}-{self.collector_id}-{self._run}"
            f"-{seq:06d}.parquet"
        )

    def _to_table(self, rows: Rows) -> pa.Table:
        if isinstance(rows, pa.Table):
            source = rows
        elif isinstance(rows, Mapping):
            source = pa.table(dict(rows))
        else:
            if not rows:
                raise LandingError("empty batch: nothing to land")
            source = pa.Table.from_pylist(list(rows))
        if source.num_rows == 0:
            raise LandingError("empty batch: nothing to land")
        columns: list[pa.Array | pa.ChunkedArray] = []
        for field in LANDING_SCHEMA:
            if field.name in source.column_names:
                column = source.column(field.name)
            elif field.name == "collector_id":
                column = pa.array([self.collector_id] * source.num_rows, pa.string())
            elif field.name == "schema_version":
                column = pa.array([SCHEMA_VERSION] * source.num_rows, pa.int16())
            elif field.name in PROPERTY_COLUMNS:
                column = pa.nulls(source.num_rows, field.type)
            else:
                raise LandingError(f"batch has no column {field.name!r}")
            try:
                column = column.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                raise LandingError(
                    f"column {field.name!r} does not fit {field.type}: {exc}"
                ) from exc
            if field.name in REQUIRED_COLUMNS and column.null_count:
                raise LandingError(
                    f"column {field.name!r} has {column.null_count} null value(s);"
                    " it is required"
                )
            columns.append(column)
        return pa.Table.from_arrays(columns, schema=LANDING_SCHEMA)

    def _remove_quietly(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fileio.unlink(path)

    def _make_dir(self, directory: Path) -> None:
        if directory.is_dir():
            return
        directory.mkdir(parents=True, exist_ok=True)
        # The new entry lives in the parent; fsync it so the directory survives a power cut.
        self._fileio.fsync_dir(directory.parent)


# <UTC write time>-<collector id>-<run>-<seq>.parquet, as LandingWriter._next_name makes them.
# The fields around the collector id have fixed shapes, so the id (which may itself hold
# '-') is recovered exactly: "a" never claims a file of collector "a-b".
_LANDED_NAME = re.compile(
    r"\d{8}T\d{6}\.\d{6}Z-(?P<collector>.+)-[0-9a-f]{6}-\d{6,}\.parquet"
)


def visible_files(root: Path, pattern: str = "*") -> list[Path]:
    """Files matching ``pattern`` under ``root`` that a reader of landing files sees, as
    Spark's file source lists them: none with a name below ``root`` starting with ``_`` or
    ``.`` (``_staging``, ``.crc`` files, ...)."""
    return [
        p for p in root.rglob(pattern)
        if p.is_file()
        and not any(part.startswith(("_", ".")) for part in p.relative_to(root).parts)
    ]


def staging_owner(name: str) -> str | None:
    """The collector id in a landing file name written by :class:`LandingWriter`, or None."""
    match = _LANDED_NAME.fullmatch(name)
    return match.group("collector") if match else None


def quarantine(
    path: str | os.PathLike[str],
    reason: str,
    landing_dir: str | os.PathLike[str] | None = None,
    fileio: FileIO = OS_FILE_IO,
) -> Path:
    """Move a bad landing file to ``<landing>/quarantine/`` and write why next to it.

    ``landing_dir`` defaults to the parent of the ``incoming`` directory ``path`` is in. The
    file keeps its name (under a ``dt=...`` subdirectory when it came from one) and
    ``<name>.reason`` holds ``reason``. Both are durable when this returns. Returns the new
    path of the file.
    """
    source = Path(path)
    if landing_dir is None:
        landing = next((p.parent for p in source.parents if p.name == INCOMING_DIR), None)
        if landing is None:
            raise LandingError(f"{source} is not under an {INCOMING_DIR!r} directory")
    else:
        landing = Path(landing_dir)
    target_dir = landing / QUARANTINE_DIR
    if source.parent.name.startswith("dt="):
        target_dir = target_dir / source.parent.name
    if not target_dir.is_dir():
        target_dir.mkdir(parents=True, exist_ok=True)
        fileio.fsync_dir(target_dir.parent)
    target = target_dir / source.name
    # Reason first: a crash between the two steps leaves a reason for a file still in
    # incoming (quarantined again next time), never a quarantined file without a reason.
    atomic_write(
        target_dir / f"{source.name}.reason", (reason.rstrip("\n") + "\n").encode(), fileio
    )
    fileio.rename(source, target)
    fileio.fsync_dir(target_dir)
    fileio.fsync_dir(source.parent)
    log.warning("quarantined landing file %s -> %s: %s", source, target, reason)
    return target


_ONE_MICROSECOND = timedelta(microseconds=1)
