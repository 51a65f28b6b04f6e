"""A bounded in-memory cache of recent log records, shaped like the log's read side.

Consumer groups read through it (it satisfies :class:`segments.LogView`), so
subscribers that keep up are served from memory and never re-read the segment files;
subscribers that are behind miss the cache and read the log in batches of
``read_ahead`` records, which are then kept for the next reader at the same place.

What a caller may rely on: :meth:`read` returns exactly what ``Log.read`` would (records
``>= offset`` and ``< committed_offset``, in order, gaps where the log has gaps); memory is
bounded by about ``max_bytes`` (payload + topic + a per-record overhead estimate).
Records are added with :meth:`put` only once they are committed, so a failed commit (whose
offsets the log reuses) can never leave a stale record here.  With :attr:`limit` set (the
broker sets it to its routed offset), readers see nothing at or after it, even if the log
committed it already: a group never reads a record before the broker routed it (applied
it to the retained store), which is what lets a SUBSCRIBE start exactly at that offset.

Two parts: the *tail*, a list of consecutive committed records (a hit is one C-level list
slice, whatever ``max_records`` the group asks for), and a small FIFO of read-ahead
records for readers that are behind.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from filemq.mqtt.runcodec import all_plain, publish_prefixes
from segments.record import record_headers, record_payload, record_topic

if TYPE_CHECKING:
    from segments import LogView, Record

# Per-entry cost of a record beyond its payload and topic, in bytes: the Record tuple (7
# fields), its offset and timestamp ints, the payload's bytes header and the list slot
# (tracemalloc: 313 bytes for a record with a 100-byte payload and a shared topic).
_OVERHEAD = 210
_FRAME = 28  # framing bytes per record, for the max_bytes accounting of Log.read
_PREFIX_PIECE = 256  # PUBLISH prefixes are made for at least this many records at a time


def _frame_bytes(records: list[Record]) -> int:
    return sum(len(r.payload) + len(r.topic) + len(r.headers) for r in records) + _FRAME * len(records)


class TailCache:
    """Recent records by offset; reads fall back to the log."""

    def __init__(self, log: LogView, *, max_bytes: int = 16 << 20, read_ahead: int = 256) -> None:
        self._log = log
        self.max_bytes = max_bytes
        self._tail_limit = max_bytes - max_bytes // 4  # the rest is for read-ahead
        self.read_ahead = read_ahead
        self._tail: list[Record] = []  # offsets [_base, _base + len(_tail)), no gaps
        # Beside the first len(_prefix) records of _tail: each one's MQTT 3.1.1 QoS 1 PUBLISH
        # prefix (fixed header and topic field, runcodec.publish_prefixes), made once for every
        # subscriber's run, when the first subscriber asks (a broker without subscribers
        # never makes them); and in _odd a 1 for a record the run path cannot send as a
        # plain QoS 1 PUBLISH (MQTT 5 headers, retained, or QoS 0), else 0 (one memchr).
        self._prefix: list[bytes] = []
        self._odd = bytearray()
        self._base = 0
        self._tail_bytes = 0
        # The tail in pieces as they were put, oldest first: [records, bytes] each, so eviction
        # drops whole pieces and subtracts their bytes (no per-record sizing twice).
        self._pieces: deque[tuple[int, int]] = deque()
        self._largest = 0  # >= the largest payload + topic + headers in the tail: cheap max_bytes check
        # Read-ahead for readers behind the tail: gap-free runs of records (oldest first),
        # each (first offset, records, bytes); a hit is a list slice of one run.
        self._ahead: deque[tuple[int, list[Record], int]] = deque()
        self._ahead_bytes = 0
        self._ahead_largest = 0  # largest payload + topic ever read ahead: cheap max_bytes check
        self.hits = 0
        self.misses = 0
        self.limit: int | None = None  # records >= limit are not visible yet (None: the log's)

    @property
    def first_offset(self) -> int:
        return self._log.first_offset

    @property
    def next_offset(self) -> int:
        return self._log.next_offset

    @property
    def committed_offset(self) -> int:
        committed = self._log.committed_offset
        limit = self.limit
        return committed if limit is None or limit > committed else limit

    def __len__(self) -> int:
        return len(self._tail) + sum(len(run) for _, run, _ in self._ahead)

    @property
    def cached_bytes(self) -> int:
        return self._tail_bytes + self._ahead_bytes

    def put(self, record: Record) -> None:
        """Remember a committed record (the broker calls this in offset order)."""
        tail = self._tail
        end = self._base + len(tail)
        offset = record.offset
        if offset != end:
            if offset < end and tail:
                return  # already here, or older than the tail
            # A gap (records committed that the broker did not route): restart the tail.
            tail.clear()
            self._prefix.clear()
            self._odd.clear()
            self._pieces.clear()
            self._base = offset
            self._tail_bytes = 0
            self._largest = 0
        tail.append(record)
        size = len(record.payload) + len(record.topic) + len(record.headers)
        if size > self._largest:
            self._largest = size
        self._tail_bytes += size + _OVERHEAD
        self._pieces.append((1, size + _OVERHEAD))
        if self._tail_bytes > self._tail_limit:
            self._evict_tail()

    def put_many(self, records: list[Record]) -> None:
        """:meth:`put` of each of ``records`` (in offset order); one list extend when they
        follow the tail without a gap (the broker's routed batch)."""
        if not records:
            return
        tail = self._tail
        first = records[0].offset
        n = len(records)
        if first != self._base + len(tail) or records[-1].offset != first + n - 1 or not tail:
            for r in records:
                self.put(r)
            return
        # Sized with C-level passes; the largest as the sum of the largest parts (a bound).
        payloads = list(map(len, map(record_payload, records)))
        topics = list(map(len, map(record_topic, records)))
        headers = list(map(len, map(record_headers, records)))
        largest = max(payloads) + max(topics) + max(headers)
        if largest > self._largest:
            self._largest = largest
        tail.extend(records)
        size = sum(payloads) + sum(topics) + sum(headers) + _OVERHEAD * n
        self._tail_bytes += size
        self._pieces.append((n, size))
        if self._tail_bytes > self._tail_limit:
            self._evict_tail()

    def _evict_tail(self) -> None:
        # Drop the oldest pieces (as put) down to seven eighths of the limit at once: one list
        # memmove, and each piece's bytes as counted when it was put (no per-record work).
        tail = self._tail
        target = self._tail_limit - self._tail_limit // 8
        pieces = self._pieces
        drop = 0
        freed = 0
        while self._tail_bytes - freed > target and pieces:
            k, size = pieces[0]
            if k > 1 and self._tail_bytes - freed - size < target:
                # A run put whole would overshoot: drop its oldest records only, as put one by
                # one would (else a big run could leave nothing of itself, or an empty tail).
                for r in tail[drop:drop + k - 1]:
                    one = len(r.payload) + len(r.topic) + len(r.headers) + _OVERHEAD
                    drop += 1
                    freed += one
                    size -= one
                    k -= 1
                    if self._tail_bytes - freed <= target:
                        break
                pieces[0] = (k, size)
                continue  # (at target now; else its last record goes whole, as a piece of one)
            pieces.popleft()
            drop += k
            freed += size
        del tail[:drop]
        del self._prefix[:drop]
        del self._odd[:drop]
        self._base += drop
        self._tail_bytes -= freed

    def _put_ahead(self, records: list[Record]) -> None:
        """Keep ``records`` (in offset order) as gap-free runs; evict the oldest runs."""
        start = 0
        n = len(records)
        while start < n:
            end = start + 1
            first = records[start].offset
            while end < n and records[end].offset == first + (end - start):
                end += 1
            run = records[start:end] if start or end < n else records
            size = 0
            largest = self._ahead_largest
            for r in run:
                k = len(r.payload) + len(r.topic) + len(r.headers)
                size += k + _OVERHEAD
                if k > largest:
                    largest = k
            self._ahead_largest = largest
            self._ahead.append((first, run, size))
            self._ahead_bytes += size
            start = end
        limit = self.max_bytes - self._tail_limit
        ahead = self._ahead
        while self._ahead_bytes > limit and ahead:
            self._ahead_bytes -= ahead.popleft()[2]
        if not ahead:
            self._ahead_largest = 0

    def _find_ahead(self, offset: int) -> tuple[list[Record], int] | None:
        """The run read ahead that holds ``offset`` and its index there, or None."""
        for first, run, _ in reversed(self._ahead):  # newest first: readers move forward
            i = offset - first
            if 0 <= i < len(run):
                return run, i
        return None

    def clear(self) -> None:
        self._tail.clear()
        self._pieces.clear()
        self._prefix.clear()
        self._odd.clear()
        self._tail_bytes = 0
        self._largest = 0
        self._ahead.clear()
        self._ahead_bytes = 0
        self._ahead_largest = 0

    def plain_prefixes(self, offset: int, n: int) -> list[bytes] | None:
        """The MQTT 3.1.1 QoS 1 PUBLISH prefixes (runcodec.publish_prefixes) of the records
        [offset, offset + n) when the tail holds them all and none has MQTT 5 headers, is
        retained or is QoS 0; else None."""
        i = offset - self._base
        if i < 0 or i + n > len(self._prefix):
            if i < 0 or i + n > len(self._tail):
                return None
            self._make_prefixes(i + n)
        if self._odd.find(1, i, i + n) >= 0:
            return None
        return self._prefix[i:i + n]

    def _make_prefixes(self, end: int) -> None:
        """Extend _prefix and _odd to at least the first ``end`` records of the tail (in
        pieces of at least _PREFIX_PIECE records: the next subscriber's run is there too)."""
        start = len(self._prefix)
        records = self._tail[start:max(end, start + _PREFIX_PIECE)]
        self._prefix += publish_prefixes(list(map(record_topic, records)), list(map(record_payload, records)))
        if all_plain(records):
            self._odd += bytes(len(records))  # (the common piece: plain QoS 1 and 2)
        else:
            self._odd += bytes(bool(r.headers) or r.retain or r.qos == 0 for r in records)

    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> list[Record]:
        """Same contract as ``Log.read`` (up to :attr:`committed_offset`); served from memory where possible."""
        committed = self.committed_offset
        if max_records <= 0 or offset >= committed:
            return []
        base = self._base
        tail = self._tail
        i = offset - base
        if 0 <= i < len(tail):
            n = min(max_records, committed - offset)
            out = tail[i:i + n]
            if len(out) * (self._largest + _FRAME) > max_bytes:
                out = self._trim(out, max_bytes)
            self.hits += 1
            return out
        out = []
        o = offset
        frame = self._ahead_largest + _FRAME
        while o < committed and len(out) < max_records:
            found = self._find_ahead(o)
            if found is None:
                break
            run, i = found
            take = run[i : i + min(max_records - len(out), committed - o)]
            if (len(out) + len(take)) * frame > max_bytes:  # rare (big records): count exactly
                total = _frame_bytes(out)
                for r in take:
                    size = len(r.payload) + len(r.topic) + len(r.headers) + _FRAME
                    if out and total + size > max_bytes:
                        self.hits += 1
                        return out
                    total += size
                    out.append(r)
            else:
                out += take
            o = offset + len(out)
        if len(out) >= max_records or o >= committed:
            self.hits += 1
            return out
        self.misses += 1
        total = _frame_bytes(out)
        want = max_records - len(out)
        more = self._log.read(o, max(want, self.read_ahead), max(max_bytes - total, 1 << 16))
        tail_start = self._base
        behind = [r for r in more if r.offset < tail_start] if more and more[-1].offset >= tail_start else more
        if behind:
            self._put_ahead(behind)
        for r in more[:want]:
            if r.offset >= committed:
                break
            size = len(r.payload) + len(r.topic) + len(r.headers) + _FRAME
            if out and total + size > max_bytes:
                break
            total += size
            out.append(r)
        return out

    @staticmethod
    def _trim(records: list[Record], max_bytes: int) -> list[Record]:
        total = 0
        for k, r in enumerate(records):
            total += len(r.payload) + len(r.topic) + len(r.headers) + _FRAME
            if k and total > max_bytes:
                return records[:k]
        return records
