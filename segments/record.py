"""Record framing: the one function that turns a message into bytes on disk, and back.

Layout (big-endian, documented byte by byte in docs/FORMAT.md)::

    u32 length      bytes after this field (crc .. end of payload)
    u32 crc         CRC-32C (Castagnoli) of every byte after this field
    u8  version     1: no headers; 2: headers follow the topic
    u8  flags       bits 0-1 QoS, bit 2 retain, bits 3-7 zero
    u64 offset      logical offset in the log
    i64 timestamp   publish time, microseconds since the Unix epoch (UTC)
    u16 topic_len   then topic_len bytes of UTF-8 topic
    u32 headers_len (version 2 only) then headers_len bytes of headers
    ...             payload: the rest of the record

A record whose headers are empty is written as version 1, byte for byte as before version 2
existed; one with headers as version 2.  A record is valid only if its length is in range,
its CRC matches, its version is known, its reserved flag bits are zero and its topic (and
headers) fit its frame.  :func:`check_frame` is the single validity test that recovery,
reads and ``filemq inspect`` all use.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from itertools import repeat, starmap
from operator import add, itemgetter
from typing import NamedTuple

from crc32c import crc32c

from segments.errors import CorruptRecord

FORMAT_VERSION = 1  # a record without headers
FORMAT_VERSION_HEADERS = 2  # a record with headers: u32 headers_len and the headers after the topic
LENGTH = struct.Struct(">I")
HEADERS_LEN = struct.Struct(">I")  # version 2: after the topic
HEADERS_LEN_SIZE = HEADERS_LEN.size  # 4
PREFIX = struct.Struct(">II")  # length, crc
BODY = struct.Struct(">BBQqH")  # version, flags, offset, timestamp_us, topic_len
HEADER = struct.Struct(">IIBBQqH")  # PREFIX + BODY, for decoding in one call
HEADER_SIZE = HEADER.size  # 28
LENGTH_SIZE = LENGTH.size  # 4
CRC_START = PREFIX.size  # the CRC covers bytes [8, framed_length)
MIN_LENGTH = HEADER_SIZE - LENGTH_SIZE  # 24: a record with empty topic and payload
MAX_RECORD_BYTES = 64 * 1024 * 1024  # framed size cap; also bounds resync candidates
MAX_TOPIC_BYTES = 0xFFFF
QOS_MASK = 0x03
RETAIN_BIT = 0x04
RESERVED_FLAGS = 0xF8

# check_frame() results below zero say why a frame is not a valid record.
INCOMPLETE = -1  # fewer bytes than the header or the length field promises (torn tail)
BAD_LENGTH = -2  # length field out of range
BAD_CRC = -3  # CRC mismatch
BAD_HEADER = -4  # unknown version, QoS 3 or reserved flag bits set
# (a topic, or a version 2 headers_len field or headers, that runs past the frame: BAD_LENGTH)

# flags bytes check_frame accepts: no reserved bit, QoS not 3 (a table: one lookup per record)
_FLAGS_OK = tuple(not (f & RESERVED_FLAGS or f & QOS_MASK == 3) for f in range(256))

REASONS = {
    INCOMPLETE: "truncated record",
    BAD_LENGTH: "length out of range",
    BAD_CRC: "CRC-32C mismatch",
    BAD_HEADER: "unknown version or flags",
}


class Record(NamedTuple):
    """One message as stored in the log; immutable.

    A named tuple rather than a frozen dataclass because reads build one per record and
    this is ~5x cheaper to construct (~0.1 us against ~0.55 us).  Use the attribute
    names; a record also compares equal to a plain tuple of the same fields.
    """

    offset: int
    timestamp_us: int
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    # Opaque to this package: the message's MQTT 5.0 message properties as a property section
    # without its length (filemq.mqtt.properties.encode_message_headers); b"" when none.
    headers: bytes = b""


# A Record's fields by position: C-level getters for map() over a run of records (no bytecode
# per record), shared by the consumer groups and the broker's delivery path.
record_offset = itemgetter(0)
record_topic = itemgetter(2)
record_payload = itemgetter(3)
record_qos = itemgetter(4)
record_retain = itemgetter(5)
record_headers = itemgetter(6)


def make_flags(qos: int, retain: bool) -> int:
    """The flags byte for ``qos`` (0-2) and ``retain``; raises ValueError on a bad QoS."""
    if qos not in (0, 1, 2):
        raise ValueError(f"qos must be 0, 1 or 2, not {qos!r}")
    return qos | (RETAIN_BIT if retain else 0)


def encode(
    offset: int, timestamp_us: int, topic: bytes, payload: bytes, flags: int, headers: bytes = b"",
) -> bytes:
    """Frame one record (``topic`` already UTF-8).  The one framing function used everywhere.

    Empty ``headers``: format version 1, byte for byte as before version 2 existed; else
    version 2.  The caller guarantees ``flags`` came from :func:`make_flags` and
    ``len(topic)`` fits u16; :meth:`segments.log.Log.append` checks both (and the framed
    size: a record larger than MAX_RECORD_BYTES is never valid).
    """
    if headers:
        return encode_v2(offset, timestamp_us, topic, payload, flags, headers)
    return encode_v1(offset, timestamp_us, topic, payload, flags)


def encode_v1(offset: int, timestamp_us: int, topic: bytes, payload: bytes, flags: int) -> bytes:
    """:func:`encode` without headers: format 1 (for the append hot path, which tests
    ``headers`` itself and so calls exactly what it called before format 2 existed)."""
    body = BODY.pack(FORMAT_VERSION, flags, offset, timestamp_us, len(topic)) + topic + payload
    return PREFIX.pack(len(body) + 4, crc32c(body)) + body


def encode_run_v1(first_offset: int, timestamp_us: int, topics: list[bytes], payloads: list[bytes],
                  flags: Iterable[int]) -> tuple[bytes, list[int]]:
    """Format 1 records at offsets ``first_offset``, ``first_offset + 1``, ... back to back:
    the bytes of :func:`encode_v1` of each, joined, and each one's framed size.  Built with
    C-level maps, no bytecode per record (the broker's run of PUBLISHes)."""
    n = len(topics)
    heads = starmap(BODY.pack, zip(repeat(FORMAT_VERSION), flags, range(first_offset, first_offset + n),
                                   repeat(timestamp_us), map(len, topics), strict=False))
    bodies = list(map(b"".join, zip(heads, topics, payloads, strict=True)))
    lengths = list(map(add, map(len, bodies), repeat(4)))  # the length field: CRC + body
    parts: list[bytes] = [b""] * (2 * n)  # prefix, body, prefix, ... (slice copies, no zip tuples)
    parts[0::2] = starmap(PREFIX.pack, zip(lengths, map(crc32c, bodies), strict=True))
    parts[1::2] = bodies
    return b"".join(parts), list(map(add, lengths, repeat(LENGTH_SIZE)))


def encode_run_v2(first_offset: int, timestamp_us: int, topics: list[bytes], payloads: list[bytes],
                  flags: Iterable[int], headers: list[bytes]) -> tuple[bytes, list[int]]:
    """:func:`encode_run_v1` for records that all have (non-empty) headers: the bytes of
    :func:`encode_v2` of each, joined, and each one's framed size, with no bytecode per record
    (the broker's run of MQTT 5 PUBLISHes with properties)."""
    n = len(topics)
    heads = starmap(BODY.pack, zip(repeat(FORMAT_VERSION_HEADERS), flags, range(first_offset, first_offset + n),
                                   repeat(timestamp_us), map(len, topics), strict=False))
    bodies = list(map(b"".join, zip(heads, topics, map(HEADERS_LEN.pack, map(len, headers)), headers, payloads,
                                    strict=True)))
    lengths = list(map(add, map(len, bodies), repeat(4)))  # the length field: CRC + body
    parts: list[bytes] = [b""] * (2 * n)
    parts[0::2] = starmap(PREFIX.pack, zip(lengths, map(crc32c, bodies), strict=True))
    parts[1::2] = bodies
    return b"".join(parts), list(map(add, lengths, repeat(LENGTH_SIZE)))


def encode_v2(offset: int, timestamp_us: int, topic: bytes, payload: bytes, flags: int, headers: bytes) -> bytes:
    """:func:`encode` with (non-empty) headers: format 2."""
    body = (BODY.pack(FORMAT_VERSION_HEADERS, flags, offset, timestamp_us, len(topic)) + topic
            + HEADERS_LEN.pack(len(headers)) + headers + payload)
    return PREFIX.pack(len(body) + 4, crc32c(body)) + body


def encode_record(record: Record) -> bytes:
    """Frame a :class:`Record` (convenience for tests and tools)."""
    topic = record.topic.encode("utf-8")
    if len(topic) > MAX_TOPIC_BYTES:
        raise ValueError(f"topic is {len(topic)} bytes, more than {MAX_TOPIC_BYTES}")
    return encode(
        record.offset, record.timestamp_us, topic, record.payload, make_flags(record.qos, record.retain),
        record.headers,
    )


def check_frame(buf: bytes | memoryview, pos: int, end: int) -> int:
    """Validate the record whose length prefix is at ``buf[pos]``, looking no further than ``end``.

    Returns the framed length (> 0) if the record is valid, else one of INCOMPLETE,
    BAD_LENGTH, BAD_CRC, BAD_HEADER.  Never raises for any content of ``buf``.
    """
    # <frame-check check_frame>
    if end - pos < HEADER_SIZE:
        return INCOMPLETE
    length, crc, version, flags, _, _, topic_len = HEADER.unpack_from(buf, pos)
    framed: int = length + LENGTH_SIZE
    nxt = pos + framed
    if length < MIN_LENGTH or framed > MAX_RECORD_BYTES:  # length in range
        return BAD_LENGTH
    if nxt > end:  # the whole frame is there
        return INCOMPLETE
    if not _FLAGS_OK[flags]:  # no reserved flag bit, QoS not 3
        return BAD_HEADER
    if version == FORMAT_VERSION:
        if HEADER_SIZE + topic_len > framed:  # topic inside the frame
            return BAD_LENGTH
    elif version == FORMAT_VERSION_HEADERS:
        if (at := pos + HEADER_SIZE + topic_len) + HEADERS_LEN_SIZE > nxt:  # headers_len field inside the frame
            return BAD_LENGTH
        if (at + HEADERS_LEN_SIZE + HEADERS_LEN.unpack_from(buf, at)[0]) > nxt:  # headers inside the frame
            return BAD_LENGTH
    else:  # unknown version
        return BAD_HEADER
    if crc32c(buf[pos + CRC_START : nxt] if framed < 4096 else memoryview(buf)[pos + CRC_START : nxt]) != crc:
        return BAD_CRC
    return framed
    # </frame-check>


def length_in_range(length: int) -> bool:
    """Whether ``length`` (a length field's value) is one a valid record may carry: the first
    check of :func:`check_frame` alone."""
    framed = length + LENGTH_SIZE
    # <frame-check length>
    return not (length < MIN_LENGTH or framed > MAX_RECORD_BYTES)
    # </frame-check>


def offset_at(buf: bytes | memoryview, pos: int) -> int:
    """The offset field of the record at ``pos`` (only meaningful after :func:`check_frame`)."""
    offset: int = HEADER.unpack_from(buf, pos)[4]
    return offset


def decode_at(buf: bytes | memoryview, pos: int, framed: int) -> Record:
    """Build the :class:`Record` at ``pos`` whose frame :func:`check_frame` accepted."""
    _, _, version, flags, offset, timestamp_us, topic_len = HEADER.unpack_from(buf, pos)
    start = pos + HEADER_SIZE
    stop = start + topic_len
    topic = bytes(buf[start:stop]).decode("utf-8", "replace")
    headers = b""
    if version == FORMAT_VERSION_HEADERS:
        headers_len: int = HEADERS_LEN.unpack_from(buf, stop)[0]
        stop += HEADERS_LEN_SIZE
        headers = bytes(buf[stop : stop + headers_len])
        stop += headers_len
    payload = bytes(buf[stop : pos + framed])
    return Record(offset, timestamp_us, topic, payload, flags & QOS_MASK, bool(flags & RETAIN_BIT), headers)


def decode(data: bytes | memoryview, path: str = "<bytes>", position: int = 0) -> tuple[Record, int]:
    """Decode the record at the start of ``data``; returns it and its framed length.

    Raises :class:`CorruptRecord` (with ``path`` and ``position`` for the message) if the
    bytes are not one valid record.
    """
    framed = check_frame(data, 0, len(data))
    if framed < 0:
        raise CorruptRecord(path, position, REASONS[framed])
    return decode_at(data, 0, framed), framed


def decode_run(
    buf: bytes, pos: int, expected: int, first: int, limit: int,
    out: list[Record], max_records: int, max_bytes: int, total: int,
) -> tuple[int, int, int, bool]:
    """Fast path of a read: decode the valid, gap-free records of ``buf`` from ``buf[pos]``.

    Applies exactly the checks of :func:`check_frame`, in one ``unpack`` per record, and
    requires each record to carry offset ``expected`` (any offset for the first one when
    ``expected`` < 0), then the next.  Records with offsets below ``first`` are checked and
    skipped; the others are appended to ``out`` until a record at or past ``limit``, or
    ``max_records`` in ``out``, or ``max_bytes`` framed bytes in ``total`` (the first record
    always fits) say the read is *full*.  Stops without being full at the end of ``buf`` or
    at bytes that are not the next valid record (an unfinished record at the buffer's end,
    corruption, an offset out of sequence), for the caller to handle with the general walk.
    Returns ``(stop position, next expected offset, total, full)``.
    """
    unpack = HEADER.unpack_from
    view = memoryview(buf)
    end = len(buf)
    last = end - HEADER_SIZE
    append = out.append
    make = tuple.__new__
    flags_ok = _FLAGS_OK
    headers_unpack = HEADERS_LEN.unpack_from
    room = max_records - len(out)
    # Consecutive records nearly always share a topic: reuse its str instead of decoding
    # each one again (one comparison, no slice), which also shares the object in memory.
    topic_raw = b""
    topic_raw_len = 0
    topic = ""
    while pos <= last:
        length, crc, version, flags, offset, ts, topic_len = unpack(buf, pos)
        framed = length + LENGTH_SIZE
        nxt = pos + framed
        if (
            # <frame-check format 1; or: offset != expected and expected >= 0>
            # (inlined: MIN_LENGTH=24, MAX_RECORD_BYTES=67108864, FORMAT_VERSION=1, HEADER_SIZE=28, CRC_START=8)
            length < 24 or framed > 67108864 or nxt > end or version != 1 or not flags_ok[flags]
            or 28 + topic_len > framed or (offset != expected and expected >= 0)
            or crc32c(buf[pos + 8 : nxt] if framed < 4096 else view[pos + 8 : nxt]) != crc
            # </frame-check>
        ):
            # A format 2 record (headers) fails the format 1 check; it is checked and decoded
            # here, so that the format 1 path costs nothing more than before format 2 existed.
            if (
                # <frame-check format 2, hstop; or: offset != expected and expected >= 0>
                # (inlined: MIN_LENGTH=24, MAX_RECORD_BYTES=67108864, FORMAT_VERSION_HEADERS=2, HEADER_SIZE=28, HEADERS_LEN_SIZE=4, CRC_START=8)
                length < 24 or framed > 67108864 or nxt > end or version != 2 or not flags_ok[flags]
                or (at := pos + 28 + topic_len) + 4 > nxt or (hstop := at + 4 + headers_unpack(buf, at)[0]) > nxt
                or (offset != expected and expected >= 0)
                or crc32c(buf[pos + 8 : nxt] if framed < 4096 else view[pos + 8 : nxt]) != crc
                # </frame-check>
            ):
                break
            if offset >= limit:
                return pos, expected, total, True
            expected = offset + 1
            if offset >= first:
                if total + framed > max_bytes and out:
                    return pos, offset, total, True
                start = pos + HEADER_SIZE
                if topic_len != topic_raw_len or not buf.startswith(topic_raw, start):
                    topic_raw = buf[start:at]
                    topic_raw_len = topic_len
                    topic = topic_raw.decode("utf-8", "replace")
                append(make(Record, (offset, ts, topic, buf[hstop:nxt], flags & QOS_MASK, flags & RETAIN_BIT != 0,
                                     buf[at + HEADERS_LEN_SIZE : hstop])))
                total += framed
                room -= 1
                if not room:
                    return nxt, expected, total, True
            pos = nxt
            continue
        if offset >= limit:
            return pos, expected, total, True
        expected = offset + 1
        if offset >= first:
            if total + framed > max_bytes and out:
                return pos, offset, total, True
            start = pos + HEADER_SIZE
            stop = start + topic_len
            if topic_len != topic_raw_len or not buf.startswith(topic_raw, start):
                topic_raw = buf[start:stop]
                topic_raw_len = topic_len
                topic = topic_raw.decode("utf-8", "replace")
            append(make(Record, (offset, ts, topic, buf[stop:nxt], flags & QOS_MASK, flags & RETAIN_BIT != 0, b"")))
            total += framed
            room -= 1
            if not room:
                return nxt, expected, total, True
        pos = nxt
    return pos, expected, total, False


def find_next_valid(
    buf: bytes, start: int, end: int, min_offset: int, max_offset: int | None
) -> tuple[int, int] | None:
    """Resync: the first position >= ``start`` holding a valid record whose offset is in range.

    A candidate must pass :func:`check_frame` (length, header, CRC-32C) *and* carry an
    offset in ``[min_offset, max_offset)`` (``max_offset`` None: unbounded), so random bytes
    that happen to pass a CRC (1 in 2**32) must also look like the next records of this log.
    Candidates are found by the version byte (1 or 2), which sits 8 bytes after the length
    prefix.  Returns ``(position, framed_length)`` or None.
    """
    v1, v2 = bytes((FORMAT_VERSION,)), bytes((FORMAT_VERSION_HEADERS,))
    probe = start + CRC_START
    # The next position of each version byte at or after ``probe`` (-1: none left); each is
    # searched again only once the probe has passed it, so the scan stays linear.
    hit1 = buf.find(v1, probe, end)
    hit2 = buf.find(v2, probe, end)
    while True:
        if hit1 >= 0 and (hit2 < 0 or hit1 < hit2):
            hit = hit1
            hit1 = buf.find(v1, hit + 1, end)
        elif hit2 >= 0:
            hit = hit2
            hit2 = buf.find(v2, hit + 1, end)
        else:
            return None
        pos = hit - CRC_START
        framed = check_frame(buf, pos, end)
        if framed > 0:
            offset = offset_at(buf, pos)
            if offset >= min_offset and (max_offset is None or offset < max_offset):
                return pos, framed


def scan_run(
    buf: bytes, pos: int, end: int, expected: int, shift: int,
    index: list[tuple[int, int]] | None, last_index_pos: int, interval: int, max_ts: int,
) -> tuple[int, int, int, int]:
    """Fast path of :func:`check_frame` for recovery: walk valid, gap-free records in ``buf``.

    Starts at ``buf[pos]`` with the record that must carry offset ``expected`` and stops at
    ``end`` or at the first record :func:`check_frame` would reject (or whose offset is not
    the next one).  Applies exactly the same checks, in one ``unpack`` per record.  Appends
    ``(offset, shift + position)`` to ``index`` every ``interval`` bytes.  Returns
    ``(stop position, next expected offset, last indexed position, newest timestamp)``.
    """
    unpack = HEADER.unpack_from
    view = memoryview(buf)
    headers_unpack = HEADERS_LEN.unpack_from
    flags_ok = _FLAGS_OK
    limit = end - HEADER_SIZE
    while pos <= limit:
        length, crc, version, flags, offset, ts, topic_len = unpack(buf, pos)
        framed = length + LENGTH_SIZE
        nxt = pos + framed
        if (
            # <frame-check format 1; or: offset != expected>
            # (inlined: MIN_LENGTH=24, MAX_RECORD_BYTES=67108864, FORMAT_VERSION=1, HEADER_SIZE=28, CRC_START=8)
            length < 24 or framed > 67108864 or nxt > end or version != 1 or not flags_ok[flags]
            or 28 + topic_len > framed or (offset != expected)
            or crc32c(buf[pos + 8 : nxt] if framed < 4096 else view[pos + 8 : nxt]) != crc
            # </frame-check>
        ) and (
            # A format 2 record fails the format 1 check: its own check here, so that the
            # format 1 path costs nothing more than before format 2 existed.
            # <frame-check format 2; or: offset != expected>
            # (inlined: MIN_LENGTH=24, MAX_RECORD_BYTES=67108864, FORMAT_VERSION_HEADERS=2, HEADER_SIZE=28, HEADERS_LEN_SIZE=4, CRC_START=8)
            length < 24 or framed > 67108864 or nxt > end or version != 2 or not flags_ok[flags]
            or (at := pos + 28 + topic_len) + 4 > nxt or (at + 4 + headers_unpack(buf, at)[0]) > nxt
            or (offset != expected) or crc32c(buf[pos + 8 : nxt] if framed < 4096 else view[pos + 8 : nxt]) != crc
            # </frame-check>
        ):
            break
        absolute = shift + pos
        if index is not None and absolute - last_index_pos >= interval:
            index.append((offset, absolute))
            last_index_pos = absolute
        if ts > max_ts:
            max_ts = ts
        expected += 1
        pos = nxt
    return pos, expected, last_index_pos, max_ts
