"""MQTT 3.1.1 (and 3.1) packet bodies: encoders (``_ENCODERS``, behind
:func:`filemq.mqtt.codec.encode`) and decoders (``_decode_body``, behind a level-4
:class:`filemq.mqtt.codec.Decoder`); the 3.1.1 twin of :mod:`.codec5`.  CONNECT, which carries
its own level, is :mod:`.codec5`'s at both levels.

Imports :mod:`.wire`, :mod:`.codec5` (CONNECT) and :mod:`filemq.mqtt.packets`; :mod:`.codec`
imports it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from filemq.mqtt.codec5 import _decode_connect, _encode_connect
from filemq.mqtt.packets import (
    CONNACK,
    CONNECT,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    SUBACK,
    SUBACK_FAILURE,
    SUBSCRIBE,
    UNSUBACK,
    UNSUBSCRIBE,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
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
from filemq.mqtt.wire import (
    _DISCONNECT,
    _PINGREQ,
    _PINGRESP,
    ProtocolError,
    _check_packet_id,
    _decode_connack,
    _decode_empty,
    _decode_header_packet_id,
    _fixed_header,
    _pack_BBBH,
    _pack_BBH,
    _pack_H,
    _read_str,
    _str,
    _unpack_H,
)

# --------------------------------------------------------------------------- encoding


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


# --------------------------------------------------------------------------- decoding


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
