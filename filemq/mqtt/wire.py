"""The primitives both MQTT protocol levels share: :class:`ProtocolError`, the struct packers,
the fixed header and its remaining-length varint (spec 2.2.3), UTF-8 strings and binary data
(spec 1.5.3, 1.5.6) on both sides of the wire, and the few packet bodies that 3.1.1 and 5.0
encode or decode alike (PINGREQ, PINGRESP, a 3.1.1 CONNACK, an empty body, a packet id).

Imports only :mod:`filemq.mqtt.packets`; :mod:`.properties`, :mod:`.codec5` and :mod:`.codec`
build on it.
"""

from __future__ import annotations

import struct

from filemq.mqtt.packets import (
    PACKET_NAMES,
    PINGREQ,
    PINGRESP,
    RC_MALFORMED_PACKET,
    RC_PROTOCOL_ERROR,
    Connack,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
)

# The largest remaining length four varint bytes can carry, spec 2.2.3.
MAX_REMAINING_LENGTH = 268_435_455


class ProtocolError(ValueError):
    """The peer sent bytes that are not valid MQTT; the connection must be closed.

    ``reason`` is the human-readable cause; ``packet_type`` the packet's name when known;
    ``reason_code`` the MQTT 5 reason code to put on the CONNACK or DISCONNECT that closes an
    MQTT 5 connection (spec 4.13): 0x81 Malformed Packet unless the spec names another
    (0x82 Protocol Error, 0x94 Topic Alias invalid, 0x95 Packet too large).  A 3.1.1
    connection has no way to send it and just closes.  ``connect_level`` is the protocol level
    of the CONNECT the fault is in, once its level byte was read (else None): a server answers
    a level-5 one with a CONNACK carrying ``reason_code`` (MQTT-3.1.4-1, 4.13.1).
    """

    def __init__(self, reason: str, packet_type: str | None = None, reason_code: int = RC_MALFORMED_PACKET) -> None:
        super().__init__(reason)
        self.reason = reason
        self.packet_type = packet_type
        self.reason_code = reason_code
        self.connect_level: int | None = None


class UnsupportedProtocolLevel(ProtocolError):
    """A CONNECT of a protocol level filemq does not speak (not 3, 4 or 5): ``level`` is it,
    ``shape`` 5 when the rest of the CONNECT parses as an MQTT 5.0 one (properties after the
    keep alive), else 4.  The server answers it before closing (3.1.2.2, MQTT-3.1.2-2 of 3.1.1
    and of 5.0): CONNACK 0x84 Unsupported Protocol Version in the MQTT 5 shape, or 0x01
    unacceptable protocol version in the 3.1.1 one.  ``reason_code`` is 0x82: on a connection
    past CONNACK a CONNECT of any level is a Protocol Error (MQTT-3.1.0-2)."""

    def __init__(self, level: int, shape: int) -> None:
        super().__init__(f"CONNECT protocol level {level} (in the MQTT {'5.0' if shape == 5 else '3.1.1'} shape); "
                         "only 4 (MQTT 3.1.1) and 5 (MQTT 5.0) are spoken", "CONNECT", RC_PROTOCOL_ERROR)
        self.level = level
        self.shape = shape


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


_PINGREQ = b"\xc0\x00"
_PINGRESP = b"\xd0\x00"
_DISCONNECT = b"\xe0\x00"


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


def _decode_connack(buf: bytes | bytearray, pos: int, end: int) -> Connack:
    if end - pos != 2:
        raise ProtocolError(f"CONNACK remaining length {end - pos}, expected 2", "CONNACK")
    ack_flags, code = buf[pos], buf[pos + 1]
    if ack_flags & 0xFE:
        raise ProtocolError(f"CONNACK reserved acknowledge flags 0x{ack_flags:02x}", "CONNACK")
    return Connack(session_present=bool(ack_flags), return_code=code)


def _decode_header_packet_id(buf: bytes | bytearray, pos: int, end: int, name: str) -> int:
    if end - pos < 2:
        raise ProtocolError(f"{name} truncated before the packet id", name)
    pid = (buf[pos] << 8) | buf[pos + 1]
    if pid == 0:  # it parses: a Protocol Error on MQTT 5, not Malformed (MQTT-2.2.1-3)
        raise _protocol_error(f"{name} with packet id 0 (MQTT-2.2.1-3)", name)
    return pid


def _decode_empty(ptype: int, remaining: int) -> Packet:
    name = PACKET_NAMES[ptype]
    if remaining:
        raise ProtocolError(f"{name} remaining length {remaining}, expected 0", name)
    if ptype == PINGREQ:
        return Pingreq()
    if ptype == PINGRESP:
        return Pingresp()
    return Disconnect()


def _protocol_error(reason: str, name: str | None) -> ProtocolError:
    return ProtocolError(reason, name, reason_code=RC_PROTOCOL_ERROR)
