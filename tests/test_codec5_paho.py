"""paho-mqtt 2.x as an independent MQTT 5.0 oracle for the codec.

Bytes paho's client builds (CONNECT, PUBLISH, SUBSCRIBE, UNSUBSCRIBE, DISCONNECT with
properties) decode with our server-side Decoder to the packet paho was asked to send; bytes we
encode for a client (CONNACK, PUBLISH, PUBACK ... PUBCOMP, SUBACK, UNSUBACK, DISCONNECT) decode
with paho's own packet decoders (``paho.mqtt._packet``) to the same fields; and properties
round-trip both ways through paho's ``Properties.pack``/``unpack``, user property order kept.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from filemq.mqtt.codec import (
    ALLOWED_PROPERTIES,
    PROPERTY_TYPES,
    Decoder,
    encode5,
)
from filemq.mqtt.packets import (
    SUB_NO_LOCAL,
    SUB_RETAIN_AS_PUBLISHED,
    SUB_RETAIN_HANDLING_SHIFT,
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
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)
from filemq.mqtt.properties import _decode_properties, _encode_properties
from tests.mqtt_strategies import normalized, properties, publishes5, server_packets5, subscribes5

paho_client = pytest.importorskip("paho.mqtt.client")
from paho.mqtt import _packet as paho_packet  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties as PahoProperties  # noqa: E402
from paho.mqtt.reasoncodes import ReasonCode  # noqa: E402
from paho.mqtt.subscribeoptions import SubscribeOptions  # noqa: E402

V5 = MQTTProtocolVersion.MQTTv5
PAHO_PACKET_TYPES = {
    "CONNECT": PacketTypes.CONNECT,
    "WILL": PacketTypes.WILLMESSAGE,
    "CONNACK": PacketTypes.CONNACK,
    "PUBLISH": PacketTypes.PUBLISH,
    "PUBACK": PacketTypes.PUBACK,
    "PUBREC": PacketTypes.PUBREC,
    "PUBREL": PacketTypes.PUBREL,
    "PUBCOMP": PacketTypes.PUBCOMP,
    "SUBSCRIBE": PacketTypes.SUBSCRIBE,
    "SUBACK": PacketTypes.SUBACK,
    "UNSUBSCRIBE": PacketTypes.UNSUBSCRIBE,
    "UNSUBACK": PacketTypes.UNSUBACK,
    "DISCONNECT": PacketTypes.DISCONNECT,
    "AUTH": PacketTypes.AUTH,
}
# identifier -> paho attribute name ("Payload Format Indicator" -> "PayloadFormatIndicator").
PAHO_NAMES = {ident: name.replace(" ", "") for name, ident in PahoProperties(PacketTypes.PUBLISH).names.items()}
# paho caps maximum packet size at the variable byte integer maximum; the spec's type is a
# four-byte integer (3.1.2.11.4), so our wider values are kept out of paho's way.
PAHO_MAX_PACKET_SIZE = 268_435_455


def test_paho_knows_the_same_property_table() -> None:
    # Same identifiers, and the same packets allowed for each (spec 2.2.2.2 table 2-4).
    assert set(PAHO_NAMES) == set(PROPERTY_TYPES)
    table = PahoProperties(PacketTypes.PUBLISH).properties
    for kind, allowed in ALLOWED_PROPERTIES.items():
        paho_allowed = {ident for ident, (_t, packets) in table.items() if PAHO_PACKET_TYPES[kind] in packets}
        assert paho_allowed == allowed, kind


def paho_compatible(props: Properties) -> Properties:
    if props.maximum_packet_size is not None:
        props.maximum_packet_size = min(props.maximum_packet_size, PAHO_MAX_PACKET_SIZE)
    return props


def to_paho(props: Properties | None, kind: str) -> PahoProperties:
    out = PahoProperties(PAHO_PACKET_TYPES[kind])
    for ident, (attr, _ptype) in PROPERTY_TYPES.items():
        value = getattr(props, attr) if props is not None else None
        if isinstance(value, list):
            if value:
                setattr(out, PAHO_NAMES[ident], list(value))
        elif value is not None:
            setattr(out, PAHO_NAMES[ident], value)
    return out


def from_paho(paho_props: PahoProperties | None) -> Properties:
    out = Properties()
    for ident, (attr, _ptype) in PROPERTY_TYPES.items():
        name = PAHO_NAMES[ident]
        if paho_props is not None and hasattr(paho_props, name):
            value = getattr(paho_props, name)
            setattr(out, attr, [tuple(v) for v in value] if ident == 0x26 else list(value) if ident == 0x0B else value)
    return out


kinds = st.sampled_from(sorted(ALLOWED_PROPERTIES))


@given(st.data())
@settings(max_examples=300)
def test_properties_round_trip_through_paho(data: st.DataObject) -> None:
    kind = data.draw(kinds)
    props = paho_compatible(data.draw(properties(kind, subscription_ids=3 if kind == "PUBLISH" else 1)))
    name = "CONNECT" if kind == "WILL" else kind
    # Ours -> paho.
    ours = _encode_properties(props, kind)
    parsed, used = PahoProperties(PAHO_PACKET_TYPES[kind]).unpack(ours)
    assert used == len(ours)
    assert from_paho(parsed) == props
    # paho -> ours.
    theirs = to_paho(props, kind).pack()
    decoded, end = _decode_properties(theirs, 0, len(theirs), name, kind)
    assert end == len(theirs)
    assert (decoded or Properties()) == props


# ---------------------------------------------------------------- paho builds, we decode


def paho_v5_client() -> tuple[Any, list[bytes]]:
    """A paho client whose outgoing packets are captured instead of sent."""
    client = paho_client.Client(CallbackAPIVersion.VERSION2, client_id="paho-5", protocol=V5)
    sent: list[bytes] = []

    def capture(command: int, packet: bytes | bytearray, mid: int, qos: int, info: object = None) -> int:
        sent.append(bytes(packet))
        return 0

    client._packet_queue = capture
    client._sock = _NoSocket()  # _send_publish refuses without a socket; nothing is written to it
    return client, sent


class _NoSocket:
    def close(self) -> None:
        pass


def server_decode(wire: bytes) -> list[Packet]:
    decoder = Decoder(protocol_level=5)
    decoder.feed(wire)
    got = decoder.packets()
    assert decoder.buffered == 0
    return got


def test_paho_connect_with_properties_and_will_properties() -> None:
    client, sent = paho_v5_client()
    connect_props = Properties(
        session_expiry_interval=3600, receive_maximum=20, maximum_packet_size=65536, topic_alias_maximum=10,
        request_response_information=1, request_problem_information=0,
        authentication_method="SCRAM-SHA-1", authentication_data=b"\x01\x02",
        user_properties=[("site", "a"), ("site", "b"), ("rack", "7")],
    )
    will_props = Properties(
        will_delay_interval=30, payload_format_indicator=1, message_expiry_interval=600, content_type="text/plain",
        response_topic="r/t", correlation_data=b"\x00\xff", user_properties=[("k", "v")],
    )
    client.will_set("dev/1/status", b"gone", qos=1, retain=True, properties=to_paho(will_props, "WILL"))
    client.username_pw_set("user", "pass")
    client._connect_properties = to_paho(connect_props, "CONNECT")
    client._clean_start = True
    client._send_connect(45)
    decoder = Decoder()  # a fresh server decoder: it reads the level from the CONNECT itself
    decoder.feed(sent[0])
    assert decoder.packets() == [Connect(
        client_id="paho-5", clean_session=True, keepalive=45, will_topic="dev/1/status", will_payload=b"gone",
        will_qos=1, will_retain=True, username="user", password=b"pass", protocol_level=5,
        properties=connect_props, will_properties=will_props,
    )]
    assert decoder.protocol_level == 5


@given(publishes5())
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_paho_publish_decodes(packet: Publish) -> None:
    client, sent = paho_v5_client()
    assert packet.properties is not None
    client._send_publish(packet.packet_id or 0, packet.topic.encode(), packet.payload, packet.qos, packet.retain,
                         packet.dup, None, to_paho(packet.properties, "PUBLISH"))
    assert server_decode(sent[0]) == [normalized(packet)]


@given(subscribes5())
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_paho_subscribe_decodes(packet: Subscribe) -> None:
    client, sent = paho_v5_client()
    topics = [
        (f.encode(), SubscribeOptions(o & 3, bool(o & SUB_NO_LOCAL), bool(o & SUB_RETAIN_AS_PUBLISHED),
                                      o >> SUB_RETAIN_HANDLING_SHIFT))
        for f, o in packet.topics
    ]
    client._send_subscribe(0, topics, to_paho(packet.properties, "SUBSCRIBE"))
    [got] = server_decode(sent[0])
    assert isinstance(got, Subscribe)
    packet.packet_id = got.packet_id  # paho numbers its own packets
    assert got == normalized(packet)


def test_paho_unsubscribe_and_disconnect_decode() -> None:
    client, sent = paho_v5_client()
    client._send_unsubscribe(0, [b"a/#", b"$share/g/b"], to_paho(Properties(user_properties=[("x", "y")]), "UNSUBSCRIBE"))
    client._send_disconnect(ReasonCode(PacketTypes.DISCONNECT, identifier=0x04),
                            to_paho(Properties(session_expiry_interval=0, reason_string="bye"), "DISCONNECT"))
    got = server_decode(b"".join(sent))
    assert isinstance(got[0], Unsubscribe)
    assert got == [
        Unsubscribe(got[0].packet_id, ["a/#", "$share/g/b"], Properties(user_properties=[("x", "y")])),
        Disconnect(0x04, Properties(session_expiry_interval=0, reason_string="bye")),
    ]


# ---------------------------------------------------------------- we build, paho decodes


def split(wire: bytes) -> tuple[int, bytes]:
    """(first byte, body) of one packet."""
    i, length, shift = 1, 0, 0
    while True:
        byte = wire[i]
        length |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            break
        shift += 7
    assert len(wire) == i + length
    return wire[0], wire[i:]


def _paho_view(packet: Packet) -> Packet | None:
    """Our packet made paho-compatible, or None for packets paho has no decoder for."""
    if packet.__class__.__name__ in ("Auth", "Pingresp"):
        return None
    if isinstance(packet, Connack) and packet.return_code == 0x99:
        return None  # in spec 3.2.2.2's CONNACK table, missing from paho's (and from spec 2.4)
    props = getattr(packet, "properties", None)
    if props is not None:
        paho_compatible(props)
    return packet


@given(server_packets5)
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_paho_decodes_what_we_send_to_clients(original: Packet) -> None:
    packet = _paho_view(original)
    if packet is None:
        return
    first, body = split(encode5(packet))
    if isinstance(packet, Connack):
        got = paho_packet.decode_connack(first, body, V5)
        assert (got.flags, got.reason.value, from_paho(got.properties)) == (
            int(packet.session_present), packet.return_code, packet.properties or Properties())
    elif isinstance(packet, Publish):
        pub = paho_packet.decode_publish(first, body, V5)
        assert (pub.topic.decode(), pub.payload, pub.qos, pub.retain, pub.dup, pub.mid or None) == (
            packet.topic, packet.payload, packet.qos, packet.retain, packet.dup, packet.packet_id)
        assert from_paho(pub.properties) == (packet.properties or Properties())
    elif isinstance(packet, Puback | Pubrec | Pubrel | Pubcomp):
        decode = getattr(paho_packet, f"decode_{type(packet).__name__.lower()}")
        ack = decode(first, body, V5)
        assert (ack.mid, ack.reason.value, from_paho(ack.properties)) == (
            packet.packet_id, packet.reason_code, packet.properties or Properties())
    elif isinstance(packet, Suback):
        sub = paho_packet.decode_suback(first, body, V5)
        assert (sub.mid, [c.value for c in sub.reason_codes], from_paho(sub.properties)) == (
            packet.packet_id, packet.return_codes, packet.properties or Properties())
    elif isinstance(packet, Unsuback):
        uns = paho_packet.decode_unsuback(first, body, V5)
        assert (uns.mid, [c.value for c in uns.reason_codes], from_paho(uns.properties)) == (
            packet.packet_id, packet.reason_codes, packet.properties or Properties())
    else:
        assert isinstance(packet, Disconnect)
        dis = paho_packet.decode_disconnect(first, body, V5)
        assert (dis.reason.value if dis.reason else 0, from_paho(dis.properties)) == (
            packet.reason_code, packet.properties or Properties())
