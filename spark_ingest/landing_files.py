"""Which landing files a micro-batch holds, and whether each one is fit to ingest.

Both run on the driver and read only metadata: the checkpoint's file-source log (the list
of files Spark assigned to a batch) and each Parquet footer (schema, row count, null counts
and publish_ts range from the row-group statistics). No row data is read here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq

from collector.landing import LANDING_SCHEMA, PROPERTY_COLUMNS, REQUIRED_COLUMNS

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """The checkpoint does not say which files a batch holds (damaged or foreign)."""


@dataclass(frozen=True)
class LandingFileCheck:
    """The verdict on one landing file; ``reason`` is set exactly when it is bad."""

    path: Path
    rows: int = 0
    first_day: date | None = None
    last_day: date | None = None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None


def batch_files(checkpoint: Path, batch_id: int, source: int = 0) -> list[Path]:
    """The landing files Spark's file source assigned to ``batch_id``, sorted by name.

    Reads ``<checkpoint>/sources/<source>/<batch_id>`` (or the ``.compact`` file that
    replaces it every few batches), the log Spark writes before it runs the batch. Only
    ``file:`` paths are supported (landing on local or shared POSIX storage).
    """
    log_dir = checkpoint / "sources" / str(source)
    plain = log_dir / str(batch_id)
    compact = log_dir / f"{batch_id}.compact"
    log_file = plain if plain.exists() else compact
    if not log_file.exists():
        raise CheckpointError(f"no file list for batch {batch_id} in {log_dir}")
    paths = [path for entry_batch, path in _log_entries(log_file) if entry_batch == batch_id]
    return sorted(paths, key=lambda p: p.name)


def seen_files(checkpoint: Path, source: int = 0) -> set[Path]:
    """Every landing file the checkpoint's file-source log lists (all batches so far)."""
    log_dir = checkpoint / "sources" / str(source)
    if not log_dir.is_dir():
        return set()
    seen: set[Path] = set()
    for log_file in log_dir.iterdir():
        if log_file.name.removesuffix(".compact").isdigit():
            seen.update(path for _, path in _log_entries(log_file))
    return seen


def _log_entries(log_file: Path) -> list[tuple[int | None, Path]]:
    """(batch id, path) of each entry of one file-source log file. A compact file lists
    the entries of every earlier batch too, each with its batch id."""
    lines = log_file.read_text(encoding="utf-8").splitlines()
    if not lines or not lines[0].startswith("v"):
        raise CheckpointError(f"{log_file}: not a file-source log (no version line)")
    entries: list[tuple[int | None, Path]] = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{log_file}:{number}: bad entry: {exc}") from exc
        entries.append((entry.get("batchId"), _local_path(entry["path"], log_file)))
    return entries


def _local_path(uri: str, log_file: Path) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        raise CheckpointError(
            f"{log_file}: landing file {uri} is not on a local or shared POSIX file system"
            " (only file: paths are supported)"
        )
    return Path(unquote(parsed.path))


def check_landing_file(path: Path) -> LandingFileCheck:
    """Read the footer of ``path`` and say whether it is a valid landing file.

    Bad (with the reason): unreadable or not Parquet; a landing column missing or of
    another type; a null in a :data:`~collector.landing.REQUIRED_COLUMNS` column; no
    publish_ts statistics to place it in a partition. Extra columns are allowed and ignored.
    A schema version 1 file (every column but :data:`~collector.landing.PROPERTY_COLUMNS`)
    is valid; a file with some of the property columns must have all of them.
    """
    try:
        meta = pq.read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as exc:
        return LandingFileCheck(path, reason=f"not a readable Parquet file: {exc}")
    version_1 = all(schema.get_field_index(name) < 0 for name in PROPERTY_COLUMNS)
    for field in LANDING_SCHEMA:
        index = schema.get_field_index(field.name)
        if index < 0 and version_1 and field.name in PROPERTY_COLUMNS:
            continue
        if index < 0:
            return LandingFileCheck(path, reason=f"column {field.name!r} is missing")
        found = schema.field(index).type
        if found != field.type:
            return LandingFileCheck(
                path, reason=f"column {field.name!r} is {found}, expected {field.type}"
            )
    if meta.num_rows == 0:
        return LandingFileCheck(path, rows=0)
    positions = {meta.schema.column(i).name: i for i in range(meta.num_columns)}
    first: datetime | None = None
    last: datetime | None = None
    for group in range(meta.num_row_groups):
        row_group = meta.row_group(group)
        for name in REQUIRED_COLUMNS:
            stats = row_group.column(positions[name]).statistics
            if stats is None or not stats.has_null_count:
                return LandingFileCheck(path, reason=f"column {name!r} has no statistics")
            if stats.null_count:
                return LandingFileCheck(
                    path,
                    reason=f"column {name!r} has {stats.null_count} null value(s) in row"
                    f" group {group}",
                )
        stats = row_group.column(positions["publish_ts"]).statistics
        if not stats.has_min_max:
            return LandingFileCheck(path, reason="column 'publish_ts' has no min/max statistics")
        low, high = _as_utc(stats.min), _as_utc(stats.max)
        first = low if first is None else min(first, low)
        last = high if last is None else max(last, high)
    assert first is not None and last is not None
    return LandingFileCheck(path, meta.num_rows, first.date(), last.date())


def _as_utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
