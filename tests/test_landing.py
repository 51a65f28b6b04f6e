"""collector.landing: exact schema, atomic landing, crash leftovers, names, quarantine."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from collector.landing import (
    LANDING_SCHEMA,
    LANDING_SCHEMA_V1,
    PROPERTY_COLUMNS,
    SCHEMA_VERSION,
    LandingError,
    LandingWriter,
    quarantine,
    visible_files,
)
from segments.fileio import OS_FILE_IO, FileHandle

T0 = datetime(2026, 3, 1, 23, 59, 58, 123456, tzinfo=UTC)


def rows(n: int, start: int = 0, device: str = "dev-1", at: datetime = T0) -> list[dict[str, object]]:
    return [
        {
            "device_id": device,
            "stream": "telemetry",
            "offset": start + i,
            "topic": f"sensors/{device}/t",
            "qos": 1,
            "publish_ts": at - timedelta(seconds=5),
            "received_at": at + timedelta(seconds=i),
            "payload": f'{{"i": {start + i}}}'.encode(),
        }
        for i in range(n)
    ]


def incoming_files(landing: Path) -> list[Path]:
    return sorted((landing / "incoming").rglob("*.parquet"))


def test_schema_is_exactly_the_contract(tmp_path: Path) -> None:
    version_1 = pa.schema(
        [
            ("device_id", pa.string()),
            ("stream", pa.string()),
            ("offset", pa.int64()),
            ("topic", pa.string()),
            ("qos", pa.int8()),
            ("publish_ts", pa.timestamp("us", tz="UTC")),
            ("received_at", pa.timestamp("us", tz="UTC")),
            ("collector_id", pa.string()),
            ("payload", pa.binary()),
            ("schema_version", pa.int16()),
        ]
    )
    # Schema version 2 (issue 13): the same ten columns, then the MQTT 5 message properties.
    expected = pa.schema(
        [
            *version_1,
            ("payload_format_indicator", pa.int8()),
            ("message_expiry_s", pa.int64()),
            ("content_type", pa.string()),
            ("response_topic", pa.string()),
            ("correlation_data", pa.binary()),
            ("user_properties", pa.list_(pa.struct([("key", pa.string()), ("value", pa.string())]))),
        ]
    )
    assert LANDING_SCHEMA_V1.equals(version_1)
    assert LANDING_SCHEMA.equals(expected) and SCHEMA_VERSION == 2
    path = LandingWriter(tmp_path, "c1").write(rows(3))
    written = pq.read_table(path)
    assert written.schema.equals(expected)
    assert written.column("collector_id").to_pylist() == ["c1"] * 3
    assert written.column("schema_version").to_pylist() == [SCHEMA_VERSION] * 3
    assert written.column("offset").to_pylist() == [0, 1, 2]
    # Rows without the property columns get nulls in them.
    assert all(written.column(c).null_count == 3 for c in PROPERTY_COLUMNS)


def test_dt_is_utc_date_of_earliest_received_at(tmp_path: Path) -> None:
    # The batch straddles midnight UTC (23:59:58 .. 00:00:00); a non-UTC input zone must
    # not move it.
    batch = rows(3, at=T0.astimezone(timezone(timedelta(hours=1))))
    path = LandingWriter(tmp_path, "c1").write(batch)
    assert path.parent == tmp_path / "incoming" / "dt=2026-03-01"


def test_accepts_arrow_table_and_columns(tmp_path: Path) -> None:
    writer = LandingWriter(tmp_path, "c1")
    table = pa.Table.from_pylist(rows(2))
    columns = {k: [r[k] for r in rows(2, start=10)] for k in rows(1)[0]}
    first = pq.read_table(writer.write(table))
    second = pq.read_table(writer.write(columns))
    assert first.column("offset").to_pylist() == [0, 1]
    assert second.column("offset").to_pylist() == [10, 11]
    assert first.schema.equals(LANDING_SCHEMA) and second.schema.equals(LANDING_SCHEMA)


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "empty batch"),
        ([{k: v for k, v in rows(1)[0].items() if k != "stream"}], "no column 'stream'"),
        ([{**rows(1)[0], "device_id": None}], "'device_id' has 1 null"),
        ([{**rows(1)[0], "qos": 300}], "'qos' does not fit"),
    ],
)
def test_bad_batches_are_refused_and_leave_nothing(
    tmp_path: Path, bad: list[dict[str, object]], message: str
) -> None:
    writer = LandingWriter(tmp_path, "c1")
    with pytest.raises(LandingError, match=message):
        writer.write(bad)
    assert incoming_files(tmp_path) == []
    assert list((tmp_path / "_staging").iterdir()) == []


def test_bad_collector_id_is_refused(tmp_path: Path) -> None:
    for bad in ("", "_hidden", ".dot", "a/b", "x" * 65):
        with pytest.raises(LandingError, match="collector id"):
            LandingWriter(tmp_path, bad)


class SimulatedCrash(BaseException):
    """A power cut: not an Exception, so no cleanup code runs (as in a real crash)."""


class CrashBeforeRename:
    """The real file layer, but the process 'dies' at the rename into incoming/."""

    def __init__(self) -> None:
        self.synced: list[str] = []

    def open(self, path: str | os.PathLike[str], *, create: bool = False) -> FileHandle:
        handle = OS_FILE_IO.open(path, create=create)
        self.synced.append(os.fspath(path))
        return handle

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        raise SimulatedCrash(f"power cut renaming {src}")

    def unlink(self, path: str | os.PathLike[str]) -> None:
        OS_FILE_IO.unlink(path)

    def fsync_dir(self, path: str | os.PathLike[str]) -> None:
        OS_FILE_IO.fsync_dir(path)

    def free_bytes(self, path: str | os.PathLike[str]) -> int:
        return OS_FILE_IO.free_bytes(path)


def test_crash_before_rename_leaves_nothing_in_incoming_and_recovery_cleans(
    tmp_path: Path,
) -> None:
    crashing = CrashBeforeRename()
    with pytest.raises(SimulatedCrash):
        LandingWriter(tmp_path, "c1", fileio=crashing).write(rows(5))
    assert incoming_files(tmp_path) == []
    leftovers = list((tmp_path / "_staging").iterdir())
    assert len(leftovers) == 1
    # The staged file was opened for fdatasync before the rename was attempted.
    assert crashing.synced == [os.fspath(leftovers[0])]

    restarted = LandingWriter(tmp_path, "c1")
    assert restarted.recover_staging() == leftovers
    assert list((tmp_path / "_staging").iterdir()) == []
    # After recovery the same rows land normally, once.
    restarted.write(rows(5))
    assert [pq.read_table(p).num_rows for p in incoming_files(tmp_path)] == [5]


def test_recovery_removes_only_its_own_staging_files_in_a_shared_landing_dir(
    tmp_path: Path,
) -> None:
    with pytest.raises(SimulatedCrash):
        LandingWriter(tmp_path, "c1", fileio=CrashBeforeRename()).write(rows(3))
    (own_leftover,) = list((tmp_path / "_staging").iterdir())
    # Other collectors sharing the directory are mid-write: their staging files must stay.
    # "c1-0a0b0c" starts like c1's own names; a plain foreign file is not ours either.
    others: list[Path] = []
    for collector in ("c2", "c1-0a0b0c"):
        with pytest.raises(SimulatedCrash):
            LandingWriter(tmp_path, collector, fileio=CrashBeforeRename()).write(rows(2))
        others.append(next(p for p in (tmp_path / "_staging").iterdir()
                           if p not in (own_leftover, *others)))
    foreign = tmp_path / "_staging" / "notes.txt"
    foreign.write_text("not a landing file")

    restarted = LandingWriter(tmp_path, "c1")
    assert restarted.recover_staging() == [own_leftover]
    assert sorted((tmp_path / "_staging").iterdir()) == sorted([*others, foreign])
    # The other collector recovers its own file in turn, and only it.
    assert LandingWriter(tmp_path, "c2").recover_staging() == [others[0]]
    assert others[1].exists() and foreign.exists()


def test_ordinary_failure_cleans_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = LandingWriter(tmp_path, "c1")

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer._fileio, "rename", disk_full)
    with pytest.raises(OSError, match="No space"):
        writer.write(rows(2))
    assert list((tmp_path / "_staging").iterdir()) == []
    assert incoming_files(tmp_path) == []


def test_names_sort_by_write_time_and_are_unique_even_if_clock_stalls(tmp_path: Path) -> None:
    ticks = iter(
        [T0, T0, T0 - timedelta(seconds=3), T0 + timedelta(days=1), T0 + timedelta(days=1)]
    )
    writer = LandingWriter(tmp_path, "c1", clock=lambda: next(ticks))
    written = [writer.write(rows(1, start=i)) for i in range(5)]
    names = [p.name for p in written]
    assert len(set(names)) == 5
    assert sorted(names) == names
    assert names[0].startswith("20260301T235958.123456Z-c1-")
    # Write order is recoverable from names alone.
    offsets = [pq.read_table(p).column("offset")[0].as_py() for p in sorted(written)]
    assert offsets == [0, 1, 2, 3, 4]


def test_two_collectors_share_one_landing_dir(tmp_path: Path) -> None:
    same_clock = lambda: T0  # noqa: E731 - both writers see the very same instant
    a = LandingWriter(tmp_path, "collector-a", clock=same_clock)
    b = LandingWriter(tmp_path, "collector-b", clock=same_clock)
    paths = [a.write(rows(2, device="d1")), b.write(rows(2, device="d2"))]
    paths += [a.write(rows(2, start=2, device="d1")), b.write(rows(2, start=2, device="d2"))]
    assert len({p.name for p in paths}) == 4
    assert set(incoming_files(tmp_path)) == set(paths)
    by_collector = {
        c: sorted(pq.read_table(p).column("collector_id")[0].as_py() for p in paths if c in p.name)
        for c in ("collector-a", "collector-b")
    }
    assert by_collector == {"collector-a": ["collector-a"] * 2, "collector-b": ["collector-b"] * 2}


def test_two_instances_of_the_same_collector_never_collide(tmp_path: Path) -> None:
    # A restarted collector with a clock that went back must not overwrite an earlier file.
    first = LandingWriter(tmp_path, "c1", clock=lambda: T0).write(rows(1))
    second = LandingWriter(tmp_path, "c1", clock=lambda: T0).write(rows(1, start=1))
    assert first != second
    assert first.exists() and second.exists()


def test_quarantine_moves_file_and_writes_reason(tmp_path: Path) -> None:
    path = LandingWriter(tmp_path, "c1").write(rows(1))
    moved = quarantine(path, "not a parquet file: bad magic")
    assert not path.exists()
    assert moved == tmp_path / "quarantine" / path.parent.name / path.name
    assert moved.exists()
    reason = moved.with_name(moved.name + ".reason").read_text()
    assert reason == "not a parquet file: bad magic\n"


def test_quarantine_outside_incoming_needs_landing_dir(tmp_path: Path) -> None:
    stray = tmp_path / "stray.parquet"
    stray.write_bytes(b"junk")
    with pytest.raises(LandingError, match="not under an 'incoming'"):
        quarantine(stray, "junk")
    moved = quarantine(stray, "junk", landing_dir=tmp_path / "landing")
    assert moved == tmp_path / "landing" / "quarantine" / "stray.parquet"


def test_visible_files_skips_what_spark_treats_as_hidden(tmp_path: Path) -> None:
    writer = LandingWriter(tmp_path, "c1")
    landed = writer.write(rows(2))
    incoming = tmp_path / "incoming"
    (landed.parent / f".{landed.name}.crc").write_bytes(b"x")
    (landed.parent / "_SUCCESS").write_bytes(b"")
    (incoming / "_tmp").mkdir()
    (incoming / "_tmp" / "part.parquet").write_bytes(b"x")
    (landed.parent / "notes.txt").write_text("x")
    assert visible_files(incoming, "*.parquet") == [landed]
    assert sorted(visible_files(incoming)) == sorted([landed, landed.parent / "notes.txt"])
