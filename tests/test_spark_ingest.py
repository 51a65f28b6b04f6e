"""spark_ingest: exactly one curated row per (device_id, stream, offset), whatever arrives.

All Spark tests share the session-scoped ``spark`` fixture (local[1]); each run_ingest call
costs a couple of seconds, so scenarios are combined where they do not hide each other.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector.landing import LANDING_SCHEMA, LANDING_SCHEMA_V1, LandingWriter
from segments.fileio import OsFileIO
from spark_ingest.job import BatchReport, IngestConfig, IngestError, IngestSummary, run_ingest
from spark_ingest.key_dedup import DROP_FILE, DROP_ROW, find_duplicates
from spark_ingest.landing_files import CheckpointError, batch_files, check_landing_file
from spark_ingest.schema import LANDING_SPARK_SCHEMA, PAYLOAD_ERROR, PayloadSchema

pytestmark = pytest.mark.spark

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)


def rows(
    offsets: range | list[int],
    device: str = "dev-1",
    stream: str = "telemetry",
    published: datetime = NOW,
    received: datetime | None = None,
    payload: bytes | None = None,
) -> list[dict[str, Any]]:
    received = received or published + timedelta(seconds=1)
    return [
        {
            "device_id": device,
            "stream": stream,
            "offset": o,
            "topic": f"sensors/{device}",
            "qos": 1,
            "publish_ts": published + timedelta(milliseconds=o),
            "received_at": received,
            "payload": payload if payload is not None else json.dumps({"o": o}).encode(),
        }
        for o in offsets
    ]


class Pipeline:
    """A landing dir, a table and a checkpoint under one tmp dir, and helpers to use them."""

    def __init__(self, root: Path, spark: Any, **config: Any) -> None:
        self.spark = spark
        self.root = root
        self.config = IngestConfig(
            landing=root / "landing", table=root / "table", checkpoint=root / "ckpt", **config
        )
        self.writer = LandingWriter(self.config.landing, "c1")
        self.reports: list[BatchReport] = []

    def land(self, batch: list[dict[str, Any]]) -> Path:
        return self.writer.write(batch)

    def ingest(self) -> IngestSummary:
        return run_ingest(self.spark, self.config, once=True, on_batch=self.reports.append)

    def table(self) -> list[dict[str, Any]]:
        if not self.config.table.exists():
            return []
        found = []
        for row in self.spark.read.parquet(str(self.config.table)).collect():
            record = row.asDict()
            # PySpark returns timestamps as naive local times; make them comparable.
            for column in ("publish_ts", "received_at"):
                record[column] = record[column].astimezone(UTC)
            found.append(record)
        return found

    def keys(self) -> Counter[tuple[str, str, int]]:
        return Counter((r["device_id"], r["stream"], r["offset"]) for r in self.table())


def expected_keys(*batches: list[dict[str, Any]]) -> set[tuple[str, str, int]]:
    return {(r["device_id"], r["stream"], r["offset"]) for b in batches for r in b}


# The dedup runs on the driver (pyarrow) below a key budget and distributed in Spark above
# it; the scenarios that matter most run through both.
BOTH_DEDUP_PATHS = pytest.mark.parametrize(
    "budget", [0, 10_000_000], ids=["spark-dedup", "driver-dedup"]
)


@BOTH_DEDUP_PATHS
def test_duplicates_within_file_across_files_and_runs_give_one_row_each(
    spark: Any, tmp_path: Path, budget: int
) -> None:
    p = Pipeline(tmp_path, spark, driver_dedup_max_keys=budget)
    first = rows(range(0, 10))
    # Within one file: offsets 3 and 4 twice. Across files: 5..14 overlaps the first file.
    p.land(first + rows([3, 4], received=NOW + timedelta(minutes=5)))
    second = rows(range(5, 15), received=NOW + timedelta(minutes=10))
    p.land(second)
    other_device = rows(range(0, 5), device="dev-2")  # same offsets, other key
    p.land(other_device)
    summary = p.ingest()
    keys = p.keys()
    assert set(keys) == expected_keys(first, second, other_device)
    assert max(keys.values()) == 1
    assert summary.rows_in == 12 + 10 + 5
    assert summary.rows_written == len(keys) == 20
    assert summary.duplicates_removed == 7
    # The first landed copy is the one kept (received_at of the first file for 3, 4, 5..9).
    kept = {r["offset"]: r["received_at"] for r in p.table() if r["device_id"] == "dev-1"}
    assert all(kept[o] == NOW + timedelta(seconds=1) for o in range(10))
    assert all(kept[o] == NOW + timedelta(minutes=10) for o in range(10, 15))

    # Across runs: a re-sent batch (offsets 10..19) and a run with nothing new.
    resent = rows(range(10, 20), received=NOW + timedelta(hours=1))
    p.land(resent)
    again = p.ingest()
    assert again.rows_in == 10 and again.rows_written == 5 and again.duplicates_removed == 5
    assert set(p.keys()) == expected_keys(first, second, other_device, resent)
    assert max(p.keys().values()) == 1

    nothing = p.ingest()
    assert (nothing.batches, nothing.rows_written) == (0, 0)
    assert sum(p.keys().values()) == 25


def test_table_columns_partitions_and_types(spark: Any, tmp_path: Path) -> None:
    p = Pipeline(tmp_path, spark)
    day_one = datetime(2026, 11, 19, 23, 59, 59, 999000, tzinfo=UTC)
    p.land(rows([0], published=day_one) + rows([1], published=day_one + timedelta(seconds=1)))
    p.ingest()
    partitions = sorted(d.name for d in p.config.table.iterdir() if not d.name.startswith("_"))
    # dt is the UTC date of publish_ts: offset 0 at 23:59:59.999, offset 1 after midnight.
    assert partitions == ["dt=2026-11-19", "dt=2026-11-20"]
    df = spark.read.parquet(str(p.config.table))
    assert [f.name for f in df.schema.fields] == [
        *(f.name for f in LANDING_SPARK_SCHEMA.fields),
        "dt",
    ]
    by_offset = {r["offset"]: r for r in p.table()}
    assert by_offset[0]["publish_ts"] == day_one
    assert str(by_offset[0]["dt"]) == "2026-11-19"
    assert by_offset[1]["payload"] == b'{"o": 1}'


def test_crash_between_batches_replays_without_duplicates(spark: Any, tmp_path: Path) -> None:
    p = Pipeline(tmp_path, spark)
    p.land(rows(range(0, 5)))
    p.ingest()
    p.land(rows(range(5, 10)))
    p.ingest()
    commit_dir = p.config.checkpoint / "commits"
    commits = sorted((f for f in commit_dir.iterdir() if f.name.isdigit()), key=lambda f: int(f.name))
    assert [c.name for c in commits] == ["0", "1"]
    # The process died after the table was written but before Spark recorded the batch
    # (the commit and its Hadoop checksum file were never written).
    commits[-1].unlink()
    (commit_dir / ".1.crc").unlink(missing_ok=True)
    p.reports.clear()
    summary = p.ingest()
    assert [r.replayed for r in p.reports] == [True]
    assert summary.rows_written == 0
    assert p.keys() == Counter(expected_keys(rows(range(10))))


@BOTH_DEDUP_PATHS
def test_crash_in_the_middle_of_an_append_adds_no_duplicate(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    p = Pipeline(tmp_path, spark, driver_dedup_max_keys=budget)
    p.land(rows(range(0, 3), published=NOW - timedelta(days=1)))
    p.land(rows(range(3, 6)))  # a second partition, so the append renames two files

    renamed: list[Path] = []
    real_rename = OsFileIO.rename

    def rename_then_die(self: OsFileIO, src: Any, dst: Any) -> None:
        real_rename(self, src, dst)
        renamed.append(Path(dst))
        raise OSError("power cut after the first rename into the table")

    monkeypatch.setattr(OsFileIO, "rename", rename_then_die)
    with pytest.raises(IngestError, match="power cut"):
        p.ingest()
    monkeypatch.undo()
    assert len(renamed) == 1
    partial = p.keys()
    assert 0 < sum(partial.values()) < 6  # one partition made it, the other did not

    summary = p.ingest()
    assert p.keys() == Counter(expected_keys(rows(range(6))))
    assert summary.rows_written == 6 - sum(partial.values())
    assert not (p.config.table / "_tmp").exists()


def test_hidden_landing_files_are_ignored(spark: Any, tmp_path: Path) -> None:
    p = Pipeline(tmp_path, spark)
    visible = p.land(rows(range(0, 2)))
    # Valid landing files under hidden names: Spark must not pick them up.
    for hidden in ("_partial.parquet", ".inflight.parquet"):
        table = pa.Table.from_pylist(rows(range(100, 102)), schema=_landing_schema_without_defaults())
        pq.write_table(table, visible.parent / hidden)
    summary = p.ingest()
    assert set(p.keys()) == expected_keys(rows(range(0, 2)))
    assert summary.files == 1
    assert summary.quarantined == []
    assert (visible.parent / "_partial.parquet").exists()


def _landing_schema_without_defaults() -> pa.Schema:
    return pa.schema([f for f in LANDING_SCHEMA if f.name not in ("collector_id", "schema_version")])


def test_old_publish_ts_and_late_landing_file_are_kept(spark: Any, tmp_path: Path) -> None:
    p = Pipeline(tmp_path, spark)
    recent = rows(range(100, 110), published=NOW)
    p.land(recent)
    p.ingest()
    # Weeks later a device that was offline delivers old messages, in a file whose
    # modification time is old too (copied in with its mtime preserved).
    old = NOW - timedelta(days=45)
    late = rows(range(0, 10), published=old, received=NOW + timedelta(days=1))
    late_file = p.land(late)
    month_ago = (NOW - timedelta(days=30)).timestamp()
    os.utime(late_file, (month_ago, month_ago))
    # And a late duplicate of an old message already ingested.
    p.land(rows(range(5, 7), published=old, received=NOW + timedelta(days=2)))
    summary = p.ingest()
    assert summary.rows_written == 10
    assert p.keys() == Counter(expected_keys(recent, late))
    assert (p.config.table / f"dt={old.date().isoformat()}").is_dir()


def test_corrupt_landing_files_are_quarantined_and_reported(spark: Any, tmp_path: Path) -> None:
    p = Pipeline(tmp_path, spark)
    good = p.land(rows(range(0, 4)))
    junk = good.parent / "20261120T000000.000000Z-c9-000000-000001.parquet"
    junk.write_bytes(b"this is not parquet at all")
    wrong = good.parent / "20261120T000000.000000Z-c9-000000-000002.parquet"
    pq.write_table(pa.table({"device_id": ["d"], "offset": ["not an int"]}), wrong)
    summary = p.ingest()
    assert sorted(summary.quarantined) == sorted([str(junk), str(wrong)])
    assert set(p.keys()) == expected_keys(rows(range(0, 4)))
    quarantine = p.config.landing / "quarantine" / good.parent.name
    assert (quarantine / junk.name).read_bytes() == b"this is not parquet at all"
    assert "not a readable Parquet file" in (quarantine / f"{junk.name}.reason").read_text()
    assert "'stream' is missing" in (quarantine / f"{wrong.name}.reason").read_text()
    assert not junk.exists() and not wrong.exists()
    # The stream carries on with later files.
    p.land(rows(range(4, 6)))
    assert p.ingest().rows_written == 2


def test_payload_json_typed_columns_and_payload_error(spark: Any, tmp_path: Path) -> None:
    p = Pipeline(tmp_path, spark, payload_schema="temperature double, humidity double")
    payloads = {
        0: b'{"temperature": 21.5, "humidity": 40}',
        1: b"not json",
        2: b'{"temperature": "hot"}',
        3: b"\xff\xfe",
        4: b'{"humidity": 10.25}',
    }
    p.land([r for o, body in payloads.items() for r in rows([o], payload=body)])
    p.ingest()
    table = {r["offset"]: r for r in p.table()}
    assert (table[0]["temperature"], table[0]["humidity"], table[0]["payload_error"]) == (
        21.5,
        40.0,
        None,
    )
    for bad in (1, 2, 3):
        assert table[bad]["payload_error"] == PAYLOAD_ERROR
        assert table[bad]["temperature"] is None
        assert table[bad]["payload"] == payloads[bad]  # the raw payload is kept
    assert (table[4]["temperature"], table[4]["humidity"], table[4]["payload_error"]) == (
        None,
        10.25,
        None,
    )


def test_payload_schema_errors(spark: Any) -> None:
    with pytest.raises(ValueError, match="does not parse"):
        PayloadSchema.parse("temperature dooble,")
    with pytest.raises(ValueError, match="offset, payload_error"):
        PayloadSchema.parse("offset bigint, payload_error string, ok int")
    assert PayloadSchema.parse("t double, h double").names == ["t", "h"]


def test_archive_moves_ingested_files_after_commit(spark: Any, tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    p = Pipeline(tmp_path, spark, archive=archive)
    first = p.land(rows(range(0, 3)))
    p.ingest()
    second = p.land(rows(range(3, 6)))
    p.ingest()
    # Spark archives a batch's files once the batch is committed, when it plans the next
    # batch: the files of the last batch of a run move on the next run.
    archived = sorted(archive.rglob("*.parquet"))
    assert [a.name for a in archived] == [first.name]
    assert not first.exists() and second.exists()
    assert p.keys() == Counter(expected_keys(rows(range(6))))


def test_every_runs_batches_until_stopped(spark: Any, tmp_path: Path) -> None:
    p = Pipeline(tmp_path, spark)
    stop = threading.Event()
    summaries: list[IngestSummary] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            summaries.append(
                run_ingest(spark, p.config, once=False, every=0.5, on_batch=p.reports.append, stop=stop)
            )
        except BaseException as exc:
            errors.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    try:
        for start in (0, 10):
            p.land(rows(range(start, start + 10)))
            deadline = time.monotonic() + 60
            while sum(r.rows_written for r in p.reports) < start + 10:
                assert time.monotonic() < deadline, "no batch within 60 s"
                time.sleep(0.2)
    finally:
        stop.set()
        runner.join(timeout=60)
    assert not runner.is_alive()
    assert errors == []
    assert summaries[0].rows_written == 20
    assert p.keys() == Counter(expected_keys(rows(range(20))))


def test_every_started_on_an_empty_landing_dir_ingests_what_lands_later(spark: Any, tmp_path: Path) -> None:
    """`filemq ingest --every` started before the collector landed anything: the first files
    arrive under incoming/dt=.../ after the stream's source fixed its schema. Spark used to infer
    `dt` as a partition column only when dt= directories existed at start, so this failed with
    "Invalid batch" at the first files (seen as a flaky test_every_runs_batches_until_stopped)."""
    p = Pipeline(tmp_path, spark)
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            run_ingest(spark, p.config, once=False, every=0.5, on_batch=p.reports.append, stop=stop)
        except BaseException as exc:
            errors.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    try:
        # The file source's log directory exists once the source (and its schema) is created.
        source_log = p.config.checkpoint / "sources" / "0"
        deadline = time.monotonic() + 120
        while not source_log.exists():
            assert time.monotonic() < deadline and runner.is_alive(), errors or "stream did not start"
            time.sleep(0.1)
        assert not any((p.config.landing / "incoming").glob("dt=*"))  # nothing landed yet
        p.land(rows(range(10)))
        deadline = time.monotonic() + 60
        while sum(r.rows_written for r in p.reports) < 10:
            assert time.monotonic() < deadline and runner.is_alive(), errors or "no batch within 60 s"
            time.sleep(0.2)
    finally:
        stop.set()
        runner.join(timeout=60)
    assert errors == []
    assert p.keys() == Counter(expected_keys(rows(range(10))))


def test_spark_schema_matches_the_landing_contract(spark: Any) -> None:
    from_arrow = spark.createDataFrame(LANDING_SCHEMA.empty_table()).schema
    assert [(f.name, f.dataType) for f in from_arrow.fields] == [
        (f.name, f.dataType) for f in LANDING_SPARK_SCHEMA.fields
    ]


def test_check_landing_file_reports_nulls_in_required_columns(tmp_path: Path) -> None:
    table = pa.Table.from_pylist(
        [{**rows([0])[0], "collector_id": "c", "schema_version": 1, "stream": None}],
        schema=LANDING_SCHEMA,
    )
    path = tmp_path / "nulls.parquet"
    pq.write_table(table, path)
    check = check_landing_file(path)
    assert not check.ok
    assert check.reason is not None and "'stream' has 1 null" in check.reason
    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist(
        [{**r, "collector_id": "c", "schema_version": 1} for r in rows([0, 1])],
        schema=LANDING_SCHEMA,
    ), good)
    verdict = check_landing_file(good)
    assert verdict.ok and verdict.rows == 2 and verdict.first_day == NOW.date()


# -- schema versions 1 and 2 in one table (issue 13 item 7) ----------------------------------

PROPS = {
    "payload_format_indicator": 1,
    "message_expiry_s": 3600,
    "content_type": "application/json",
    "response_topic": "replies/dev-1",
    "correlation_data": b"\x00corr",
    "user_properties": [{"key": "site", "value": "n"}, {"key": "line", "value": "3"}, {"key": "site", "value": "s"}],
}


def _v1_file(path: Path, batch: list[dict[str, Any]], collector: str = "old") -> Path:
    """A landing (or table) file as the release before schema version 2 wrote it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(
        [{**r, "collector_id": collector, "schema_version": 1} for r in batch], schema=LANDING_SCHEMA_V1
    )
    pq.write_table(table, path)
    return path


def test_old_and_new_landing_files_are_ingested_into_one_table(spark: Any, tmp_path: Path) -> None:
    """A schema_version 1 landing file (an older collector's: no property columns) and a
    schema_version 2 file in one incoming dir, read by one streaming batch with the explicit
    landing schema, into a table that already holds a file of the previous ingest release:
    old rows get nulls in the property columns, new rows their properties, and still exactly
    one row per (device_id, stream, offset)."""
    p = Pipeline(tmp_path, spark)
    day = p.config.landing / "incoming" / f"dt={NOW.date().isoformat()}"
    # The previous release's table file (ten landing columns, dt from the directory) holds offset 0.
    _v1_file(p.config.table / f"dt={NOW.date().isoformat()}" / "b0-oldquery-part-00000.parquet", rows([0]))
    old = rows(range(0, 4))
    _v1_file(day / "20261120T000000.000000Z-old-000000-000001.parquet", old)
    new = [{**r, **PROPS} for r in rows(range(3, 6), received=NOW + timedelta(minutes=1))]
    new += rows([6], received=NOW + timedelta(minutes=1))  # an MQTT 3.1.1 message: no properties
    p.land(new)
    summary = p.ingest()
    assert summary.quarantined == [] and summary.files == 2
    assert summary.rows_in == 8 and summary.rows_written == 6  # offset 0 (table) and 3 (old file) dropped
    frame = spark.read.option("mergeSchema", "true").parquet(str(p.config.table))
    assert [f.name for f in frame.schema.fields] == [*(f.name for f in LANDING_SPARK_SCHEMA.fields), "dt"]
    by_offset = {r["offset"]: r.asDict(recursive=True) for r in frame.collect()}
    assert sorted(by_offset) == list(range(7))
    for offset in (0, 1, 2, 3, 6):  # old rows (3: the first landed copy is kept) and the 3.1.1 one
        assert all(by_offset[offset][c] is None for c in PROPS), offset
    assert {by_offset[o]["schema_version"] for o in range(4)} == {1}
    for offset in (4, 5):
        assert {c: by_offset[offset][c] for c in PROPS} == {**PROPS, "correlation_data": bytearray(b"\x00corr")}
        assert by_offset[offset]["schema_version"] == 2


def test_check_landing_file_accepts_both_schema_versions_and_refuses_a_mix(tmp_path: Path) -> None:
    v1 = _v1_file(tmp_path / "v1.parquet", rows([0, 1]))
    assert check_landing_file(v1).ok and check_landing_file(v1).rows == 2
    v2 = tmp_path / "v2.parquet"
    pq.write_table(pa.Table.from_pylist(
        [{**r, "collector_id": "c", "schema_version": 2, **PROPS} for r in rows([0])], schema=LANDING_SCHEMA
    ), v2)
    assert check_landing_file(v2).ok
    partial = tmp_path / "partial.parquet"
    pq.write_table(pq.read_table(v2).drop_columns(["content_type"]), partial)
    verdict = check_landing_file(partial)
    assert verdict.reason is not None and "'content_type' is missing" in verdict.reason
    wrong = tmp_path / "wrong.parquet"
    table = pq.read_table(v2)
    index = table.schema.get_field_index("message_expiry_s")
    pq.write_table(table.set_column(index, "message_expiry_s", pa.array(["1h"])), wrong)
    verdict = check_landing_file(wrong)
    assert verdict.reason is not None and "'message_expiry_s' is string, expected int64" in verdict.reason


def test_batch_files_reads_plain_and_compact_logs(tmp_path: Path) -> None:
    log_dir = tmp_path / "sources" / "0"
    log_dir.mkdir(parents=True)
    entry: Callable[[str, int], str] = lambda p, b: json.dumps({"path": f"file://{p}", "timestamp": 1, "batchId": b})  # noqa: E731
    (log_dir / "3").write_text("v1\n" + entry("/l/incoming/dt=x/b.parquet", 3) + "\n")
    (log_dir / "9.compact").write_text(
        "v1\n" + "\n".join([entry("/l/a%20b.parquet", 8), entry("/l/z.parquet", 9),
                            entry("/l/y.parquet", 9)]) + "\n"
    )
    assert batch_files(tmp_path, 3) == [Path("/l/incoming/dt=x/b.parquet")]
    assert batch_files(tmp_path, 9) == [Path("/l/y.parquet"), Path("/l/z.parquet")]
    with pytest.raises(CheckpointError, match="no file list for batch 4"):
        batch_files(tmp_path, 4)
    (log_dir / "5").write_text("v1\n" + json.dumps({"path": "s3://b/k", "batchId": 5}) + "\n")
    with pytest.raises(CheckpointError, match="only file: paths"):
        batch_files(tmp_path, 5)


# -- the driver-side key dedup (spark_ingest.key_dedup) and its Spark fallback -----------------


def _landing_file(path: Path, batch: list[dict[str, Any]], **write_options: Any) -> Path:
    table = pa.Table.from_pylist(
        [{**r, "collector_id": "c", "schema_version": 1} for r in batch], schema=LANDING_SCHEMA
    )
    pq.write_table(table, path, **write_options)
    return path


def test_find_duplicates_keeps_the_first_landed_copy_and_table_keys(tmp_path: Path) -> None:
    a = _landing_file(tmp_path / "a.parquet", rows([0, 1, 2, 1]) + rows([1], device="dev-2"))
    # Plain (not dictionary-encoded) strings, as another writer might produce them.
    b = _landing_file(tmp_path / "b.parquet", rows([2, 3, 4]) + rows([1], stream="other"),
                      use_dictionary=False)
    c = _landing_file(tmp_path / "c.parquet", rows([4, 9, 9, 9]))
    in_table = _landing_file(tmp_path / "table.parquet", rows([3, 7]))
    found = find_duplicates([a, b, c], [in_table])
    dropped = sorted((r[DROP_FILE], r[DROP_ROW]) for r in found.rows.to_pylist())
    assert dropped == [
        ("a.parquet", 3),  # offset 1 again in its own file
        ("b.parquet", 0),  # offset 2: first landed in a
        ("b.parquet", 1),  # offset 3: already in the table
        ("c.parquet", 0),  # offset 4: first landed in b
        ("c.parquet", 2),  # offset 9 three times in c: the first is kept
        ("c.parquet", 3),
    ]
    # dev-1/telemetry 1, 2, 3, 4, 9 (dev-2 offset 1 and stream "other" are other keys).
    assert found.keys == 5
    alone = find_duplicates([a, in_table], [])
    assert sorted((r[DROP_FILE], r[DROP_ROW]) for r in alone.rows.to_pylist()) == [
        ("a.parquet", 3)
    ]
    assert find_duplicates([in_table], []).rows.num_rows == 0


def test_find_duplicates_with_offsets_too_large_to_pack(tmp_path: Path) -> None:
    # Offsets near 2**62 (and a negative one) do not fit the packed one-integer sort key:
    # the two-column sort must give the same answer.
    def at(offsets: list[int], device: str = "dev-1") -> list[dict[str, Any]]:
        return [{**r, "offset": o} for r, o in zip(rows(range(len(offsets)), device), offsets, strict=True)]

    big = [2**62, 2**62 + 1, -5]
    a = _landing_file(tmp_path / "a.parquet", at(big) + at(big[:1], device="dev-2"))
    b = _landing_file(tmp_path / "b.parquet", at([-5, 2**62 + 1, 2**62 + 2]))
    found = find_duplicates([a, b], [])
    assert sorted((r[DROP_FILE], r[DROP_ROW]) for r in found.rows.to_pylist()) == [
        ("b.parquet", 0), ("b.parquet", 1),
    ]
    assert found.keys == 2


def _key(offsets: st.SearchStrategy[int]) -> st.SearchStrategy[tuple[str, str, int]]:
    return st.tuples(
        st.sampled_from(["dev-1", "dev-2", "d3"]), st.sampled_from(["telemetry", "events"]), offsets
    )


# Offsets that pack into one integer per key, and offsets that do not (huge or negative).
_PACKED_KEY = _key(st.integers(0, 12))
_WIDE_KEY = _key(st.one_of(st.integers(0, 3), st.sampled_from([2**40, 2**62 + 3, -7])))
_REFERENCE_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.parametrize("key", [_PACKED_KEY, _WIDE_KEY], ids=["packed", "wide-offsets"])
@_REFERENCE_SETTINGS
@given(data=st.data())
def test_find_duplicates_matches_a_reference(
    tmp_path_factory: pytest.TempPathFactory,
    key: st.SearchStrategy[tuple[str, str, int]],
    data: st.DataObject,
) -> None:
    table_keys = data.draw(st.lists(key, max_size=10, unique=True), label="table keys")
    split = data.draw(st.integers(0, 10), label="split")
    batch = data.draw(st.lists(st.lists(key, max_size=8), min_size=1, max_size=4), label="batch")
    _check_against_reference(tmp_path_factory.mktemp("keys"), table_keys, split, batch)


def _check_against_reference(
    root: Path,
    table_keys: list[tuple[str, str, int]],
    split: int,
    batch: list[list[tuple[str, str, int]]],
) -> None:
    # Reference: walk the table rows, then the batch files in order, each in row order; a
    # batch row whose key was seen before is dropped.
    def write(name: str, keys: list[tuple[str, str, int]]) -> Path:
        return _landing_file(root / name, [
            {**rows([0], device=d, stream=s)[0], "offset": o} for d, s, o in keys
        ])

    # The table holds each key once, in up to two files.
    table = [keys for keys in (table_keys[:split], table_keys[split:]) if keys]
    table_files = [write(f"t{i}.parquet", keys) for i, keys in enumerate(table)]
    batch_files = [write(f"b{i}.parquet", keys) for i, keys in enumerate(batch)]
    seen = set(table_keys)
    expected = []
    for path, keys in zip(batch_files, batch, strict=True):
        for index, key in enumerate(keys):
            if key in seen:
                expected.append((path.name, index))
            seen.add(key)
    in_batch = Counter(k for keys in batch for k in keys)
    duplicated = {k for k, n in in_batch.items() if n > 1 or k in set(table_keys)}
    found = find_duplicates(batch_files, table_files)
    assert sorted((r[DROP_FILE], r[DROP_ROW]) for r in found.rows.to_pylist()) == sorted(expected)
    assert found.keys == len(duplicated)


def test_find_duplicates_refuses_two_files_with_one_name(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    one = _landing_file(tmp_path / "f.parquet", rows([0]))
    two = _landing_file(tmp_path / "x" / "f.parquet", rows([0]))
    with pytest.raises(ValueError, match="distinct names"):
        find_duplicates([one, two], [])


@BOTH_DEDUP_PATHS
def test_both_dedup_paths_keep_the_same_rows(spark: Any, tmp_path: Path, budget: int) -> None:
    p = Pipeline(tmp_path, spark, driver_dedup_max_keys=budget)
    p.land(rows(range(0, 20)))
    p.ingest()
    # A later batch: a file with internal duplicates, files overlapping each other, a late
    # overlap with the table, a file that overlaps nothing, and another device.
    p.land(rows([20, 21, 21, 22], received=NOW + timedelta(minutes=1)))
    p.land(rows(range(18, 26), received=NOW + timedelta(minutes=2)))
    p.land(rows(range(100, 110), received=NOW + timedelta(minutes=3)))
    p.land(rows(range(0, 3), device="dev-9", received=NOW + timedelta(minutes=4)))
    summary = p.ingest()
    assert summary.rows_in == 4 + 8 + 10 + 3
    assert summary.rows_written == 6 + 10 + 3  # 20..25, 100..109, dev-9 0..2
    keys = p.keys()
    assert max(keys.values()) == 1
    assert set(keys) == expected_keys(rows(range(0, 26)), rows(range(100, 110)),
                                      rows(range(0, 3), device="dev-9"))
    kept = {r["offset"]: r["received_at"] for r in p.table() if r["device_id"] == "dev-1"}
    # The table's copy of 18, 19 stays; 20..22 come from the first file of the batch.
    assert kept[19] == NOW + timedelta(seconds=1)
    assert kept[21] == NOW + timedelta(minutes=1)
    assert kept[23] == NOW + timedelta(minutes=2)


@BOTH_DEDUP_PATHS
def test_files_with_unusual_names_are_deduplicated(spark: Any, tmp_path: Path, budget: int) -> None:
    # Spark gives _metadata.file_name URL-encoded ("a b#" -> "a%20b%23"): rows must still be
    # matched to their file, or the copies in such a file would all be kept.
    p = Pipeline(tmp_path, spark, driver_dedup_max_keys=budget)
    p.land(rows(range(0, 5)))
    copied = p.land(rows(range(3, 8), received=NOW + timedelta(minutes=1)))
    renamed = copied.with_name("20991231 re-sent #1 100%.parquet")
    copied.rename(renamed)
    summary = p.ingest()
    assert summary.files == 2 and summary.quarantined == []
    assert p.keys() == Counter(expected_keys(rows(range(0, 8))))
    assert summary.duplicates_removed == 2


def test_rows_dropped_must_be_the_duplicates_found(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The staged batch must hold exactly rows in - duplicates found before anything is
    # renamed into the table. Break the drop (Spark gets an empty drop list): the batch
    # fails, the table is untouched, and a run with the drop intact adds each key once.
    import spark_ingest.job as job

    drop_frame = job.BatchIngestor._drop_frame

    def no_drops(self: Any, drops: pa.Table, batch_id: int) -> Any:
        return drop_frame(self, drops.slice(0, 0), batch_id)

    p = Pipeline(tmp_path, spark)
    p.land(rows(range(0, 5)))
    p.land(rows(range(3, 9), received=NOW + timedelta(minutes=1)))
    monkeypatch.setattr(job.BatchIngestor, "_drop_frame", no_drops)
    with pytest.raises(IngestError, match="written with 11 rows, expected 9"):
        p.ingest()
    assert list(p.config.table.glob("dt=*")) == []
    assert not (p.config.table / "_tmp").exists()
    monkeypatch.setattr(job.BatchIngestor, "_drop_frame", drop_frame)
    summary = p.ingest()
    assert summary.rows_written == 9 and summary.duplicates_removed == 2
    assert p.keys() == Counter(expected_keys(rows(range(0, 9))))


def test_append_refuses_a_batch_with_the_wrong_row_count(spark: Any, tmp_path: Path) -> None:
    from spark_ingest.curated import CuratedTable, RowCountMismatch, partition_value

    frame = spark.createDataFrame(rows(range(0, 4)), schema=LANDING_SPARK_SCHEMA)
    frame = frame.withColumn("dt", partition_value("publish_ts"))
    table = CuratedTable(tmp_path / "table")
    with pytest.raises(RowCountMismatch, match="written with 4 rows, expected 3"):
        table.append(frame, "query-1", 0, expected_rows=3)
    assert not (tmp_path / "table" / "_tmp").exists()
    assert list((tmp_path / "table").glob("dt=*")) == []
    assert table.append(frame, "query-1", 0, expected_rows=4) == 4


def test_duplicates_found_ahead_are_used_only_for_the_files_seen(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from spark_ingest.job import BatchIngestor

    p = Pipeline(tmp_path, spark)
    first = [p.land(rows(range(0, 5))), p.land(rows(range(3, 8), received=NOW))]
    checks = [check_landing_file(f) for f in first]
    ahead = BatchIngestor(spark, p.config, lambda report: None)
    ahead.find_ahead()
    found = ahead._found_ahead(checks, [])
    assert found is not None
    assert found.rows.to_pylist() == find_duplicates(first, []).rows.to_pylist()
    assert ahead._found_ahead(checks, []) is None  # used once
    # A file rewritten after the prediction (another mtime): not used.
    ahead.find_ahead()
    assert ahead._ahead is not None and ahead._ahead.result() is not None
    stat = first[1].stat()
    os.utime(first[1], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert ahead._found_ahead(checks, []) is None
    # A real run uses it; afterwards only the files the checkpoint has not seen are predicted.
    with caplog.at_level("DEBUG", logger="spark_ingest.job"):
        assert p.ingest().rows_written == 8
    assert "using the duplicates found ahead of the batch" in caplog.text
    late = p.land(rows(range(6, 10), received=NOW + timedelta(minutes=5)))
    ahead.find_ahead()
    assert ahead._ahead is not None
    predicted = ahead._ahead.result()
    assert predicted is not None and list(predicted.stats) == [late.absolute()]
    assert predicted.table_files  # checked against the table partition it touches
    summary = p.ingest()
    assert summary.rows_written == 2 and summary.duplicates_removed == 2
    assert p.keys() == Counter(expected_keys(rows(range(0, 10))))
