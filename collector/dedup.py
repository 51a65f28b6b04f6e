"""Per-(device_id, stream) high-water marks: the collector's duplicate filter.

A :class:`HighWaterMarks` maps ``(device_id, stream)`` to the highest device-log offset the
collector's lander has taken from its write-ahead log. Everything at or below the mark is
already durable at the collector (in the WAL, or landed), so:

* the door acknowledges and drops a batch that lies entirely at or below the mark, and trims
  one that overlaps it;
* the lander drops rows at or below the mark, so a batch stored twice (re-sent while its
  first copy was still being committed) lands once.

Durability: :meth:`HighWaterMarks.save` writes a snapshot (``dedup.snap`` in the collector's
data directory, via :func:`segments.fileio.atomic_write`, CRC-checked) recording the WAL
offset it covers. The lander saves it right after it has landed a file and persisted its
offset, so ``covered`` never exceeds what is landed; at start-up :meth:`load` reads it and
the lander replays the WAL from ``covered`` up to its Pending offset (see
``collector.lander``). A missing or damaged snapshot means replaying the whole WAL that
retention has left: nothing is lost; a resent batch older than that WAL lands again and the
Spark job removes it by ``(device_id, stream, offset)``.

Snapshot layout (little-endian): ``b"FMQD"``, u8 version (1), u64 covered, u32 entries, then
per entry u16 length + UTF-8 device id, u16 length + UTF-8 stream, u64 mark; then u32
CRC-32C of every byte before it.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from pathlib import Path

from crc32c import crc32c

from segments.fileio import OS_FILE_IO, FileIO, atomic_write

log = logging.getLogger(__name__)

SNAPSHOT_FILE = "dedup.snap"
_MAGIC = b"FMQD"
_VERSION = 1
_HEAD = struct.Struct("<4sBQI")
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")

Key = tuple[str, str]


class HighWaterMarks:
    """The marks in memory plus the snapshot file; use from one thread (the event loop)."""

    def __init__(self, path: str | Path | None, fileio: FileIO = OS_FILE_IO) -> None:
        """``path`` None: marks kept in memory only (:meth:`save` and :meth:`load` refuse)."""
        self.path = Path(path) if path is not None else None
        self._fileio = fileio
        self._marks: dict[Key, int] = {}
        self.covered = 0  # WAL offset the loaded/saved snapshot covers (records below it)

    def get(self, device_id: str, stream: str) -> int:
        """The mark, or -1 when nothing of this stream has been seen."""
        return self._marks.get((device_id, stream), -1)

    def advance(self, device_id: str, stream: str, offset: int) -> None:
        """Raise the mark to ``offset`` (never lowers it)."""
        key = (device_id, stream)
        if offset > self._marks.get(key, -1):
            self._marks[key] = offset

    def items(self) -> Iterator[tuple[Key, int]]:
        return iter(self._marks.items())

    def __len__(self) -> int:
        return len(self._marks)

    def clear(self) -> None:
        self._marks.clear()
        self.covered = 0

    # -- the snapshot ---------------------------------------------------------------------------

    def encode(self, covered: int) -> bytes:
        parts = [_HEAD.pack(_MAGIC, _VERSION, covered, len(self._marks))]
        for (device, stream), mark in self._marks.items():
            for name in (device, stream):
                raw = name.encode("utf-8")
                parts.append(_U16.pack(len(raw)))
                parts.append(raw)
            parts.append(_U64.pack(mark))
        body = b"".join(parts)
        return body + _U32.pack(crc32c(body))

    def save(self, covered: int) -> None:
        """Write the snapshot: the marks as they are, covering WAL offsets below ``covered``."""
        self.save_encoded(self.encode(covered), covered)

    def save_encoded(self, data: bytes, covered: int) -> None:
        """Write a snapshot made by :meth:`encode` (may run on a worker thread)."""
        if self.path is None:
            raise ValueError("these high-water marks have no snapshot file")
        atomic_write(self.path, data, self._fileio)
        self.covered = covered

    def load(self) -> bool:
        """Replace the marks with the snapshot's; False (and empty marks) if missing or damaged."""
        self.clear()
        if self.path is None:
            return False
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("dedup snapshot %s unreadable (%s); starting without it", self.path, exc)
            return False
        decoded = _decode(data)
        if decoded is None:
            log.warning(
                "dedup snapshot %s is damaged; starting without it (rows may land twice;"
                " the ingest removes them by (device_id, stream, offset))",
                self.path,
            )
            return False
        self.covered, self._marks = decoded
        return True


def _decode(data: bytes) -> tuple[int, dict[Key, int]] | None:
    if len(data) < _HEAD.size + 4:
        return None
    body, (crc,) = data[:-4], _U32.unpack_from(data, len(data) - 4)
    if crc32c(body) != crc:
        return None
    magic, version, covered, count = _HEAD.unpack_from(body, 0)
    if magic != _MAGIC or version != _VERSION:
        return None
    pos = _HEAD.size
    marks: dict[Key, int] = {}
    try:
        for _ in range(count):
            names = []
            for _ in range(2):
                (n,) = _U16.unpack_from(body, pos)
                pos += 2
                names.append(body[pos : pos + n].decode("utf-8"))
                pos += n
            (mark,) = _U64.unpack_from(body, pos)
            pos += 8
            marks[(names[0], names[1])] = mark
    except (struct.error, UnicodeDecodeError):
        return None
    if pos != len(body):
        return None
    return covered, marks
