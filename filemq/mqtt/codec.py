"""MQTT 3.1.1 wire codec without I/O: packets in, bytes out (:func:`encode`); bytes in,
packets out (:class:`Decoder`).

Modelled on h11: the asyncio server and client only move bytes and call these.  Every
malformed input raises :class:`ProtocolError` with a reason a person can act on; the caller
closes that one connection (architecture guarantee 6).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from filemq.mqtt.packets import (
    CONNACK,
    CONNECT,
    DISCONNECT,
    PACKET_NAMES,
    PINGREQ,
    PINGRESP,
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
# Fixed-header flags every type but PUBLISH must carry, spec 2.2.2 table 2.2.
_REQUIRED_FLAGS = {t: (0b0010 if t in (PUBREL, SUBSCRIBE, UNSUBSCRIBE) else 0) for t in PACKET_NAMES}


class ProtocolError(ValueError):
    """The peer sent bytes that are not valid MQTT 3.1.1; the connection must be closed.

    ``reason`` is the human-readable cause; ``packet_type`` the packet's name when known.
    """

    def __init__(self, reason: str, packet_type: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.packet_type = packet_type


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


def _encode_ack(first: int, name: str) -> Callable[[Puback | Pubrec | Pubrel | Pubcomp | Unsuback], bytes]:
    def encode_ack(p: Puback | Pubrec | Pubrel | Pubcomp | Unsuback) -> bytes:
        pid = p.packet_id
        if not 0 < pid <= 0xFFFF:
            raise ValueError(f"{name} packet id must be 1..65535, got {pid!r}")
        return _pack_BBH(first, 2, pid)

    return encode_ack


def _encode_connect(p: Connect) -> bytes:
    flags = 0x02 if p.clean_session else 0
    parts = [_str(p.client_id, "client id")]
    if p.will_topic is not None:
        if not 0 <= p.will_qos <= 2:
            raise ValueError(f"CONNECT will QoS must be 0, 1 or 2, got {p.will_qos}")
        flags |= 0x04 | (p.will_qos << 3) | (0x20 if p.will_retain else 0)
        parts.append(_str(p.will_topic, "will topic"))
        parts.append(_bin(p.will_payload, "will payload"))
    if p.username is not None:
        flags |= 0x80
        parts.append(_str(p.username, "username"))
    if p.password is not None:
        if p.username is None:
            raise ValueError("CONNECT with a password needs a username (spec 3.1.2-22)")
        flags |= 0x40
        parts.append(_bin(p.password, "password"))
    if not 0 <= p.keepalive <= 0xFFFF:
        raise ValueError(f"keepalive must be 0..65535 seconds, got {p.keepalive}")
    head = _str(p.protocol_name, "protocol name") + struct.pack("!BBH", p.protocol_level, flags, p.keepalive)
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
    Unsuback: _encode_ack(0xB0, "UNSUBACK"),  # type: ignore[dict-item]
    Connect: _encode_connect,  # type: ignore[dict-item]
    Connack: _encode_connack,  # type: ignore[dict-item]
    Subscribe: _encode_subscribe,  # type: ignore[dict-item]
    Suback: _encode_suback,  # type: ignore[dict-item]
    Unsubscribe: _encode_unsubscribe,  # type: ignore[dict-item]
    Pingreq: lambda _p: _PINGREQ,
    Pingresp: lambda _p: _PINGRESP,
    Disconnect: lambda _p: _DISCONNECT,
}


def encode(packet: Packet) -> bytes:
    """The wire bytes of ``packet``.

    Raises ``ValueError`` for a packet that cannot be framed (QoS outside 0-2, a missing or
    out-of-range packet id, a string over 65535 bytes, a body over 256 MB, an empty
    SUBSCRIBE/UNSUBSCRIBE/SUBACK list).  It does not
    check topic wildcard rules: that is :mod:`filemq.topics`' job.
    """
    return _ENCODERS[type(packet)](packet)


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
    if has_password and not has_user:
        raise ProtocolError("CONNECT password flag set without the username flag", name)
    client_id, pos = _read_str(buf, pos, end, "client id", name)
    packet = Connect(
        client_id=client_id,
        clean_session=bool(flags & 0x02),
        keepalive=keepalive,
        protocol_name=protocol_name,
        protocol_level=level,
    )
    if will:
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
    # Cheap checks only; the full topic grammar lives in filemq.topics.
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


class Decoder:
    """Incremental MQTT 3.1.1 decoder for one connection direction.

    ``feed`` bytes as they arrive, in chunks of any size and split anywhere; ``packets()``
    (or ``next_packet()``) returns every complete packet, in order.  Work is O(bytes fed):
    the buffer keeps a read offset and is compacted only when the consumed prefix is large.

    ``server=True`` accepts only client-to-server packets (CONNECT ... DISCONNECT),
    ``server=False`` only server-to-client ones; the other direction is a protocol error.
    A packet larger than ``max_packet_size`` bytes (fixed header included) is rejected as
    soon as its fixed header is read, so at most ``max_packet_size`` + one read's bytes are
    ever buffered.

    After a :class:`ProtocolError` the decoder is poisoned: every later call re-raises it,
    because a byte stream cannot be resynchronised after a framing error.
    """

    __slots__ = ("_allowed", "_buf", "_error", "_max", "_pos", "_topics")

    def __init__(self, max_packet_size: int = DEFAULT_MAX_PACKET_SIZE, *, server: bool = True) -> None:
        if max_packet_size < 2:
            raise ValueError(f"max_packet_size must be at least 2 bytes, got {max_packet_size}")
        self._max = max_packet_size
        self._allowed = CLIENT_TO_SERVER if server else SERVER_TO_CLIENT
        # ``bytes`` while a whole fed chunk is being consumed (zero-copy slices),
        # ``bytearray`` once a partial packet must be kept and appended to.
        self._buf: bytes | bytearray = b""
        self._pos = 0
        self._error: ProtocolError | None = None
        # Validated topic bytes -> str, so a repeated topic skips UTF-8 decoding and checks.
        self._topics: dict[bytes, str] = {}

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
        name = PACKET_NAMES.get(ptype)
        if name is None:
            raise ProtocolError(f"reserved packet type {ptype} (first byte 0x{first:02x})")
        if ptype not in self._allowed:
            side = "client" if self._allowed is SERVER_TO_CLIENT else "server"
            raise ProtocolError(f"{name} is not a packet a {side} may receive", name)
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
                f"packet of {total} bytes exceeds max_packet_size {self._max}", name
            )
        return ptype, flags, i - pos, remaining

    def _decode(self, limit: int) -> list[Packet]:
        if self._error is not None:
            raise self._error
        out: list[Packet] = []
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
