"""Fuzzing the MQTT 5.0 decoder, properties above all: any bytes after a valid fixed header give
packets or a ProtocolError carrying a reason code the spec allows for closing, never anything
else; whatever decodes is a valid packet (it encodes again, to the same packet)."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from filemq.mqtt.codec import (
    ALLOWED_PROPERTIES,
    PROPERTY_TYPES,
    Decoder,
    ProtocolError,
    encode5,
    encoder,
)
from filemq.mqtt.packets import Connack, Connect, Packet
from tests.mqtt_strategies import client_packets5, server_packets5

# 0x81 Malformed Packet, 0x82 Protocol Error, 0x94 Topic Alias invalid, 0x95 Packet too large.
CLOSING_CODES = {0x81, 0x82, 0x94, 0x95}


def drive5(chunks: list[bytes], *, server: bool = True, level: int = 5, max_packet_size: int = 1 << 16) -> list[Packet]:
    """Feed chunks and drain; the packets, or the ones before a ProtocolError (any other
    exception fails the test)."""
    decoder = Decoder(max_packet_size, server=server, protocol_level=level)
    out: list[Packet] = []
    try:
        for chunk in chunks:
            decoder.feed(chunk)
            out.extend(decoder.packets())
            assert decoder.buffered <= max_packet_size
    except ProtocolError as exc:
        assert str(exc), "a ProtocolError must carry a reason"
        assert exc.reason_code in CLOSING_CODES, exc
        event(f"ProtocolError 0x{exc.reason_code:02x}")
    event(f"{len(out) and 'some' or 'no'} packets decoded")
    return out


def _recheck(packets: list[Packet], server: bool) -> None:
    # The decoder never yields an invalid object: it encodes, and decodes back equal.
    for packet in packets:
        # (A 3.1.1 server's CONNACK refusal is read as such by a v5 client: it has no properties.)
        wire = encoder(4 if isinstance(packet, Connack) and 1 <= packet.return_code <= 5 else 5)(packet)
        decoder = Decoder(1 << 20, server=server, protocol_level=5)
        decoder.feed(wire)
        assert decoder.packets() == [packet]


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(2, "big") + data


@st.composite
def _one_property(draw: st.DrawFn, kind: str) -> bytes:
    """A property, well typed three times in four (so values, repeats and allowed sets get checked),
    otherwise an identifier (mostly one ``kind`` allows, real or not) followed by noise."""
    ident = draw(st.sampled_from(sorted(ALLOWED_PROPERTIES[kind])) | st.sampled_from(sorted(PROPERTY_TYPES))
                 | st.integers(0, 255))
    if ident not in PROPERTY_TYPES or not draw(st.integers(0, 3)):
        return bytes((ident,)) + draw(st.binary(max_size=8))
    ptype = PROPERTY_TYPES[ident][1]
    text = st.text(max_size=6).map(lambda t: t.encode("utf-8", "surrogatepass")) | st.binary(max_size=6)
    value: bytes
    if ptype <= 2:  # byte, two-byte, four-byte integer; small values are the interesting ones
        size = (1, 2, 4)[ptype]
        value = draw(st.integers(0, 3) | st.integers(0, 256**size - 1)).to_bytes(size, "big")
    elif ptype == 3:  # variable byte integer, including over-long ones
        value = draw(st.integers(0, 2**28 - 1).map(_vbi) | st.binary(min_size=1, max_size=5))
    elif ptype == 6:  # string pair
        value = _lp(draw(text)) + _lp(draw(text))
    else:  # UTF-8 string or binary data
        value = _lp(draw(text))
    return bytes((ident,)) + value


def _property_bytes(kind: str) -> st.SearchStrategy[bytes]:
    return st.lists(_one_property(kind), max_size=6).map(b"".join)


def _vbi(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# The bytes before the property section of each v5 packet with properties (client to server).
_SERVER_PREFIXES = [
    (0x10, b"\x00\x04MQTT\x05\x02\x00\x3c", "CONNECT"),
    (0x30, b"\x00\x01t", "PUBLISH"),  # QoS 0
    (0x32, b"\x00\x01t\x00\x01", "PUBLISH"),  # QoS 1
    (0x40, b"\x00\x01\x00", "PUBACK"),
    (0x50, b"\x00\x01\x10", "PUBREC"),
    (0x62, b"\x00\x01\x00", "PUBREL"),
    (0x70, b"\x00\x01\x92", "PUBCOMP"),
    (0x82, b"\x00\x01", "SUBSCRIBE"),
    (0xA2, b"\x00\x01", "UNSUBSCRIBE"),
    (0xE0, b"\x00", "DISCONNECT"),
    (0xF0, b"\x18", "AUTH"),
]
_CLIENT_PREFIXES = [
    (0x20, b"\x00\x00", "CONNACK"),
    (0x90, b"\x00\x01", "SUBACK"),
    (0xB0, b"\x00\x01", "UNSUBACK"),
    (0xE0, b"\x8e", "DISCONNECT"),  # from the server
    (0x30, b"\x00\x01t", "PUBLISH"),  # to a client
]


@given(st.sampled_from(_SERVER_PREFIXES + _CLIENT_PREFIXES), st.data(), st.binary(max_size=20),
       st.integers(-3, 3), st.booleans())
@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_random_properties_after_a_valid_header(prefix: tuple[int, bytes, str], data: st.DataObject,
                                                 tail: bytes, skew: int, will: bool) -> None:
    first, head, kind = prefix
    server = prefix in _SERVER_PREFIXES
    if first == 0x10 and will:
        kind = "WILL"
    raw = data.draw(_property_bytes(kind))
    # Mostly the right property length and a valid rest of the packet, so decoding gets past
    # the framing to the property rules; sometimes not.
    good_tail = {"WILL": b"\x00\x01w\x00\x00", "CONNECT": b"\x00\x01c", "SUBSCRIBE": b"\x00\x01t\x00",
                 "UNSUBSCRIBE": b"\x00\x01t", "SUBACK": b"\x00", "UNSUBACK": b"\x00"}.get(kind, b"")
    if data.draw(st.integers(0, 3)):
        tail, skew = (good_tail + tail if kind == "PUBLISH" else good_tail), 0
    # The property length is right or a little off; the tail is anything (payload, filters...).
    section = _vbi(max(0, len(raw) + skew)) + raw
    if first == 0x10 and will:
        head = head[:7] + b"\x06" + head[8:]  # CONNECT with a will: fuzz the will properties
        body = head + b"\x00\x00\x01c" + section + tail
    else:
        body = head + section + tail
    wire = bytes((first,)) + _vbi(len(body)) + body
    got = drive5([wire], server=server)
    _recheck(got, server)


@given(st.sampled_from([0x10, 0x20, 0x30, 0x32, 0x34, 0x40, 0x50, 0x62, 0x70, 0x82, 0x90, 0xA2, 0xB0, 0xE0, 0xF0]),
       st.binary(max_size=120), st.booleans())
@settings(max_examples=1000)
def test_random_body_after_a_valid_fixed_header(first: int, body: bytes, server: bool) -> None:
    got = drive5([bytes((first,)) + _vbi(len(body)) + body], server=server)
    _recheck(got, server)


@given(st.lists(st.binary(max_size=200), max_size=10), st.booleans())
@settings(max_examples=400)
def test_random_bytes_at_level_5(chunks: list[bytes], server: bool) -> None:
    drive5(chunks, server=server)


@given(st.booleans(), st.data())
@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_valid_v5_streams(server: bool, data: st.DataObject) -> None:
    packets = data.draw(st.lists(client_packets5 if server else server_packets5, min_size=1, max_size=4))
    stream = bytearray(b"".join(encode5(p) for p in packets))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "delete", "insert", "truncate"]))
        if not stream:
            break
        at = data.draw(st.integers(0, len(stream) - 1))
        if kind == "flip":
            stream[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set":
            stream[at] = data.draw(st.integers(0, 255))
        elif kind == "delete":
            del stream[at]
        elif kind == "insert":
            stream[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        else:
            del stream[at:]
    cut = data.draw(st.integers(0, len(stream)))
    got = drive5([bytes(stream[:cut]), bytes(stream[cut:])], server=server, max_packet_size=1 << 20)
    _recheck(got, server)


@given(st.lists(client_packets5, min_size=1, max_size=3), st.binary(max_size=60))
@settings(max_examples=300)
def test_v5_connect_then_garbage_on_a_fresh_server_decoder(packets: list[Packet], garbage: bytes) -> None:
    # The level switch itself under fuzz: a level-5 CONNECT, then valid packets, then noise.
    stream = encode5(Connect(client_id="f", protocol_level=5)) + b"".join(encode5(p) for p in packets)
    drive5([stream + garbage], level=4)
