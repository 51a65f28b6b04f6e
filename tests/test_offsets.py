"""Offset files: exact bytes, atomic replacement, and every kind of damage reads as None."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.queue.offsets import (
    FILE_SIZE,
    MAGIC,
    CorruptOffsetFile,
    OffsetFile,
    decode_offset,
    encode_offset,
)
from segments.fileio import OS_FILE_IO, FileHandle, FileIO


def test_layout_is_as_documented() -> None:
    data = encode_offset(0x0102030405060708)
    assert len(data) == FILE_SIZE == 17
    assert data[0:4] == MAGIC == b"FMQO"
    assert data[4] == 1
    assert data[5:13] == bytes([1, 2, 3, 4, 5, 6, 7, 8])
    assert struct.unpack(">I", data[13:17])[0] == crc32c.crc32c(data[:13])


def test_crc_is_castagnoli_not_plain_crc32() -> None:
    crcmod = pytest.importorskip("crcmod.predefined", reason="crcmod cross-checks the CRC")
    crc_fun = crcmod.mkCrcFun("crc-32c")
    data = encode_offset(42)
    assert struct.unpack(">I", data[13:])[0] == crc_fun(data[:13])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**64 - 1))
def test_round_trip(value: int) -> None:
    assert decode_offset(encode_offset(value)) == value


@pytest.mark.parametrize("value", [-1, 2**64])
def test_out_of_range_values_are_refused(value: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        encode_offset(value)


def test_write_then_read(tmp_path: Path) -> None:
    f = OffsetFile(tmp_path / "pending")
    assert f.read() is None  # missing
    f.write(7)
    assert f.read() == 7
    f.write(123456789)
    assert f.read() == 123456789
    assert (tmp_path / "pending").read_bytes() == encode_offset(123456789)
    assert not (tmp_path / "pending.tmp").exists()


def test_missing_is_reported_as_missing(tmp_path: Path) -> None:
    reading = OffsetFile(tmp_path / "doing").inspect()
    assert reading.value is None and reading.missing and not reading.ok


@pytest.mark.parametrize("cut", range(FILE_SIZE))
def test_every_truncation_reads_as_none(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "pending"
    path.write_bytes(encode_offset(99)[:cut])
    f = OffsetFile(path)
    assert f.read() is None
    reading = f.inspect()
    assert reading.problem is not None and "torn" in reading.problem


def test_trailing_garbage_reads_as_none(tmp_path: Path) -> None:
    path = tmp_path / "pending"
    path.write_bytes(encode_offset(99) + b"\x00")
    assert OffsetFile(path).read() is None


@pytest.mark.parametrize("bit", range(FILE_SIZE * 8))
def test_every_bit_flip_reads_as_none(tmp_path: Path, bit: int) -> None:
    data = bytearray(encode_offset(0xDEADBEEF))
    data[bit // 8] ^= 1 << (bit % 8)
    path = tmp_path / "pending"
    path.write_bytes(bytes(data))
    assert OffsetFile(path).read() is None
    with pytest.raises(CorruptOffsetFile) as info:
        decode_offset(bytes(data), str(path))
    assert str(path) in str(info.value)


def test_wrong_magic_and_version_are_named(tmp_path: Path) -> None:
    body = struct.pack(">4sBQ", b"XXXX", 1, 5)
    (tmp_path / "a").write_bytes(body + struct.pack(">I", crc32c.crc32c(body)))
    assert "magic" in (OffsetFile(tmp_path / "a").inspect().problem or "")
    body = struct.pack(">4sBQ", MAGIC, 9, 5)
    (tmp_path / "b").write_bytes(body + struct.pack(">I", crc32c.crc32c(body)))
    assert "version 9" in (OffsetFile(tmp_path / "b").inspect().problem or "")


def test_directory_in_place_of_file_reads_as_none(tmp_path: Path) -> None:
    (tmp_path / "pending").mkdir()
    assert OffsetFile(tmp_path / "pending").read() is None


def test_leftover_tmp_is_ignored_and_overwritten(tmp_path: Path) -> None:
    f = OffsetFile(tmp_path / "pending")
    f.write(10)
    # A crash after writing the temp file but before the rename leaves it behind.
    (tmp_path / "pending.tmp").write_bytes(encode_offset(20)[:9])
    assert f.read() == 10
    f.write(30)
    assert f.read() == 30
    assert not (tmp_path / "pending.tmp").exists()


class _RecordingIO:
    """Forwards to the real file layer and records the order of durable steps."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def open(self, path: str | os.PathLike[str], *, create: bool = False) -> FileHandle:
        self.calls.append(f"open {Path(path).name}")
        handle = OS_FILE_IO.open(path, create=create)
        calls = self.calls

        class _Handle:
            def __init__(self) -> None:
                self.path = handle.path

            def pwrite(self, data: bytes | bytearray | memoryview, position: int) -> None:
                calls.append("pwrite")
                handle.pwrite(data, position)

            def pread(self, size: int, position: int) -> bytes:
                return handle.pread(size, position)

            def size(self) -> int:
                return handle.size()

            def truncate(self, size: int) -> None:
                handle.truncate(size)

            def datasync(self) -> None:
                calls.append("datasync")
                handle.datasync()

            def close(self) -> None:
                handle.close()

        return _Handle()

    def rename(self, src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        self.calls.append(f"rename {Path(src).name} {Path(dst).name}")
        OS_FILE_IO.rename(src, dst)

    def unlink(self, path: str | os.PathLike[str]) -> None:
        OS_FILE_IO.unlink(path)

    def fsync_dir(self, path: str | os.PathLike[str]) -> None:
        self.calls.append("fsync_dir")
        OS_FILE_IO.fsync_dir(path)

    def free_bytes(self, path: str | os.PathLike[str]) -> int:
        return OS_FILE_IO.free_bytes(path)


def test_write_goes_through_fileio_atomically(tmp_path: Path) -> None:
    io = _RecordingIO()
    fileio: FileIO = io
    OffsetFile(tmp_path / "doing", fileio).write(5)
    assert io.calls == ["open doing.tmp", "pwrite", "datasync", "rename doing.tmp doing", "fsync_dir"]
    io.calls.clear()
    assert OffsetFile(tmp_path / "doing", fileio).read() == 5
    assert io.calls == ["open doing"]  # reads use the same seam, so fault injection reaches them


def test_golden_bytes_match_the_format_doc() -> None:
    # docs/FORMAT.md, "Offset files", shows exactly these bytes for offset 42.
    assert encode_offset(42) == bytes.fromhex("464D514F01000000000000002A0A181A2D")
    assert decode_offset(bytes.fromhex("464D514F01000000000000002A0A181A2D")) == 42


@pytest.mark.parametrize("mode", ["drop", "tear"])
def test_power_cut_at_every_step_of_a_write_leaves_old_or_new(tmp_path: Path, mode: str) -> None:
    import random

    faults = pytest.importorskip("tests.faults", reason="needs the fault-injection file layer")
    rng = random.Random(1234)
    step = 0
    while True:
        root = tmp_path / f"{mode}-{step}"
        io = faults.FaultyFileIO(root)
        f = OffsetFile(root / "pending", io)
        f.write(100)
        io.power_cut_after(step)
        try:
            f.write(200)
            completed = True
        except faults.PowerCut:
            completed = False
        io.crash(mode, rng)
        value = OffsetFile(root / "pending").read()
        assert value in (100, 200), (step, value)
        if completed:
            assert value == 200  # a write that returned is durable
            break  # every step of the write has been cut once
        step += 1
    assert step >= 4  # open-create, pwrite, datasync, rename, fsync_dir
