"""MQTT 3.1.1 codec: round trips, arbitrary stream splits and specific malformed inputs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.mqtt import codec
from filemq.mqtt.codec import CLIENT_TO_SERVER, Decoder, ProtocolError, encode
from filemq.mqtt.packets import (
    Connack,
    Connect,
    Packet,
    Pingreq,
    Pingresp,
    Puback,
    Publish,
    PublishRun,
    Pubrel,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)
from filemq.mqtt.runcodec import puback_run
from tests.mqtt_strategies import client_packets, publishes, server_packets


def decode_all(data: bytes, *, server: bool = True, max_packet_size: int = 1 << 20) -> list[Packet]:
    decoder = Decoder(max_packet_size, server=server)
    decoder.feed(data)
    out = decoder.packets()
    assert decoder.buffered == 0, "bytes left over after a whole stream"
    return out


# ---------------------------------------------------------------- round trips


@given(client_packets)
def test_client_packets_round_trip(packet: Packet) -> None:
    assert decode_all(encode(packet), server=True) == [packet]


@given(server_packets)
def test_server_packets_round_trip(packet: Packet) -> None:
    assert decode_all(encode(packet), server=False) == [packet]


@given(st.lists(client_packets, min_size=1, max_size=8), st.data())
@settings(max_examples=150)
def test_any_split_of_a_stream_decodes_identically(packets: list[Packet], data: st.DataObject) -> None:
    stream = b"".join(encode(p) for p in packets)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    decoder = Decoder()
    got: list[Packet] = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        decoder.feed(stream[prev:cut])
        prev = cut
        # Alternate the two read APIs so both see partial packets.
        if cut % 2:
            got.extend(decoder.packets())
        else:
            while (p := decoder.next_packet()) is not None:
                got.append(p)
    assert got == packets
    assert decoder.buffered == 0


def test_byte_by_byte_feed() -> None:
    packets: list[Packet] = [
        Connect(client_id="dev-1", username="u", password=b"p", will_topic="w", will_payload=b"bye"),
        Publish("s/t", b"x" * 200, 1, packet_id=9),  # two-byte remaining length
        Publish("s/t", b"y" * 20000, 2, packet_id=10),  # three-byte remaining length
        Subscribe(3, [("a/#", 1), ("b/+", 2)]),
        Pingreq(),
    ]
    stream = b"".join(encode(p) for p in packets)
    decoder = Decoder()
    got: list[Packet] = []
    for i in range(len(stream)):
        decoder.feed(stream[i : i + 1])
        got.extend(decoder.packets())
    assert got == packets


def test_remaining_length_boundaries() -> None:
    # 127/128, 16383/16384 and 2097151/2097152 body sizes cross the 1-, 2-, 3- and 4-byte varints.
    for body in (127, 128, 16383, 16384, 2_097_151, 2_097_152):
        packet = Publish("t", b"z" * (body - 3), 0)
        wire = encode(packet)
        varint_len = 1 if body < 128 else 2 if body < 16384 else 3 if body < 2_097_152 else 4
        assert len(wire) == 1 + varint_len + body
        assert decode_all(wire, max_packet_size=len(wire)) == [packet]


def test_known_bytes_match_the_spec() -> None:
    # Hand-assembled from the spec's layout, not from our encoder.
    assert encode(Puback(0x1234)) == b"\x40\x02\x12\x34"
    assert encode(Pubrel(1)) == b"\x62\x02\x00\x01"
    assert encode(Pingreq()) == b"\xc0\x00"
    assert encode(Publish("a/b", b"hi", 1, retain=True, packet_id=10)) == b"\x33\x09\x00\x03a/b\x00\x0ahi"
    assert encode(Connect(client_id="c", keepalive=60)) == (
        b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x3c\x00\x01c"
    )
    assert encode(Subscribe(2, [("x", 1)])) == b"\x82\x06\x00\x02\x00\x01x\x01"


def test_encoder_refuses_unframeable_packets() -> None:
    with pytest.raises(ValueError, match="QoS"):
        encode(Publish("t", b"", 3, packet_id=1))
    with pytest.raises(ValueError, match="packet id"):
        encode(Publish("t", b"", 1))
    with pytest.raises(ValueError, match="packet id"):
        encode(Puback(0))
    with pytest.raises(ValueError, match="needs a username"):
        encode(Connect(password=b"x"))
    with pytest.raises(ValueError, match="topic of 70000 bytes"):
        encode(Publish("t" * 70000, b"", 0))
    with pytest.raises(ValueError, match="at least one topic filter"):
        encode(Subscribe(1, []))
    with pytest.raises(ValueError, match="at least one topic filter"):
        encode(Unsubscribe(1, []))
    with pytest.raises(ValueError, match="return codes"):
        encode(Suback(1, [3]))
    with pytest.raises(ValueError, match="return code must be"):
        encode(Connack(return_code=256))


def test_server_decoder_rejects_server_to_client_packets() -> None:
    for packet in (Connack(), Suback(1, [0]), Unsuback(1), Pingresp()):
        with pytest.raises(ProtocolError, match="not a packet a server may receive"):
            decode_all(encode(packet), server=True)
    with pytest.raises(ProtocolError, match="not a packet a client may receive"):
        decode_all(encode(Connect()), server=False)


def test_direction_sets_follow_the_spec() -> None:
    assert len(CLIENT_TO_SERVER) == 10


# ---------------------------------------------------------------- malformed input

MALFORMED = [
    # (bytes, expected message fragment)
    (b"\x30\xff\xff\xff\xff\x01", "remaining length exceeds 4 bytes"),
    (b"\x83\x05\x00\x01\x00\x01x", "reserved flags 0b0011 on SUBSCRIBE"),
    (b"\x80\x03\x00\x01\x00", "reserved flags 0b0000 on SUBSCRIBE"),
    (b"\x41\x02\x00\x01", "reserved flags 0b0001 on PUBACK"),
    (b"\x60\x02\x00\x01", "reserved flags 0b0000 on PUBREL"),
    (b"\xc1\x00", "reserved flags 0b0001 on PINGREQ"),
    (b"\x36\x05\x00\x01t\x00\x01", "QoS 3 in PUBLISH"),
    (b"\x32\x05\x00\x01t\x00\x00", "PUBLISH QoS>0 with packet id 0"),
    (b"\x30\x04\x00\x02\xc3\x28", "invalid UTF-8 in topic"),
    (b"\x30\x04\x00\x02a\x00", "U+0000 in topic"),
    (b"\x30\x05\x00\x03a/+", "wildcard in PUBLISH topic name"),
    (b"\x30\x02\x00\x00", "PUBLISH with an empty topic name"),
    (b"\x30\x03\x00\x05a", "runs past the end of the packet"),
    (b"\x30\x00", "PUBLISH truncated before the topic length"),
    (b"\x82\x02\x00\x01", "SUBSCRIBE with no topic filters"),
    (b"\x82\x05\x00\x01\x00\x01x", "has no QoS byte"),
    (b"\x82\x06\x00\x01\x00\x01x\x03", "QoS 3 in SUBSCRIBE"),
    (b"\x82\x06\x00\x01\x00\x01x\x41", "requested QoS byte 0x41"),
    (b"\x82\x05\x00\x00\x00\x00\x00", "SUBSCRIBE with packet id 0"),
    (b"\xa2\x02\x00\x01", "UNSUBSCRIBE with no topic filters"),
    (b"\x40\x03\x00\x01\x00", "PUBACK remaining length 3, expected 2"),
    (b"\x40\x02\x00\x00", "PUBACK with packet id 0"),
    (b"\xc0\x01\x00", "PINGREQ remaining length 1, expected 0"),
    (b"\xe0\x01\x00", "DISCONNECT remaining length 1, expected 0"),
    (b"\x00\x00", "reserved packet type 0"),
    (b"\xf0\x00", "reserved packet type 15"),
    (b"\x10\x0c\x00\x04MQTX\x04\x02\x00\x3c\x00\x00", "protocol name 'MQTX'"),
    (b"\x10\x0c\x00\x04MQTT\x04\x03\x00\x3c\x00\x00", "CONNECT reserved flag (bit 0) is set"),
    (b"\x10\x0c\x00\x04MQTT\x04\x1e\x00\x3c\x00\x00", "QoS 3 in CONNECT will"),
    (b"\x10\x0c\x00\x04MQTT\x04\x0a\x00\x3c\x00\x00", "will QoS/retain set without the will flag"),
    (b"\x10\x0c\x00\x04MQTT\x04\x42\x00\x3c\x00\x00", "password flag set without the username flag"),
    (b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x3c\x00\x00\x00", "1 unexpected bytes after the CONNECT payload"),
    (b"\x10\x0c\x00\x04MQTT\x04\x82\x00\x3c\x00\x00", "truncated before the length of username"),
    (b"\x10\x0e\x00\x04MQTT\x04\x02\x00\x3c\x00\x02\xed\xa0", "invalid UTF-8 in client id"),
    (b"\x10\x06\x00\x04MQTT", "CONNECT truncated in the variable header"),
]


@pytest.mark.parametrize(("wire", "fragment"), MALFORMED, ids=[m[1] for m in MALFORMED])
def test_malformed_packet_reports_the_reason(wire: bytes, fragment: str) -> None:
    decoder = Decoder()
    decoder.feed(wire)
    with pytest.raises(ProtocolError, match=fragment.replace("+", r"\+").replace("(", r"\(").replace(")", r"\)")):
        decoder.packets()
    # Poisoned: a framing error cannot be recovered from, so later calls fail the same way.
    with pytest.raises(ProtocolError):
        decoder.next_packet()


@pytest.mark.parametrize(
    ("wire", "fragment"),
    [
        (b"\x20\x03\x00\x00\x00", "CONNACK remaining length 3, expected 2"),
        (b"\x20\x02\x02\x00", "CONNACK reserved acknowledge flags 0x02"),
        (b"\x90\x03\x00\x01\x03", "SUBACK return code 0x03"),
        (b"\x90\x02\x00\x01", "SUBACK with no return codes"),
    ],
)
def test_malformed_server_packets(wire: bytes, fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        decode_all(wire, server=False)


def test_oversized_packet_rejected_from_the_fixed_header_alone() -> None:
    decoder = Decoder(max_packet_size=1 << 20)
    # Only the fixed header of a 5,000,000-byte PUBLISH arrives; no body is buffered.
    header = encode(Publish("t", b"\0" * (5_000_000 - 8), 0))[:5]
    decoder.feed(header)
    with pytest.raises(ProtocolError, match="packet of 5000000 bytes exceeds max_packet_size 1048576"):
        decoder.packets()


def test_oversized_packet_rejected_on_feed_before_buffering_more() -> None:
    decoder = Decoder(max_packet_size=100)
    wire = encode(Publish("t", b"p" * 200, 1, packet_id=1))
    with pytest.raises(ProtocolError, match="exceeds max_packet_size 100"):
        decoder.feed(wire)


def test_packet_exactly_at_the_limit_is_accepted() -> None:
    wire = encode(Publish("t", b"p" * 200, 1, packet_id=1))
    assert decode_all(wire, max_packet_size=len(wire))[0] == Publish("t", b"p" * 200, 1, packet_id=1)
    with pytest.raises(ProtocolError, match="exceeds max_packet_size"):
        decode_all(wire, max_packet_size=len(wire) - 1)


def test_protocol_level_is_passed_through_for_the_broker_to_refuse() -> None:
    # Spec 3.1.2-2: an unsupported level gets CONNACK 0x01, so the codec must not reject it.
    packet = Connect(client_id="old", protocol_level=3)
    assert decode_all(encode(packet)) == [packet]


def test_buffer_is_compacted_not_grown_forever() -> None:
    one = encode(Publish("t", b"x" * 100, 1, packet_id=1))
    decoder = Decoder()
    decoder.feed(one[:50])
    for _ in range(5000):
        # Each feed completes one packet and starts the next, so a partial tail always stays.
        decoder.feed(one[50:] + one[:50])
        assert len(decoder.packets()) == 1
    assert decoder.buffered == 50
    assert len(decoder._buf) < 200_000


# ---------------------------------------------------------------- the repeated-topic fast path


@given(st.lists(publishes(), min_size=2, max_size=20), st.data())
@settings(max_examples=150)
def test_repeated_topic_stream_any_split(packets: list[Publish], data: st.DataObject) -> None:
    # One topic for all, as from a sensor: after the first packet the decoder's topic cache
    # is hit, from both the bytes and the bytearray buffer (partial tails of any size).
    for p in packets:
        p.topic = "sensors/dev-1/temp"
    stream = b"".join(encode(p) for p in packets)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    decoder = Decoder()
    got: list[Packet] = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        decoder.feed(stream[prev:cut])
        prev = cut
        got.extend(decoder.packets())
    assert got == packets


@pytest.mark.parametrize(
    ("wire", "fragment"),
    [
        (b"\x36\x05\x00\x01t\x00\x01", "QoS 3 in PUBLISH"),
        (b"\x32\x05\x00\x01t\x00\x00", "PUBLISH QoS>0 with packet id 0"),
        (b"\x32\x04\x00\x01t\x00", "topic of 1 bytes and packet id run past the end"),
        (b"\x30\x01\x00", "PUBLISH truncated before the topic length"),
        (b"\x30\xc8\x01\x00\x01t" + b"p" * 197, "packet of 203 bytes exceeds max_packet_size 200"),
    ],
)
def test_cached_topic_does_not_skip_checks(wire: bytes, fragment: str) -> None:
    decoder = Decoder(max_packet_size=200)
    decoder.feed(encode(Publish("t", b"ok", 1, packet_id=1)))
    assert decoder.packets() == [Publish("t", b"ok", 1, packet_id=1)]
    with pytest.raises(ProtocolError, match=fragment):
        # An oversized packet may already be refused by feed(); the rest by packets().
        decoder.feed(wire)
        decoder.packets()


def test_codec_bench_runs_and_checks_both_sides() -> None:
    from bench.codec import ratios, run_codec_bench

    results = run_codec_bench(300, rounds=1, progress=lambda _msg: None)
    assert {(r.operation, r.impl) for r in results} == {
        (op, impl)
        for op in ("decode_publish", "encode_puback", "encode_publish")
        for impl in ("filemq", "amqtt")
    }
    assert all(r.packets == 300 and r.seconds > 0 for r in results)
    assert set(ratios(results)) == {"decode_publish", "encode_puback", "encode_publish"}


# ---------------------------------------------------------------- runs of equal-shaped PUBLISHes


def _decode_in_cuts(stream: bytes, cuts: list[int], runs: bool = False) -> list[Packet] | str:
    decoder = Decoder(runs=runs)
    got: list[Packet] = []
    prev = 0
    try:
        for cut in [*cuts, len(stream)]:
            decoder.feed(stream[prev:cut])
            prev = cut
            for p in decoder.packets():
                if isinstance(p, PublishRun):
                    assert len(p.payloads) >= codec._RUN_MIN
                    got.extend(p.publishes())
                else:
                    got.append(p)
    except ProtocolError as exc:
        return f"{len(got)} then {exc.reason}"
    return got


# Repeats: short runs, and runs of 76 and 151 packets (decoded in struct pieces of 64, 8, 4
# and 128, 16, 4, 2, 1); "a/c" packets have the size of "a/b" ones and another topic.
_REPEATS = st.one_of(st.integers(0, 3), st.sampled_from([25, 50]))


@given(st.lists(st.tuples(st.sampled_from(["a/b", "a/c", "sensors/dev-1/temp", "é"]),
                          st.sampled_from([0, 1, 5, 100, 200]),
                          st.integers(0, 2), st.booleans(), st.booleans(), _REPEATS),
                min_size=1, max_size=40),
       st.data())
@settings(max_examples=200, deadline=None)  # (a loaded machine's first call may take > 200 ms)
def test_runs_of_equal_shaped_publishes_decode_as_packet_by_packet(
        shapes: list[tuple[str, int, int, bool, bool, int]], data: st.DataObject) -> None:
    """A run of PUBLISHes with the same size, fixed header and topic (decoded without bytecode
    per packet) gives exactly the packets the per-packet path gives, for any split of the
    stream, mixed with packets of other shapes; an invalid packet id 0 inside a run is still
    reported, after the same packets."""
    packets: list[Packet] = []
    for i, (topic, size, qos, retain, dup, repeat) in enumerate(shapes):
        for j in range(1 + repeat * 3):
            pid = None if not qos else (i * 16 + j) % 65536 or 1
            packets.append(Publish(topic, bytes([j % 256]) * size, qos, retain, dup and qos > 0, pid))
    stream = b"".join(encode(p) for p in packets)
    if data.draw(st.booleans()):  # a packet id 0 somewhere (invalid)
        k = data.draw(st.integers(0, len(packets) - 1))
        p = packets[k]
        if isinstance(p, Publish) and p.qos:
            wire = bytearray(encode(p))
            at = stream.index(bytes(wire))
            tid = wire.index(p.topic.encode()) + len(p.topic.encode())
            wire[tid:tid + 2] = b"\x00\x00"
            stream = stream[:at] + bytes(wire) + stream[at + len(wire):]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    with_runs = _decode_in_cuts(stream, cuts)
    assert _decode_in_cuts(stream, cuts, runs=True) == with_runs  # PublishRun: the same messages
    no_runs = pytest.MonkeyPatch()
    no_runs.setattr(codec, "_RUN_MIN", 1 << 30)
    try:
        without = _decode_in_cuts(stream, cuts)
    finally:
        no_runs.undo()
    assert with_runs == without


def test_a_run_is_decoded_without_the_per_packet_path() -> None:
    """The run path does take a read of equal-shaped PUBLISHes (all but the first, whose topic
    is not cached yet)."""
    stream = b"".join(encode(Publish("t/1", b"x" * 100, 1, packet_id=i + 1)) for i in range(20))
    decoder = Decoder()
    decoder.feed(stream[:len(stream) // 20])
    assert decoder.packets() == [Publish("t/1", b"x" * 100, 1, packet_id=1)]
    run = codec._publish_run(stream, len(stream) // 20, len(stream), 1 << 20, decoder._topics)
    assert isinstance(run, tuple) and run[1] == len(stream)
    assert run[0] == [Publish("t/1", b"x" * 100, 1, packet_id=i + 1) for i in range(1, 20)]
    decoder.feed(stream[len(stream) // 20:])
    assert decoder.packets() == run[0]


def test_a_long_run_is_cut_where_a_packet_of_the_same_size_has_another_topic() -> None:
    """A read of 300 equal-sized QoS 1 PUBLISHes whose 200th has another topic of the same
    length: the run path gives the first 199 as one PublishRun (struct pieces of 64, 64, 64,
    4, 2, 1), then the rest, exactly as the per-packet path; packet ids and payloads intact."""
    packets = [Publish("t/a" if i != 199 else "t/b", bytes([i % 256]) * 40, 1, packet_id=i + 1) for i in range(300)]
    stream = b"".join(map(encode, packets))
    decoder = Decoder(runs=True)
    decoder.feed(encode(Publish("t/a", b"", 0)) + encode(Publish("t/b", b"", 0)))  # (caches both topics)
    decoder.packets()
    decoder.feed(stream)
    got = decoder.packets()
    assert isinstance(got[0], PublishRun) and len(got[0].payloads) == 199
    assert got[0].packet_ids == list(range(1, 200))
    flat = [q for p in got for q in (p.publishes() if isinstance(p, PublishRun) else [p])]
    assert flat == packets


def test_the_run_decoders_struct_cache_stays_bounded() -> None:
    """Every layout (header and topic size, payload size, piece size) gets a cached Struct,
    and the cache is cleared when it is full: 300 payload sizes leave at most its bound."""
    for size in range(300):
        stream = b"".join(encode(Publish("t/x", b"y" * size, 1, packet_id=i + 1)) for i in range(5))
        decoder = Decoder(runs=True)
        decoder.feed(encode(Publish("t/x", b"", 0)))
        decoder.packets()
        decoder.feed(stream)
        assert [len(p.payloads) for p in decoder.packets() if isinstance(p, PublishRun)] == [5]
        assert len(codec._run_structs) <= codec._RUN_STRUCTS_MAX


@given(st.lists(st.integers(1, 0xFFFF), max_size=300))
@settings(max_examples=100, deadline=None)
def test_puback_run_is_the_pubacks_of_the_ids_back_to_back(ids: list[int]) -> None:
    """The broker's PUBACKs for a stored run of PUBLISHes (runcodec.puback_run): exactly what
    encode(Puback(id)) gives for each id, joined, for any ids (ones with a zero byte too)."""
    assert puback_run(ids) == b"".join(encode(Puback(i)) for i in ids)
