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
import threading
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


# ---- the progress journal -------------------------------------------------------------------

JOURNAL_MAGIC = b"FMQJ"
_JHEAD = struct.Struct(">4sH")  # magic, key length
_JBODY = struct.Struct(">QQ")  # pending, doing
FORGET = MAX_OFFSET  # pending == doing == FORGET: drop every earlier record of the key


def encode_journal_record(key: str, pending: int, doing: int) -> bytes:
    """One journal record: magic, u16 key length, key (ASCII), u64 pending, u64 doing, CRC-32C."""
    raw = key.encode("ascii")
    body = _JHEAD.pack(JOURNAL_MAGIC, len(raw)) + raw + _JBODY.pack(pending, doing)
    return body + _CRC.pack(crc32c.crc32c(body))


def decode_journal(data: bytes) -> tuple[dict[str, tuple[int, int]], int]:
    """Replay journal bytes: per key the highest (pending, doing) since its last FORGET record,
    and how many leading bytes were valid (replay stops at the first torn or damaged record)."""
    progress: dict[str, tuple[int, int]] = {}
    pos = 0
    while pos + _JHEAD.size <= len(data):
        magic, n = _JHEAD.unpack_from(data, pos)
        end = pos + _JHEAD.size + n + _JBODY.size + _CRC.size
        if magic != JOURNAL_MAGIC or end > len(data):
            break
        crc_at = end - _CRC.size
        if _CRC.unpack_from(data, crc_at)[0] != crc32c.crc32c(data[pos:crc_at]):
            break
        try:
            key = data[pos + _JHEAD.size : pos + _JHEAD.size + n].decode("ascii")
        except UnicodeDecodeError:
            break
        pending, doing = _JBODY.unpack_from(data, pos + _JHEAD.size + n)
        if pending == FORGET and doing == FORGET:
            progress.pop(key, None)
        else:
            old = progress.get(key)
            progress[key] = (pending, doing) if old is None else (max(old[0], pending), max(old[1], doing))
        pos = end
    return progress, pos


class ProgressJournal:
    """Consumer groups' acknowledged progress between two writes of their offset files.

    The Doing/Pending files are replaced with write-temp-fsync-rename, which is too costly to
    do on every ack. The broker therefore appends each changed group's (Pending, Doing) to
    this one file after every event-loop turn that processed acks (one ``pwrite``, no fsync:
    it survives a process crash such as ``kill -9``), and the group commit fdatasyncs it
    after each log commit that synced (:meth:`sync`, on a thread of its own), so a power
    loss costs about the acks of the last one or two commit cycles. On open the journal is replayed (:func:`decode_journal`: per group the
    highest values since its last FORGET record; replay stops at the first damaged record)
    and compacted: the queue writes the replayed values into the offset files, then
    :meth:`reset` empties the journal. It is also compacted when it grows past
    ``compact_bytes``. A journal value is, like an offset file, a Pending that was the lowest
    unacked offset when written: using it never skips an unacked record.

    Thread-safety: :meth:`record`, :meth:`forget`, :meth:`sync` and :meth:`reset` may be
    called from any thread (one lock).
    """

    def __init__(self, path: str | os.PathLike[str], fileio: FileIO = OS_FILE_IO,
                 *, compact_bytes: int = 1 << 20) -> None:
        self.path = Path(path)
        self.compact_bytes = compact_bytes
        self._fileio = fileio
        self._lock = threading.Lock()
        existed = self.path.exists()
        self._handle = fileio.open(self.path, create=True)
        if not existed:
            fileio.fsync_dir(self.path.parent)  # its name must outlive a power loss too
        data = self._handle.pread(self._handle.size(), 0)
        self.replayed, valid = decode_journal(data)
        if valid < len(data):
            log.warning("progress journal %s: %d damaged trailing bytes ignored (torn by a crash)",
                        self.path, len(data) - valid)
        self._end = len(data)
        self._dirty = False
        self.records = 0  # appended since open

    @property
    def size(self) -> int:
        return self._end

    def needs_sync(self) -> bool:
        """Whether records were appended since the last sync (read on the loop thread, which
        is the one appending them)."""
        return self._dirty

    def record(self, entries: list[tuple[str, int, int]]) -> None:
        """Append (key, pending, doing) records with one write; not synced (see :meth:`sync`)."""
        if not entries:
            return
        data = b"".join(encode_journal_record(k, p, d) for k, p, d in entries)
        with self._lock:
            self._handle.pwrite(data, self._end)
            self._end += len(data)
            self._dirty = True
            self.records += len(entries)

    def forget(self, key: str) -> None:
        """Durably discard ``key``'s earlier records (the group was created anew or dropped)."""
        data = encode_journal_record(key, FORGET, FORGET)
        with self._lock:
            self._handle.pwrite(data, self._end)
            self._end += len(data)
            self._handle.datasync()
            self._dirty = False
        self.replayed.pop(key, None)

    def sync(self) -> None:
        """fdatasync the appended records, if any (called by the group commit's thread)."""
        with self._lock:
            if self._dirty:
                self._handle.datasync()
                self._dirty = False

    def reset(self) -> None:
        """Empty the journal (after every group's offset files were written)."""
        with self._lock:
            self._handle.truncate(0)
            self._handle.datasync()
            self._end = 0
            self._dirty = False

    def close(self) -> None:
        with self._lock:
            self._handle.close()
