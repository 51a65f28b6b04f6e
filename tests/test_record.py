"""Record framing: golden bytes, CRC-32C against crcmod, round trips, corruption detection.

Format version 1 (no headers) and 2 (a record with MQTT 5 message properties, issue 13):
docs/FORMAT.md "Record".
"""

from __future__ import annotations

from pathlib import Path

import crcmod.predefined
import pytest
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from segments import CorruptRecord, Record
from segments.record import (
    BAD_CRC,
    BAD_HEADER,
    BAD_LENGTH,
    HEADER_SIZE,
    INCOMPLETE,
    check_frame,
    decode,
    decode_at,
    decode_run,
    encode_record,
    encode_run_v1,
    encode_v1,
    find_next_valid,
    make_flags,
    offset_at,
    record_headers,
    record_offset,
    record_payload,
    record_qos,
    record_retain,
    record_topic,
    scan_run,
)

GOLDEN = Path(__file__).parent / "golden"

# encode_message_headers(Properties(content_type="text/plain", user_properties=[("k", "v")]))
# (checked by test_golden_v2_headers_are_a_message_property_section)
HEADERS = b"\x03\x00\x0atext/plain&\x00\x01k\x00\x01v"

# Each golden file holds exactly these records, framed back to back.
GOLDEN_RECORDS = {
    "record_qos1.bin": [Record(42, 1_700_000_000_123_456, "sensors/t1", b"21.5", qos=1)],
    "record_empty.bin": [Record(0, 0, "", b"")],
    "record_retain_qos2_utf8.bin": [
        Record(2**40 + 7, -1, "cafés/🌡", bytes(range(256)), qos=2, retain=True)
    ],
    "records_three.bin": [
        Record(100, 1_600_000_000_000_000, "a", b"x"),
        Record(101, 1_600_000_000_000_001, "a/b", b"yy", qos=1),
        Record(102, 1_600_000_000_000_002, "a/b/c", b"zzz", retain=True),
    ],
    "record_v2_headers.bin": [Record(43, 1_700_000_000_123_457, "sensors/t1", b"21.5", qos=1, headers=HEADERS)],
    "records_v1_v2_mixed.bin": [
        Record(7, 1, "a", b"x"),
        Record(8, 2, "a", b"", qos=2, headers=b"\x01\x01"),
        Record(9, 3, "", b"yy", retain=True, headers=HEADERS),
        Record(10, 4, "a", b"z"),
    ],
}

crcmod_crc32c = crcmod.predefined.mkCrcFun("crc-32c")

records = st.builds(
    Record,
    offset=st.integers(0, 2**64 - 1),
    timestamp_us=st.integers(-(2**63), 2**63 - 1),
    topic=st.text(max_size=50).filter(lambda t: len(t.encode("utf-8", "surrogatepass")) < 200),
    payload=st.binary(max_size=2000),
    qos=st.integers(0, 2),
    retain=st.booleans(),
    # Opaque to segments: any bytes (b"" half of the time: a format 1 record).
    headers=st.one_of(st.just(b""), st.binary(min_size=1, max_size=300)),
)


def v1_bytes(record: Record) -> bytes:
    """The record as the code before format 2 framed it (an independent reimplementation)."""
    topic = record.topic.encode("utf-8")
    flags = record.qos | (4 if record.retain else 0)
    body = (bytes([1, flags]) + record.offset.to_bytes(8, "big")
            + record.timestamp_us.to_bytes(8, "big", signed=True)
            + len(topic).to_bytes(2, "big") + topic + record.payload)
    return (len(body) + 4).to_bytes(4, "big") + crc32c(body).to_bytes(4, "big") + body


def _encodable(record: Record) -> bool:
    try:
        record.topic.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def decode_all(data: bytes) -> list[Record]:
    out, pos = [], 0
    while pos < len(data):
        record, framed = decode(data[pos:], position=pos)
        out.append(record)
        pos += framed
    return out


@pytest.mark.parametrize("name", sorted(GOLDEN_RECORDS))
def test_golden_encode_matches_committed_bytes(name: str) -> None:
    expected = (GOLDEN / name).read_bytes()
    assert b"".join(encode_record(r) for r in GOLDEN_RECORDS[name]) == expected


@pytest.mark.parametrize("name", sorted(GOLDEN_RECORDS))
def test_golden_decodes_to_records(name: str) -> None:
    assert decode_all((GOLDEN / name).read_bytes()) == GOLDEN_RECORDS[name]


def test_golden_layout_fields_at_documented_positions() -> None:
    data = (GOLDEN / "record_qos1.bin").read_bytes()
    assert int.from_bytes(data[0:4], "big") == len(data) - 4
    assert int.from_bytes(data[4:8], "big") == crc32c(data[8:])
    assert data[8] == 1 and data[9] == 1
    assert int.from_bytes(data[10:18], "big") == 42
    assert int.from_bytes(data[18:26], "big", signed=True) == 1_700_000_000_123_456
    assert int.from_bytes(data[26:28], "big") == len("sensors/t1")
    assert data[28:38] == b"sensors/t1" and data[38:] == b"21.5"


def test_golden_v2_layout_fields_at_documented_positions() -> None:
    data = (GOLDEN / "record_v2_headers.bin").read_bytes()
    assert int.from_bytes(data[0:4], "big") == len(data) - 4
    assert int.from_bytes(data[4:8], "big") == crc32c(data[8:])
    assert data[8] == 2 and data[9] == 1
    assert int.from_bytes(data[10:18], "big") == 43
    assert int.from_bytes(data[26:28], "big") == len("sensors/t1")
    assert data[28:38] == b"sensors/t1"
    assert int.from_bytes(data[38:42], "big") == len(HEADERS)
    assert data[42 : 42 + len(HEADERS)] == HEADERS and data[42 + len(HEADERS) :] == b"21.5"


def test_golden_v2_headers_are_a_message_property_section() -> None:
    from filemq.mqtt.packets import Properties
    from filemq.mqtt.properties import decode_message_headers, encode_message_headers

    props = Properties(content_type="text/plain", user_properties=[("k", "v")])
    assert encode_message_headers(props) == HEADERS
    decoded = decode_message_headers(HEADERS)
    assert decoded is not None and decoded.content_type == "text/plain"
    assert list(decoded.user_properties or ()) == [("k", "v")]


def test_crc32c_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283 == crcmod_crc32c(b"123456789")


@given(st.binary(max_size=4096))
def test_crc32c_matches_crcmod(data: bytes) -> None:
    assert crc32c(data) == crcmod_crc32c(data)


@given(records)
def test_round_trip(record: Record) -> None:
    """Any headers round-trip; b"" is format 1, byte for byte what the code before issue 13
    wrote; non-empty headers are format 2 (u32 headers_len and the headers after the topic)."""
    if not _encodable(record):
        return
    data = encode_record(record)
    decoded, framed = decode(data)
    assert framed == len(data)
    assert decoded == record
    if not record.headers:
        assert data == v1_bytes(record)
    else:
        topic_len = len(record.topic.encode("utf-8"))
        v1 = v1_bytes(record._replace(headers=b""))
        assert data[8] == 2 and data[9:28 + topic_len] == v1[9:28 + topic_len]
        at = 28 + topic_len
        assert int.from_bytes(data[at : at + 4], "big") == len(record.headers)
        assert data[at + 4 : at + 4 + len(record.headers)] == record.headers
        assert data[at + 4 + len(record.headers) :] == record.payload
        assert int.from_bytes(data[0:4], "big") == len(data) - 4 == len(v1) + len(record.headers)
        assert int.from_bytes(data[4:8], "big") == crc32c(data[8:])


@settings(max_examples=50)
@given(records, st.data())
def test_any_flipped_bit_is_detected(record: Record, data: st.DataObject) -> None:
    if not _encodable(record):
        return
    framed = bytearray(encode_record(record))
    bit = data.draw(st.integers(0, len(framed) * 8 - 1))
    framed[bit // 8] ^= 1 << (bit % 8)
    assert check_frame(bytes(framed), 0, len(framed)) < 0
    with pytest.raises(CorruptRecord):
        decode(bytes(framed))


def test_every_flipped_bit_of_a_small_record_is_detected() -> None:
    good = encode_record(Record(7, 123, "t", b"payload", qos=1))
    for bit in range(len(good) * 8):
        bad = bytearray(good)
        bad[bit // 8] ^= 1 << (bit % 8)
        assert check_frame(bytes(bad), 0, len(bad)) < 0, f"bit {bit} not detected"


def test_check_frame_reasons() -> None:
    good = encode_record(Record(1, 2, "t", b"p"))
    assert check_frame(good, 0, len(good)) == len(good)
    for cut in range(len(good)):
        assert check_frame(good[:cut], 0, cut) == INCOMPLETE
    assert check_frame(b"\0" * HEADER_SIZE, 0, HEADER_SIZE) == BAD_LENGTH
    bad_crc = bytearray(good)
    bad_crc[-1] ^= 0xFF
    assert check_frame(bytes(bad_crc), 0, len(good)) == BAD_CRC
    bad_flags = bytearray(good)
    bad_flags[9] = 0x03  # QoS 3
    assert check_frame(bytes(bad_flags), 0, len(good)) == BAD_HEADER


def _with_crc(frame: bytearray) -> bytes:
    frame[4:8] = crc32c(bytes(frame[8:])).to_bytes(4, "big")
    return bytes(frame)


def test_v2_headers_len_past_the_frame_is_invalid_not_an_exception() -> None:
    """A v2 record whose headers_len runs past its frame is BAD_LENGTH even with a matching
    CRC (a writer bug, or damage a CRC collision let through); so is one too short to hold
    the headers_len field at all."""
    good = bytearray(encode_record(Record(1, 2, "t", b"payload", headers=b"hh")))
    assert check_frame(bytes(good), 0, len(good)) == len(good)
    for bad_len in (3 + len(b"payload"), 2**32 - 1, 10**6):
        frame = bytearray(good)
        frame[29:33] = bad_len.to_bytes(4, "big")
        assert check_frame(_with_crc(frame), 0, len(frame)) == BAD_LENGTH
    exact = bytearray(good)
    exact[29:33] = (2 + len(b"payload")).to_bytes(4, "big")  # headers take the whole rest
    assert decode(_with_crc(exact))[0] == Record(1, 2, "t", b"", headers=b"hhpayload")
    # version 2, but the frame ends before (or inside) the headers_len field
    for keep in range(4):
        frame = bytearray(good[: 29 + keep])
        frame[0:4] = (len(frame) - 4).to_bytes(4, "big")
        assert check_frame(_with_crc(frame), 0, len(frame)) == BAD_LENGTH
    unknown = bytearray(good)
    unknown[8] = 3
    assert check_frame(_with_crc(unknown), 0, len(unknown)) == BAD_HEADER


@given(st.binary(min_size=HEADER_SIZE, max_size=200), st.sampled_from([1, 2, 3]), st.booleans())
def test_no_bytes_make_the_frame_checks_raise(data: bytes, version: int, fix_crc: bool) -> None:
    """check_frame, decode_run, scan_run and find_next_valid never raise, whatever the bytes."""
    frame = bytearray(data)
    frame[0:4] = (len(frame) - 4).to_bytes(4, "big")
    frame[8] = version
    frame[9] &= 0x07
    buf = _with_crc(frame) if fix_crc else bytes(frame)
    framed = check_frame(buf, 0, len(buf))
    assert framed in (len(buf), BAD_LENGTH, BAD_CRC, BAD_HEADER)
    out: list[Record] = []
    decode_run(buf, 0, -1, 0, 2**64, out, 100, 1 << 30, 0)
    scan_run(buf, 0, len(buf), offset_at(buf, 0), 0, [], 0, 64, 0)
    find_next_valid(buf, 0, len(buf), 0, None)
    if framed > 0:
        assert out == [decode_at(buf, 0, framed)]


def test_qos_and_topic_are_validated() -> None:
    with pytest.raises(ValueError):
        encode_record(Record(0, 0, "t", b"", qos=3))
    with pytest.raises(ValueError):
        encode_record(Record(0, 0, "x" * 70_000, b""))


def test_resync_finds_next_record_in_offset_window() -> None:
    a = encode_record(Record(10, 0, "t", b"a" * 30))
    b = encode_record(Record(11, 0, "t", b"b" * 30))
    garbage = bytes([1]) * 50  # version bytes everywhere: candidates that must fail the CRC
    buf = a[:20] + garbage + b
    assert find_next_valid(buf, 1, len(buf), 10, 12) == (20 + len(garbage), len(b))
    assert find_next_valid(buf, 1, len(buf), 12, None) is None  # offset below the window
    assert find_next_valid(buf, 1, len(buf), 0, 11) is None  # offset above the window


def test_resync_finds_v2_records() -> None:
    """The resync probe searches the version byte: it must find format 2 records too, also
    behind candidates of the other version."""
    a = encode_record(Record(10, 0, "t", b"a" * 30, headers=b"h" * 5))
    b = encode_record(Record(11, 0, "t", b"b" * 30, headers=HEADERS))
    c = encode_record(Record(12, 0, "t", b"c" * 30))
    garbage = bytes([1, 2, 0, 2, 1]) * 20
    buf = a[:20] + garbage + b + c
    assert find_next_valid(buf, 1, len(buf), 10, 13) == (20 + len(garbage), len(b))
    assert find_next_valid(buf, 1, len(buf), 12, 13) == (20 + len(garbage) + len(b), len(c))
    v2_only = a[:20] + b
    assert find_next_valid(v2_only, 1, len(v2_only), 0, None) == (20, len(b))


@settings(max_examples=100)
@given(st.lists(records, min_size=1, max_size=8), st.data())
def test_scan_run_stops_where_check_frame_does(recs: list[Record], data: st.DataObject) -> None:
    """The recovery fast path applies exactly the checks of check_frame plus offset sequence."""
    from segments.record import offset_at, scan_run

    recs = [r._replace(offset=100 + i) for i, r in enumerate(r for r in recs if _encodable(r))]
    buf = bytearray(b"".join(encode_record(r) for r in recs))
    if buf and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] ^= data.draw(st.integers(1, 255))
    if bool(recs) and data.draw(st.booleans()):  # damage behind a matching CRC, as above
        k = data.draw(st.integers(0, len(recs) - 1))
        at = sum(len(encode_record(r)) for r in recs[:k])
        size = len(encode_record(recs[k]))
        i = at + data.draw(st.sampled_from([8, 9, 26, 27, 28 + len(recs[k].topic.encode()), 31 + len(recs[k].topic.encode())]))
        if i < at + size:
            buf[i] ^= data.draw(st.integers(1, 255))
            buf[at + 4 : at + 8] = crc32c(bytes(buf[at + 8 : at + size])).to_bytes(4, "big")
    cut = data.draw(st.integers(0, len(buf)))
    stream = bytes(buf[:cut])
    pos, expected = 0, 100
    while True:
        framed = check_frame(stream, pos, len(stream))
        if framed <= 0 or offset_at(stream, pos) != expected:
            break
        pos, expected = pos + framed, expected + 1
    index: list[tuple[int, int]] = []
    stop, nxt, _, _ = scan_run(stream, 0, len(stream), 100, 0, index, 0, 64, -(2**63))
    assert (stop, nxt) == (pos, expected)


def _reference_run(stream: bytes, first: int, limit: int, max_records: int,
                   max_bytes: int) -> tuple[list[Record], int, int]:
    """What decode_run must return, by check_frame + decode_at one record at a time: the
    records, where it stops, and the framed bytes of the records it returns."""
    out: list[Record] = []
    pos, expected, total = 0, -1, 0
    while True:
        framed = check_frame(stream, pos, len(stream))
        if framed <= 0 or (expected >= 0 and offset_at(stream, pos) != expected):
            return out, pos, total
        offset = offset_at(stream, pos)
        if offset >= limit or len(out) >= max_records or (out and offset >= first and total + framed > max_bytes):
            return out, pos, total
        if offset >= first:
            out.append(decode_at(stream, pos, framed))
            total += framed
        pos, expected = pos + framed, offset + 1


@settings(max_examples=150)
@given(st.lists(records, min_size=1, max_size=8), st.data())
def test_decode_run_agrees_with_check_frame_on_mixed_v1_v2(recs: list[Record], data: st.DataObject) -> None:
    """The read fast path decodes v1 and v2 records alike and stops exactly where the
    generic check_frame walk stops (damage, a cut, an offset out of sequence, the limits)."""
    recs = [r._replace(offset=100 + i) for i, r in enumerate(r for r in recs if _encodable(r))]
    buf = bytearray(b"".join(encode_record(r) for r in recs))
    if buf and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] ^= data.draw(st.integers(1, 255))
    if bool(recs) and data.draw(st.booleans()):
        # Damage behind a matching CRC (what only the structural checks catch): a byte of one
        # record's header, topic_len or headers_len, then its CRC recomputed.
        k = data.draw(st.integers(0, len(recs) - 1))
        at = sum(len(encode_record(r)) for r in recs[:k])
        size = len(encode_record(recs[k]))
        i = at + data.draw(st.sampled_from([8, 9, 26, 27, 28 + len(recs[k].topic.encode()), 31 + len(recs[k].topic.encode())]))
        if i < at + size:
            buf[i] ^= data.draw(st.integers(1, 255))
            buf[at + 4 : at + 8] = crc32c(bytes(buf[at + 8 : at + size])).to_bytes(4, "big")
    stream = bytes(buf[: data.draw(st.integers(0, len(buf)))])
    first = data.draw(st.integers(99, 110))
    limit = data.draw(st.integers(100, 110))
    max_records = data.draw(st.integers(1, 10))
    max_bytes = data.draw(st.sampled_from([1, 100, 1000, 1 << 30]))
    expected_records, expected_stop, expected_total = _reference_run(stream, first, limit, max_records, max_bytes)
    out: list[Record] = []
    stop, _, total, _ = decode_run(stream, 0, -1, first, limit, out, max_records, max_bytes, 0)
    assert out == expected_records
    assert stop == expected_stop
    # The framed bytes of what was returned, as stored: not re-encoded, since a topic that is
    # not UTF-8 (damage behind a matching CRC) decodes with U+FFFD, longer when encoded again.
    assert total == expected_total


def test_decode_run_counts_a_non_utf8_topic_by_its_stored_bytes() -> None:
    """A topic byte damaged behind a matching CRC can leave a topic that is not UTF-8: it
    decodes with U+FFFD (3 bytes when encoded again, for the 2 stored), and decode_run's byte
    total counts what is stored, as check_frame does (the case Hypothesis found, 2026-11-26)."""
    rec = Record(100, 0, "\x80", b"", 0, False)  # topic stored as c2 80
    buf = bytearray(encode_record(rec))
    buf[HEADER_SIZE] ^= 0x20  # c2 -> e2: e2 80 is not UTF-8
    buf[4:8] = crc32c(bytes(buf[8:])).to_bytes(4, "big")
    out: list[Record] = []
    stop, _, total, _ = decode_run(bytes(buf), 0, -1, 100, 101, out, 1, 1 << 30, 0)
    assert [r.topic for r in out] == ["\ufffd"]
    assert stop == total == len(buf) == check_frame(bytes(buf), 0, len(buf))
    assert len(encode_record(out[0])) == len(buf) + 1


def _check_walk(stream: bytes, first_offset: int) -> tuple[int, int]:
    """(stop, next offset) of the generic check_frame walk over gap-free records."""
    pos, expected = 0, first_offset
    while True:
        framed = check_frame(stream, pos, len(stream))
        if framed <= 0 or offset_at(stream, pos) != expected:
            return pos, expected
        pos, expected = pos + framed, expected + 1


def test_fast_paths_agree_with_check_frame_on_damage_behind_a_matching_crc() -> None:
    """Exhaustive over the fields only the structural checks guard (version, flags, topic_len,
    headers_len: damaged, then the CRC recomputed): decode_run and scan_run stop exactly where
    check_frame does, on format 1 and format 2 records, never raising."""
    recs = [
        Record(7, 1, "ab", b"x" * 5),
        Record(8, 2, "ab", b"yy", qos=2, headers=b"\x01\x01"),
        Record(9, 3, "", b"zzz", retain=True, headers=HEADERS),
        Record(10, 4, "ab", b""),
        Record(11, 5, "c", b"w", headers=b"h" * 3),
    ]
    frames = [encode_record(r) for r in recs]
    for k, frame in enumerate(frames):
        at = sum(map(len, frames[:k]))
        tl = len(recs[k].topic.encode())
        for field in (0, 1, 2, 3, 8, 9, 26, 27, 28 + tl, 29 + tl, 30 + tl, 31 + tl):
            if field >= len(frame):
                continue
            for xor in (0x01, 0x02, 0x04, 0x10, 0x80, 0xFF):
                buf = bytearray(b"".join(frames))
                buf[at + field] ^= xor
                buf[at + 4 : at + 8] = crc32c(bytes(buf[at + 8 : at + len(frame)])).to_bytes(4, "big")
                stream = bytes(buf)
                stop, nxt = _check_walk(stream, 7)
                assert scan_run(stream, 0, len(stream), 7, 0, [], 0, 64, 0)[:2] == (stop, nxt), (k, field, xor)
                out: list[Record] = []
                pos = decode_run(stream, 0, 7, 0, 2**64, out, 100, 1 << 30, 0)[0]
                assert pos == stop and len(out) == nxt - 7, (k, field, xor)
                assert out == [decode_at(stream, p, n) for p, n in _frames(stream, stop)], (k, field, xor)


def _frames(stream: bytes, stop: int) -> list[tuple[int, int]]:
    out, pos = [], 0
    while pos < stop:
        framed = check_frame(stream, pos, len(stream))
        out.append((pos, framed))
        pos += framed
    return out


def test_positional_getters_read_the_named_fields() -> None:
    """The C-level getters the groups and the delivery path map over runs of records read the
    fields they are named for (they go by position: a reordered Record would break them)."""
    r = Record(7, 11, "a/b", b"payload", 1, True, b"\x02\x00\x00\x00\x05")
    assert [g(r) for g in (record_offset, record_topic, record_payload, record_qos, record_retain,
                           record_headers)] == [r.offset, r.topic, r.payload, r.qos, r.retain, r.headers]


@given(st.sampled_from([b"t", b"sensors/dev-1/temp", "é/ü".encode()]), st.integers(0, 300), st.integers(1, 200),
       st.lists(st.booleans(), min_size=200, max_size=200), st.integers(0, 2), st.integers(0, 2**40),
       st.booleans())
@settings(max_examples=150, deadline=None)
def test_encode_run_v1_is_encode_v1_of_each_record(topic: bytes, size: int, n: int, retains: list[bool], qos: int,
                                                    first: int, uniform: bool) -> None:
    """A run of one topic and equal-sized payloads (the broker's run of PUBLISHes) and one that
    is not (a longer last payload), up to 200 records: the same bytes and framed sizes as
    encode_v1 of each record."""
    payloads = [bytes([i % 256]) * size for i in range(n)]
    if not uniform:
        payloads[-1] += b"+"
    flags = [make_flags(qos, r) for r in retains[:n]]
    data, sizes = encode_run_v1(first, 1234, [topic] * n, payloads, iter(flags))
    each = [encode_v1(first + i, 1234, topic, p, f) for i, (p, f) in enumerate(zip(payloads, flags, strict=False))]
    assert data == b"".join(each)
    assert sizes == [len(e) for e in each]
