"""Log layer: round trips, rolling, index lookups, reopen, recovery, retention, DiskFull."""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path

import pytest

from segments import DiskFull, Log, LogConfig, Record, SegmentError
from segments.record import decode, decode_at, encode_record
from segments.segment import segment_name
from tests.storage_faults import InjectingFileIO

SMALL = LogConfig(segment_bytes=2048, index_interval_bytes=200)


def fill(log: Log, n: int, size: int = 40, topic: str = "dev/t") -> list[int]:
    offsets = [log.append(topic, bytes([i % 251]) * size, qos=i % 3, retain=i % 5 == 0) for i in range(n)]
    log.flush()
    return offsets


def payload_ok(record: Record) -> bool:
    return record.payload == bytes([record.offset % 251]) * len(record.payload)


def test_round_trip_and_rolling(tmp_path: Path) -> None:
    log = Log.open(tmp_path, SMALL)
    assert fill(log, 300) == list(range(300))
    records = log.read(0, max_records=10_000, max_bytes=1 << 30)
    assert [r.offset for r in records] == list(range(300))
    assert all(payload_ok(r) and r.topic == "dev/t" and r.qos == r.offset % 3 for r in records)
    infos = log.segments()
    assert len(infos) > 5 and all(i.sealed for i in infos[:-1]) and not infos[-1].sealed
    assert all(i.size <= SMALL.segment_bytes for i in infos)
    assert [i.base_offset for i in infos[1:]] == [i.next_offset for i in infos[:-1]]
    for info in infos[:-1]:
        assert (tmp_path / segment_name(info.base_offset, ".seal")).exists()
    assert log.size_bytes() == sum(i.size for i in infos)
    log.close()


def test_log_keeps_its_attributes_in_slots(tmp_path: Path) -> None:
    """Log has __slots__ and no instance __dict__: at 30 attributes in a __dict__ CPython 3.11
    stopped specializing attribute access on a Log, and every append cost ~0.6k instructions
    more (issue 29, `python -m bench.callgrind_append`). A new attribute goes into __slots__."""
    log = Log.open(tmp_path)
    try:
        assert not hasattr(log, "__dict__")
        with pytest.raises(AttributeError):
            log.not_a_slot = 1  # type: ignore[attr-defined]
    finally:
        log.close()


def test_read_from_every_offset_uses_index(tmp_path: Path) -> None:
    log = Log.open(tmp_path, SMALL)
    fill(log, 250)
    for offset in range(250):
        assert [r.offset for r in log.read(offset, max_records=3)] == list(range(offset, min(offset + 3, 250)))
    assert log.read(250) == []
    assert [r.offset for r in log.read(0, max_records=1000, max_bytes=1)] == [0]  # always one
    log.close()


def test_cold_indexes_are_not_kept_in_memory(tmp_path: Path) -> None:
    cfg = LogConfig(segment_bytes=2048, index_interval_bytes=200, index_cache_segments=2)
    log = Log.open(tmp_path, cfg)
    fill(log, 400)
    assert len(log.segments()) > 8
    assert log.loaded_indexes() == 1  # sealing released every index but the active one's
    for offset in range(400):  # every offset, from every segment: each lookup still lands
        assert [r.offset for r in log.read(offset, max_records=2)] == list(range(offset, min(offset + 2, 400)))
        assert log.loaded_indexes() <= 1 + cfg.index_cache_segments
    for offset in range(399, -1, -7):  # backwards: every load evicts the least recently read
        assert log.read(offset, 1)[0].offset == offset
        assert log.loaded_indexes() <= 1 + cfg.index_cache_segments
    log.close()
    again = Log.open(tmp_path, cfg)
    assert again.loaded_indexes() == 1  # opening loads no sealed index
    assert [r.offset for r in again.read(0, 1000, 1 << 30)] == list(range(400))
    assert again.loaded_indexes() <= 1 + cfg.index_cache_segments
    again.close()


def test_retention_forgets_loaded_indexes(tmp_path: Path) -> None:
    cfg = LogConfig(segment_bytes=2048, index_interval_bytes=200, retention_bytes=6000, index_cache_segments=8)
    log = Log.open(tmp_path, cfg)
    fill(log, 300)
    log.read(0, 1000, 1 << 30)
    report = log.enforce_retention()
    assert report.segments_deleted >= 1
    alive = set(map(id, log._segments))  # noqa: SLF001 (white-box: no dangling references)
    assert all(id(s) in alive for s in log._hot_indexes)  # noqa: SLF001
    assert [r.offset for r in log.read(0, 1000, 1 << 30)] == list(range(log.first_offset, 300))
    log.close()


def test_index_cache_size_is_validated() -> None:
    with pytest.raises(ValueError, match="index_cache_segments"):
        LogConfig(index_cache_segments=0)


def _reference_read(log: Log, offset: int, max_records: int, max_bytes: int) -> list[Record]:
    """The read algorithm before the fast path: one generic walk per segment (white-box)."""
    limit = log.committed_offset
    segments = log._segments  # noqa: SLF001
    offset = max(offset, segments[0].base_offset)
    out: list[Record] = []
    total = 0
    for segment in segments:
        if segment.next_offset <= offset or offset >= limit:
            continue
        start = segment.ensure_index(log.config.index_interval_bytes).lookup(offset)
        max_offset = segment.next_offset if segment.sealed else limit
        for frame in segment.walk(start, segment.size, None, resync=True, max_offset=max_offset):
            if frame.framed <= 0:
                continue
            if frame.offset >= limit:
                return out
            if frame.offset < offset:
                continue
            if out and total + frame.framed > max_bytes:
                return out
            out.append(decode_at(frame.buf, frame.rel, frame.framed))
            total += frame.framed
            if len(out) >= max_records:
                return out
    return out


@pytest.mark.parametrize("headers", [False, True], ids=["v1", "v1+v2"])
def test_fast_read_matches_the_generic_walk_around_damage(tmp_path: Path, headers: bool) -> None:
    """Log.read's fast path (decode_run) returns what the generic check_frame walk does, on
    format 1 records and on a mix of format 1 and 2 (headers) records (issue 13)."""
    cfg = LogConfig(segment_bytes=4096, index_interval_bytes=300)
    log = Log.open(tmp_path, cfg)
    rng = random.Random(11)
    for i in range(400):
        # Topics of equal length that differ, and of other lengths: the decoder reuses a
        # topic only when its bytes are the same.
        topic = rng.choice(["dev/a", "dev/b", "dev/bb", "", "dév/ü"])
        h = rng.choice([b"", b"", b"\x01\x01", rng.randbytes(rng.choice([1, 40, 300]))]) if headers else b""
        log.append(topic, bytes([i % 251]) * rng.choice([0, 1, 30, 200, 900]), qos=i % 3, retain=i % 4 == 0,
                   headers=h)
    log.flush()
    infos = log.segments()
    log.close()
    assert len(infos) > 6
    for info in infos[1:-1:2]:  # damage every other sealed segment: a payload bit, a length field
        data = bytearray(info.path.read_bytes())
        data[len(data) // 2] ^= 0x40
        data[len(data) // 3 : len(data) // 3 + 2] = b"\xff\xff"
        info.path.write_bytes(bytes(data))
    # A valid record (CRC fine) whose offset is out of sequence, in an undamaged segment.
    data = bytearray(infos[2].path.read_bytes())
    pos = 0
    for _ in range(3):
        pos += decode(bytes(data[pos:]))[1]
    record, framed = decode(bytes(data[pos:]))
    data[pos : pos + framed] = encode_record(record._replace(offset=record.offset + 1000))
    infos[2].path.write_bytes(bytes(data))
    again = Log.open(tmp_path, cfg)
    for offset in range(0, 401):
        for max_records, max_bytes in ((1, 1 << 20), (7, 1 << 20), (1000, 1 << 30), (1000, 2500)):
            got = again.read(offset, max_records, max_bytes)
            assert got == _reference_read(again, offset, max_records, max_bytes), (offset, max_records, max_bytes)
    assert again.stats.corrupt_skipped >= len(infos[1:-1:2])
    if headers:
        assert any(r.headers for r in again.read(0, 1000, 1 << 30))
    again.close()


def golden_v1_records() -> list[Record]:
    """The records of tests/golden/log_v1, written by main's code at 95ea32c (before format 2)
    with ``LogConfig(segment_bytes=1024, index_interval_bytes=256)``, appended in order."""
    topics = ["sensors/t1", "cafés/🌡", "", "a/b/c"]
    out = []
    for i in range(40):
        payload = bytes((i * 7 + k) % 256 for k in range((i * 13) % 90))
        out.append(Record(i, 1_700_000_000_000_000 + i * 1_000_003, topics[i % 4], payload, qos=i % 3,
                          retain=i % 5 == 0))
    return out


def test_a_v1_log_written_before_format_2_opens_and_reads_identically(tmp_path: Path) -> None:
    """Issue 13: a log written by the release before record format 2 (three sealed segments
    with index and seal, one active) opens without any repair and reads the same records;
    new records with headers (format 2) are appended after them and both read back."""
    golden = Path(__file__).parent / "golden" / "log_v1"
    before = {p.name: p.read_bytes() for p in golden.iterdir()}
    target = tmp_path / "log"
    target.mkdir()
    for name, data in before.items():
        (target / name).write_bytes(data)
    cfg = LogConfig(segment_bytes=1024, index_interval_bytes=256)
    log = Log.open(target, cfg)
    assert log.recovery.tail_bytes_truncated == 0 and log.recovery.corrupt_records == 0
    assert log.read(0, 1000, 1 << 30) == golden_v1_records()
    for offset in range(40):
        assert log.read(offset, 3) == golden_v1_records()[offset : offset + 3]
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before, "opening changed a byte"
    assert log.append("m5", b"p", qos=1, headers=b"\x03\x00\x01x") == 40
    log.append("m5", b"q")
    log.close()
    again = Log.open(target, cfg)
    got = again.read(0, 1000, 1 << 30)
    assert got[:40] == golden_v1_records()
    assert got[40:] == [Record(40, got[40].timestamp_us, "m5", b"p", 1, False, b"\x03\x00\x01x"),
                        Record(41, got[41].timestamp_us, "m5", b"q")]
    assert [s.read_bytes()[8] for s in sorted(target.glob("*.log"))][:3] == [1, 1, 1]
    again.close()


def test_record_size_limit_counts_the_headers(tmp_path: Path) -> None:
    log = Log.open(tmp_path, LogConfig(segment_bytes=1024))
    fits = 1024 - 28 - 1 - 4 - 100  # framed: 28 + topic 1 + headers_len 4 + headers 100 + payload
    assert log.append("t", b"x" * fits, headers=b"h" * 100) == 0
    with pytest.raises(ValueError, match="does not fit"):
        log.append("t", b"x" * (fits + 1), headers=b"h" * 100)
    with pytest.raises(ValueError, match="does not fit"):
        log.append("t", b"x", headers=b"h" * 1024)
    log.flush()
    assert [len(r.payload) for r in log.read(0)] == [fits]
    assert log.next_offset == 1
    log.close()


@pytest.mark.slow
def test_records_bigger_than_a_read_chunk(tmp_path: Path) -> None:
    log = Log.open(tmp_path, LogConfig(segment_bytes=8 << 20, index_interval_bytes=4096))
    sizes = [10, (1 << 20) + 5, 100, 3 << 20, 7, (1 << 20) - 40, 1]
    for i, size in enumerate(sizes):
        log.append(f"big/{i}", bytes([i]) * size)
    log.flush()
    for offset in range(len(sizes)):
        got = log.read(offset, 1000, 1 << 30)
        assert [len(r.payload) for r in got] == sizes[offset:]
        assert all(r.payload == bytes([r.offset]) * len(r.payload) and r.topic == f"big/{r.offset}" for r in got)
        assert [r.offset for r in log.read(offset, 1000, 1)] == [offset]  # one always, however big
    log.close()


def test_unflushed_records_are_invisible(tmp_path: Path) -> None:
    log = Log.open(tmp_path, SMALL)
    fill(log, 3)
    log.append("t", b"later")
    assert log.committed_offset == 3 and log.next_offset == 4
    assert [r.offset for r in log.read(0)] == [0, 1, 2]
    log.flush()
    assert [r.offset for r in log.read(3)] == [3]
    log.close()


def test_reopen_after_clean_close(tmp_path: Path) -> None:
    log = Log.open(tmp_path, SMALL)
    fill(log, 120)
    before = log.read(0, 10_000, 1 << 30)
    log.close()
    again = Log.open(tmp_path, SMALL)
    assert again.recovery.tail_bytes_truncated == 0 and again.recovery.corrupt_records == 0
    assert again.recovery.segments == len(again.segments())
    assert again.read(0, 10_000, 1 << 30) == before
    assert again.append("x", b"y") == 120
    again.close()


def test_torn_tail_truncated_at_open(tmp_path: Path) -> None:
    log = Log.open(tmp_path, SMALL)
    fill(log, 100)
    tail = log.segments()[-1]
    log.close()
    with open(tail.path, "r+b") as f:
        f.truncate(tail.size - 7)
    again = Log.open(tmp_path, SMALL)
    assert again.recovery.tail_bytes_truncated > 0
    assert again.next_offset == 99
    assert [r.offset for r in again.read(0, 10_000, 1 << 30)] == list(range(99))
    assert again.append("x", b"y") == 99
    again.close()


def test_corrupt_record_in_sealed_segment_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = Log.open(tmp_path, SMALL)
    fill(log, 200)
    first = log.segments()[1]
    log.close()
    # Damage a record in the middle of a sealed segment, length field included (no framing left).
    with open(first.path, "r+b") as f:
        f.seek(first.size // 2)
        chunk = bytearray(f.read(60))
        for i in range(len(chunk)):
            chunk[i] ^= 0x5A
        f.seek(first.size // 2)
        f.write(chunk)
    again = Log.open(tmp_path, SMALL)
    assert again.recovery.corrupt_records == 0  # sealed: trusted at open, checked on read
    with caplog.at_level(logging.ERROR, logger="segments"):
        got = [r.offset for r in again.read(0, 10_000, 1 << 30)]
    lost = sorted(set(range(200)) - set(got))
    assert 1 <= len(lost) <= 2 and got == sorted(got)
    assert all(first.base_offset <= o < first.next_offset for o in lost)
    assert again.stats.corrupt_skipped >= 1
    assert first.path.name in caplog.text and "byte" in caplog.text
    counted = again.stats.corrupt_skipped
    again.read(0, 10_000, 1 << 30)
    assert again.stats.corrupt_skipped == counted  # counted once per spot
    scanned = list(again.scan())
    assert any(not s.crc_ok and s.segment == first.path.name for s in scanned)
    assert [s.record.offset for s in scanned if s.record is not None] == got
    again.close()


@pytest.mark.parametrize("damage", ["missing", "garbage", "wrong_entries"])
def test_bad_index_is_rebuilt(tmp_path: Path, damage: str) -> None:
    log = Log.open(tmp_path, SMALL)
    fill(log, 200)
    seg = log.segments()[0]
    log.close()
    index_path = tmp_path / segment_name(seg.base_offset, ".index")
    original = index_path.read_bytes()
    assert original
    if damage == "missing":
        index_path.unlink()
    elif damage == "garbage":
        index_path.write_bytes(b"\xff" * 13)
    else:  # well-formed but pointing at wrong positions: caught by the CRC in the seal
        entries = bytearray(original)
        entries[7] ^= 0x01
        index_path.write_bytes(bytes(entries))
    again = Log.open(tmp_path, SMALL)
    for offset in range(seg.base_offset, seg.next_offset):
        assert again.read(offset, 1)[0].offset == offset
    assert index_path.read_bytes() == original
    again.close()


def test_retention_by_bytes_respects_and_reports_needed_offsets(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = LogConfig(segment_bytes=2048, index_interval_bytes=200, retention_bytes=6000)
    log = Log.open(tmp_path, cfg)
    fill(log, 300)
    total_before = log.size_bytes()
    with caplog.at_level(logging.WARNING):
        report = log.enforce_retention(min_needed_offset=0)
    assert report.segments_deleted >= 1 and log.size_bytes() <= 6000
    assert report.bytes_deleted == total_before - log.size_bytes()
    assert log.first_offset == report.first_offset > 0
    assert report.dropped_range == (0, log.first_offset) and report.dropped_needed == log.first_offset
    assert log.stats.dropped_by_retention == report.dropped_needed
    assert "forced deletion" in caplog.text
    assert log.read(0)[0].offset == log.first_offset
    for info in log.segments():
        assert info.path.exists()
    log.close()
    assert Log.open(tmp_path, cfg).first_offset == report.first_offset


def test_retention_by_age_stops_at_min_needed(tmp_path: Path) -> None:
    cfg = LogConfig(segment_bytes=2048, index_interval_bytes=200, retention_ms=60_000)
    log = Log.open(tmp_path, cfg)
    old = time.time_ns() // 1000 - 3_600_000_000
    for i in range(200):
        log.append("t", b"x" * 40, timestamp_us=old + i)
    for _ in range(30):
        log.append("t", b"new" * 10)
    log.flush()
    segs = log.segments()
    needed = segs[2].base_offset + 1  # inside the third segment
    report = log.enforce_retention(min_needed_offset=needed)
    assert report.segments_deleted == 2 and log.first_offset == segs[2].base_offset
    assert report.dropped_needed == 0 and report.dropped_range is None
    report = log.enforce_retention()
    assert log.first_offset > needed and report.segments_deleted >= 1
    assert log.read(0)  # fresh records survive
    log.close()


def test_disk_full_on_write_leaves_nothing_visible_then_recovers(tmp_path: Path) -> None:
    io = InjectingFileIO()
    log = Log.open(tmp_path, SMALL, fileio=io)
    fill(log, 10)
    size_before = log.size_bytes()
    io.full = True
    for _ in range(100):  # enough to roll into new segments inside the failed batch
        log.append("t", b"z" * 40)
    with pytest.raises(DiskFull):
        log.flush()
    assert log.committed_offset == 10 and log.next_offset == 10
    assert [r.offset for r in log.read(0, 1000)] == list(range(10))
    assert log.size_bytes() == size_before and len(log.segments()) == 1
    io.full = False
    assert fill(log, 5) == list(range(10, 15))
    log.close()
    again = Log.open(tmp_path, SMALL)
    assert again.recovery.tail_bytes_truncated == 0
    assert [r.offset for r in again.read(0, 1000)] == list(range(15))
    again.close()


def test_failed_undo_stops_writes_until_reopen(tmp_path: Path) -> None:
    io = InjectingFileIO()
    log = Log.open(tmp_path, SMALL, fileio=io)
    fill(log, 5)
    io.full = io.fail_truncate = True
    log.append("t", b"doomed" * 10)
    with pytest.raises(DiskFull):
        log.flush()
    with pytest.raises(SegmentError, match="reopen"):
        log.append("t", b"more")
    io.full = io.fail_truncate = False
    log.close()  # nothing pending: closes the files without writing
    again = Log.open(tmp_path, SMALL)  # recovery cuts the half-written record
    assert again.recovery.tail_bytes_truncated > 0
    assert [r.offset for r in again.read(0)] == list(range(5))
    again.close()


def test_min_free_bytes_floor_raises_on_append_and_clears(tmp_path: Path) -> None:
    io = InjectingFileIO()
    io.free = 10_000
    log = Log.open(tmp_path, LogConfig(min_free_bytes=9_000), fileio=io)
    with pytest.raises(DiskFull):
        for _ in range(100):
            log.append("t", b"x" * 50)
    accepted = log.next_offset
    assert 0 < accepted < 100
    log.flush()
    io.free = 10**9
    assert log.append("t", b"again") == accepted
    log.close()


def test_writes_go_through_the_given_fileio(tmp_path: Path) -> None:
    io = InjectingFileIO()
    log = Log.open(tmp_path, SMALL, fileio=io)
    fill(log, 100)
    log.sync()
    assert ("fsync_dir", str(tmp_path)) in io.events
    assert sum(1 for e in io.events if e[0] == "datasync") >= len(log.segments())
    log.close()


@pytest.mark.slow
def test_tmpfs_real_enospc(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=256k tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("mount -t tmpfs not permitted in this environment")
    try:
        log = Log.open(mnt, LogConfig(segment_bytes=64 * 1024))
        committed = 0
        with pytest.raises(DiskFull):
            for _ in range(10_000):
                for _ in range(50):
                    log.append("t", b"x" * 100)
                log.flush()
                committed = log.committed_offset
        assert log.committed_offset == committed
        assert len(log.read(0, 100_000, 1 << 30)) == committed
        log.enforce_retention()  # nothing configured: no deletion, but no crash either
        log.close()
    finally:
        os.system(f"umount {mnt}")


def test_crash_states_around_a_roll_are_repaired(tmp_path: Path) -> None:
    log = Log.open(tmp_path, SMALL)
    fill(log, 100)
    infos = log.segments()
    log.close()
    # Crash after writing segment 0 but before its seal: it is scanned and sealed again.
    seal0 = tmp_path / segment_name(infos[0].base_offset, ".seal")
    seal0.unlink()
    again = Log.open(tmp_path, SMALL)
    assert again.recovery.scanned_bytes >= infos[0].size and seal0.exists()
    assert [r.offset for r in again.read(0, 1000, 1 << 30)] == list(range(100))
    again.close()
    # Crash after sealing the last segment but before creating the next: a new one is created.
    again = Log.open(tmp_path, SMALL)
    tail = again.segments()[-1]
    again.close()
    Path(tail.path).unlink()
    last_sealed = again.segments()[-2]
    third = Log.open(tmp_path, SMALL)
    assert third.segments()[-1].base_offset == last_sealed.next_offset == third.next_offset
    assert not third.segments()[-1].sealed
    third.close()


def test_orphan_index_and_seal_files_are_removed(tmp_path: Path) -> None:
    log = Log.open(tmp_path, SMALL)
    fill(log, 10)
    log.close()
    orphans = [tmp_path / segment_name(999_999, ".index"), tmp_path / segment_name(999_999, ".seal")]
    for orphan in orphans:
        orphan.write_bytes(b"stale")
    again = Log.open(tmp_path, SMALL)
    assert not any(o.exists() for o in orphans)
    assert again.next_offset == 10
    again.close()
