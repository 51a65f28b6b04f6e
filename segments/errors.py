"""Error types of the segment log; each carries the file and position a person needs to act."""

from __future__ import annotations

from segments.fileio import DiskFull

__all__ = ["CorruptRecord", "DiskFull", "SegmentError"]


class SegmentError(Exception):
    """A segment file or its metadata cannot be used (bad name, bad seal, inconsistent offsets)."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = path
        self.detail = detail


class CorruptRecord(SegmentError):
    """A record failed its CRC or framing checks.

    ``path`` is the segment file, ``position`` the byte position of the record's length
    prefix; ``offset`` is the logical offset expected there when known.
    """

    def __init__(self, path: str, position: int, detail: str, offset: int | None = None) -> None:
        where = f"byte {position}" + (f" (expected offset {offset})" if offset is not None else "")
        super().__init__(path, f"corrupt record at {where}: {detail}")
        self.position = position
        self.offset = offset
