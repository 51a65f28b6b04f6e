"""One segment: a ``.log`` file of records, its sparse ``.index`` and, once rolled, its ``.seal``.

A segment knows how to append bytes at its end, read records from an offset, seal itself,
and recover itself at open (:meth:`Segment.recover`).  It knows nothing of other segments.

File names are the base offset (the offset of the first record) zero-padded to 20 digits,
as in Kafka: ``00000000000000000000.log``, ``.index``, ``.seal``.  A sealed segment is
trusted at open from its seal when the file size matches, so opening a log costs one small
read per segment; its records are still CRC-checked on every read.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from crc32c import crc32c

from segments.errors import SegmentError
from segments.fileio import FileHandle, FileIO, atomic_write
from segments.index import SparseIndex
from segments.record import (
    INCOMPLETE,
    LENGTH,
    LENGTH_SIZE,
    MAX_RECORD_BYTES,
    REASONS,
    Record,
    check_frame,
    decode_run,
    find_next_valid,
    length_in_range,
    offset_at,
    scan_run,
)

log = logging.getLogger(__name__)

NAME_DIGITS = 20
READ_CHUNK = 1 << 20
# Recovery reads the tail in chunks this big.  Two chunks are alive at a time, so this sets
# the peak memory of an open: 8 MiB chunks cost ~16 MiB of RSS at start-up for no measurable
# speed (a 58 MiB tail scans in ~0.22 s either way).
SCAN_CHUNK = 2 << 20
SEAL_MAGIC = b"FMQS"
SEAL_VERSION = 1
# magic, version, base_offset, next_offset, size, max_timestamp_us, index_crc; then u32 CRC-32C
SEAL_BODY = struct.Struct(">4sBxxxQQQqI")
SEAL_CRC = struct.Struct(">I")
SEAL_SIZE = SEAL_BODY.size + SEAL_CRC.size
NO_TIMESTAMP = -(1 << 63)


def segment_name(base_offset: int, suffix: str) -> str:
    """``00000000000000000042.log`` for base offset 42 and suffix ``.log``."""
    return f"{base_offset:0{NAME_DIGITS}d}{suffix}"


def parse_segment_name(name: str) -> int | None:
    """The base offset of a ``<20 digits>.log`` name, or None for any other file."""
    stem, dot, suffix = name.partition(".")
    if suffix != "log" or not dot or len(stem) != NAME_DIGITS or not stem.isdigit():
        return None
    return int(stem)


@dataclass(frozen=True, slots=True)
class Seal:
    """What a sealed segment promises: its records are [base_offset, next_offset) in ``size`` bytes."""

    base_offset: int
    next_offset: int
    size: int
    max_timestamp_us: int
    index_crc: int

    def encode(self) -> bytes:
        body = SEAL_BODY.pack(
            SEAL_MAGIC, SEAL_VERSION, self.base_offset, self.next_offset, self.size,
            self.max_timestamp_us, self.index_crc,
        )
        return body + SEAL_CRC.pack(crc32c(body))

    @classmethod
    def decode(cls, data: bytes) -> Seal | None:
        """The seal in ``data``, or None if it is short, has a bad CRC or an unknown version."""
        if len(data) != SEAL_SIZE:
            return None
        body = data[: SEAL_BODY.size]
        if SEAL_CRC.unpack_from(data, SEAL_BODY.size)[0] != crc32c(body):
            return None
        magic, version, base, nxt, size, max_ts, index_crc = SEAL_BODY.unpack(body)
        if magic != SEAL_MAGIC or version != SEAL_VERSION or nxt < base:
            return None
        return cls(base, nxt, size, max_ts, index_crc)


@dataclass(frozen=True, slots=True)
class Frame:
    """One step of a walk over a segment: a valid record, or a corrupt spot (``framed`` <= 0)."""

    position: int
    framed: int
    buf: bytes
    rel: int  # position of the record inside ``buf``
    offset: int  # -1 for a corrupt spot
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SegmentRecovery:
    """What :meth:`Segment.recover` found and did."""

    scanned_bytes: int
    truncated_bytes: int
    corrupt_records: int


class Segment:
    """A ``.log`` file with its index and seal.  Not thread-safe on its own; the log serialises writers."""

    def __init__(self, directory: Path, base_offset: int, fileio: FileIO, handle: FileHandle) -> None:
        self.directory = directory
        self.base_offset = base_offset
        self.fileio = fileio
        self.handle = handle
        self.log_path = directory / segment_name(base_offset, ".log")
        self.index_path = directory / segment_name(base_offset, ".index")
        self.seal_path = directory / segment_name(base_offset, ".seal")
        self.size = 0
        self.next_offset = base_offset
        self.max_timestamp_us = NO_TIMESTAMP
        self.seal: Seal | None = None
        self.index: SparseIndex | None = SparseIndex(base_offset)  # None: sealed, not loaded yet
        self.last_index_position = 0
        self._reported_corrupt: set[int] = set()

    @property
    def sealed(self) -> bool:
        return self.seal is not None

    # -- creation, recovery -------------------------------------------------------------

    @classmethod
    def create(cls, directory: Path, base_offset: int, fileio: FileIO) -> Segment:
        """Create an empty segment file and make its name durable (directory fsync)."""
        path = directory / segment_name(base_offset, ".log")
        handle = fileio.open(path, create=True)
        segment = cls(directory, base_offset, fileio, handle)
        if handle.size():  # a leftover of a crash: its bytes must not come back after the next one
            handle.truncate(0)
            handle.datasync()
        fileio.fsync_dir(directory)
        return segment

    @classmethod
    def recover(
        cls, directory: Path, base_offset: int, fileio: FileIO, index_interval_bytes: int
    ) -> tuple[Segment, SegmentRecovery]:
        """Open an existing segment and make it consistent.

        With a valid seal whose size matches the file, the segment is trusted as sealed
        without reading it.  Otherwise every record is scanned from the start: the segment
        keeps the longest prefix of valid, gap-free records; a single corrupt record whose
        length field still leads to the next expected record is skipped and counted; the
        first bytes that do not parse (a torn or zero-filled tail) and everything after
        them are cut off, and the index is rebuilt.
        """
        handle = fileio.open(directory / segment_name(base_offset, ".log"))
        segment = cls(directory, base_offset, fileio, handle)
        size = handle.size()
        seal = segment._read_seal()
        if seal is not None and seal.base_offset == base_offset and seal.size == size:
            segment.seal = seal
            segment.size = size
            segment.next_offset = seal.next_offset
            segment.max_timestamp_us = seal.max_timestamp_us
            segment.index = None
            return segment, SegmentRecovery(0, 0, 0)
        if seal is not None:
            log.warning(
                "%s: seal says %d bytes but the file has %d; scanning it as unsealed",
                segment.log_path, seal.size, size,
            )
            fileio.unlink(segment.seal_path)
            fileio.fsync_dir(directory)
        return segment, segment._scan_and_truncate(size, index_interval_bytes)

    def _read_seal(self) -> Seal | None:
        try:
            handle = self.fileio.open(self.seal_path)
        except FileNotFoundError:
            return None
        try:
            data = handle.pread(SEAL_SIZE + 1, 0)
        finally:
            handle.close()
        seal = Seal.decode(data)
        if seal is None:
            log.warning("%s: unreadable seal, ignoring it", self.seal_path)
        return seal

    def _scan_and_truncate(self, size: int, interval: int) -> SegmentRecovery:
        entries: list[tuple[int, int]] = []
        last_index_pos = 0
        expected = self.base_offset
        pos = 0
        corrupt = 0
        max_ts = NO_TIMESTAMP
        while pos < size:
            want = min(SCAN_CHUNK, size - pos)
            head = self.handle.pread(LENGTH_SIZE, pos)
            if len(head) == LENGTH_SIZE:
                need = LENGTH.unpack(head)[0] + LENGTH_SIZE
                if want < need <= min(MAX_RECORD_BYTES, size - pos):
                    want = need  # one record bigger than a chunk
            buf = self.handle.pread(want, pos)
            rel, expected, last_index_pos, max_ts = scan_run(
                buf, 0, len(buf), expected, pos, entries, last_index_pos, interval, max_ts
            )
            if rel == len(buf) or (rel > 0 and pos + len(buf) < size
                                   and check_frame(buf, rel, len(buf)) == INCOMPLETE):
                pos += rel  # chunk boundary: read on from the first unfinished record
                continue
            pos += rel
            reason = REASONS.get(check_frame(buf, rel, len(buf)), "offset out of sequence")
            skip = self._skippable(pos, size, expected + 1)
            resume = expected + 1
            if skip is None:
                # The length field itself may be what is damaged (a flipped bit): a valid record
                # with a later offset further on means corruption inside the segment, not a torn
                # tail, and cutting here would destroy the (acknowledged) records after it.
                rest = self.handle.pread(size - pos, pos)
                found = find_next_valid(rest, 1, len(rest), expected + 1, None)
                if found is None:
                    break
                skip, resume = found[0], offset_at(rest, found[0])
            log.warning(
                "%s: corrupt record at byte %d (offset %d): %s; skipped %d bytes to offset %d",
                self.log_path, pos, expected, reason, skip, resume,
            )
            corrupt += 1
            pos += skip
            expected = resume
        truncated = size - pos
        if truncated:
            log.warning(
                "%s: cutting %d bytes of torn or corrupt tail at byte %d (next offset %d)",
                self.log_path, truncated, pos, expected,
            )
            self.handle.truncate(pos)
            self.handle.datasync()
        index = SparseIndex(self.base_offset)
        for offset, position in entries:
            index.add(offset, position)
        self.size = pos
        self.next_offset = expected
        self.max_timestamp_us = max_ts
        self.index = index
        self.last_index_position = last_index_pos
        return SegmentRecovery(size, truncated, corrupt)

    def _skippable(self, position: int, size: int, next_expected: int) -> int | None:
        """Framed length of a corrupt record whose length field is still right, else None.

        Right means: the bytes right after it hold a valid record with the next expected
        offset.  Only then is skipping safe; anything else is treated as a torn tail.
        """
        head = self.handle.pread(LENGTH_SIZE, position)
        if len(head) < LENGTH_SIZE:
            return None
        length: int = LENGTH.unpack(head)[0]
        if not length_in_range(length):
            return None
        framed = length + LENGTH_SIZE
        nxt = position + framed
        probe = self.handle.pread(READ_CHUNK, nxt)
        if check_frame(probe, 0, len(probe)) == INCOMPLETE and len(probe) >= LENGTH_SIZE:
            probe = self.handle.pread(LENGTH.unpack_from(probe, 0)[0] + LENGTH_SIZE, nxt)
        ok = check_frame(probe, 0, len(probe))
        if ok > 0 and offset_at(probe, 0) == next_expected:
            return framed
        return None

    # -- walking and reading --------------------------------------------------------------

    def walk(
        self, pos: int, end: int, expected: int | None, *, resync: bool, max_offset: int | None = None
    ) -> Iterator[Frame]:
        """Yield the records in bytes [pos, end) in order, and a corrupt :class:`Frame` for each bad spot.

        ``expected`` is the offset the first record must carry (None: any).  Records must
        then be gap-free.  With ``resync`` a bad spot is followed by a scan for the next
        valid record with an offset in [expected, max_offset); without, the walk stops there.
        """
        buf = b""
        buf_start = pos
        while pos < end:
            rel = pos - buf_start
            framed = check_frame(buf, rel, len(buf))
            if framed == INCOMPLETE and buf_start + len(buf) < end:
                want = READ_CHUNK
                if len(buf) - rel >= LENGTH_SIZE:
                    need = LENGTH.unpack_from(buf, rel)[0] + LENGTH_SIZE
                    if need <= MAX_RECORD_BYTES:
                        want = max(want, need)
                buf = self.handle.pread(min(want, end - pos), pos)
                buf_start = pos
                continue
            if framed > 0:
                offset = offset_at(buf, rel)
                if expected is None or offset == expected:
                    yield Frame(pos, framed, buf, rel, offset)
                    expected = offset + 1
                    pos += framed
                    continue
                reason = f"offset {offset} out of sequence (expected {expected})"
            else:
                reason = REASONS[framed]
            yield Frame(pos, framed if framed < 0 else -framed, buf, rel, -1, reason)
            if not resync:
                return
            rest = self.handle.pread(end - pos, pos)
            low = expected if expected is not None else self.base_offset
            found = find_next_valid(rest, 1, len(rest), low, max_offset)
            if found is None:
                return
            buf, buf_start = rest, pos
            pos += found[0]
            expected = offset_at(rest, found[0])

    def read_run(
        self, pos: int, first: int, limit: int, out: list[Record], max_records: int, max_bytes: int,
        total: int,
    ) -> tuple[int, int, int, bool]:
        """Fast path of a read: append the records from byte ``pos`` on to ``out``.

        Reads the file in chunks and decodes them with :func:`segments.record.decode_run`
        (same limits: records < ``first`` skipped, full at ``limit`` / ``max_records`` /
        ``max_bytes``).  Stops at the segment end, when full, or at the first bytes that are
        not the next valid, gap-free record: the caller goes on from there with :meth:`walk`
        (which skips and reports corruption).  Returns ``(stop position, offset the record
        there must carry (-1: any), total, full)``.
        """
        end = self.size
        expected = -1
        want = READ_CHUNK
        while pos < end:
            buf = self.handle.pread(min(want, end - pos), pos)
            rel, expected, total, full = decode_run(
                buf, 0, expected, first, limit, out, max_records, max_bytes, total
            )
            pos += rel
            if full or pos >= end or pos - rel + len(buf) >= end:
                return pos, expected, total, full
            # Stopped inside a chunk that does not reach the segment end: an unfinished record
            # (read on from it, in one piece if it is bigger than a chunk), or bad bytes.
            if check_frame(buf, rel, len(buf)) != INCOMPLETE:
                break
            need = READ_CHUNK
            if len(buf) - rel >= LENGTH_SIZE:
                need = LENGTH.unpack_from(buf, rel)[0] + LENGTH_SIZE
                if need > MAX_RECORD_BYTES:
                    break
            if rel == 0 and need <= want:
                break  # no progress possible (cannot happen for a consistent file; be safe)
            want = max(READ_CHUNK, need)
        return pos, expected, total, False

    def ensure_index(self, interval: int) -> SparseIndex:
        """The index, loading it for a sealed segment (and rebuilding it if it is bad)."""
        index: SparseIndex | None = self.index  # read once: another thread may release it
        if index is not None:
            return index
        seal = self.seal
        assert seal is not None
        try:
            handle = self.fileio.open(self.index_path)
            try:
                data = handle.pread(handle.size(), 0)
            finally:
                handle.close()
            if crc32c(data) == seal.index_crc:
                index = SparseIndex.decode(self.base_offset, data, self.size, self.next_offset)
            else:
                log.warning("%s: index CRC does not match the seal; rebuilding", self.index_path)
        except FileNotFoundError:
            log.warning("%s: index missing; rebuilding", self.index_path)
        except ValueError as exc:
            log.warning("%s: index invalid (%s); rebuilding", self.index_path, exc)
        if index is None:
            index = self._rebuild_index(interval)
        self.index = index
        return index

    def release_index(self) -> bool:
        """Forget a sealed segment's index (the next :meth:`ensure_index` reloads it from disk).

        True if one was dropped; an unsealed segment keeps its index (appends extend it and
        the seal writes it), so this is a no-op there.  Safe while another thread reads: a
        reader that already holds the index keeps using it.
        """
        if self.seal is None or self.index is None:
            return False
        self.index = None
        return True

    def _rebuild_index(self, interval: int) -> SparseIndex:
        index = SparseIndex(self.base_offset)
        last = 0
        for frame in self.walk(0, self.size, self.base_offset, resync=True, max_offset=self.next_offset):
            if frame.framed > 0 and frame.position - last >= interval:
                index.add(frame.offset, frame.position)
                last = frame.position
        if self.seal is not None:
            # Rewrite index then seal: a crash in between leaves a CRC mismatch, so it is rebuilt again.
            index_bytes = index.encode()
            atomic_write(self.index_path, index_bytes, self.fileio)
            seal = self.seal
            self.seal = Seal(seal.base_offset, seal.next_offset, seal.size, seal.max_timestamp_us, crc32c(index_bytes))
            atomic_write(self.seal_path, self.seal.encode(), self.fileio)
        return index

    def note_corrupt(self, frame: Frame) -> bool:
        """Log a corrupt spot once per process; True the first time it is seen (for counting)."""
        if frame.position in self._reported_corrupt:
            return False
        self._reported_corrupt.add(frame.position)
        log.error("%s: skipping corrupt record at byte %d: %s", self.log_path, frame.position, frame.reason)
        return True

    # -- writing, sealing, deleting -------------------------------------------------------

    def write(self, data: bytes, position: int) -> None:
        """Write ``data`` at ``position`` (the current end) and advance :attr:`size`."""
        if position != self.size:
            raise SegmentError(str(self.log_path), f"write at byte {position} but size is {self.size}")
        self.handle.pwrite(data, position)
        self.size = position + len(data)

    def cut(self, size: int, next_offset: int, max_timestamp_us: int, last_index_position: int) -> None:
        """Cut the file back to ``size`` bytes after a failed write (the bytes were never visible)."""
        self.handle.truncate(size)
        self.size = size
        self.next_offset = next_offset
        self.max_timestamp_us = max_timestamp_us
        self.last_index_position = last_index_position
        if self.index is not None:
            self.index.truncate_to(size)

    def seal_now(self) -> None:
        """Seal: fdatasync the records, write the index, then the seal (each atomically, durably)."""
        assert self.index is not None
        self.handle.datasync()
        index_bytes = self.index.encode()
        atomic_write(self.index_path, index_bytes, self.fileio)
        seal = Seal(self.base_offset, self.next_offset, self.size, self.max_timestamp_us, crc32c(index_bytes))
        atomic_write(self.seal_path, seal.encode(), self.fileio)
        self.seal = seal

    def unseal(self) -> None:
        """Remove the seal again (used when the write that rolled this segment failed)."""
        if self.seal is not None:
            self.fileio.unlink(self.seal_path)
            self.seal = None

    def close(self) -> None:
        self.handle.close()

    def delete(self) -> None:
        """Close and unlink the ``.log`` (first, so a crash leaves no half-deleted log), index and seal.

        The caller fsyncs the directory.
        """
        self.handle.close()
        for path in (self.log_path, self.index_path, self.seal_path):
            with contextlib.suppress(FileNotFoundError):
                self.fileio.unlink(path)
