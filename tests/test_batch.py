"""The upstream batch format: round trips, the CRC/malformed split, and every header check."""

from __future__ import annotations

import struct
import zlib

import pytest
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.upstream.batch import (
    CRC_START,
    MAGIC,
    PREFIX_SIZE,
    BatchCrcError,
    BatchRecord,
    MalformedBatch,
    batch_topic,
    decode_batch,
    encode_batch,
    parse_batch_topic,
    peek_header,
    records_after,
)


def rec(offset: int, payload: bytes = b"p", topic: str = "t/a", ts: int = 1, qos: int = 1) -> BatchRecord:
    return BatchRecord(offset, ts, topic, payload, qos)


def reseal(data: bytes | bytearray) -> bytes:
    """``data`` with a CRC that matches again (for structurally bad batches)."""
    data = bytearray(data)
    data[4:8] = struct.pack("<I", crc32c(bytes(data[CRC_START:]), crc32c(bytes(data[:4]))))
    return bytes(data)


def as_tuples(records: object) -> list[tuple[int, int, str, bytes, int]]:
    return [(r.offset, r.timestamp_us, r.topic, bytes(r.payload), r.qos) for r in records]  # type: ignore[attr-defined]


names = st.text(
    st.characters(blacklist_characters="/+#\x00", blacklist_categories=["Cs"]), min_size=1, max_size=20
)
topics = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=["Cs"]), min_size=0, max_size=30)


@st.composite
def record_lists(draw: st.DrawFn) -> list[BatchRecord]:
    n = draw(st.integers(1, 40))
    first = draw(st.integers(0, 2**63 - 2**33))
    gaps = draw(st.lists(st.integers(1, 1000), min_size=n - 1, max_size=n - 1))
    offsets = [first]
    for gap in gaps:
        offsets.append(offsets[-1] + gap)
    topic_pool = draw(st.lists(topics, min_size=1, max_size=5))
    return [
        BatchRecord(
            off,
            draw(st.integers(-(2**63), 2**63 - 1)),
            draw(st.sampled_from(topic_pool)),
            draw(st.binary(max_size=200)),
            draw(st.integers(0, 2)),
        )
        for off in offsets
    ]


@settings(max_examples=150, deadline=None)
@given(records=record_lists(), device=names, stream=names, compression=st.sampled_from(["none", "zlib"]))
def test_round_trip(records: list[BatchRecord], device: str, stream: str, compression: str) -> None:
    data = encode_batch(device, stream, records, compression=compression)
    batch = decode_batch(data)
    assert batch.device_id == device and batch.stream == stream
    assert batch.first_offset == records[0].offset
    assert batch.last_offset == records[-1].offset
    assert len(batch) == len(records)
    assert as_tuples(batch.records()) == as_tuples(records)
    assert batch.offsets() == [r.offset for r in records]
    header = peek_header(data)
    assert header.count == len(records) and header.compression == (1 if compression == "zlib" else 0)


@settings(max_examples=60, deadline=None)
@given(records=record_lists(), data=st.data())
def test_any_flipped_bit_is_a_crc_error(records: list[BatchRecord], data: st.DataObject) -> None:
    encoded = bytearray(encode_batch("dev", "main", records, compression=data.draw(st.sampled_from(["none", "zlib"]))))
    bit = data.draw(st.integers(0, len(encoded) * 8 - 1))
    encoded[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(BatchCrcError):
        decode_batch(bytes(encoded))


@pytest.mark.parametrize("byte", range(CRC_START))
def test_damage_to_magic_or_crc_is_a_crc_error(byte: int) -> None:
    """Transport damage must be resent, never quarantined: the CRC is checked first."""
    encoded = bytearray(encode_batch("dev", "main", [rec(5)]))
    encoded[byte] ^= 0x10
    with pytest.raises(BatchCrcError):
        decode_batch(bytes(encoded))


def test_truncated_batch_is_a_crc_error() -> None:
    encoded = encode_batch("dev", "main", [rec(5, b"x" * 100)])
    for cut in range(CRC_START, len(encoded)):
        with pytest.raises(BatchCrcError):
            decode_batch(encoded[:cut])


def test_offsets_with_gaps_survive() -> None:
    """The device log may have skipped a corrupt record: offsets must still be exact."""
    records = [rec(10), rec(11), rec(13), rec(20)]
    batch = decode_batch(encode_batch("dev", "main", records))
    assert batch.offsets() == [10, 11, 13, 20]


def test_records_after_trims_an_overlap() -> None:
    batch = decode_batch(encode_batch("dev", "main", [rec(o) for o in range(100, 110)]))
    assert [r.offset for r in records_after(batch, 104)] == list(range(105, 110))
    assert records_after(batch, 200) == []


def test_encode_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        encode_batch("dev", "main", [])
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_batch("dev", "main", [rec(5), rec(5)])
    with pytest.raises(ValueError, match="strictly increasing"):
        encode_batch("dev", "main", [rec(5), rec(9), rec(7)])
    with pytest.raises(ValueError, match="must not contain"):
        encode_batch("dev/1", "main", [rec(5)])
    with pytest.raises(ValueError, match="empty"):
        encode_batch("dev", "", [rec(5)])
    with pytest.raises(ValueError, match="QoS"):
        encode_batch("dev", "main", [rec(5, qos=3)])
    with pytest.raises(ValueError, match="span"):
        encode_batch("dev", "main", [rec(0), rec(2**32 + 5)])
    with pytest.raises(ValueError, match="unknown compression"):
        encode_batch("dev", "main", [rec(1)], compression="lz4")


# -- structurally bad batches with a valid CRC: MalformedBatch (quarantine) ------------------


def header_field(encoded: bytes, fmt: str, pos: int, value: int) -> bytes:
    data = bytearray(encoded)
    struct.pack_into(fmt, data, pos, value)
    return reseal(data)


def test_bad_magic_with_valid_crc_is_malformed() -> None:
    encoded = bytearray(encode_batch("dev", "main", [rec(1)]))
    encoded[0:4] = b"XXXX"
    with pytest.raises(MalformedBatch, match="magic"):
        decode_batch(reseal(encoded))


def test_unknown_version_is_malformed() -> None:
    for version in (0, 3, 255):
        encoded = header_field(encode_batch("dev", "main", [rec(1)]), "<B", 8, version)
        with pytest.raises(MalformedBatch, match=f"version {version}"):
            decode_batch(encoded)


def test_unknown_compression_is_malformed() -> None:
    encoded = header_field(encode_batch("dev", "main", [rec(1)]), "<B", 9, 7)
    with pytest.raises(MalformedBatch, match="compression code 7") as info:
        decode_batch(encoded)
    assert info.value.device_id == "dev" and info.value.first_offset == 1


def test_zstd_without_the_module_is_malformed_not_crash() -> None:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        encoded = header_field(encode_batch("dev", "main", [rec(1)]), "<B", 9, 2)
        with pytest.raises(MalformedBatch, match="zstd"):
            decode_batch(encoded)
    else:
        pytest.skip("zstandard is installed here; the missing-module path cannot be exercised")


def test_reserved_bits_are_malformed() -> None:
    encoded = header_field(encode_batch("dev", "main", [rec(1)]), "<H", 10, 1)
    with pytest.raises(MalformedBatch, match="reserved"):
        decode_batch(encoded)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("first", 3, "last record's offset"),  # first moved: delta no longer matches last
        ("last", 9, "last record's offset"),
        ("last", 0, "cannot hold"),
        ("count", 0, "count is 0"),
        ("count", 5, "cannot hold"),
        ("count", 3, "columns|payload lengths|topic|offset"),
        ("body_length", 10, "body is"),
    ],
)
def test_inconsistent_header_is_malformed(field: str, value: int, message: str) -> None:
    encoded = encode_batch("dev", "main", [rec(1, b"abc"), rec(4, b"de")])
    pos = {"first": 12, "last": 20, "count": 28, "body_length": 32}[field]
    fmt = {"first": "<Q", "last": "<Q", "count": "<I", "body_length": "<I"}[field]
    with pytest.raises(MalformedBatch, match=message):
        decode_batch(header_field(encoded, fmt, pos, value))


def body_of(encoded: bytes) -> tuple[bytes, int]:
    header = peek_header(encoded)
    return encoded[: header.header_size], header.header_size


def with_body(encoded: bytes, new_body: bytes) -> bytes:
    head, _ = body_of(encoded)
    data = bytearray(head + new_body)
    struct.pack_into("<I", data, 32, len(new_body))
    return reseal(data)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:-1], "payload lengths"),
        (lambda b: b + b"z", "payload lengths"),
        (lambda b: b[:3], "topic table"),
        (lambda b: struct.pack("<I", 0) + b[4:], "topic table of 0"),
        (lambda b: struct.pack("<I", 9) + b[4:], "topic table of 9"),
        (lambda b: b[:6] + b"\xff\xfe" + b[8:], "UTF-8"),
        (lambda b: b[:6] + b"\x00t" + b[8:], "NUL"),
    ],
)
def test_bad_body_is_malformed(mutate: object, message: str) -> None:
    encoded = encode_batch("dev", "main", [rec(1, b"abc", "ta"), rec(2, b"de", "ta")])
    _, start = body_of(encoded)
    bad = with_body(encoded, mutate(encoded[start:]))  # type: ignore[operator]
    with pytest.raises(MalformedBatch, match=message):
        decode_batch(bad)


def _columns(encoded: bytes) -> tuple[bytearray, int]:
    """The body and where its columns start (one topic "ta" of 2 bytes, 2 records)."""
    _, start = body_of(encoded)
    return bytearray(encoded[start:]), 4 + 2 + 2


def test_bad_columns_are_malformed() -> None:
    encoded = encode_batch("dev", "main", [rec(1, b"abc", "ta"), rec(2, b"de", "ta")])
    cases = []
    body, col = _columns(encoded)
    struct.pack_into("<I", body, col, 1)  # first delta not 0
    cases.append((bytes(body), "first record's offset delta"))
    body, col = _columns(encoded)
    struct.pack_into("<I", body, col + 4, 0)  # second delta 0: not increasing, and != last
    cases.append((bytes(body), "last record's offset|strictly increasing"))
    body, col = _columns(encoded)
    body[col + 8 + 16] = 3  # QoS column
    cases.append((bytes(body), "QoS"))
    body, col = _columns(encoded)
    struct.pack_into("<I", body, col + 8 + 16 + 2, 1)  # topic index beyond the table
    cases.append((bytes(body), "topic index"))
    for new_body, message in cases:
        with pytest.raises(MalformedBatch, match=message):
            decode_batch(with_body(encoded, new_body))


def test_zlib_bomb_and_garbage_are_malformed() -> None:
    encoded = encode_batch("dev", "main", [rec(1, b"x" * 1000)], compression="zlib")
    head, start = body_of(encoded)
    # Claims a small body but inflates to far more: refused without inflating it all.
    bomb = zlib.compress(b"\0" * 10_000_000)
    data = bytearray(head + bomb)
    struct.pack_into("<I", data, 32, 100)
    with pytest.raises(MalformedBatch, match="zlib body"):
        decode_batch(reseal(data))
    with pytest.raises(MalformedBatch, match="zlib body"):
        decode_batch(reseal(head + b"not zlib at all"))


def test_short_inputs() -> None:
    with pytest.raises(MalformedBatch, match="shorter"):
        decode_batch(b"FMQ")
    # 8..11 bytes whose CRC matches the (empty or tiny) rest: still malformed, not a crash.
    tiny = MAGIC + struct.pack("<I", crc32c(b"\x01", crc32c(MAGIC))) + b"\x01"
    with pytest.raises(MalformedBatch, match="shorter"):
        decode_batch(tiny)
    assert PREFIX_SIZE == 12


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(data: bytes) -> None:
    """Garbage gives one of the two batch errors (never another exception); with a
    matching CRC it is malformed unless it really is a batch."""
    with pytest.raises((BatchCrcError, MalformedBatch)):
        decode_batch(data)
    if len(data) >= CRC_START:
        try:
            batch = decode_batch(reseal(data))
        except MalformedBatch:
            return
        # Astronomically unlikely, but if it parses it must be a consistent batch.
        again = decode_batch(encode_batch(batch.device_id, batch.stream, list(batch.records())))
        assert as_tuples(again.records()) == as_tuples(batch.records())


def test_topic_helpers() -> None:
    assert batch_topic("press-07", "main") == "filemq/v1/press-07/main"
    assert parse_batch_topic("filemq/v1/press-07/main") == ("press-07", "main")
    assert parse_batch_topic("filemq/v1/press-07") is None
    assert parse_batch_topic("filemq/v1/a/b/c") is None
    assert parse_batch_topic("other/v1/a/b") is None


# -- version 2: record headers (MQTT 5.0 message properties, opaque to the batch) ----------

# A version 1 batch as every earlier release wrote it (two records, offsets 7 and 9, no
# compression): pinned so that the collector keeps reading what old agents send.
V1_BATCH = bytes.fromhex(
    "464d5142aefc65f00100000007000000000000000900000000000000020000004c000000030064657604006d"
    "61696e020000000a0073656e736f72732f74310a0073656e736f72732f7432000000000200000000401e1824"
    "0a060001401e18240a060001000000000001000000040000000200000032312e357b7d"
)


def test_a_version_1_batch_of_an_older_agent_still_decodes() -> None:
    batch = decode_batch(V1_BATCH)
    assert batch.header.version == 1
    assert [(r.offset, r.timestamp_us, r.topic, r.payload, r.qos, r.headers) for r in batch.records()] == [
        (7, 1700000000000000, "sensors/t1", b"21.5", 1, b""),
        (9, 1700000000000001, "sensors/t2", b"{}", 0, b""),
    ]
    assert not batch.has_headers and list(batch.record_headers()) == [b"", b""]


def test_records_without_headers_are_written_as_version_1_byte_for_byte() -> None:
    """An agent whose records carry no MQTT 5 properties sends exactly the bytes of earlier
    releases, so it keeps working against a collector that predates version 2."""
    records = [BatchRecord(7, 1700000000000000, "sensors/t1", b"21.5", 1),
               BatchRecord(9, 1700000000000001, "sensors/t2", b"{}", 0)]
    assert encode_batch("dev", "main", records) == V1_BATCH
    assert peek_header(encode_batch("dev", "main", [rec(1)])).version == 1


def test_a_record_with_headers_makes_a_version_2_batch() -> None:
    records = [rec(1), BatchRecord(2, 5, "t", b"x", 1, b"\x03\x00\x04text"), rec(3)]
    data = encode_batch("dev", "main", records)
    batch = decode_batch(data)
    assert batch.header.version == 2 and batch.has_headers
    assert [r.headers for r in batch.records()] == [b"", b"\x03\x00\x04text", b""]
    assert list(batch.header_lengths) == [0, 7, 0]
    # Forced version 2 without headers also round-trips; version 1 cannot carry headers.
    plain = decode_batch(encode_batch("dev", "main", [rec(1)], version=2))
    assert plain.header.version == 2 and not plain.has_headers
    with pytest.raises(ValueError, match="version 1 cannot carry"):
        encode_batch("dev", "main", records, version=1)
    with pytest.raises(ValueError, match="unknown batch format version 3"):
        encode_batch("dev", "main", records, version=3)


@st.composite
def record_lists_with_headers(draw: st.DrawFn) -> list[BatchRecord]:
    plain = draw(record_lists())
    headers = st.one_of(st.just(b""), st.binary(min_size=1, max_size=120))
    return [BatchRecord(r.offset, r.timestamp_us, r.topic, r.payload, r.qos, draw(headers)) for r in plain]


@settings(max_examples=150, deadline=None)
@given(records=record_lists_with_headers(), compression=st.sampled_from(["none", "zlib"]))
def test_round_trip_with_arbitrary_headers(records: list[BatchRecord], compression: str) -> None:
    data = encode_batch("dev", "main", records, compression=compression)
    batch = decode_batch(data)
    assert batch.header.version == (2 if any(r.headers for r in records) else 1)
    assert [(*t, r.headers) for t, r in zip(as_tuples(batch.records()), batch.records(), strict=True)] == [
        (*t, r.headers) for t, r in zip(as_tuples(records), records, strict=True)
    ]
    assert list(batch.record_headers()) == [r.headers for r in records]
    # The door's trim re-encodes decoded records: the headers survive it.
    assert decode_batch(encode_batch("dev", "main", list(batch.records()))).headers == batch.headers


@settings(max_examples=60, deadline=None)
@given(records=record_lists_with_headers(), data=st.data())
def test_headers_are_covered_by_the_crc(records: list[BatchRecord], data: st.DataObject) -> None:
    encoded = bytearray(encode_batch("dev", "main", records, version=2))
    # A bit in the header section (the tail of the body) or anywhere else.
    start = data.draw(st.sampled_from([len(encoded) - sum(len(r.headers) for r in records), CRC_START]))
    bit = data.draw(st.integers(min(start, len(encoded) - 1) * 8, len(encoded) * 8 - 1))
    encoded[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(BatchCrcError):
        decode_batch(bytes(encoded))


def _v2_body(encoded: bytes) -> tuple[bytearray, int]:
    """The body of a version 2 batch of records rec(1, b"abc", "ta") and rec(2, b"de", "ta")
    and where the header-length column starts."""
    _, start = body_of(encoded)
    return bytearray(encoded[start:]), 4 + 2 + 2 + 2 * (4 + 8 + 1 + 4 + 4)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b, col: b[:-1], "header lengths add up"),
        (lambda b, col: b + b"z", "header lengths add up"),
        (lambda b, col: b[:col] + struct.pack("<I", 1000) + b[col + 4 :], "payload lengths add up|header lengths"),
        (lambda b, col: b[:col + 4], "columns"),
    ],
)
def test_bad_header_section_is_malformed(mutate: object, message: str) -> None:
    records = [BatchRecord(1, 1, "ta", b"abc", 1, b"\x01\x01"), BatchRecord(2, 1, "ta", b"de", 1, b"")]
    encoded = encode_batch("dev", "main", records)
    body, col = _v2_body(encoded)
    assert struct.unpack_from("<II", body, col) == (2, 0)
    with pytest.raises(MalformedBatch, match=message):
        decode_batch(with_body(encoded, bytes(mutate(body, col))))  # type: ignore[operator]


def test_headers_refused_by_check_headers_make_the_batch_malformed() -> None:
    """The collector passes the property decoder: headers it refuses are a malformed batch
    (whose CRC matched: the sender really sent them), never another exception."""
    seen: list[bytes] = []

    def check(headers: bytes) -> None:
        seen.append(headers)
        if headers == b"bad":
            raise ValueError("not a property section")

    good = encode_batch("dev", "main", [rec(1), BatchRecord(2, 1, "t", b"p", 1, b"ok")])
    assert decode_batch(good, check_headers=check).has_headers and seen == [b"ok"]
    bad = encode_batch("dev", "main", [rec(4), BatchRecord(5, 1, "t", b"p", 1, b"bad")])
    with pytest.raises(MalformedBatch, match="offset 5 has malformed headers: not a property section") as info:
        decode_batch(bad, check_headers=check)
    assert info.value.device_id == "dev" and info.value.first_offset == 4


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=200), count=st.integers(1, 4), span=st.integers(0, 6))
def test_random_version_2_bodies_never_crash(body: bytes, count: int, span: int) -> None:
    """Any body under a valid version 2 header (CRC matching) is a MalformedBatch or a
    consistent batch, with or without check_headers; never another exception."""
    head, _ = body_of(encode_batch("dev", "main", [rec(o) for o in range(10, 10 + max(count, span + 1))], version=2))
    data = bytearray(head + body)
    struct.pack_into("<QQII", data, 12, 10, 10 + max(span, count - 1), count, len(body))

    def check(headers: bytes) -> None:
        if headers[:1] != b"\x26":
            raise ValueError("refused")

    for checker in (None, check):
        try:
            batch = decode_batch(reseal(data), check_headers=checker)
        except MalformedBatch:
            continue
        assert len(list(batch.records())) == count == len(list(batch.record_headers()))
