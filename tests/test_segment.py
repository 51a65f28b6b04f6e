"""Segment layer: names, seal, index, and per-segment recovery of torn or corrupt tails."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from crc32c import crc32c

from segments.fileio import OsFileIO
from segments.index import ENTRY, SparseIndex
from segments.record import Record, encode_record
from segments.segment import Seal, Segment, parse_segment_name, segment_name

IO = OsFileIO()


def write_segment(directory: Path, records: list[Record], base: int = 0) -> bytes:
    data = b"".join(encode_record(r) for r in records)
    (directory / segment_name(base, ".log")).write_bytes(data)
    return data


def recs(n: int, base: int = 0, size: int = 20) -> list[Record]:
    return [Record(base + i, 1000 + i, f"t/{i % 3}", bytes([i % 256]) * size, qos=i % 3) for i in range(n)]


def offsets_of(segment: Segment) -> list[int]:
    return [f.offset for f in segment.walk(0, segment.size, segment.base_offset, resync=False)]


def test_segment_names_sort_by_offset() -> None:
    assert segment_name(42, ".log") == "00000000000000000042.log"
    assert parse_segment_name("00000000000000000042.log") == 42
    for bad in ("42.log", "00000000000000000042.index", "0000000000000000004x.log", "x.log.tmp"):
        assert parse_segment_name(bad) is None


def test_seal_round_trip_and_damage() -> None:
    seal = Seal(10, 20, 4096, 123, 0xDEADBEEF)
    data = seal.encode()
    assert Seal.decode(data) == seal
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x10
        assert Seal.decode(bytes(damaged)) is None
    assert Seal.decode(data[:-1]) is None


def test_index_lookup_and_validation() -> None:
    index = SparseIndex(100)
    for off, pos in ((110, 4096), (121, 8200), (130, 12300)):
        index.add(off, pos)
    assert index.lookup(100) == 0 and index.lookup(109) == 0
    assert index.lookup(110) == 4096 and index.lookup(125) == 8200 and index.lookup(10**9) == 12300
    assert SparseIndex.decode(100, index.encode(), 20000, 140).entries() == index.entries()
    with pytest.raises(ValueError):
        SparseIndex.decode(100, index.encode(), 10000, 140)  # position past the end
    with pytest.raises(ValueError):
        SparseIndex.decode(100, index.encode()[8:] + index.encode()[:8], 20000, 140)  # not sorted
    index.truncate_to(8200)
    assert index.entries() == [(110, 4096)]


def test_index_encoding_is_the_documented_big_endian_pairs() -> None:
    entries = [(1000 + 7, 4096), (1000 + 70_000, 1 << 31), (1000 + (1 << 32) - 1, (1 << 32) - 1)]
    index = SparseIndex(1000)
    for off, pos in entries:
        index.add(off, pos)
    expected = b"".join(ENTRY.pack(off - 1000, pos) for off, pos in entries)
    assert index.encode() == expected
    assert index.crc() == crc32c(expected)
    assert index.nbytes == 8 * len(entries)  # compact: no Python object per entry
    decoded = SparseIndex.decode(1000, expected, 1 << 32, 1000 + (1 << 32))
    assert decoded.entries() == entries and decoded.encode() == expected
    assert SparseIndex(5).encode() == b"" and SparseIndex.decode(5, b"", 0, 5).entries() == []


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (ENTRY.pack(1, 10) + ENTRY.pack(1, 20), "out of order"),  # offsets not strictly increasing
        (ENTRY.pack(1, 20) + ENTRY.pack(2, 20), "out of order"),  # positions not strictly increasing
        (ENTRY.pack(1, 10) + ENTRY.pack(9, 20), "past segment end"),  # offset >= next_offset
        (ENTRY.pack(1, 10) + ENTRY.pack(2, 500), "past the segment end"),  # position >= size
        (ENTRY.pack(1, 10) + b"\0", "not a multiple"),
    ],
)
def test_index_decode_rejects_implausible_entries(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        SparseIndex.decode(100, data, 500, 109)


def test_index_lookup_matches_a_linear_search_from_every_offset() -> None:
    rng = random.Random(7)
    index = SparseIndex(50)
    entries: list[tuple[int, int]] = []
    off, pos = 50, 0
    for _ in range(300):
        off += rng.randint(1, 40)
        pos += rng.randint(28, 9000)
        index.add(off, pos)
        entries.append((off, pos))
    for probe in range(40, off + 50):
        expected = max((p for o, p in entries if o <= probe), default=0)
        assert index.lookup(probe) == expected, probe
    cut = entries[150][1]
    index.truncate_to(cut)
    assert index.entries() == entries[:150]
    index.truncate_to(cut + 1)  # nothing at or past it any more: unchanged
    assert index.entries() == entries[:150]


def test_sealed_index_loads_lazily_releases_and_reloads(tmp_path: Path) -> None:
    write_segment(tmp_path, recs(200, size=50))
    segment, _ = Segment.recover(tmp_path, 0, IO, 1000)
    built = segment.ensure_index(1000).entries()
    segment.seal_now()
    assert segment.release_index() and segment.index is None
    assert not segment.release_index()  # nothing loaded
    assert segment.ensure_index(1000).entries() == built  # from the .index file
    segment.close()
    reopened, _ = Segment.recover(tmp_path, 0, IO, 1000)
    assert reopened.sealed and reopened.index is None  # opening reads no index
    (tmp_path / segment_name(0, ".index")).unlink()
    assert reopened.ensure_index(1000).entries() == built  # rebuilt from the records
    assert (tmp_path / segment_name(0, ".index")).exists()
    reopened.close()


def test_unsealed_segment_keeps_its_index(tmp_path: Path) -> None:
    write_segment(tmp_path, recs(50, size=50))
    segment, _ = Segment.recover(tmp_path, 0, IO, 200)
    assert not segment.sealed and not segment.release_index() and segment.index is not None
    segment.close()


def test_torn_tail_cut_at_every_byte_of_last_record(tmp_path: Path) -> None:
    records = recs(5)
    data = write_segment(tmp_path, records)
    last = len(encode_record(records[-1]))
    good = len(data) - last
    for cut in range(good, len(data)):
        path = tmp_path / segment_name(0, ".log")
        path.write_bytes(data[:cut])
        segment, found = Segment.recover(tmp_path, 0, IO, 64)
        assert found.truncated_bytes == cut - good
        assert segment.size == good == os.path.getsize(path)
        assert segment.next_offset == 4
        assert offsets_of(segment) == [0, 1, 2, 3]
        segment.close()


def test_zero_filled_tail_is_cut(tmp_path: Path) -> None:
    data = write_segment(tmp_path, recs(3))
    with open(tmp_path / segment_name(0, ".log"), "ab") as f:
        f.write(b"\0" * 5000)  # what a file system may leave after a power cut
    segment, found = Segment.recover(tmp_path, 0, IO, 64)
    assert (segment.size, segment.next_offset, found.truncated_bytes) == (len(data), 3, 5000)


def test_bit_flip_inside_tail_with_intact_framing_is_skipped(tmp_path: Path) -> None:
    records = recs(6)
    data = bytearray(write_segment(tmp_path, records))
    third = sum(len(encode_record(r)) for r in records[:2])
    data[third + 40] ^= 0x01  # inside the payload of offset 2
    (tmp_path / segment_name(0, ".log")).write_bytes(bytes(data))
    segment, found = Segment.recover(tmp_path, 0, IO, 64)
    assert found.corrupt_records == 1 and found.truncated_bytes == 0
    assert segment.next_offset == 6 and segment.size == len(data)
    frames = list(segment.walk(0, segment.size, None, resync=True, max_offset=6))
    assert [f.offset for f in frames] == [0, 1, -1, 3, 4, 5]


def test_index_rebuilt_during_scan_matches_interval(tmp_path: Path) -> None:
    write_segment(tmp_path, recs(200, size=50))
    segment, _ = Segment.recover(tmp_path, 0, IO, 1000)
    index = segment.index
    assert index is not None and len(index) > 5
    positions = [pos for _, pos in index.entries()]
    gaps = [b - a for a, b in zip([0, *positions], positions, strict=False)]
    assert all(g >= 1000 for g in gaps)
    for off, pos in index.entries():
        frame = next(segment.walk(pos, segment.size, None, resync=False))
        assert frame.offset == off


def test_sealed_segment_trusted_by_seal_and_rescanned_on_size_mismatch(tmp_path: Path) -> None:
    write_segment(tmp_path, recs(10))
    segment, _ = Segment.recover(tmp_path, 0, IO, 64)
    segment.seal_now()
    segment.close()
    trusted, found = Segment.recover(tmp_path, 0, IO, 64)
    assert trusted.sealed and found.scanned_bytes == 0 and trusted.next_offset == 10
    trusted.close()
    with open(tmp_path / segment_name(0, ".log"), "ab") as f:
        f.write(b"junk")
    rescanned, found = Segment.recover(tmp_path, 0, IO, 64)
    assert not rescanned.sealed and found.truncated_bytes == 4 and rescanned.next_offset == 10
    assert not (tmp_path / segment_name(0, ".seal")).exists()


def test_damaged_length_field_inside_tail_loses_only_that_record(tmp_path: Path) -> None:
    records = recs(6)
    data = bytearray(write_segment(tmp_path, records))
    third = sum(len(encode_record(r)) for r in records[:2])
    data[third + 1] ^= 0x40  # the length of offset 2 now points far away: its framing is lost
    (tmp_path / segment_name(0, ".log")).write_bytes(bytes(data))
    segment, found = Segment.recover(tmp_path, 0, IO, 64)
    assert found.corrupt_records == 1 and found.truncated_bytes == 0
    assert segment.next_offset == 6
    frames = list(segment.walk(0, segment.size, None, resync=True, max_offset=6))
    assert [f.offset for f in frames] == [0, 1, -1, 3, 4, 5]
