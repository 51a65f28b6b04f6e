"""MQTT 5.0 codec (OASIS Standard, 7 March 2019): round trips of every packet type with
arbitrary valid properties, the protocol-level switch, and a table of malformed and
protocol-error cases, each citing the spec rule it holds."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.mqtt.codec import (
    Decoder,
    ProtocolError,
    encode,
    encode5,
    encoder,
)
from filemq.mqtt.packets import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Subscribe,
    Unsuback,
    subscription_options,
)
from tests.mqtt_strategies import (
    client_packets5,
    normalized,
    properties,
    publishes5,
    server_packets5,
)


def decode5(data: bytes, *, server: bool = True, max_packet_size: int = 1 << 20) -> list[Packet]:
    decoder = Decoder(max_packet_size, server=server, protocol_level=5)
    decoder.feed(data)
    out = decoder.packets()
    assert decoder.buffered == 0, "bytes left over after a whole stream"
    return out


# ---------------------------------------------------------------- round trips


@given(client_packets5)
@settings(max_examples=400)
def test_client_packets_round_trip(packet: Packet) -> None:
    assert decode5(encode5(packet), server=True) == [normalized(packet)]


@given(server_packets5)
@settings(max_examples=400)
def test_server_packets_round_trip(packet: Packet) -> None:
    assert decode5(encode5(packet), server=False) == [normalized(packet)]


@given(st.lists(client_packets5, min_size=1, max_size=6), st.data())
@settings(max_examples=100)
def test_any_split_of_a_v5_stream_decodes_identically(packets: list[Packet], data: st.DataObject) -> None:
    stream = b"".join(encode5(p) for p in packets)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    decoder = Decoder(protocol_level=5)
    got: list[Packet] = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        decoder.feed(stream[prev:cut])
        prev = cut
        got.extend(decoder.packets())
    assert got == [normalized(p) for p in packets]


def test_user_property_order_and_repeats_are_kept() -> None:
    # Spec 3.3.2.3.7: user properties may repeat, names too, and their order is kept
    # (MQTT-3.3.2-18 for forwarding).
    pairs = [("b", "1"), ("a", "2"), ("b", "0"), ("", "")]
    packet = Publish("t", b"x", 1, packet_id=7, properties=Properties(user_properties=pairs))
    [got] = decode5(encode5(packet))
    assert isinstance(got, Publish) and got.properties is not None
    assert got.properties.user_properties == pairs


# ---------------------------------------------------------------- wire form, short forms


def test_known_v5_bytes_match_the_spec() -> None:
    # Hand-assembled from the spec's layout, not from our encoder.
    assert encode5(Connect(client_id="c", keepalive=60, protocol_level=5)) == (
        b"\x10\x0e\x00\x04MQTT\x05\x02\x00\x3c\x00\x00\x01c"
    )
    props = Properties(message_expiry_interval=10, user_properties=[("k", "v")])
    assert encode5(Publish("a", b"hi", 1, packet_id=1, properties=props)) == (
        b"\x32\x14\x00\x01a\x00\x01\x0c\x02\x00\x00\x00\x0a\x26\x00\x01k\x00\x01vhi"
    )
    assert encode5(Subscribe(2, [("x", subscription_options(1, True, True, 2))])) == (
        b"\x82\x07\x00\x02\x00\x00\x01x\x2d"
    )
    assert encode5(Connack(False, 0x00, Properties(receive_maximum=10))) == b"\x20\x06\x00\x00\x03\x21\x00\x0a"
    assert encode5(Unsuback(3, [0x00, 0x11])) == b"\xb0\x05\x00\x03\x00\x00\x11"
    assert encode5(Auth(0x18, Properties(authentication_method="m"))) == b"\xf0\x06\x18\x04\x15\x00\x01m"


@pytest.mark.parametrize(
    ("packet", "wire"),
    [
        # Spec 3.4.2.1: reason code and property length omitted for 0x00 without properties.
        (Puback(5), b"\x40\x02\x00\x05"),
        # Spec 3.4.2.2.1: property length omitted when there are none.
        (Puback(5, 0x10), b"\x40\x03\x00\x05\x10"),
        (Pubrec(5, 0x97), b"\x50\x03\x00\x05\x97"),
        (Pubrel(5, 0x92), b"\x62\x03\x00\x05\x92"),
        (Pubcomp(5, 0, Properties(reason_string="r")), b"\x70\x08\x00\x05\x00\x04\x1f\x00\x01r"),
        # Spec 3.14.2.1: DISCONNECT 0x00 without properties has remaining length 0.
        (Disconnect(), b"\xe0\x00"),
        (Disconnect(0x8E), b"\xe0\x01\x8e"),
        # Spec 3.15.2.1: so has AUTH 0x00 without properties.
        (Auth(), b"\xf0\x00"),
    ],
)
def test_short_forms(packet: Packet, wire: bytes) -> None:
    assert encode5(packet) == wire
    assert decode5(wire, server=False) == [packet]
    if getattr(packet, "properties", None) is None:  # an empty Properties() is the same wire as none
        # (properties is a field of only some packet types, the union's replace() takes none)
        assert encode5(dataclasses.replace(packet, properties=Properties())) == wire  # type: ignore[arg-type]


def test_connack_of_a_311_server_reads_on_a_v5_client() -> None:
    # Spec 3.1.4: a server without level 5 may answer with its own level's CONNACK 0x01; a v5
    # client must be able to read that (filemq's broker does exactly this until it speaks 5).
    assert decode5(b"\x20\x02\x00\x01", server=False) == [Connack(False, 0x01)]


# ---------------------------------------------------------------- the protocol-level switch


def test_server_decoder_switches_on_a_level_5_connect_before_pipelined_packets() -> None:
    connect = Connect(client_id="c", protocol_level=5, properties=Properties(receive_maximum=5))
    publish = Publish("t", b"x", 1, packet_id=1, properties=Properties(content_type="text/plain"))
    stream = encode5(connect) + encode5(publish) + encode5(Disconnect(0x04))
    decoder = Decoder()
    assert decoder.protocol_level == 4
    decoder.feed(stream)
    assert decoder.packets() == [connect, publish, Disconnect(0x04)]
    assert decoder.protocol_level == 5
    # The same one packet at a time.
    decoder = Decoder()
    decoder.feed(stream)
    assert [decoder.next_packet(), decoder.next_packet(), decoder.next_packet(), decoder.next_packet()] == [
        connect, publish, Disconnect(0x04), None
    ]


def test_311_connect_keeps_the_311_decoder() -> None:
    decoder = Decoder()
    decoder.feed(encode(Connect(client_id="c")) + encode(Publish("t", b"x", 1, packet_id=1)))
    assert decoder.packets() == [Connect(client_id="c"), Publish("t", b"x", 1, packet_id=1)]
    assert decoder.protocol_level == 4


def test_a_level_5_connect_decodes_for_the_broker_to_refuse() -> None:
    # Until the broker speaks MQTT 5 it answers CONNACK 0x01 (docs/MQTT5.md); the codec must
    # hand it the level-5 CONNECT, properties and all, rather than misread it.
    connect = Connect(client_id="dev", protocol_level=5, properties=Properties(session_expiry_interval=60))
    decoder = Decoder()
    decoder.feed(encode(connect))
    assert decoder.packets() == [connect]


def test_client_decoder_is_told_the_level() -> None:
    decoder = Decoder(server=False)
    decoder.protocol_level = 5
    decoder.feed(encode5(Disconnect(0x8B, Properties(reason_string="bye"))))
    assert decoder.packets() == [Disconnect(0x8B, Properties(reason_string="bye"))]
    with pytest.raises(ValueError, match="protocol level must be 3, 4 or 5"):
        decoder.protocol_level = 6


def test_311_rejects_what_only_5_has() -> None:
    decoder = Decoder()
    decoder.feed(b"\xf0\x00")
    with pytest.raises(ProtocolError, match="reserved packet type 15"):
        decoder.packets()
    client = Decoder(server=False)
    client.feed(b"\xe0\x00")
    with pytest.raises(ProtocolError, match="DISCONNECT is not a packet a client may receive") as info:
        client.packets()
    assert info.value.reason_code == 0x82


def test_encoder_refuses_what_311_cannot_say() -> None:
    # A refusal must never go out as a success (issue 13 item 6): no silent drop of a reason code.
    with pytest.raises(ValueError, match="needs MQTT 5"):
        encode(Puback(1, 0x97))
    with pytest.raises(ValueError, match="needs MQTT 5"):
        encode(Disconnect(0x8E))
    with pytest.raises(ValueError, match="need MQTT 5"):
        encode(Unsuback(1, [0x87]))
    with pytest.raises(ValueError, match="AUTH cannot be encoded at protocol level 3 or 4"):
        encode(Auth())
    with pytest.raises(ValueError, match="need protocol_level 5"):
        encode(Connect(properties=Properties()))
    # Properties are simply not on the 3.1.1 wire.
    assert encode(Publish("t", b"", 0, properties=Properties(content_type="x"))) == encode(Publish("t", b"", 0))
    # The ack encoder's combined hot-path check still refuses every bad packet id.
    for pid in (0, -1, 0x10000):
        with pytest.raises(ValueError, match="packet id must be 1..65535"):
            encode(Pubrec(pid))
    assert encoder(4) is encode and encoder(3) is encode and encoder(5) is encode5


@pytest.mark.parametrize(
    ("packet", "fragment"),
    [
        (Publish("t", properties=Properties(session_expiry_interval=1)), "PUBLISH may not carry the session expiry"),
        (Puback(1, 0x01), "PUBACK reason code 1 is not one"),
        (Connack(True, 0x80), "must not set session present"),
        (Publish("", b""), "empty topic needs a topic alias"),
        (Publish("t", properties=Properties(payload_format_indicator=2)), "payload format indicator must be 0..1"),
        (Publish("t", properties=Properties(topic_alias=0)), "topic alias must be 1..65535"),
        (Subscribe(1, [("t", 0x03)]), "QoS 3 or retain handling 3"),
        (Subscribe(1, [("t", 0x40)]), "reserved bits"),
        (Subscribe(1, [("t", 0)], Properties(subscription_identifiers=[1, 2])), "at most one subscription id"),
        (Unsuback(1, []), "one reason code per topic filter"),
    ],
)
def test_v5_encoder_refuses_invalid_packets(packet: Packet, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        encode5(packet)


# ---------------------------------------------------------------- malformed and protocol errors


def pkt(first: int, body: bytes) -> bytes:
    """A packet with a one-byte remaining length, assembled by hand."""
    assert len(body) < 128
    return bytes((first, len(body))) + body


def props(raw: bytes) -> bytes:
    """A property section: one-byte property length + ``raw``."""
    return bytes((len(raw),)) + raw


def connect5(properties_raw: bytes = b"", will_raw: bytes | None = None) -> bytes:
    flags = 0x02 | (0x04 if will_raw is not None else 0)
    body = b"\x00\x04MQTT\x05" + bytes((flags,)) + b"\x00\x3c" + props(properties_raw) + b"\x00\x01c"
    if will_raw is not None:
        body += props(will_raw) + b"\x00\x01w\x00\x00"
    return pkt(0x10, body)


def publish5(properties_raw: bytes, topic: bytes = b"t") -> bytes:
    return pkt(0x32, len(topic).to_bytes(2, "big") + topic + b"\x00\x01" + props(properties_raw) + b"payload")


MALFORMED = 0x81
PROTOCOL = 0x82

# (rule, wire, reason code, message fragment), to a server-side decoder at level 5.
SERVER_CASES = [
    ("2.2.2.2 identifier not valid for PUBLISH: Malformed",
     publish5(b"\x11\x00\x00\x00\x01"), MALFORMED, "PUBLISH may not carry the session expiry interval"),
    ("2.2.2.2 reason string not valid for PUBLISH: Malformed",
     publish5(b"\x1f\x00\x01r"), MALFORMED, "may not carry the reason string"),
    ("2.2.2.2 unknown identifier: Malformed", publish5(b"\x05\x00"), MALFORMED, "unknown property identifier 0x05"),
    ("2.2.2.2 identifier not valid for will properties: Malformed",
     connect5(will_raw=b"\x23\x00\x01"), MALFORMED, "will properties may not carry the topic alias"),
    ("2.2.2.2 CONNACK-only property on CONNECT: Malformed",
     connect5(b"\x24\x01"), MALFORMED, "CONNECT may not carry the maximum qos"),
    ("3.3.2.3.3 message expiry interval twice: Protocol Error",
     publish5(b"\x02\x00\x00\x00\x01\x02\x00\x00\x00\x02"), PROTOCOL, "repeats the message expiry interval"),
    ("3.1.3.2.2 will delay interval twice: Protocol Error",
     connect5(will_raw=b"\x18\x00\x00\x00\x01\x18\x00\x00\x00\x01"), PROTOCOL, "repeats the will delay interval"),
    ("3.1.2.11.2 session expiry interval twice: Protocol Error",
     connect5(b"\x11\x00\x00\x00\x01\x11\x00\x00\x00\x01"), PROTOCOL, "repeats the session expiry interval"),
    ("3.3.2.3.2 payload format indicator 2 (only 0 and 1 are defined)",
     publish5(b"\x01\x02"), PROTOCOL, "payload format indicator is 2"),
    ("3.1.2.11.3 receive maximum 0: Protocol Error", connect5(b"\x21\x00\x00"), PROTOCOL, "receive maximum of 0"),
    ("3.1.2.11.4 maximum packet size 0: Protocol Error",
     connect5(b"\x27\x00\x00\x00\x00"), PROTOCOL, "maximum packet size of 0"),
    ("3.1.2.11.7 request problem information 2: Protocol Error",
     connect5(b"\x17\x02"), PROTOCOL, "request problem information is 2"),
    ("3.1.2.11.6 request response information 2: Protocol Error",
     connect5(b"\x19\x02"), PROTOCOL, "request response information is 2"),
    ("3.1.2.11.10 authentication data without method: Protocol Error",
     connect5(b"\x16\x00\x01x"), PROTOCOL, "authentication data without an authentication method"),
    ("3.8.2.1.2 subscription identifier 0: Protocol Error",
     pkt(0x82, b"\x00\x01" + props(b"\x0b\x00") + b"\x00\x01t\x00"), PROTOCOL, "subscription identifier 0"),
    ("3.8.2.1.2 subscription identifier twice on SUBSCRIBE: Protocol Error",
     pkt(0x82, b"\x00\x01" + props(b"\x0b\x01\x0b\x02") + b"\x00\x01t\x00"), PROTOCOL,
     "repeats the subscription identifier"),
    ("MQTT-3.3.4-6 PUBLISH from a client with a subscription identifier",
     publish5(b"\x0b\x01"), PROTOCOL, "PUBLISH from a client carries a subscription identifier"),
    ("1.5.5 / 2.2.2.1 property length in 5 bytes: Malformed",
     pkt(0x32, b"\x00\x01t\x00\x01\xff\xff\xff\xff\x01"), MALFORMED, "variable byte integer exceeds 4 bytes"),
    ("1.5.5 subscription identifier in 5 bytes: Malformed",
     pkt(0x82, b"\x00\x01\x06\x0b\x80\x80\x80\x80\x01\x00\x01t\x00"), MALFORMED,
     "variable byte integer exceeds 4 bytes"),
    ("2.2.2.1 property length past the end of the packet: Malformed",
     pkt(0x32, b"\x00\x01t\x00\x01\x10\x01"), MALFORMED, "property length 16 runs past the end"),
    ("2.2.2.2 four-byte value cut by the property length: Malformed",
     publish5(b"\x02\x00\x00"), MALFORMED, "message expiry interval runs past the property length"),
    ("2.2.2.2 user property value cut short: Malformed",
     publish5(b"\x26\x00\x01k\x00\x05v"), MALFORMED, "user property value of 5 bytes runs past"),
    ("MQTT-1.5.4-1 ill-formed UTF-8 in a string property: Malformed",
     publish5(b"\x03\x00\x02\xc3\x28"), MALFORMED, "invalid UTF-8 in content type"),
    ("MQTT-1.5.4-2 U+0000 in a string property: Malformed",
     publish5(b"\x08\x00\x02a\x00"), MALFORMED, "U\\+0000 in response topic"),
    ("MQTT-3.3.2-8 topic alias 0: Topic Alias invalid",
     publish5(b"\x23\x00\x00"), 0x94, "topic alias 0"),
    ("3.3.2.1 empty topic name without a topic alias: Protocol Error",
     publish5(b"", topic=b""), PROTOCOL, "empty topic name and no topic alias"),
    ("MQTT-3.8.3-5 reserved subscription option bits: Malformed",
     pkt(0x82, b"\x00\x01\x00\x00\x01t\x40"), MALFORMED, "reserved option bits"),
    ("3.8.3.1 retain handling 3: Protocol Error",
     pkt(0x82, b"\x00\x01\x00\x00\x01t\x30"), PROTOCOL, "retain handling 3"),
    ("3.8.3.1 maximum QoS 3: Protocol Error", pkt(0x82, b"\x00\x01\x00\x00\x01t\x03"), PROTOCOL, "QoS 3 in SUBSCRIBE"),
    ("MQTT-3.8.3-4 no local on a shared subscription: Protocol Error",
     pkt(0x82, b"\x00\x01\x00\x00\x0a$share/g/t\x04"), PROTOCOL, "no local on shared subscription"),
    ("MQTT-3.8.3-2 SUBSCRIBE without a filter: Protocol Error",
     pkt(0x82, b"\x00\x01\x00"), PROTOCOL, "SUBSCRIBE with no topic filters"),
    ("MQTT-3.10.3-2 UNSUBSCRIBE without a filter: Protocol Error",
     pkt(0xA2, b"\x00\x01\x00"), PROTOCOL, "UNSUBSCRIBE with no topic filters"),
    ("2.2.2.2 subscription identifier on UNSUBSCRIBE: Malformed",
     pkt(0xA2, b"\x00\x01\x02\x0b\x01\x00\x01t"), MALFORMED, "UNSUBSCRIBE may not carry the subscription"),
    ("MQTT-3.4.2-1 PUBACK reason code not a PUBACK code: Protocol Error",
     pkt(0x40, b"\x00\x01\x05"), PROTOCOL, "PUBACK reason code 0x05"),
    ("MQTT-3.6.2-1 PUBREL reason code 0x10: Protocol Error",
     pkt(0x62, b"\x00\x01\x10"), PROTOCOL, "PUBREL reason code 0x10"),
    ("MQTT-3.14.2-1 DISCONNECT reason code 0x01: Protocol Error",
     pkt(0xE0, b"\x01"), PROTOCOL, "DISCONNECT reason code 0x01"),
    ("MQTT-3.15.2-1 AUTH reason code 0x01: Protocol Error", pkt(0xF0, b"\x01\x00"), PROTOCOL, "AUTH reason code 0x01"),
    ("3.15.2.2.3 AUTH authentication data without method: Protocol Error",
     pkt(0xF0, b"\x18" + props(b"\x16\x00\x00")), PROTOCOL, "authentication data without"),
    ("3.4.2.2 bytes after the PUBACK properties: Malformed",
     pkt(0x40, b"\x00\x01\x00\x00\xff"), MALFORMED, "1 unexpected bytes after the PUBACK properties"),
    ("2.1.3 AUTH with reserved flags set: Malformed", b"\xf1\x00", MALFORMED, "reserved flags 0b0001 on AUTH"),
    ("2.1.2 a client may not send CONNACK: Protocol Error",
     pkt(0x20, b"\x00\x00\x00"), PROTOCOL, "CONNACK is not a packet a server may receive"),
]

# The same, to a client-side decoder at level 5.
CLIENT_CASES = [
    ("3.2.2.3.4 maximum QoS 2: Protocol Error", pkt(0x20, b"\x00\x00" + props(b"\x24\x02")), PROTOCOL,
     "maximum qos is 2"),
    ("3.2.2.3.5 retain available 2: Protocol Error", pkt(0x20, b"\x00\x00" + props(b"\x25\x02")), PROTOCOL,
     "retain available is 2"),
    ("3.2.2.3.11 wildcard subscription available twice: Protocol Error",
     pkt(0x20, b"\x00\x00" + props(b"\x28\x01\x28\x01")), PROTOCOL, "repeats the wildcard subscription"),
    ("MQTT-3.2.2-6 session present with a non-zero reason code: Protocol Error",
     pkt(0x20, b"\x01\x80\x00"), PROTOCOL, "sets session present"),
    ("MQTT-3.2.2-8 a reason code CONNACK does not define: Protocol Error",
     pkt(0x20, b"\x00\x10\x00"), PROTOCOL, "CONNACK reason code 0x10"),
    ("2.2.2.2 topic alias on CONNACK: Malformed",
     pkt(0x20, b"\x00\x00" + props(b"\x23\x00\x01")), MALFORMED, "CONNACK may not carry the topic alias"),
    ("MQTT-3.14.2-2 server DISCONNECT with session expiry interval: Protocol Error",
     pkt(0xE0, b"\x00" + props(b"\x11\x00\x00\x00\x01")), PROTOCOL, "session expiry interval"),
    ("MQTT-3.9.3-2 SUBACK reason code 0x03: Protocol Error",
     pkt(0x90, b"\x00\x01\x00\x03"), PROTOCOL, "SUBACK reason code 0x03"),
    ("MQTT-3.11.3-2 UNSUBACK reason code 0x01: Protocol Error",
     pkt(0xB0, b"\x00\x01\x00\x01"), PROTOCOL, "UNSUBACK reason code 0x01"),
    ("3.11.3 UNSUBACK without reason codes: Protocol Error",
     pkt(0xB0, b"\x00\x01\x00"), PROTOCOL, "UNSUBACK with no reason codes"),
    ("2.2.2.2 correlation data on SUBACK: Malformed",
     pkt(0x90, b"\x00\x01" + props(b"\x09\x00\x00") + b"\x00"), MALFORMED, "SUBACK may not carry the correlation"),
]


@pytest.mark.parametrize(("rule", "wire", "code", "fragment"), SERVER_CASES, ids=[c[0] for c in SERVER_CASES])
def test_server_side_errors_carry_the_spec_reason_code(rule: str, wire: bytes, code: int, fragment: str) -> None:
    decoder = Decoder(protocol_level=5)
    with pytest.raises(ProtocolError, match=fragment) as info:
        decoder.feed(wire)
        decoder.packets()
    assert info.value.reason_code == code, rule
    # Poisoned like the 3.1.1 decoder: a byte stream cannot be resynchronised.
    with pytest.raises(ProtocolError):
        decoder.next_packet()


@pytest.mark.parametrize(("rule", "wire", "code", "fragment"), CLIENT_CASES, ids=[c[0] for c in CLIENT_CASES])
def test_client_side_errors_carry_the_spec_reason_code(rule: str, wire: bytes, code: int, fragment: str) -> None:
    decoder = Decoder(server=False, protocol_level=5)
    with pytest.raises(ProtocolError, match=fragment) as info:
        decoder.feed(wire)
        decoder.packets()
    assert info.value.reason_code == code, rule


def test_connect_errors_are_found_before_the_level_switch() -> None:
    # A level-5 CONNECT is decoded by its own level byte, so its property errors show on a
    # fresh (level 4) server decoder too, with their MQTT 5 reason code for the CONNACK.
    decoder = Decoder()
    decoder.feed(connect5(b"\x21\x00\x00"))
    with pytest.raises(ProtocolError, match="receive maximum of 0") as info:
        decoder.packets()
    assert info.value.reason_code == PROTOCOL


def test_packet_too_large_carries_0x95() -> None:
    # Spec 3.2.2.3.6 / 4.13: a packet over the maximum packet size is 0x95 Packet too large.
    decoder = Decoder(max_packet_size=100, protocol_level=5)
    with pytest.raises(ProtocolError, match="exceeds max_packet_size") as info:
        decoder.feed(encode5(Publish("t", b"x" * 200, 0)))
    assert info.value.reason_code == 0x95


def test_protocol_error_stays_compatible() -> None:
    # Existing callers build ProtocolError(reason[, packet_type]); the code defaults to 0x81.
    exc = ProtocolError("PUBLISH before CONNECT")
    assert (exc.reason, exc.packet_type, exc.reason_code, str(exc)) == (
        "PUBLISH before CONNECT", None, 0x81, "PUBLISH before CONNECT"
    )
    assert isinstance(exc, ValueError)
    assert ProtocolError("x", "CONNECT", reason_code=0x82).reason_code == 0x82


# ---------------------------------------------------------------- the level-5 PUBLISH fast path


@given(st.lists(publishes5(), min_size=2, max_size=20), st.data())
@settings(max_examples=150)
def test_v5_repeated_topic_stream_any_split(packets: list[Publish], data: st.DataObject) -> None:
    # One topic, properties on some packets only: the topic cache (used for packets without
    # properties) is hit from bytes and bytearray buffers, and mixed with the general path.
    for p in packets:
        p.topic = "sensors/dev-1/temp"
        if data.draw(st.booleans()):
            p.properties = None
    stream = b"".join(encode5(p) for p in packets)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    decoder = Decoder(protocol_level=5)
    got: list[Packet] = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        decoder.feed(stream[prev:cut])
        prev = cut
        got.extend(decoder.packets())
    assert got == [normalized(p) for p in packets]


@pytest.mark.parametrize(
    ("wire", "code", "fragment"),
    [
        (b"\x36\x06\x00\x01t\x00\x01\x00", MALFORMED, "QoS 3 in PUBLISH"),
        (b"\x32\x06\x00\x01t\x00\x00\x00", PROTOCOL, "PUBLISH QoS>0 with packet id 0"),  # MQTT-2.2.1-3
        (b"\x32\x05\x00\x01t\x00\x01", MALFORMED, "PUBLISH property length runs past the end"),
        (b"\x30\x04\x00\x01t\x03", MALFORMED, "property length 3 runs past the end"),
        (b"\x30\x06\x00\x01t\x02\x23\x00", MALFORMED, "topic alias runs past the property length"),
        (b"\x30\x07\x00\x01t\x03\x23\x00\x00", 0x94, "topic alias 0"),
        (b"\x30\x06\x00\x01t\x02\x0b\x01", PROTOCOL, "carries a subscription identifier"),
        (b"\x30\xc8\x01\x00\x01t\x00" + b"p" * 196, 0x95, "packet of 203 bytes exceeds max_packet_size 200"),
    ],
)
def test_v5_cached_topic_does_not_skip_checks(wire: bytes, code: int, fragment: str) -> None:
    decoder = Decoder(max_packet_size=200, protocol_level=5)
    decoder.feed(encode5(Publish("t", b"ok", 1, packet_id=1)))
    assert decoder.packets() == [Publish("t", b"ok", 1, packet_id=1)]
    with pytest.raises(ProtocolError, match=fragment) as info:
        decoder.feed(wire)
        decoder.packets()
    assert info.value.reason_code == code


@given(properties("PUBLISH", subscription_ids=3) | properties("WILL"))
def test_message_headers_fast_encoder_equals_the_generic_encoder(props: Properties) -> None:
    """A record's headers (encode_message_headers, built directly for speed) are byte for byte
    the generic property encoder's section of the message properties, in identifier order,
    and decode back to exactly those properties (topic alias, subscription identifiers and
    will delay are not message properties and are left out)."""
    from filemq.mqtt.properties import (
        _encode_message_headers_generic,
        decode_message_headers,
        encode_message_headers,
    )

    headers = encode_message_headers(props)
    assert headers == _encode_message_headers_generic(props)
    back = decode_message_headers(headers)
    if not headers:
        assert back is None
        return
    assert back is not None
    for attr in ("payload_format_indicator", "message_expiry_interval", "content_type", "response_topic",
                 "correlation_data", "user_properties"):
        assert getattr(back, attr) == getattr(props, attr)
    assert back.topic_alias is None and back.subscription_identifiers == [] and back.will_delay_interval is None
