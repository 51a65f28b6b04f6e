"""The sparse offset index of one segment: offset -> byte position, every N bytes.

On disk (``<base>.index``) it is a sequence of 8-byte big-endian entries
``(u32 offset - base_offset, u32 position)``, strictly increasing in both fields.  The index
is only a hint: it is rebuilt from the segment whenever it is missing, fails its CRC in the
seal, or is not monotonic, so a bad index can slow a read but never change its result.

In memory an index is two ``array('I')`` columns holding exactly the on-disk values
(8 bytes per entry, ~2 MB per GB of log at the default 4 KiB interval), not Python ints:
an index of Python objects cost ~72 bytes per entry (~19 MB per GB read).  Which indexes
stay loaded at all is the log's business (:class:`segments.log.Log` keeps the active
segment's and a few recently read sealed ones).
"""

from __future__ import annotations

import bisect
import operator
import struct
import sys
from array import array

from crc32c import crc32c

ENTRY = struct.Struct(">II")
_NATIVE_IS_BIG = sys.byteorder == "big"


_U32 = "I"  # 4 bytes on every platform CPython supports, like the on-disk u32 fields
if array(_U32).itemsize != 4:
    raise ImportError(f"array({_U32!r}) is not 4 bytes on this platform; segments.index needs it")


def _u32_array() -> array[int]:
    return array(_U32)


class SparseIndex:
    """Sorted (offset, byte position) entries of one segment; lookups by bisection.

    Entries are added in increasing offset and position order (the segment is append-only);
    positions fit in u32 because a segment is smaller than 4 GiB.
    """

    __slots__ = ("base_offset", "_rel", "_pos")

    def __init__(self, base_offset: int) -> None:
        self.base_offset = base_offset
        self._rel = _u32_array()  # offset - base_offset
        self._pos = _u32_array()

    def __len__(self) -> int:
        return len(self._rel)

    @property
    def nbytes(self) -> int:
        """Bytes held by the entries (for memory accounting and tests)."""
        return (len(self._rel) + len(self._pos)) * self._rel.itemsize

    def entries(self) -> list[tuple[int, int]]:
        """Every entry as ``(offset, position)``, in order (a copy; for tools and tests)."""
        base = self.base_offset
        return [(base + rel, pos) for rel, pos in zip(self._rel, self._pos, strict=True)]

    def add(self, offset: int, position: int) -> None:
        """Append an entry; entries must come in increasing offset and position order."""
        self._rel.append(offset - self.base_offset)
        self._pos.append(position)

    def lookup(self, offset: int) -> int:
        """Byte position of the last indexed record with offset <= ``offset`` (0 if none)."""
        i = bisect.bisect_right(self._rel, offset - self.base_offset)
        return self._pos[i - 1] if i else 0

    def truncate_to(self, size: int) -> None:
        """Drop entries at positions >= ``size`` (after the segment was cut back)."""
        i = bisect.bisect_left(self._pos, size)
        del self._rel[i:]
        del self._pos[i:]

    def encode(self) -> bytes:
        """The on-disk bytes of this index."""
        flat = array(_U32, bytes(self.nbytes))
        flat[0::2] = self._rel
        flat[1::2] = self._pos
        if not _NATIVE_IS_BIG:
            flat.byteswap()
        return flat.tobytes()

    def crc(self) -> int:
        """CRC-32C of :meth:`encode`, stored in the segment's seal."""
        return crc32c(self.encode())

    @classmethod
    def decode(cls, base_offset: int, data: bytes, segment_size: int, next_offset: int) -> SparseIndex:
        """Parse index bytes; raises ValueError if they are not a plausible index of the segment:
        entries strictly increasing in both fields, positions inside the segment, offsets
        below ``next_offset``."""
        if len(data) % ENTRY.size:
            raise ValueError(f"index length {len(data)} is not a multiple of {ENTRY.size}")
        flat = _u32_array()
        flat.frombytes(data)
        if not _NATIVE_IS_BIG:
            flat.byteswap()
        index = cls(base_offset)
        rel, pos = flat[0::2], flat[1::2]
        if rel:
            # One C-level pass each instead of a Python loop per entry; the slow loop below
            # only runs to name the first bad entry.
            if not (all(map(operator.lt, rel, rel[1:])) and all(map(operator.lt, pos, pos[1:]))):
                for k in range(1, len(rel)):
                    if rel[k] <= rel[k - 1] or pos[k] <= pos[k - 1]:
                        raise ValueError(f"index entry ({rel[k]}, {pos[k]}) out of order")
            if pos[-1] >= segment_size:
                raise ValueError(f"index entry ({rel[-1]}, {pos[-1]}) past the segment end {segment_size}")
            if base_offset + rel[-1] >= next_offset:
                raise ValueError(f"index entry offset {base_offset + rel[-1]} past segment end")
        index._rel = rel
        index._pos = pos
        return index
