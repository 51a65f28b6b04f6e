"""One consumer-group offset (Doing or Pending) in a small, CRC-checked, atomically replaced file.

What a caller may rely on:

* :meth:`OffsetFile.write` goes through :func:`segments.fileio.atomic_write` (temp file,
  fdatasync, rename, directory fsync): after a crash at any point the file holds the old value
  or the new one, never a mix.
* :meth:`OffsetFile.read` never raises for damaged content: it returns ``None`` when the file
  is missing, torn (wrong size), has the wrong magic or version, or fails its CRC. The caller
  then falls back to a *safe* value (one that re-delivers, never one that skips).
  :meth:`OffsetFile.inspect` says which of those it was, for ``filemq verify``.
* A leftover ``<name>.tmp`` from an interrupted write is never read.

Byte layout (17 bytes, big-endian; also in docs/FORMAT.md, "Offset files"):

====== ====== ==============================================================
bytes  type   meaning
====== ====== ==============================================================
0-3    4 B    magic ``b"FMQO"`` (filemq offset)
4      u8     format version, currently 1
5-12   u64    the offset
13-16  u32    CRC-32C (Castagnoli) of bytes 0-12
====== ====== ==============================================================
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import crc32c

from segments.fileio import OS_FILE_IO, FileIO, atomic_write

log = logging.getLogger(__name__)

MAGIC = b"FMQO"
VERSION = 1
_BODY = struct.Struct(">4sBQ")
_CRC = struct.Struct(">I")
FILE_SIZE = _BODY.size + _CRC.size  # 17
MAX_OFFSET = (1 << 64) - 1


class CorruptOffsetFile(ValueError):
    """The bytes of an offset file are not a valid offset record; ``path`` and ``reason`` say why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"offset file {path}: {reason}")
        self.path = path
        self.reason = reason


def encode_offset(value: int) -> bytes:
    """The 17 bytes of an offset file holding ``value`` (0 <= value < 2**64)."""
    if not 0 <= value <= MAX_OFFSET:
        raise ValueError(f"offset {value} outside 0..2**64-1")
    body = _BODY.pack(MAGIC, VERSION, value)
    return body + _CRC.pack(crc32c.crc32c(body))


def decode_offset(data: bytes, path: str = "<bytes>") -> int:
    """The offset held by ``data``; raises :class:`CorruptOffsetFile` naming ``path`` if invalid."""
    if len(data) != FILE_SIZE:
        raise CorruptOffsetFile(path, f"torn: {len(data)} bytes, expected {FILE_SIZE}")
    magic, version, value = _BODY.unpack_from(data)
    if magic != MAGIC:
        raise CorruptOffsetFile(path, f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise CorruptOffsetFile(path, f"unsupported version {version}")
    (stored_crc,) = _CRC.unpack_from(data, _BODY.size)
    actual = crc32c.crc32c(data[: _BODY.size])
    if stored_crc != actual:
        raise CorruptOffsetFile(path, f"CRC mismatch: stored {stored_crc:#010x}, computed {actual:#010x}")
    return int(value)


@dataclass(frozen=True, slots=True)
class OffsetReading:
    """What :meth:`OffsetFile.inspect` found: ``value`` if valid, else ``problem`` says why."""

    path: str
    value: int | None
    problem: str | None  # None: valid; "missing"; or the corruption found

    @property
    def ok(self) -> bool:
        return self.problem is None

    @property
    def missing(self) -> bool:
        return self.problem == "missing"


class OffsetFile:
    """A Doing or Pending offset file at ``path``; every write and read goes through ``fileio``."""

    __slots__ = ("path", "_fileio")

    def __init__(self, path: str | os.PathLike[str], fileio: FileIO = OS_FILE_IO) -> None:
        self.path = Path(path)
        self._fileio = fileio

    def __repr__(self) -> str:
        return f"OffsetFile({str(self.path)!r})"

    def inspect(self) -> OffsetReading:
        """Read and check the file without changing anything on disk."""
        path = str(self.path)
        try:
            handle = self._fileio.open(self.path)
        except FileNotFoundError:
            return OffsetReading(path, None, "missing")
        except IsADirectoryError:
            return OffsetReading(path, None, "is a directory, not an offset file")
        try:
            # Read one byte more than expected so trailing garbage shows up as a wrong size.
            data = handle.pread(FILE_SIZE + 1, 0)
        finally:
            handle.close()
        try:
            return OffsetReading(path, decode_offset(data, path), None)
        except CorruptOffsetFile as exc:
            return OffsetReading(path, None, exc.reason)

    def read(self) -> int | None:
        """The stored offset, or ``None`` if the file is missing or damaged (logged as WARNING)."""
        reading = self.inspect()
        if reading.problem is not None and not reading.missing:
            log.warning("offset file %s unusable (%s); caller falls back", reading.path, reading.problem)
        return reading.value

    def write(self, value: int) -> None:
        """Durably replace the stored offset with ``value`` (atomic: old or new after a crash)."""
        atomic_write(self.path, encode_offset(value), self._fileio)
