"""Per-(device_id, stream) offsets the collector already holds: its duplicate filter.

A :class:`HighWaterMarks` keeps, per ``(device_id, stream)``, the exact device-log offsets
the collector holds durably (in its write-ahead log, or landed), as disjoint ranges. Normally
that is one range ``[first, high-water mark]``; a batch that arrives after a gap (an earlier
batch whose commit failed, while a later one succeeded) opens a second range, and the hole
closes when the missing batch is re-sent. Holes are never treated as held, so a late fill-in
is stored, not dropped as a duplicate. With the ranges:

* the door acknowledges and drops a batch whose span lies inside one held range, and trims
  the held records off one that overlaps;
* the lander drops rows inside held ranges, so a batch stored twice (re-sent while its first
  copy was still being committed) lands once.

A batch adds exactly the offsets it carries (:func:`batch_ranges`): its span
``[first_offset, last_offset]`` only when ``count`` fills it, otherwise one range per run of
consecutive offsets. So one batch never makes the collector hold an offset it did not carry:
a batch with offsets ``{0, 10**9}`` holds those two, and the device's real records 1, 2, ...
are stored, not dropped as duplicates (issue 10 item 3). At most :data:`MAX_RANGES` ranges are
kept per stream; beyond that the lowest range is *forgotten* (logged as a WARNING), never
merged across a hole: a forgotten range can only let a resend of old records land a second
time (the Spark ingest removes it by ``(device_id, stream, offset)``), never drop a record.

Durability: :meth:`HighWaterMarks.save` writes a snapshot (``dedup.snap`` in the collector's
data directory, via :func:`segments.fileio.atomic_write`, CRC-checked) recording the WAL
offset it covers. The lander saves it right after it has landed a file and persisted its
offset, so ``covered`` never exceeds what is landed; at start-up :meth:`load` reads it and
the lander replays the WAL from ``covered`` up to its Pending offset (see
``collector.lander``). A missing or damaged snapshot means replaying the whole WAL that
retention has left: nothing is lost; a resent batch older than that WAL lands again and the
Spark job removes it by ``(device_id, stream, offset)``.

Snapshot layout (little-endian): ``b"FMQD"``, u8 version (1), u64 covered, u32 entries, then
per entry u16 length + UTF-8 device id, u16 length + UTF-8 stream, u32 range count, and per
range u64 first, u64 last; then u32 CRC-32C of every byte before it.
"""

from __future__ import annotations

import logging
import struct
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from pathlib import Path

from crc32c import crc32c

from filemq.upstream.batch import BatchHeader, decode_batch
from segments.fileio import OS_FILE_IO, FileIO, atomic_write

log = logging.getLogger(__name__)

SNAPSHOT_FILE = "dedup.snap"
MAX_RANGES = 1024
_MAGIC = b"FMQD"
_VERSION = 1
_HEAD = struct.Struct("<4sBQI")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_RANGE = struct.Struct("<QQ")

Key = tuple[str, str]
Range = tuple[int, int]


def offset_runs(first: int, deltas: Iterable[int]) -> list[Range]:
    """The maximal runs of consecutive offsets ``first + d`` (``deltas`` strictly increasing)."""
    runs: list[Range] = []
    lo = hi = -2
    for d in deltas:
        offset = first + d
        if offset != hi + 1:
            if hi >= 0:
                runs.append((lo, hi))
            lo = offset
        hi = offset
    if hi >= 0:
        runs.append((lo, hi))
    return runs


def batch_ranges(header: BatchHeader, payload: bytes | bytearray | memoryview) -> list[Range]:
    """The exact offset ranges a batch carries: its span when ``count`` fills it, else the runs
    of its decoded offsets. Raises :class:`filemq.upstream.batch.MalformedBatch` for a bad body."""
    first, last = header.first_offset, header.last_offset
    if last - first + 1 == header.count:  # strictly increasing offsets: every one is there
        return [(first, last)]
    return offset_runs(first, decode_batch(payload).offset_deltas)


class HighWaterMarks:
    """Held offset ranges in memory plus the snapshot file; use from one thread (the loop)."""

    def __init__(self, path: str | Path | None, fileio: FileIO = OS_FILE_IO, *,
                 max_ranges: int = MAX_RANGES) -> None:
        """``path`` None: kept in memory only (:meth:`save` refuses, :meth:`load` finds nothing)."""
        if max_ranges < 1:
            raise ValueError("max_ranges must be at least 1")
        self.max_ranges = max_ranges
        self.forgotten_ranges = 0  # ranges dropped to stay within max_ranges (logged)
        self.path = Path(path) if path is not None else None
        self._fileio = fileio
        # Per stream: first offsets and last offsets of disjoint, non-adjacent ranges, sorted.
        self._firsts: dict[Key, list[int]] = {}
        self._lasts: dict[Key, list[int]] = {}
        self.covered = 0  # WAL offset the loaded/saved snapshot covers (records below it)

    def get(self, device_id: str, stream: str) -> int:
        """The high-water mark: the highest offset held, or -1 when nothing is."""
        lasts = self._lasts.get((device_id, stream))
        return lasts[-1] if lasts else -1

    def ranges(self, device_id: str, stream: str) -> list[Range]:
        """The held ranges ``(first, last)``, ascending."""
        key = (device_id, stream)
        return list(zip(self._firsts.get(key, ()), self._lasts.get(key, ()), strict=True))

    def add(self, device_id: str, stream: str, first: int, last: int) -> None:
        """Mark ``[first, last]`` held, merging with overlapping or adjacent ranges."""
        if last < first:
            raise ValueError(f"empty range {first}..{last}")
        key = (device_id, stream)
        firsts = self._firsts.setdefault(key, [])
        lasts = self._lasts.setdefault(key, [])
        if firsts and firsts[-1] <= first <= lasts[-1] + 1:
            # The common case: the batch continues (or repeats) the top range.
            if last > lasts[-1]:
                lasts[-1] = last
            return
        i = bisect_right(firsts, first)
        # Merge with the range before if it touches, and with every following one we reach.
        if i > 0 and lasts[i - 1] + 1 >= first:
            i -= 1
            first = firsts[i]
            last = max(last, lasts[i])
        j = i
        while j < len(firsts) and firsts[j] <= last + 1:
            last = max(last, lasts[j])
            j += 1
        firsts[i:j] = [first]
        lasts[i:j] = [last]
        if len(firsts) > self.max_ranges:
            # Forget (never merge across a hole): a forgotten range can only let a resend land
            # twice (removed downstream by key); a merged hole would drop real records.
            self.forgotten_ranges += 1
            if self.forgotten_ranges % 1000 == 1:  # one gappy batch must not flood the log
                log.warning(
                    "device %r stream %r: more than %d separate offset ranges; forgetting the lowest"
                    " %d..%d (a resend of those records would land again; %d forgotten so far)",
                    device_id, stream, self.max_ranges, firsts[0], lasts[0], self.forgotten_ranges,
                )
            del firsts[0], lasts[0]

    def add_ranges(self, device_id: str, stream: str, ranges: Iterable[Range]) -> None:
        """:meth:`add` each range (e.g. :func:`batch_ranges` of a batch)."""
        for first, last in ranges:
            self.add(device_id, stream, first, last)

    def holds(self, device_id: str, stream: str, first: int, last: int) -> bool:
        """True if ``[first, last]`` lies inside one held range."""
        key = (device_id, stream)
        firsts = self._firsts.get(key)
        if not firsts:
            return False
        i = bisect_right(firsts, first) - 1
        return i >= 0 and self._lasts[key][i] >= last

    def overlaps(self, device_id: str, stream: str, first: int, last: int) -> list[Range]:
        """The held ranges that intersect ``[first, last]``, clipped to it."""
        key = (device_id, stream)
        firsts = self._firsts.get(key)
        if not firsts:
            return []
        lasts = self._lasts[key]
        out: list[Range] = []
        i = max(bisect_right(firsts, first) - 1, 0)
        while i < len(firsts) and firsts[i] <= last:
            if lasts[i] >= first:
                out.append((max(first, firsts[i]), min(last, lasts[i])))
            i += 1
        return out

    def items(self) -> Iterator[tuple[Key, list[Range]]]:
        for key in self._firsts:
            yield key, self.ranges(*key)

    def __len__(self) -> int:
        return len(self._firsts)

    def clear(self) -> None:
        self._firsts.clear()
        self._lasts.clear()
        self.covered = 0

    # -- the snapshot ---------------------------------------------------------------------------

    def encode(self, covered: int) -> bytes:
        parts = [_HEAD.pack(_MAGIC, _VERSION, covered, len(self._firsts))]
        for (device, stream), ranges in self.items():
            for name in (device, stream):
                raw = name.encode("utf-8")
                parts.append(_U16.pack(len(raw)))
                parts.append(raw)
            parts.append(_U32.pack(len(ranges)))
            parts.extend(_RANGE.pack(lo, hi) for lo, hi in ranges)
        body = b"".join(parts)
        return body + _U32.pack(crc32c(body))

    def save(self, covered: int) -> None:
        """Write the snapshot: the ranges as they are, covering WAL offsets below ``covered``."""
        self.save_encoded(self.encode(covered), covered)

    def save_encoded(self, data: bytes, covered: int) -> None:
        """Write a snapshot made by :meth:`encode` (may run on a worker thread)."""
        if self.path is None:
            raise ValueError("these high-water marks have no snapshot file")
        atomic_write(self.path, data, self._fileio)
        self.covered = covered

    def load(self) -> bool:
        """Replace the ranges with the snapshot's; False (and nothing held) if missing or damaged."""
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
                "dedup snapshot %s is damaged; rebuilding from the WAL (rows older than the WAL"
                " may land twice; the ingest removes them by (device_id, stream, offset))",
                self.path,
            )
            return False
        self.covered, streams = decoded
        for (device, stream), ranges in streams.items():
            for lo, hi in ranges:
                self.add(device, stream, lo, hi)
        return True


def _decode(data: bytes) -> tuple[int, dict[Key, list[Range]]] | None:
    if len(data) < _HEAD.size + 4:
        return None
    body, (crc,) = data[:-4], _U32.unpack_from(data, len(data) - 4)
    if crc32c(body) != crc:
        return None
    magic, version, covered, count = _HEAD.unpack_from(body, 0)
    if magic != _MAGIC or version != _VERSION:
        return None
    pos = _HEAD.size
    streams: dict[Key, list[Range]] = {}
    try:
        for _ in range(count):
            names = []
            for _ in range(2):
                (n,) = _U16.unpack_from(body, pos)
                pos += 2
                names.append(body[pos : pos + n].decode("utf-8"))
                pos += n
            (n_ranges,) = _U32.unpack_from(body, pos)
            pos += 4
            ranges = []
            for _ in range(n_ranges):
                lo, hi = _RANGE.unpack_from(body, pos)
                pos += _RANGE.size
                if hi < lo:
                    return None
                ranges.append((lo, hi))
            streams[(names[0], names[1])] = ranges
    except (struct.error, UnicodeDecodeError):
        return None
    if pos != len(body):
        return None
    return covered, streams
