"""A bounded in-memory cache of recent log records, shaped like the log's read side.

Consumer groups read through it (it satisfies :class:`filemq.groups.LogView`), so
subscribers that keep up are served from memory and never re-read the segment files;
subscribers that are behind miss the cache and read the log in batches of
``read_ahead`` records, which are then kept for the next reader at the same place.

What a caller may rely on: :meth:`read` returns exactly what ``Log.read`` would (records
``>= offset`` and ``< committed_offset``, in order, gaps where the log has gaps); memory is
bounded by ``max_bytes`` of payload + topic (oldest inserted entries evicted first).
Records are added with :meth:`put` only once they are committed, so a failed commit (whose
offsets the log reuses) can never leave a stale record here.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from segments import Log, Record

_OVERHEAD = 120  # rough per-entry cost of the Record object and dict slot, in bytes


class TailCache:
    """Recent records by offset, FIFO-evicted at ``max_bytes``; reads fall back to the log."""

    def __init__(self, log: Log, *, max_bytes: int = 4 << 20, read_ahead: int = 256) -> None:
        self._log = log
        self._records: dict[int, Record] = {}
        self._order: deque[int] = deque()  # insertion order, for FIFO eviction
        self._bytes = 0
        self.max_bytes = max_bytes
        self.read_ahead = read_ahead
        self.hits = 0
        self.misses = 0

    @property
    def first_offset(self) -> int:
        return self._log.first_offset

    @property
    def next_offset(self) -> int:
        return self._log.next_offset

    @property
    def committed_offset(self) -> int:
        return self._log.committed_offset

    def __len__(self) -> int:
        return len(self._records)

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def put(self, record: Record) -> None:
        """Remember a committed record."""
        records = self._records
        if record.offset in records:
            return
        records[record.offset] = record
        self._order.append(record.offset)
        self._bytes += len(record.payload) + len(record.topic) + _OVERHEAD
        if self._bytes > self.max_bytes:
            self._evict()

    def _evict(self) -> None:
        records = self._records
        order = self._order
        # Evict down to 7/8 so a put does not evict one entry each time, but in chunks small
        # enough not to stall the event loop (O(evicted), never a copy of the whole cache).
        target = self.max_bytes - self.max_bytes // 8
        while self._bytes > target and order:
            r = records.pop(order.popleft(), None)
            if r is not None:
                self._bytes -= len(r.payload) + len(r.topic) + _OVERHEAD

    def clear(self) -> None:
        self._records.clear()
        self._order.clear()
        self._bytes = 0

    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> list[Record]:
        """Same contract as ``Log.read``; served from memory where possible."""
        committed = self._log.committed_offset
        out: list[Record] = []
        if max_records <= 0 or offset >= committed:
            return out
        records = self._records
        get = records.get
        total = 0
        o = offset
        while o < committed and len(out) < max_records:
            r = get(o)
            if r is None:
                break
            size = len(r.payload) + len(r.topic) + 28
            if out and total + size > max_bytes:
                return out
            total += size
            out.append(r)
            o += 1
        if len(out) >= max_records or o >= committed:
            self.hits += 1
            return out
        self.misses += 1
        want = max_records - len(out)
        more = self._log.read(o, max(want, self.read_ahead), max(max_bytes - total, 1 << 16))
        for r in more:
            self.put(r)
        for r in more[:want]:
            size = len(r.payload) + len(r.topic) + 28
            if out and total + size > max_bytes:
                break
            total += size
            out.append(r)
        return out
