"""MQTT 5.0 packet bodies (spec chapter 3): encoders (``_ENCODERS5``, behind
:func:`filemq.mqtt.codec.encode5`) and decoders (``_decode_body5``, behind a level-5
:class:`filemq.mqtt.codec.Decoder`), with reason codes, properties and the short forms.  CONNECT
carries its own protocol level, so its encoder and decoder, used at both levels, are here too.

Imports :mod:`.wire`, :mod:`.properties` and :mod:`filemq.mqtt.packets`; :mod:`.codec` imports it.
"""

from __future__ import annotations

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
    PROTOCOL_LEVEL_5,
    PUBACK,
    PUBACK_REASON_CODES,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    PUBREL_REASON_CODES,
    RC_TOPIC_ALIAS_INVALID,
    SUB_NO_LOCAL,
    SUB_QOS_MASK,
    SUB_RETAIN_HANDLING_SHIFT,
    SUBACK,
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
from filemq.mqtt.properties import _decode_properties, _encode_properties, decode_publish_properties
from filemq.mqtt.wire import (
    _PINGREQ,
    _PINGRESP,
    ProtocolError,
    UnsupportedProtocolLevel,
    _bin,
    _check_packet_id,
    _decode_connack,
    _decode_empty,
    _decode_header_packet_id,
    _fixed_header,
    _pack_BBH,
    _pack_H,
    _protocol_error,
    _read_bin,
    _read_str,
    _str,
)

# --------------------------------------------------------------------------- CONNECT, either level


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


def _decode_connect(buf: bytes | bytearray, pos: int, end: int) -> Connect:
    name = "CONNECT"
    protocol_name, pos = _read_str(buf, pos, end, "protocol name", name)
    if protocol_name not in ("MQTT", "MQIsdp"):
        raise ProtocolError(f"CONNECT protocol name {protocol_name!r} is not 'MQTT'", name)
    if end - pos < 4:
        raise ProtocolError("CONNECT truncated in the variable header", name)
    level, flags, keepalive = struct.unpack_from("!BBH", buf, pos)
    pos += 4
    if level not in (3, 4, PROTOCOL_LEVEL_5):
        raise UnsupportedProtocolLevel(level, _connect_shape(buf, pos, end, flags))
    try:
        return _decode_connect_rest(buf, pos, end, protocol_name, level, flags, keepalive)
    except ProtocolError as exc:
        exc.connect_level = level  # (a level-5 one is answered with CONNACK 0x81 / 0x82)
        raise


def _connect_level(buf: bytes | bytearray, pos: int, n: int) -> int | None:
    """The protocol level byte of a CONNECT whose variable header starts at ``pos`` (the
    protocol name's length), or None while it has not arrived (``buf[:n]`` is what has)."""
    if pos + 2 > n:
        return None
    at = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
    return buf[at] if at < n else None


def _connect_shape(buf: bytes | bytearray, pos: int, end: int, flags: int) -> int:
    """5 if the CONNECT from its properties on (at ``pos``) parses as an MQTT 5.0 one, else 4."""
    try:
        _decode_connect_rest(buf, pos, end, "MQTT", PROTOCOL_LEVEL_5, flags, 0)
    except ProtocolError:
        return 4
    return PROTOCOL_LEVEL_5


def _decode_connect_rest(buf: bytes | bytearray, pos: int, end: int, protocol_name: str, level: int, flags: int,
                         keepalive: int) -> Connect:
    """A CONNECT after its keep alive (at ``pos``): flags checked, then properties (level 5),
    client id, will, username and password."""
    name = "CONNECT"
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


# --------------------------------------------------------------------------- MQTT 5.0 decoding


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


def _publish_properties(buf: bytes | bytearray, pos: int, end: int, server: bool) -> tuple[Properties | None, int]:
    """The property section of a PUBLISH at ``pos`` (:func:`decode_publish_properties`) and
    the rules on its values that need the packet: topic alias 0 (0x94, MQTT-3.3.2-8) and a
    subscription identifier from a client (``server``: 0x82, MQTT-3.3.4-6)."""
    props, pos = decode_publish_properties(buf, pos, end)
    if props is not None:
        if props.topic_alias == 0:
            raise ProtocolError("PUBLISH topic alias 0 (MQTT-3.3.2-8)", "PUBLISH", reason_code=RC_TOPIC_ALIAS_INVALID)
        if server and props.subscription_identifiers:
            raise _protocol_error("PUBLISH from a client carries a subscription identifier (MQTT-3.3.4-6)",
                                  "PUBLISH")
    return props, pos


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
        if packet_id == 0:  # it parses: a Protocol Error, not Malformed (MQTT-2.2.1-3)
            raise _protocol_error("PUBLISH QoS>0 with packet id 0 (MQTT-2.2.1-3)", name)
        pos += 2
    props, pos = _publish_properties(buf, pos, end, server)
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
        raise _protocol_error(f"{name} with packet id 0 (MQTT-2.2.1-3)", name)
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
