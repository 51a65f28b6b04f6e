"""MQTT 3.1.1 and 5.0 wire codec without I/O: packets in, bytes out (:func:`encode`); bytes in,
packets out (:class:`Decoder`).

Modelled on h11: the asyncio server and client only move bytes and call these.  Every
malformed input raises :class:`ProtocolError` with a reason a person can act on and the MQTT 5
reason code (0x81 Malformed Packet, 0x82 Protocol Error, ...) to close with; the caller
closes that one connection (architecture guarantee 6).

The protocol level is per connection: ``encode`` (3.1.1) or ``encode5`` (``encoder(level)``
picks one) and ``Decoder(protocol_level=...)``; a server-side decoder switches to level 5 itself when it
decodes a level-5 CONNECT, so packets pipelined behind the CONNECT decode right.  The 3.1.1
paths are unchanged.  The MQTT 5 packet and property tables are in ``docs/MQTT5.md``.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable

from filemq.mqtt.packets import (
    AUTH,
    AUTH_REASON_CODES,
    CONNACK,
    CONNACK_REASON_CODES,
    CONNECT,
    DISCONNECT,
    DISCONNECT_REASON_CODES,
    PACKET_NAMES,
    PACKET_NAMES_V5,
    PINGREQ,
    PINGRESP,
    PROTOCOL_LEVEL,
    PROTOCOL_LEVEL_5,
    PUBACK,
    PUBACK_REASON_CODES,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    PUBREL_REASON_CODES,
    RC_MALFORMED_PACKET,
    RC_PACKET_TOO_LARGE,
    RC_PROTOCOL_ERROR,
    RC_TOPIC_ALIAS_INVALID,
    SUB_NO_LOCAL,
    SUB_QOS_MASK,
    SUB_RETAIN_HANDLING_SHIFT,
    SUBACK,
    SUBACK_FAILURE,
    SUBACK_REASON_CODES,
    SUBSCRIBE,
    UNSUBACK,
    UNSUBACK_REASON_CODES,
    UNSUBSCRIBE,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
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

# The largest remaining length four varint bytes can carry, spec 2.2.3.
MAX_REMAINING_LENGTH = 268_435_455
DEFAULT_MAX_PACKET_SIZE = 1 << 20
_TOPIC_CACHE_SIZE = 1024

# Packet types each side may receive (spec 2.2.1 "direction of flow").
CLIENT_TO_SERVER = frozenset(
    {CONNECT, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP, SUBSCRIBE, UNSUBSCRIBE, PINGREQ, DISCONNECT}
)
SERVER_TO_CLIENT = frozenset(
    {CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK, UNSUBACK, PINGRESP}
)
# MQTT 5.0: AUTH both ways, DISCONNECT also from the server (spec 2.1.2 table 2-1).
CLIENT_TO_SERVER_V5 = CLIENT_TO_SERVER | {AUTH}
SERVER_TO_CLIENT_V5 = SERVER_TO_CLIENT | {DISCONNECT, AUTH}
# Fixed-header flags every type but PUBLISH must carry, spec 2.2.2 table 2.2.
_REQUIRED_FLAGS = {t: (0b0010 if t in (PUBREL, SUBSCRIBE, UNSUBSCRIBE) else 0) for t in PACKET_NAMES_V5}


class ProtocolError(ValueError):
    """The peer sent bytes that are not valid MQTT; the connection must be closed.

    ``reason`` is the human-readable cause; ``packet_type`` the packet's name when known;
    ``reason_code`` the MQTT 5 reason code to put on the CONNACK or DISCONNECT that closes an
    MQTT 5 connection (spec 4.13): 0x81 Malformed Packet unless the spec names another
    (0x82 Protocol Error, 0x94 Topic Alias invalid, 0x95 Packet too large).  A 3.1.1
    connection has no way to send it and just closes.
    """

    def __init__(self, reason: str, packet_type: str | None = None, reason_code: int = RC_MALFORMED_PACKET) -> None:
        super().__init__(reason)
        self.reason = reason
        self.packet_type = packet_type
        self.reason_code = reason_code


_pack_BB = struct.Struct("!BB").pack
_pack_BBB = struct.Struct("!BBB").pack
_pack_BBH = struct.Struct("!BBH").pack
_pack_BBBH = struct.Struct("!BBBH").pack
_pack_H = struct.Struct("!H").pack
_unpack_H = struct.Struct("!H").unpack_from
_unpack_BBH = struct.Struct("!BBH").unpack_from


# --------------------------------------------------------------------------- encoding


def _fixed_header(first: int, remaining: int) -> bytes:
    if remaining < 0x80:
        return _pack_BB(first, remaining)
    if remaining < 0x4000:
        return _pack_BBB(first, (remaining & 0x7F) | 0x80, remaining >> 7)
    if remaining > MAX_REMAINING_LENGTH:
        raise ValueError(f"packet body of {remaining} bytes exceeds the MQTT limit {MAX_REMAINING_LENGTH}")
    out = bytearray((first,))
    while True:
        byte = remaining & 0x7F
        remaining >>= 7
        if remaining:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _str(value: str, what: str) -> bytes:
    data = value.encode("utf-8")
    if len(data) > 0xFFFF:
        raise ValueError(f"{what} of {len(data)} bytes exceeds 65535")
    return _pack_H(len(data)) + data


def _bin(value: bytes, what: str) -> bytes:
    if len(value) > 0xFFFF:
        raise ValueError(f"{what} of {len(value)} bytes exceeds 65535")
    return _pack_H(len(value)) + value


def _check_packet_id(packet_id: int | None, name: str) -> int:
    if packet_id is None or not 0 < packet_id <= 0xFFFF:
        raise ValueError(f"{name} packet id must be 1..65535, got {packet_id!r}")
    return packet_id


def _encode_publish(p: Publish) -> bytes:
    topic = p.topic.encode("utf-8")
    tlen = len(topic)
    payload = p.payload
    qos = p.qos
    first = 0x30 | (qos << 1) | (0x08 if p.dup else 0) | (0x01 if p.retain else 0)
    if tlen > 0xFFFF:
        raise ValueError(f"PUBLISH topic of {tlen} bytes exceeds 65535")
    if qos == 0:
        remaining = 2 + tlen + len(payload)
        if remaining < 0x80:
            return b"".join((_pack_BBH(first, remaining, tlen), topic, payload))
        return b"".join((_fixed_header(first, remaining), _pack_H(tlen), topic, payload))
    if qos > 2 or qos < 0:
        raise ValueError(f"PUBLISH QoS must be 0, 1 or 2, got {qos}")
    pid = p.packet_id
    if pid is None or not 0 < pid <= 0xFFFF:
        raise ValueError(f"PUBLISH QoS {qos} needs a packet id 1..65535, got {pid!r}")
    remaining = 4 + tlen + len(payload)
    if remaining < 0x80:
        return b"".join((_pack_BBH(first, remaining, tlen), topic, _pack_H(pid), payload))
    if remaining < 0x4000:
        head = _pack_BBBH(first, (remaining & 0x7F) | 0x80, remaining >> 7, tlen)
        return b"".join((head, topic, _pack_H(pid), payload))
    return b"".join((_fixed_header(first, remaining), _pack_H(tlen), topic, _pack_H(pid), payload))


def _encode_ack(first: int, name: str) -> Callable[[Puback | Pubrec | Pubrel | Pubcomp], bytes]:
    def encode_ack(p: Puback | Pubrec | Pubrel | Pubcomp) -> bytes:
        pid = p.packet_id
        # One test for both faults on this hot path; struct refuses a pid outside 0..65535.
        if not pid or p.reason_code:
            if pid:  # 3.1.1 has no way to say it: never send a refusal as a success
                raise ValueError(f"{name} reason code 0x{p.reason_code:02x} needs MQTT 5 (protocol level 5)")
            raise ValueError(f"{name} packet id must be 1..65535, got {pid!r}")
        try:
            return _pack_BBH(first, 2, pid)
        except struct.error:
            raise ValueError(f"{name} packet id must be 1..65535, got {pid!r}") from None

    return encode_ack


def _encode_unsuback(p: Unsuback) -> bytes:
    if not 0 < p.packet_id <= 0xFFFF:
        raise ValueError(f"UNSUBACK packet id must be 1..65535, got {p.packet_id!r}")
    if any(p.reason_codes):
        raise ValueError(f"UNSUBACK reason codes {p.reason_codes!r} need MQTT 5 (protocol level 5)")
    return _pack_BBH(0xB0, 2, p.packet_id)


def _encode_auth_311(p: Auth) -> bytes:
    raise ValueError("AUTH cannot be encoded at protocol level 3 or 4 (it is MQTT 5 only)")


def _encode_disconnect(p: Disconnect) -> bytes:
    if p.reason_code:
        raise ValueError(f"DISCONNECT reason code 0x{p.reason_code:02x} needs MQTT 5 (protocol level 5)")
    return _DISCONNECT


def _encode_connect(p: Connect) -> bytes:
    # CONNECT carries its own level: properties are encoded exactly when it is 5.
    v5 = p.protocol_level == PROTOCOL_LEVEL_5
    if not v5 and (p.properties is not None or p.will_properties is not None):
        raise ValueError("CONNECT properties need protocol_level 5")
    flags = 0x02 if p.clean_session else 0
    parts = [_str(p.client_id, "client id")]
    if p.will_topic is not None:
        if not 0 <= p.will_qos <= 2:
            raise ValueError(f"CONNECT will QoS must be 0, 1 or 2, got {p.will_qos}")
        flags |= 0x04 | (p.will_qos << 3) | (0x20 if p.will_retain else 0)
        if v5:
            parts.append(_encode_properties(p.will_properties, "WILL"))
        parts.append(_str(p.will_topic, "will topic"))
        parts.append(_bin(p.will_payload, "will payload"))
    elif p.will_properties is not None:
        raise ValueError("CONNECT will properties without a will")
    if p.username is not None:
        flags |= 0x80
        parts.append(_str(p.username, "username"))
    if p.password is not None:
        if p.username is None and not v5:  # MQTT 5 allows a password alone (spec 3.1.2.9)
            raise ValueError("CONNECT with a password needs a username (spec 3.1.2-22)")
        flags |= 0x40
        parts.append(_bin(p.password, "password"))
    if not 0 <= p.keepalive <= 0xFFFF:
        raise ValueError(f"keepalive must be 0..65535 seconds, got {p.keepalive}")
    head = _str(p.protocol_name, "protocol name") + struct.pack("!BBH", p.protocol_level, flags, p.keepalive)
    if v5:
        head += _encode_properties(p.properties, "CONNECT")
    body = head + b"".join(parts)
    return _fixed_header(0x10, len(body)) + body


def _encode_connack(p: Connack) -> bytes:
    if not 0 <= p.return_code <= 0xFF:
        raise ValueError(f"CONNACK return code must be 0..255, got {p.return_code}")
    return struct.pack("!BBBB", 0x20, 2, 1 if p.session_present else 0, p.return_code)


def _encode_subscribe(p: Subscribe) -> bytes:
    if not p.topics:
        raise ValueError("SUBSCRIBE needs at least one topic filter")
    body = bytearray(_pack_H(_check_packet_id(p.packet_id, "SUBSCRIBE")))
    for topic_filter, qos in p.topics:
        if not 0 <= qos <= 2:
            raise ValueError(f"SUBSCRIBE QoS must be 0, 1 or 2, got {qos}")
        body += _str(topic_filter, "topic filter")
        body.append(qos)
    return _fixed_header(0x82, len(body)) + body


def _encode_suback(p: Suback) -> bytes:
    if not p.return_codes or any(c not in (0, 1, 2, SUBACK_FAILURE) for c in p.return_codes):
        raise ValueError(f"SUBACK needs return codes from 0, 1, 2, 0x80, got {p.return_codes!r}")
    body = _pack_H(_check_packet_id(p.packet_id, "SUBACK")) + bytes(p.return_codes)
    return _fixed_header(0x90, len(body)) + body


def _encode_unsubscribe(p: Unsubscribe) -> bytes:
    if not p.topics:
        raise ValueError("UNSUBSCRIBE needs at least one topic filter")
    body = _pack_H(_check_packet_id(p.packet_id, "UNSUBSCRIBE")) + b"".join(
        _str(t, "topic filter") for t in p.topics
    )
    return _fixed_header(0xA2, len(body)) + body


_PINGREQ = b"\xc0\x00"
_PINGRESP = b"\xd0\x00"
_DISCONNECT = b"\xe0\x00"

_ENCODERS: dict[type, Callable[[object], bytes]] = {
    Publish: _encode_publish,  # type: ignore[dict-item]
    Puback: _encode_ack(0x40, "PUBACK"),  # type: ignore[dict-item]
    Pubrec: _encode_ack(0x50, "PUBREC"),  # type: ignore[dict-item]
    Pubrel: _encode_ack(0x62, "PUBREL"),  # type: ignore[dict-item]
    Pubcomp: _encode_ack(0x70, "PUBCOMP"),  # type: ignore[dict-item]
    Unsuback: _encode_unsuback,  # type: ignore[dict-item]
    Connect: _encode_connect,  # type: ignore[dict-item]
    Connack: _encode_connack,  # type: ignore[dict-item]
    Subscribe: _encode_subscribe,  # type: ignore[dict-item]
    Suback: _encode_suback,  # type: ignore[dict-item]
    Unsubscribe: _encode_unsubscribe,  # type: ignore[dict-item]
    Pingreq: lambda _p: _PINGREQ,
    Pingresp: lambda _p: _PINGRESP,
    Disconnect: _encode_disconnect,  # type: ignore[dict-item]
    Auth: _encode_auth_311,  # type: ignore[dict-item]
}


# --------------------------------------------------------------------------- MQTT 5.0 properties

# Property value types, spec 2.2.2.2 / 1.5.
_P_BYTE, _P_TWO, _P_FOUR, _P_VBI, _P_STR, _P_BIN, _P_PAIR = range(7)

# identifier -> (Properties attribute, type), every property of spec 2.2.2.2 table 2-4.
PROPERTY_TYPES: dict[int, tuple[str, int]] = {
    0x01: ("payload_format_indicator", _P_BYTE),
    0x02: ("message_expiry_interval", _P_FOUR),
    0x03: ("content_type", _P_STR),
    0x08: ("response_topic", _P_STR),
    0x09: ("correlation_data", _P_BIN),
    0x0B: ("subscription_identifiers", _P_VBI),
    0x11: ("session_expiry_interval", _P_FOUR),
    0x12: ("assigned_client_identifier", _P_STR),
    0x13: ("server_keep_alive", _P_TWO),
    0x15: ("authentication_method", _P_STR),
    0x16: ("authentication_data", _P_BIN),
    0x17: ("request_problem_information", _P_BYTE),
    0x18: ("will_delay_interval", _P_FOUR),
    0x19: ("request_response_information", _P_BYTE),
    0x1A: ("response_information", _P_STR),
    0x1C: ("server_reference", _P_STR),
    0x1F: ("reason_string", _P_STR),
    0x21: ("receive_maximum", _P_TWO),
    0x22: ("topic_alias_maximum", _P_TWO),
    0x23: ("topic_alias", _P_TWO),
    0x24: ("maximum_qos", _P_BYTE),
    0x25: ("retain_available", _P_BYTE),
    0x26: ("user_properties", _P_PAIR),
    0x27: ("maximum_packet_size", _P_FOUR),
    0x28: ("wildcard_subscription_available", _P_BYTE),
    0x29: ("subscription_identifier_available", _P_BYTE),
    0x2A: ("shared_subscription_available", _P_BYTE),
}
# The spec's name of each property, for error messages.
PROPERTY_NAMES: dict[int, str] = {
    ident: attr.replace("_", " ").replace("identifiers", "identifier").replace("properties", "property")
    for ident, (attr, _kind) in PROPERTY_TYPES.items()
}
# The two properties that may repeat (spec 3.1.2.11.8 user property; 3.3.2.3.8 subscription
# identifier, several on a PUBLISH to a client -- but only one on a SUBSCRIBE, 3.8.2.1.2).
_LIST_PROPERTIES = frozenset({0x0B, 0x26})
# Byte properties whose only values are 0 and 1: "It is a Protocol Error to ... have a value
# other than 0 or 1" (3.1.2.11.6, 3.1.2.11.7, 3.2.2.3.4, 3.2.2.3.5, 3.2.2.3.11-13); the payload
# format indicator has only the values 0 and 1 defined (3.3.2.3.2, 3.1.3.2.3).
_BOOLEAN_PROPERTIES = frozenset({0x01, 0x17, 0x19, 0x24, 0x25, 0x28, 0x29, 0x2A})
# "It is a Protocol Error ... for it to have the value 0": receive maximum (3.1.2.11.3,
# 3.2.2.3.3), maximum packet size (3.1.2.11.4, 3.2.2.3.6), subscription identifier (3.3.2.3.8,
# 3.8.2.1.2).  Topic alias 0 is checked on PUBLISH with its own reason code (3.3.2.3.4).
_NONZERO_PROPERTIES = frozenset({0x21, 0x27, 0x0B})

# Which properties each packet may carry (spec 2.2.2.2 table 2-4, and 3.x.2.x per packet).
ALLOWED_PROPERTIES: dict[str, frozenset[int]] = {
    "CONNECT": frozenset({0x11, 0x15, 0x16, 0x17, 0x19, 0x21, 0x22, 0x26, 0x27}),
    "WILL": frozenset({0x01, 0x02, 0x03, 0x08, 0x09, 0x18, 0x26}),
    "CONNACK": frozenset(
        {0x11, 0x12, 0x13, 0x15, 0x16, 0x1A, 0x1C, 0x1F, 0x21, 0x22, 0x24, 0x25, 0x26, 0x27, 0x28, 0x29, 0x2A}
    ),
    "PUBLISH": frozenset({0x01, 0x02, 0x03, 0x08, 0x09, 0x0B, 0x23, 0x26}),
    "PUBACK": frozenset({0x1F, 0x26}),
    "PUBREC": frozenset({0x1F, 0x26}),
    "PUBREL": frozenset({0x1F, 0x26}),
    "PUBCOMP": frozenset({0x1F, 0x26}),
    "SUBSCRIBE": frozenset({0x0B, 0x26}),
    "SUBACK": frozenset({0x1F, 0x26}),
    "UNSUBSCRIBE": frozenset({0x26}),
    "UNSUBACK": frozenset({0x1F, 0x26}),
    "DISCONNECT": frozenset({0x11, 0x1C, 0x1F, 0x26}),
    "AUTH": frozenset({0x15, 0x16, 0x1F, 0x26}),
}
# (identifier, type) in table order, and a getter of every Properties field in that order.
_PROPERTY_KINDS = tuple((ident, kind) for ident, (_attr, kind) in PROPERTY_TYPES.items())
_all_properties = operator.attrgetter(*(attr for attr, _kind in PROPERTY_TYPES.values()))
_MAX_VBI = 268_435_455
_pack_I = struct.Struct("!I").pack
_unpack_I = struct.Struct("!I").unpack_from


def _vbi(value: int) -> bytes:
    """A variable byte integer, spec 1.5.5."""
    if value < 0x80:
        return bytes((value,))
    if value > _MAX_VBI:
        raise ValueError(f"variable byte integer {value} exceeds {_MAX_VBI}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _encode_properties(props: Properties | None, name: str) -> bytes:
    """Property length + properties of ``name`` (a key of ALLOWED_PROPERTIES); ValueError for a
    property the packet may not carry or a value out of its type's range."""
    if props is None:
        return b"\x00"
    allowed = ALLOWED_PROPERTIES[name]
    out = bytearray()
    for (pid, kind), value in zip(_PROPERTY_KINDS, _all_properties(props), strict=True):
        if value is None or (pid in _LIST_PROPERTIES and not value):
            continue
        what = PROPERTY_NAMES[pid]
        if pid not in allowed:
            raise ValueError(f"{name} may not carry the {what} property (spec 2.2.2.2)")
        if kind == _P_PAIR:
            for key, val in value:
                out.append(pid)
                out += _str(key, f"{what} name")
                out += _str(val, f"{what} value")
        elif kind == _P_VBI:
            for ident in value:
                if not 0 < ident <= _MAX_VBI:
                    raise ValueError(f"{what} must be 1..{_MAX_VBI}, got {ident}")
                out.append(pid)
                out += _vbi(ident)
        elif kind == _P_STR:
            out.append(pid)
            out += _str(value, what)
        elif kind == _P_BIN:
            out.append(pid)
            out += _bin(value, what)
        else:
            top = 1 if pid in _BOOLEAN_PROPERTIES else 0xFF if kind == _P_BYTE else 0xFFFF if kind == _P_TWO \
                else 0xFFFF_FFFF
            bottom = 1 if pid in _NONZERO_PROPERTIES or pid == 0x23 else 0
            if not bottom <= value <= top:
                raise ValueError(f"{what} must be {bottom}..{top}, got {value}")
            out.append(pid)
            if kind == _P_BYTE:
                out.append(value)
            elif kind == _P_TWO:
                out += _pack_H(value)
            else:
                out += _pack_I(value)
    return _vbi(len(out)) + out


# --------------------------------------------------------------------------- MQTT 5.0 encoding


def _check_reason(code: int, allowed: frozenset[int], name: str) -> int:
    if code not in allowed:
        raise ValueError(f"{name} reason code {code!r} is not one of the spec's {sorted(allowed)}")
    return code


def _encode_publish5(p: Publish) -> bytes:
    qos = p.qos
    if not 0 <= qos <= 2:
        raise ValueError(f"PUBLISH QoS must be 0, 1 or 2, got {qos}")
    props = p.properties
    if not p.topic and (props is None or props.topic_alias is None):
        raise ValueError("PUBLISH with an empty topic needs a topic alias (spec 3.3.2.1)")
    first = 0x30 | (qos << 1) | (0x08 if p.dup else 0) | (0x01 if p.retain else 0)
    parts = [_str(p.topic, "PUBLISH topic")]
    if qos:
        pid = p.packet_id
        if pid is None or not 0 < pid <= 0xFFFF:
            raise ValueError(f"PUBLISH QoS {qos} needs a packet id 1..65535, got {pid!r}")
        parts.append(_pack_H(pid))
    parts.append(_encode_properties(props, "PUBLISH"))
    parts.append(p.payload)
    body = b"".join(parts)
    return _fixed_header(first, len(body)) + body


def _encode_ack5(
    first: int, name: str, codes: frozenset[int]
) -> Callable[[Puback | Pubrec | Pubrel | Pubcomp], bytes]:
    def encode_ack(p: Puback | Pubrec | Pubrel | Pubcomp) -> bytes:
        pid = p.packet_id
        if not 0 < pid <= 0xFFFF:
            raise ValueError(f"{name} packet id must be 1..65535, got {pid!r}")
        code = _check_reason(p.reason_code, codes, name)
        props = _encode_properties(p.properties, name)
        if props == b"\x00":
            # Spec 3.4.2.1 / 3.4.2.2.1: the reason code is omitted when it is 0x00 and there
            # are no properties, and the property length when there are none.
            if code == 0:
                return _pack_BBH(first, 2, pid)
            return struct.pack("!BBHB", first, 3, pid, code)
        body = struct.pack("!HB", pid, code) + props
        return _fixed_header(first, len(body)) + body

    return encode_ack


def _encode_connack5(p: Connack) -> bytes:
    code = _check_reason(p.return_code, CONNACK_REASON_CODES, "CONNACK")
    if code and p.session_present:
        raise ValueError("CONNACK with a non-zero reason code must not set session present (MQTT-3.2.2-6)")
    body = bytes((1 if p.session_present else 0, code)) + _encode_properties(p.properties, "CONNACK")
    return _fixed_header(0x20, len(body)) + body


def _check_options(options: int, topic_filter: str) -> int:
    if options & 0xC0 or options & 0x03 == 3 or (options >> SUB_RETAIN_HANDLING_SHIFT) & 0x03 == 3:
        raise ValueError(f"SUBSCRIBE options 0x{options:02x} for {topic_filter!r}: reserved bits, QoS 3 "
                         "or retain handling 3 (spec 3.8.3.1)")
    return options


def _encode_subscribe5(p: Subscribe) -> bytes:
    if not p.topics:
        raise ValueError("SUBSCRIBE needs at least one topic filter")
    if p.properties is not None and len(p.properties.subscription_identifiers) > 1:
        raise ValueError("SUBSCRIBE carries at most one subscription identifier (spec 3.8.2.1.2)")
    body = bytearray(_pack_H(_check_packet_id(p.packet_id, "SUBSCRIBE")))
    body += _encode_properties(p.properties, "SUBSCRIBE")
    for topic_filter, options in p.topics:
        body += _str(topic_filter, "topic filter")
        body.append(_check_options(options, topic_filter))
    return _fixed_header(0x82, len(body)) + body


def _encode_suback5(p: Suback) -> bytes:
    if not p.return_codes:
        raise ValueError("SUBACK needs at least one reason code")
    for code in p.return_codes:
        _check_reason(code, SUBACK_REASON_CODES, "SUBACK")
    body = _pack_H(_check_packet_id(p.packet_id, "SUBACK")) + _encode_properties(p.properties, "SUBACK")
    body += bytes(p.return_codes)
    return _fixed_header(0x90, len(body)) + body


def _encode_unsubscribe5(p: Unsubscribe) -> bytes:
    if not p.topics:
        raise ValueError("UNSUBSCRIBE needs at least one topic filter")
    body = _pack_H(_check_packet_id(p.packet_id, "UNSUBSCRIBE")) + _encode_properties(p.properties, "UNSUBSCRIBE")
    body += b"".join(_str(t, "topic filter") for t in p.topics)
    return _fixed_header(0xA2, len(body)) + body


def _encode_unsuback5(p: Unsuback) -> bytes:
    if not p.reason_codes:
        raise ValueError("an MQTT 5 UNSUBACK needs one reason code per topic filter (spec 3.11.3)")
    for code in p.reason_codes:
        _check_reason(code, UNSUBACK_REASON_CODES, "UNSUBACK")
    body = _pack_H(_check_packet_id(p.packet_id, "UNSUBACK")) + _encode_properties(p.properties, "UNSUBACK")
    body += bytes(p.reason_codes)
    return _fixed_header(0xB0, len(body)) + body


def _encode_reason_only(first: int, name: str, codes: frozenset[int]) -> Callable[[Disconnect | Auth], bytes]:
    def encode_reason_only(p: Disconnect | Auth) -> bytes:
        code = _check_reason(p.reason_code, codes, name)
        props = _encode_properties(p.properties, name)
        if props == b"\x00":
            # Spec 3.14.2.1 / 3.15.2.1: both omitted for 0x00 without properties; the
            # property length alone when there are none (3.14.2.2.1).
            return bytes((first, 1, code)) if code else bytes((first, 0))
        body = bytes((code,)) + props
        return _fixed_header(first, len(body)) + body

    return encode_reason_only


_ENCODERS5: dict[type, Callable[[object], bytes]] = {
    Publish: _encode_publish5,  # type: ignore[dict-item]
    Puback: _encode_ack5(0x40, "PUBACK", PUBACK_REASON_CODES),  # type: ignore[dict-item]
    Pubrec: _encode_ack5(0x50, "PUBREC", PUBACK_REASON_CODES),  # type: ignore[dict-item]
    Pubrel: _encode_ack5(0x62, "PUBREL", PUBREL_REASON_CODES),  # type: ignore[dict-item]
    Pubcomp: _encode_ack5(0x70, "PUBCOMP", PUBREL_REASON_CODES),  # type: ignore[dict-item]
    Unsuback: _encode_unsuback5,  # type: ignore[dict-item]
    Connect: _encode_connect,  # type: ignore[dict-item]
    Connack: _encode_connack5,  # type: ignore[dict-item]
    Subscribe: _encode_subscribe5,  # type: ignore[dict-item]
    Suback: _encode_suback5,  # type: ignore[dict-item]
    Unsubscribe: _encode_unsubscribe5,  # type: ignore[dict-item]
    Pingreq: lambda _p: _PINGREQ,
    Pingresp: lambda _p: _PINGRESP,
    Disconnect: _encode_reason_only(0xE0, "DISCONNECT", DISCONNECT_REASON_CODES),  # type: ignore[dict-item]
    Auth: _encode_reason_only(0xF0, "AUTH", AUTH_REASON_CODES),  # type: ignore[dict-item]
}


def encode(packet: Packet) -> bytes:
    """The MQTT 3.1.1 (and 3.1) wire bytes of ``packet``; :func:`encode5` gives the MQTT 5.0
    ones, :func:`encoder` the one for a connection's level.  A :class:`Connect` is encoded at
    its own ``protocol_level`` by both.

    Raises ``ValueError`` for a packet that cannot be framed (QoS outside 0-2, a missing or
    out-of-range packet id, a string over 65535 bytes, a body over 256 MB, an empty
    SUBSCRIBE/UNSUBSCRIBE/SUBACK list; a non-zero reason code or an AUTH, which 3.1.1 cannot
    express: a refusal is never sent as a success).  Properties are not on the 3.1.1 wire and
    are dropped.  It does not check topic wildcard rules: that is :mod:`filemq.common.topics`' job.
    """
    return _ENCODERS[type(packet)](packet)


def encode5(packet: Packet) -> bytes:
    """The MQTT 5.0 wire bytes of ``packet`` (spec chapter 3): properties, reason codes, the
    short forms of 3.4.2.1 / 3.14.2.1 / 3.15.2.1 when they apply.

    Raises ``ValueError`` as :func:`encode` does, and for a property the packet may not carry
    (spec 2.2.2.2), a property value out of its range, a reason code the packet does not define.
    """
    return _ENCODERS5[type(packet)](packet)


def encoder(protocol_level: int) -> Callable[[Packet], bytes]:
    """:func:`encode5` for protocol level 5, else :func:`encode` (3 and 4)."""
    return encode5 if protocol_level == PROTOCOL_LEVEL_5 else encode


def encode_puback(packet_id: int) -> bytes:
    """PUBACK bytes for ``packet_id`` without building a :class:`Puback` (the broker's hot path)."""
    return _pack_BBH(0x40, 2, packet_id)


_topic_bytes: dict[str, bytes] = {}


def publish_bytes(topic: str, payload: bytes, qos: int, dup: bool, packet_id: int | None,
                  retain: bool = False) -> bytes:
    """PUBLISH bytes, the same as ``encode(Publish(...))``, without building a :class:`Publish`
    and with each topic's encoding cached: a record fanned out to N subscribers encodes its
    topic once (the broker's delivery hot path; the topic was validated when it was stored)."""
    tb = _topic_bytes.get(topic)
    if tb is None:
        raw = topic.encode("utf-8")
        tb = _pack_H(len(raw)) + raw
        if len(_topic_bytes) >= 4096:
            _topic_bytes.clear()  # bounded with unbounded distinct topics
        _topic_bytes[topic] = tb
    first = 0x30 | (qos << 1) | (0x08 if dup else 0) | (0x01 if retain else 0)
    if qos:
        assert packet_id is not None
        return b"".join((_fixed_header(first, len(tb) + 2 + len(payload)), tb, _pack_H(packet_id), payload))
    return b"".join((_fixed_header(first, len(tb) + len(payload)), tb, payload))


# --------------------------------------------------------------------------- decoding


def _utf8(buf: bytes | bytearray, start: int, end: int, what: str, name: str) -> str:
    try:
        text = buf[start:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"invalid UTF-8 in {what} at byte {exc.start}", name) from None
    # Spec 1.5.3: U+0000 MUST NOT appear (surrogates are already refused by the decoder).
    if "\x00" in text:
        raise ProtocolError(f"U+0000 in {what}", name)
    return text


def _read_str(buf: bytes | bytearray, pos: int, end: int, what: str, name: str) -> tuple[str, int]:
    if end - pos < 2:
        raise ProtocolError(f"{name} truncated before the length of {what}", name)
    (n,) = _unpack_H(buf, pos)
    pos += 2
    if end - pos < n:
        raise ProtocolError(f"{name} {what} of {n} bytes runs past the end of the packet", name)
    return _utf8(buf, pos, pos + n, what, name), pos + n


def _read_bin(buf: bytes | bytearray, pos: int, end: int, what: str, name: str) -> tuple[bytes, int]:
    if end - pos < 2:
        raise ProtocolError(f"{name} truncated before the length of {what}", name)
    (n,) = _unpack_H(buf, pos)
    pos += 2
    if end - pos < n:
        raise ProtocolError(f"{name} {what} of {n} bytes runs past the end of the packet", name)
    return bytes(buf[pos : pos + n]), pos + n


def _decode_connect(buf: bytes | bytearray, pos: int, end: int) -> Connect:
    name = "CONNECT"
    protocol_name, pos = _read_str(buf, pos, end, "protocol name", name)
    if protocol_name not in ("MQTT", "MQIsdp"):
        raise ProtocolError(f"CONNECT protocol name {protocol_name!r} is not 'MQTT'", name)
    if end - pos < 4:
        raise ProtocolError("CONNECT truncated in the variable header", name)
    level, flags, keepalive = struct.unpack_from("!BBH", buf, pos)
    pos += 4
    v5 = level == PROTOCOL_LEVEL_5
    if flags & 0x01:
        raise ProtocolError("CONNECT reserved flag (bit 0) is set", name)
    will = bool(flags & 0x04)
    will_qos = (flags >> 3) & 0x03
    will_retain = bool(flags & 0x20)
    if will_qos == 3:
        raise ProtocolError("QoS 3 in CONNECT will", name)
    if not will and (will_qos or will_retain):
        raise ProtocolError("CONNECT will QoS/retain set without the will flag", name)
    has_user = bool(flags & 0x80)
    has_password = bool(flags & 0x40)
    if has_password and not has_user and not v5:  # MQTT 5 allows it (spec 3.1.2.9)
        raise ProtocolError("CONNECT password flag set without the username flag", name)
    properties = None
    if v5:
        properties, pos = _decode_properties(buf, pos, end, name)
    client_id, pos = _read_str(buf, pos, end, "client id", name)
    packet = Connect(
        client_id=client_id,
        clean_session=bool(flags & 0x02),
        keepalive=keepalive,
        protocol_name=protocol_name,
        protocol_level=level,
        properties=properties,
    )
    if will:
        if v5:
            packet.will_properties, pos = _decode_properties(buf, pos, end, name, "WILL")
        packet.will_topic, pos = _read_str(buf, pos, end, "will topic", name)
        packet.will_payload, pos = _read_bin(buf, pos, end, "will payload", name)
        packet.will_qos = will_qos
        packet.will_retain = will_retain
    if has_user:
        packet.username, pos = _read_str(buf, pos, end, "username", name)
    if has_password:
        packet.password, pos = _read_bin(buf, pos, end, "password", name)
    if pos != end:
        raise ProtocolError(f"{end - pos} unexpected bytes after the CONNECT payload", name)
    return packet


def _decode_connack(buf: bytes | bytearray, pos: int, end: int) -> Connack:
    if end - pos != 2:
        raise ProtocolError(f"CONNACK remaining length {end - pos}, expected 2", "CONNACK")
    ack_flags, code = buf[pos], buf[pos + 1]
    if ack_flags & 0xFE:
        raise ProtocolError(f"CONNACK reserved acknowledge flags 0x{ack_flags:02x}", "CONNACK")
    return Connack(session_present=bool(ack_flags), return_code=code)


def _decode_publish(buf: bytes | bytearray, pos: int, end: int, flags: int) -> Publish:
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise ProtocolError("QoS 3 in PUBLISH", "PUBLISH")
    if end - pos < 2:
        raise ProtocolError("PUBLISH truncated before the topic length", "PUBLISH")
    (tlen,) = _unpack_H(buf, pos)
    tstart = pos + 2
    pos = tstart + tlen
    if qos:
        if end - pos < 2:
            raise ProtocolError(
                f"PUBLISH topic of {tlen} bytes and packet id run past the end of the packet", "PUBLISH"
            )
        pid = (buf[pos] << 8) | buf[pos + 1]
        if pid == 0:
            raise ProtocolError("PUBLISH QoS>0 with packet id 0", "PUBLISH")
        packet_id: int | None = pid
        pstart = pos + 2
    else:
        if pos > end:
            raise ProtocolError(f"PUBLISH topic of {tlen} bytes runs past the end of the packet", "PUBLISH")
        packet_id = None
        pstart = pos
    if tlen == 0:
        raise ProtocolError("PUBLISH with an empty topic name", "PUBLISH")
    try:
        topic = buf[tstart:pos].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"invalid UTF-8 in topic at byte {exc.start}", "PUBLISH") from None
    # Cheap checks only; the full topic grammar lives in filemq.common.topics.
    if "\x00" in topic:
        raise ProtocolError("U+0000 in topic", "PUBLISH")
    if "+" in topic or "#" in topic:
        raise ProtocolError(f"wildcard in PUBLISH topic name {topic!r}", "PUBLISH")
    return Publish(topic, bytes(buf[pstart:end]), qos, bool(flags & 1), bool(flags & 8), packet_id)


def _decode_packet_id(buf: bytes | bytearray, pos: int, end: int, name: str) -> int:
    if end - pos != 2:
        raise ProtocolError(f"{name} remaining length {end - pos}, expected 2", name)
    pid = (buf[pos] << 8) | buf[pos + 1]
    if pid == 0:
        raise ProtocolError(f"{name} with packet id 0", name)
    return pid


def _decode_header_packet_id(buf: bytes | bytearray, pos: int, end: int, name: str) -> int:
    if end - pos < 2:
        raise ProtocolError(f"{name} truncated before the packet id", name)
    pid = (buf[pos] << 8) | buf[pos + 1]
    if pid == 0:
        raise ProtocolError(f"{name} with packet id 0", name)
    return pid


def _decode_subscribe(buf: bytes | bytearray, pos: int, end: int) -> Subscribe:
    name = "SUBSCRIBE"
    pid = _decode_header_packet_id(buf, pos, end, name)
    pos += 2
    topics: list[tuple[str, int]] = []
    while pos < end:
        topic_filter, pos = _read_str(buf, pos, end, "topic filter", name)
        if not topic_filter:
            raise ProtocolError("SUBSCRIBE with an empty topic filter", name)
        if pos >= end:
            raise ProtocolError(f"SUBSCRIBE filter {topic_filter!r} has no QoS byte", name)
        qos = buf[pos]
        pos += 1
        if qos & 0xFC:
            raise ProtocolError(f"SUBSCRIBE requested QoS byte 0x{qos:02x} for {topic_filter!r}", name)
        if qos == 3:
            raise ProtocolError(f"QoS 3 in SUBSCRIBE for {topic_filter!r}", name)
        topics.append((topic_filter, qos))
    if not topics:
        raise ProtocolError("SUBSCRIBE with no topic filters", name)
    return Subscribe(pid, topics)


def _decode_suback(buf: bytes | bytearray, pos: int, end: int) -> Suback:
    pid = _decode_header_packet_id(buf, pos, end, "SUBACK")
    codes = list(buf[pos + 2 : end])
    if not codes:
        raise ProtocolError("SUBACK with no return codes", "SUBACK")
    for code in codes:
        if code > 2 and code != SUBACK_FAILURE:
            raise ProtocolError(f"SUBACK return code 0x{code:02x} is not 0, 1, 2 or 0x80", "SUBACK")
    return Suback(pid, codes)


def _decode_unsubscribe(buf: bytes | bytearray, pos: int, end: int) -> Unsubscribe:
    name = "UNSUBSCRIBE"
    pid = _decode_header_packet_id(buf, pos, end, name)
    pos += 2
    topics: list[str] = []
    while pos < end:
        topic_filter, pos = _read_str(buf, pos, end, "topic filter", name)
        if not topic_filter:
            raise ProtocolError("UNSUBSCRIBE with an empty topic filter", name)
        topics.append(topic_filter)
    if not topics:
        raise ProtocolError("UNSUBSCRIBE with no topic filters", name)
    return Unsubscribe(pid, topics)


def _decode_empty(ptype: int, remaining: int) -> Packet:
    name = PACKET_NAMES[ptype]
    if remaining:
        raise ProtocolError(f"{name} remaining length {remaining}, expected 0", name)
    if ptype == PINGREQ:
        return Pingreq()
    if ptype == PINGRESP:
        return Pingresp()
    return Disconnect()


def _decode_body(ptype: int, flags: int, buf: bytes | bytearray, pos: int, end: int) -> Packet:
    if ptype == PUBLISH:
        return _decode_publish(buf, pos, end, flags)
    if ptype == PUBACK:
        return Puback(_decode_packet_id(buf, pos, end, "PUBACK"))
    if ptype == PUBREC:
        return Pubrec(_decode_packet_id(buf, pos, end, "PUBREC"))
    if ptype == PUBREL:
        return Pubrel(_decode_packet_id(buf, pos, end, "PUBREL"))
    if ptype == PUBCOMP:
        return Pubcomp(_decode_packet_id(buf, pos, end, "PUBCOMP"))
    if ptype == UNSUBACK:
        return Unsuback(_decode_packet_id(buf, pos, end, "UNSUBACK"))
    if ptype == CONNECT:
        return _decode_connect(buf, pos, end)
    if ptype == CONNACK:
        return _decode_connack(buf, pos, end)
    if ptype == SUBSCRIBE:
        return _decode_subscribe(buf, pos, end)
    if ptype == SUBACK:
        return _decode_suback(buf, pos, end)
    if ptype == UNSUBSCRIBE:
        return _decode_unsubscribe(buf, pos, end)
    return _decode_empty(ptype, end - pos)


# --------------------------------------------------------------------------- MQTT 5.0 decoding


def _protocol_error(reason: str, name: str | None) -> ProtocolError:
    return ProtocolError(reason, name, reason_code=RC_PROTOCOL_ERROR)


def _read_vbi(buf: bytes | bytearray, pos: int, end: int, what: str, name: str) -> tuple[int, int]:
    """A variable byte integer (spec 1.5.5); more than 4 bytes or running past ``end`` is a
    Malformed Packet."""
    value = 0
    shift = 0
    while True:
        if pos >= end:
            raise ProtocolError(f"{name} {what} runs past the end of the packet", name)
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 28:
            raise ProtocolError(f"{name} {what}: variable byte integer exceeds 4 bytes", name)


def _decode_properties(
    buf: bytes | bytearray, pos: int, end: int, name: str, kind: str | None = None
) -> tuple[Properties | None, int]:
    """Property length and properties at ``pos`` of packet ``name`` (``kind`` selects the allowed
    set when it differs from the packet's, i.e. "WILL"); returns them (None for a property
    length of 0) and the position after.

    Spec 2.2.2.2: an identifier not valid for the packet, or a value not of its type, is a
    Malformed Packet (0x81); each property's own section makes a repeat, and the values it
    forbids, a Protocol Error (0x82)."""
    length, pos = _read_vbi(buf, pos, end, "property length", name)
    pend = pos + length
    if pend > end:
        raise ProtocolError(f"{name} property length {length} runs past the end of the packet", name)
    if not length:
        return None, pos
    props = Properties()
    allowed = ALLOWED_PROPERTIES[kind or name]
    types = PROPERTY_TYPES
    while pos < pend:
        ident = buf[pos]
        pos += 1
        spec = types.get(ident)
        if spec is None:
            raise ProtocolError(f"{name} unknown property identifier 0x{ident:02x}", name)
        attr, ptype = spec
        what = PROPERTY_NAMES[ident]
        if ident not in allowed:
            where = "will properties" if kind == "WILL" else name
            raise ProtocolError(f"{where} may not carry the {what} property (0x{ident:02x})", name)
        if ptype == _P_PAIR:  # the user property, the one most often repeated
            key, pos = _read_str(buf, pos, pend, "user property name", name)
            val, pos = _read_str(buf, pos, pend, "user property value", name)
            props.user_properties.append((key, val))
            continue
        value: object
        if ptype == _P_BYTE:
            if pos >= pend:
                raise ProtocolError(f"{name} {what} runs past the property length", name)
            value = buf[pos]
            pos += 1
        elif ptype == _P_TWO:
            if pend - pos < 2:
                raise ProtocolError(f"{name} {what} runs past the property length", name)
            (value,) = _unpack_H(buf, pos)
            pos += 2
        elif ptype == _P_FOUR:
            if pend - pos < 4:
                raise ProtocolError(f"{name} {what} runs past the property length", name)
            (value,) = _unpack_I(buf, pos)
            pos += 4
        elif ptype == _P_VBI:
            value, pos = _read_vbi(buf, pos, pend, what, name)
        elif ptype == _P_STR:
            value, pos = _read_str(buf, pos, pend, what, name)
        else:
            value, pos = _read_bin(buf, pos, pend, what, name)
        if ident in _LIST_PROPERTIES:  # the subscription identifier
            if value == 0:
                raise _protocol_error(f"{name} subscription identifier 0 (spec 3.3.2.3.8, 3.8.2.1.2)", name)
            props.subscription_identifiers.append(value)  # type: ignore[arg-type]
            continue
        if getattr(props, attr) is not None:
            # Each property's section: "It is a Protocol Error to include ... more than once".
            raise _protocol_error(f"{name} repeats the {what} property", name)
        if ident in _BOOLEAN_PROPERTIES and value not in (0, 1):
            raise _protocol_error(f"{name} {what} is {value}; only 0 and 1 are defined", name)
        if ident in _NONZERO_PROPERTIES and value == 0:
            raise _protocol_error(f"{name} {what} of 0 is a Protocol Error", name)
        setattr(props, attr, value)
    if (props.authentication_data is not None and props.authentication_method is None):
        raise _protocol_error(f"{name} authentication data without an authentication method "
                              "(spec 3.1.2.11.10, 3.2.2.3.18, 3.15.2.2.3)", name)
    return props, pos


def _check_reason_code(code: int, allowed: frozenset[int], name: str) -> int:
    if code not in allowed:
        raise _protocol_error(f"{name} reason code 0x{code:02x} is not one the spec defines for {name}", name)
    return code


def _decode_connack5(buf: bytes | bytearray, pos: int, end: int) -> Connack:
    name = "CONNACK"
    if end - pos == 2 and 1 <= buf[pos + 1] <= 5:
        # A 3.1.1 server's refusal (spec 3.1.4: a server that does not speak level 5 answers
        # in its own level); returned as is, without properties.
        return _decode_connack(buf, pos, end)
    if end - pos < 3:
        raise ProtocolError(f"CONNACK remaining length {end - pos}, expected at least 3", name)
    ack_flags, code = buf[pos], buf[pos + 1]
    if ack_flags & 0xFE:
        raise ProtocolError(f"CONNACK reserved acknowledge flags 0x{ack_flags:02x}", name)
    _check_reason_code(code, CONNACK_REASON_CODES, name)
    if code and ack_flags:
        raise _protocol_error("CONNACK with a non-zero reason code sets session present (MQTT-3.2.2-6)", name)
    props, pos = _decode_properties(buf, pos + 2, end, name)
    if pos != end:
        raise ProtocolError(f"{end - pos} unexpected bytes after the CONNACK properties", name)
    return Connack(bool(ack_flags), code, props)


def _decode_publish5(buf: bytes | bytearray, pos: int, end: int, flags: int, server: bool) -> Publish:
    name = "PUBLISH"
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise ProtocolError("QoS 3 in PUBLISH", name)
    topic, pos = _read_str(buf, pos, end, "topic", name)
    packet_id: int | None = None
    if qos:
        if end - pos < 2:
            raise ProtocolError("PUBLISH truncated before the packet id", name)
        packet_id = (buf[pos] << 8) | buf[pos + 1]
        if packet_id == 0:
            raise ProtocolError("PUBLISH QoS>0 with packet id 0", name)
        pos += 2
    props, pos = _decode_properties(buf, pos, end, name)
    if props is not None:
        if props.topic_alias == 0:
            raise ProtocolError("PUBLISH topic alias 0 (MQTT-3.3.2-8)", name, reason_code=RC_TOPIC_ALIAS_INVALID)
        if server and props.subscription_identifiers:
            raise _protocol_error("PUBLISH from a client carries a subscription identifier (MQTT-3.3.4-6)",
                                  name)
    if not topic and (props is None or props.topic_alias is None):
        raise _protocol_error("PUBLISH with an empty topic name and no topic alias (spec 3.3.2.1)", name)
    if "+" in topic or "#" in topic:
        raise ProtocolError(f"wildcard in PUBLISH topic name {topic!r}", name)
    return Publish(topic, bytes(buf[pos:end]), qos, bool(flags & 1), bool(flags & 8), packet_id, props)


_ACK_CLASSES: dict[int, tuple[type[Puback | Pubrec | Pubrel | Pubcomp], frozenset[int]]] = {
    PUBACK: (Puback, PUBACK_REASON_CODES),
    PUBREC: (Pubrec, PUBACK_REASON_CODES),
    PUBREL: (Pubrel, PUBREL_REASON_CODES),
    PUBCOMP: (Pubcomp, PUBREL_REASON_CODES),
}


def _decode_ack5(ptype: int, buf: bytes | bytearray, pos: int, end: int) -> Puback | Pubrec | Pubrel | Pubcomp:
    cls, codes = _ACK_CLASSES[ptype]
    name = PACKET_NAMES[ptype]
    if end - pos < 2:
        raise ProtocolError(f"{name} remaining length {end - pos}, expected at least 2", name)
    pid = (buf[pos] << 8) | buf[pos + 1]
    if pid == 0:
        raise ProtocolError(f"{name} with packet id 0", name)
    if end - pos == 2:  # spec 3.4.2.1: no reason code means 0x00
        return cls(pid)
    code = _check_reason_code(buf[pos + 2], codes, name)
    if end - pos == 3:  # spec 3.4.2.2.1: no property length means none
        return cls(pid, code)
    props, pos = _decode_properties(buf, pos + 3, end, name)
    if pos != end:
        raise ProtocolError(f"{end - pos} unexpected bytes after the {name} properties", name)
    return cls(pid, code, props)


def _decode_subscribe5(buf: bytes | bytearray, pos: int, end: int) -> Subscribe:
    name = "SUBSCRIBE"
    pid = _decode_header_packet_id(buf, pos, end, name)
    props, pos = _decode_properties(buf, pos + 2, end, name)
    if props is not None and len(props.subscription_identifiers) > 1:
        raise _protocol_error("SUBSCRIBE repeats the subscription identifier (spec 3.8.2.1.2)", name)
    topics: list[tuple[str, int]] = []
    while pos < end:
        topic_filter, pos = _read_str(buf, pos, end, "topic filter", name)
        if not topic_filter:
            raise ProtocolError("SUBSCRIBE with an empty topic filter", name)
        if pos >= end:
            raise ProtocolError(f"SUBSCRIBE filter {topic_filter!r} has no subscription options byte", name)
        options = buf[pos]
        pos += 1
        if options & 0xC0:
            raise ProtocolError(f"SUBSCRIBE reserved option bits set (0x{options:02x}) for {topic_filter!r} "
                                "(MQTT-3.8.3-5)", name)
        if options & SUB_QOS_MASK == 3:
            raise _protocol_error(f"QoS 3 in SUBSCRIBE for {topic_filter!r} (spec 3.8.3.1)", name)
        if options >> SUB_RETAIN_HANDLING_SHIFT == 3:
            raise _protocol_error(f"SUBSCRIBE retain handling 3 for {topic_filter!r} (spec 3.8.3.1)", name)
        if options & SUB_NO_LOCAL and topic_filter.startswith("$share/"):
            raise _protocol_error(f"SUBSCRIBE no local on shared subscription {topic_filter!r} (MQTT-3.8.3-4)",
                                  name)
        topics.append((topic_filter, options))
    if not topics:
        raise _protocol_error("SUBSCRIBE with no topic filters (MQTT-3.8.3-2)", name)
    return Subscribe(pid, topics, props)


def _decode_codes(buf: bytes | bytearray, pos: int, end: int, name: str, allowed: frozenset[int]) -> list[int]:
    codes = list(buf[pos:end])
    if not codes:
        raise _protocol_error(f"{name} with no reason codes", name)
    for code in codes:
        _check_reason_code(code, allowed, name)
    return codes


def _decode_suback5(buf: bytes | bytearray, pos: int, end: int) -> Suback:
    pid = _decode_header_packet_id(buf, pos, end, "SUBACK")
    props, pos = _decode_properties(buf, pos + 2, end, "SUBACK")
    return Suback(pid, _decode_codes(buf, pos, end, "SUBACK", SUBACK_REASON_CODES), props)


def _decode_unsubscribe5(buf: bytes | bytearray, pos: int, end: int) -> Unsubscribe:
    name = "UNSUBSCRIBE"
    pid = _decode_header_packet_id(buf, pos, end, name)
    props, pos = _decode_properties(buf, pos + 2, end, name)
    topics: list[str] = []
    while pos < end:
        topic_filter, pos = _read_str(buf, pos, end, "topic filter", name)
        if not topic_filter:
            raise ProtocolError("UNSUBSCRIBE with an empty topic filter", name)
        topics.append(topic_filter)
    if not topics:
        raise _protocol_error("UNSUBSCRIBE with no topic filters (MQTT-3.10.3-2)", name)
    return Unsubscribe(pid, topics, props)


def _decode_unsuback5(buf: bytes | bytearray, pos: int, end: int) -> Unsuback:
    pid = _decode_header_packet_id(buf, pos, end, "UNSUBACK")
    props, pos = _decode_properties(buf, pos + 2, end, "UNSUBACK")
    return Unsuback(pid, _decode_codes(buf, pos, end, "UNSUBACK", UNSUBACK_REASON_CODES), props)


def _decode_reason_only(ptype: int, buf: bytes | bytearray, pos: int, end: int, server: bool) -> Disconnect | Auth:
    name = "AUTH" if ptype == AUTH else "DISCONNECT"
    codes = AUTH_REASON_CODES if ptype == AUTH else DISCONNECT_REASON_CODES
    code = 0
    props = None
    if end > pos:  # spec 3.14.2.1 / 3.15.2.1: no reason code means 0x00
        code = _check_reason_code(buf[pos], codes, name)
        if end - pos > 1:  # spec 3.14.2.2.1: no property length means none
            props, pos = _decode_properties(buf, pos + 1, end, name)
            if pos != end:
                raise ProtocolError(f"{end - pos} unexpected bytes after the {name} properties", name)
    if ptype == AUTH:
        return Auth(code, props)
    if not server and props is not None and props.session_expiry_interval is not None:
        raise _protocol_error("DISCONNECT from the server carries a session expiry interval (MQTT-3.14.2-2)",
                              name)
    return Disconnect(code, props)


def _decode_body5(ptype: int, flags: int, buf: bytes | bytearray, pos: int, end: int, server: bool) -> Packet:
    if ptype == PUBLISH:
        return _decode_publish5(buf, pos, end, flags, server)
    if ptype in _ACK_CLASSES:
        return _decode_ack5(ptype, buf, pos, end)
    if ptype == CONNECT:
        return _decode_connect(buf, pos, end)
    if ptype == CONNACK:
        return _decode_connack5(buf, pos, end)
    if ptype == SUBSCRIBE:
        return _decode_subscribe5(buf, pos, end)
    if ptype == SUBACK:
        return _decode_suback5(buf, pos, end)
    if ptype == UNSUBSCRIBE:
        return _decode_unsubscribe5(buf, pos, end)
    if ptype == UNSUBACK:
        return _decode_unsuback5(buf, pos, end)
    if ptype in (DISCONNECT, AUTH):
        return _decode_reason_only(ptype, buf, pos, end, server)
    return _decode_empty(ptype, end - pos)


class Decoder:
    """Incremental MQTT 3.1.1 / 5.0 decoder for one connection direction.

    ``feed`` bytes as they arrive, in chunks of any size and split anywhere; ``packets()``
    (or ``next_packet()``) returns every complete packet, in order.  Work is O(bytes fed):
    the buffer keeps a read offset and is compacted only when the consumed prefix is large.

    ``server=True`` accepts only client-to-server packets (CONNECT ... DISCONNECT),
    ``server=False`` only server-to-client ones; the other direction is a protocol error.
    A packet larger than ``max_packet_size`` bytes (fixed header included) is rejected as
    soon as its fixed header is read, so at most ``max_packet_size`` + one read's bytes are
    ever buffered.

    ``protocol_level`` is the connection's (3 or 4: MQTT 3.1/3.1.1, 5: MQTT 5.0), settable
    later through the :attr:`protocol_level` property (a client sets it to the level of the
    CONNECT it sent).  A server-side decoder switches to 5 by itself on decoding a level-5
    CONNECT, before the packets pipelined behind it; a CONNECT of any level is decoded by its
    own level byte.  A packet's ``properties`` is a :class:`Properties` when the wire carries
    any, else None (always None on 3.1.1).  Level 5 has the same PUBLISH fast path as 3.1.1
    for packets without properties.

    After a :class:`ProtocolError` the decoder is poisoned: every later call re-raises it,
    because a byte stream cannot be resynchronised after a framing error.
    """

    __slots__ = ("_allowed", "_buf", "_error", "_max", "_names", "_pos", "_server", "_topics", "_v5")

    def __init__(self, max_packet_size: int = DEFAULT_MAX_PACKET_SIZE, *, server: bool = True,
                 protocol_level: int = PROTOCOL_LEVEL) -> None:
        if max_packet_size < 2:
            raise ValueError(f"max_packet_size must be at least 2 bytes, got {max_packet_size}")
        self._max = max_packet_size
        self._server = server
        self._v5 = False
        self._allowed = CLIENT_TO_SERVER if server else SERVER_TO_CLIENT
        self._names = PACKET_NAMES
        self.protocol_level = protocol_level
        # ``bytes`` while a whole fed chunk is being consumed (zero-copy slices),
        # ``bytearray`` once a partial packet must be kept and appended to.
        self._buf: bytes | bytearray = b""
        self._pos = 0
        self._error: ProtocolError | None = None
        # Validated topic bytes -> str, so a repeated topic skips UTF-8 decoding and checks.
        self._topics: dict[bytes, str] = {}

    @property
    def protocol_level(self) -> int:
        """4 (MQTT 3.1 and 3.1.1 decode alike) or 5."""
        return PROTOCOL_LEVEL_5 if self._v5 else PROTOCOL_LEVEL

    @protocol_level.setter
    def protocol_level(self, level: int) -> None:
        if level not in (3, PROTOCOL_LEVEL, PROTOCOL_LEVEL_5):
            raise ValueError(f"protocol level must be 3, 4 or 5, got {level}")
        self._v5 = level == PROTOCOL_LEVEL_5
        if self._v5:
            self._allowed = CLIENT_TO_SERVER_V5 if self._server else SERVER_TO_CLIENT_V5
            self._names = PACKET_NAMES_V5
        else:
            self._allowed = CLIENT_TO_SERVER if self._server else SERVER_TO_CLIENT
            self._names = PACKET_NAMES

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as packets."""
        return len(self._buf) - self._pos

    @property
    def max_packet_size(self) -> int:
        """The largest packet accepted; may be changed between packets (the broker accepts
        only CONNECT-sized packets before CONNECT, its configured limit afterwards)."""
        return self._max

    @max_packet_size.setter
    def max_packet_size(self, value: int) -> None:
        if value < 2:
            raise ValueError(f"max_packet_size must be at least 2 bytes, got {value}")
        self._max = value

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes; decoding happens in :meth:`packets` / :meth:`next_packet`."""
        if self._error is not None:
            raise self._error
        if not data:
            return
        buf = self._buf
        pos = self._pos
        rest = len(buf) - pos
        if rest <= 0:
            self._buf = bytes(data)
            self._pos = 0
        elif rest <= len(data):
            # A short partial tail: one copy into an immutable ``bytes`` keeps the decode
            # path zero-copy, and the copy is paid for by the new data (O(1) per byte).
            self._buf = b"".join((buf[pos:], data))
            self._pos = 0
        elif isinstance(buf, bytes):
            # A long partial packet is accumulating: append in place instead.
            tail = bytearray(buf[pos:])
            tail += data
            self._buf = tail
            self._pos = 0
        else:
            # Compact when the consumed prefix dominates, so each byte moves O(1) times.
            if pos > 65536 and pos * 2 > len(buf):
                del buf[:pos]
                self._pos = 0
            buf += data
        # Pre-check the header now so an oversized packet is refused before it is buffered.
        if len(self._buf) - self._pos > self._max:
            self._peek_header()

    def next_packet(self) -> Packet | None:
        """The next complete packet, or None if more bytes are needed."""
        out = self._decode(1)
        return out[0] if out else None

    def packets(self) -> list[Packet]:
        """Every complete packet buffered so far (possibly none), in order."""
        return self._decode(-1)

    def _peek_header(self) -> tuple[int, int, int, int] | None:
        """(type, flags, fixed-header length, remaining length) of the next packet, or None
        if its fixed header is incomplete.  Raises for a bad type, flags or size."""
        if self._error is not None:
            raise self._error
        try:
            return self._header()
        except ProtocolError as exc:
            self._error = exc
            raise

    def _header(self) -> tuple[int, int, int, int] | None:
        buf = self._buf
        pos = self._pos
        n = len(buf)
        if pos >= n:
            return None
        first = buf[pos]
        ptype = first >> 4
        flags = first & 0x0F
        name = self._names.get(ptype)
        if name is None:
            raise ProtocolError(f"reserved packet type {ptype} (first byte 0x{first:02x})")
        if ptype not in self._allowed:
            side = "server" if self._server else "client"
            raise ProtocolError(f"{name} is not a packet a {side} may receive", name, RC_PROTOCOL_ERROR)
        if ptype != PUBLISH and flags != _REQUIRED_FLAGS[ptype]:
            raise ProtocolError(f"reserved flags 0b{flags:04b} on {name}", name)
        remaining = 0
        shift = 0
        i = pos + 1
        while True:
            if i >= n:
                return None
            byte = buf[i]
            i += 1
            remaining |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift >= 28:
                raise ProtocolError("remaining length exceeds 4 bytes", name)
        total = i - pos + remaining
        if total > self._max:
            raise ProtocolError(
                f"packet of {total} bytes exceeds max_packet_size {self._max}", name, RC_PACKET_TOO_LARGE
            )
        return ptype, flags, i - pos, remaining

    def _decode(self, limit: int) -> list[Packet]:
        if self._error is not None:
            raise self._error
        if self._v5:
            return self._decode5(limit)
        out: list[Packet] = []
        switch = False
        buf = self._buf
        n = len(buf)
        pos = self._pos
        maxsize = self._max
        cache = self._topics
        as_bytes = type(buf) is bytes
        try:
            while limit and n - pos >= 2:
                first = buf[pos]
                # Fast path: a PUBLISH with a 1- or 2-byte remaining length and a topic seen
                # before on this connection -- nearly all traffic.  Anything unusual falls
                # through to the general path, which also produces the error messages.
                if first >> 4 == PUBLISH:
                    second = buf[pos + 1]
                    if second < 0x80:
                        start = pos + 2
                        end = start + second
                    elif n - pos >= 3 and buf[pos + 2] < 0x80:
                        start = pos + 3
                        end = start + ((second & 0x7F) | (buf[pos + 2] << 7))
                    else:
                        end = 0
                    if end:
                        if end - pos > maxsize or end - start < 2:
                            end = 0  # oversized, or too short for a topic: general path reports it
                        elif end > n:
                            break
                    if end:
                        tend = start + 2 + ((buf[start] << 8) | buf[start + 1])
                        qos = (first >> 1) & 0x03
                        if qos:
                            pstart = tend + 2
                            pid: int | None = (buf[tend] << 8) | buf[tend + 1] if pstart <= end else 0
                        else:
                            pstart = tend
                            pid = None
                        key = buf[start + 2 : tend]
                        topic = cache.get(key if as_bytes else bytes(key))  # type: ignore[arg-type]
                        if topic is not None and pstart <= end and pid != 0 and qos != 3:
                            payload = buf[pstart:end] if as_bytes else bytes(buf[pstart:end])
                            out.append(Publish(topic, payload, qos, bool(first & 1), bool(first & 8), pid))  # type: ignore[arg-type]
                            pos = end
                            limit -= 1
                            continue
                self._pos = pos
                header = self._header()
                if header is None:
                    break
                ptype, flags, header_len, remaining = header
                end = pos + header_len + remaining
                if end > n:
                    break
                packet = _decode_body(ptype, flags, buf, pos + header_len, end)
                if ptype == PUBLISH:
                    self._remember_topic(packet.topic)  # type: ignore[union-attr]
                elif ptype == CONNECT and self._server and packet.protocol_level == PROTOCOL_LEVEL_5:  # type: ignore[union-attr]
                    switch = True
                out.append(packet)
                pos = end
                limit -= 1
                if switch:
                    break
        except ProtocolError as exc:
            self._error = exc
            raise
        finally:
            self._pos = pos
        if pos >= n and n:
            self._buf = b""
            self._pos = 0
        if switch:
            # The rest of the connection is MQTT 5, including what was pipelined behind.
            self.protocol_level = PROTOCOL_LEVEL_5
            if limit:
                out.extend(self._decode5(limit))
        return out

    def _decode5(self, limit: int) -> list[Packet]:
        """:meth:`_decode` for MQTT 5.0, with the same PUBLISH fast path for packets without
        properties."""
        out: list[Packet] = []
        buf = self._buf
        n = len(buf)
        pos = self._pos
        maxsize = self._max
        cache = self._topics
        as_bytes = type(buf) is bytes
        server = self._server
        try:
            while limit and n - pos >= 2:
                first = buf[pos]
                # Fast path: a PUBLISH with a 1- or 2-byte remaining length, a property length
                # of 0 and a topic seen before; anything else takes the general path below.
                if first >> 4 == PUBLISH:
                    second = buf[pos + 1]
                    if second < 0x80:
                        start = pos + 2
                        end = start + second
                    elif n - pos >= 3 and buf[pos + 2] < 0x80:
                        start = pos + 3
                        end = start + ((second & 0x7F) | (buf[pos + 2] << 7))
                    else:
                        end = 0
                    if end:
                        if end - pos > maxsize or end - start < 3:
                            end = 0
                        elif end > n:
                            break
                    if end:
                        tend = start + 2 + ((buf[start] << 8) | buf[start + 1])
                        qos = (first >> 1) & 0x03
                        if qos:
                            plen = tend + 2
                            pid: int | None = (buf[tend] << 8) | buf[tend + 1] if plen < end else 0
                        else:
                            plen = tend
                            pid = None
                        if plen < end and not buf[plen] and pid != 0 and qos != 3:
                            key = buf[start + 2 : tend]
                            topic = cache.get(key if as_bytes else bytes(key))  # type: ignore[arg-type]
                            if topic is not None:
                                plen += 1
                                payload = buf[plen:end] if as_bytes else bytes(buf[plen:end])
                                out.append(Publish(topic, payload, qos, bool(first & 1), bool(first & 8), pid))  # type: ignore[arg-type]
                                pos = end
                                limit -= 1
                                continue
                self._pos = pos
                header = self._header()
                if header is None:
                    break
                ptype, flags, header_len, remaining = header
                end = pos + header_len + remaining
                if end > n:
                    break
                packet = _decode_body5(ptype, flags, buf, pos + header_len, end, server)
                if ptype == PUBLISH and packet.topic and packet.properties is None:  # type: ignore[union-attr]
                    # Only a topic the fast path can use (it takes packets without properties).
                    self._remember_topic(packet.topic)  # type: ignore[union-attr]
                out.append(packet)
                pos = end
                limit -= 1
        except ProtocolError as exc:
            self._error = exc
            raise
        finally:
            self._pos = pos
        if pos >= n and n:
            self._buf = b""
            self._pos = 0
        return out

    def _remember_topic(self, topic: str) -> None:
        # Only topics that passed full validation enter; bounded so a client cycling
        # through many topics cannot grow it without limit.
        cache = self._topics
        if len(cache) >= _TOPIC_CACHE_SIZE:
            cache.clear()
        cache[topic.encode("utf-8")] = topic
