"""The sparse offset index of one segment: offset -> byte position, every N bytes.

On disk (``<base>.index``) it is a sequence of 8-byte big-endian entries
``(u32 offset - base_offset, u32 position)``, strictly increasing in both fields.  The index
is only a hint: it is rebuilt from the segment whenever it is missing, fails its CRC in the
seal, or is not monotonic, so a bad index can slow a read but never change its result.
"""

from __future__ import annotations

import bisect
import struct

from crc32c import crc32c

ENTRY = struct.Struct(">II")


class SparseIndex:
    """In-memory sparse index: sorted offsets with their byte positions."""

    __slots__ = ("base_offset", "offsets", "positions")

    def __init__(self, base_offset: int) -> None:
        self.base_offset = base_offset
        self.offsets: list[int] = []
        self.positions: list[int] = []

    def __len__(self) -> int:
        return len(self.offsets)

    def add(self, offset: int, position: int) -> None:
        """Append an entry; entries must come in increasing offset and position order."""
        self.offsets.append(offset)
        self.positions.append(position)

    def lookup(self, offset: int) -> int:
        """Byte position of the last indexed record with offset <= ``offset`` (0 if none)."""
        i = bisect.bisect_right(self.offsets, offset)
        return self.positions[i - 1] if i else 0

    def truncate_to(self, size: int) -> None:
        """Drop entries at positions >= ``size`` (after the segment was cut back)."""
        i = bisect.bisect_left(self.positions, size)
        del self.offsets[i:]
        del self.positions[i:]

    def encode(self) -> bytes:
        """The on-disk bytes of this index."""
        base = self.base_offset
        return b"".join(
            ENTRY.pack(o - base, p) for o, p in zip(self.offsets, self.positions, strict=True)
        )

    def crc(self) -> int:
        """CRC-32C of :meth:`encode`, stored in the segment's seal."""
        return crc32c(self.encode())

    @classmethod
    def decode(cls, base_offset: int, data: bytes, segment_size: int, next_offset: int) -> SparseIndex:
        """Parse index bytes; raises ValueError if they are not a plausible index of the segment."""
        if len(data) % ENTRY.size:
            raise ValueError(f"index length {len(data)} is not a multiple of {ENTRY.size}")
        index = cls(base_offset)
        last_rel, last_pos = -1, -1
        for rel, pos in ENTRY.iter_unpack(data):
            if rel <= last_rel or pos <= last_pos or pos >= segment_size:
                raise ValueError(f"index entry ({rel}, {pos}) out of order or past end")
            if base_offset + rel >= next_offset:
                raise ValueError(f"index entry offset {base_offset + rel} past segment end")
            index.add(base_offset + rel, pos)
            last_rel, last_pos = rel, pos
        return index
