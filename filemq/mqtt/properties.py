"""MQTT 5.0 properties (spec 2.2.2): the property tables (identifier, type, name, which packet
may carry which) and the encoding and decoding of a property section, with the variable byte
integers (spec 1.5.5) they use.

Imports :mod:`.wire` and :mod:`filemq.mqtt.packets`; used by :mod:`.codec5` and :mod:`.codec`.
"""

from __future__ import annotations

import operator
import struct

from filemq.mqtt.packets import Properties
from filemq.mqtt.wire import (
    ProtocolError,
    _bin,
    _pack_H,
    _protocol_error,
    _read_bin,
    _read_str,
    _str,
    _unpack_H,
)

# --------------------------------------------------------------------------- MQTT 5.0 properties

MAX_USER_PROPERTIES = 1024
"""User properties one packet may carry (issue 30 item 4): the spec sets no number, and
decoding 200,000 empty ones (one 1 MB PUBLISH) took 0.4 s of the event loop; more is refused
with reason code 0x97 Quota exceeded (an implementation-imposed limit, 4.13)."""
RC_QUOTA_EXCEEDED = 0x97

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
# The message properties of a PUBLISH (and of a will) that the log stores with its record and
# that travel upstream: what a receiver gets again (3.3.2.3; the topic alias and the
# subscription identifiers belong to one connection and are not stored).
MESSAGE_PROPERTY_IDS = frozenset({0x01, 0x02, 0x03, 0x08, 0x09, 0x26})
# ALLOWED_PROPERTIES and the pseudo-kind "MESSAGE" (a record's headers).
_KIND_ALLOWED: dict[str, frozenset[int]] = {**ALLOWED_PROPERTIES, "MESSAGE": MESSAGE_PROPERTY_IDS}
# (identifier, type) in table order, and a getter of every Properties field in that order.
_PROPERTY_KINDS = tuple((ident, kind) for ident, (_attr, kind) in PROPERTY_TYPES.items())
_all_properties = operator.attrgetter(*(attr for attr, _kind in PROPERTY_TYPES.values()))
_MAX_VBI = 268_435_455
_pack_I = struct.Struct("!I").pack
_unpack_I = struct.Struct("!I").unpack_from


def encode_vbi(value: int) -> bytes:
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
    allowed = _KIND_ALLOWED[name]
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
                out += encode_vbi(ident)
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
    return encode_vbi(len(out)) + out


# --------------------------------------------------------------------------- decoding


def read_vbi(buf: bytes | bytearray, pos: int, end: int, what: str, name: str) -> tuple[int, int]:
    """A variable byte integer (spec 1.5.5); more than 4 bytes, running past ``end`` or more
    bytes than the value needs (MQTT-1.5.5-1) is a Malformed Packet."""
    value = 0
    shift = 0
    while True:
        if pos >= end:
            raise ProtocolError(f"{name} {what} runs past the end of the packet", name)
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if not byte and shift:  # e.g. "80 00": a shorter encoding exists
                raise ProtocolError(f"{name} {what}: variable byte integer not in its minimal encoding "
                                    "(MQTT-1.5.5-1)", name)
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
    length, pos = read_vbi(buf, pos, end, "property length", name)
    pend = pos + length
    if pend > end:
        raise ProtocolError(f"{name} property length {length} runs past the end of the packet", name)
    if not length:
        return None, pos
    props = Properties()
    allowed = _KIND_ALLOWED[kind or name]
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
            pairs = props.user_properties
            if len(pairs) >= MAX_USER_PROPERTIES:
                raise ProtocolError(f"{name} carries more than {MAX_USER_PROPERTIES} user properties", name,
                                    reason_code=RC_QUOTA_EXCEEDED)
            pairs.append((key, val))
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
            value, pos = read_vbi(buf, pos, pend, what, name)
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


def decode_publish_properties(buf: bytes | bytearray, pos: int, end: int) -> tuple[Properties | None, int]:
    """:func:`_decode_properties` of a PUBLISH (``name`` "PUBLISH"), specialised: the same
    result for every block the generic decoder takes, and the same error for every block it
    refuses (issue 33 item 6; tests/test_properties_publish.py checks both with Hypothesis).

    One pass over the block for the PUBLISH property set only (payload format indicator,
    message expiry, content type, response topic, correlation data, topic alias,
    subscription identifier, user property), with the values kept in locals and one
    :class:`Properties` built at the end.  Every rule of the generic decoder holds: a property
    length or subscription identifier in its minimal encoding (MQTT-1.5.5-1), every length
    within the block and the block within the packet, UTF-8 well-formed without U+0000
    (MQTT-1.5.4-1, -2), a single-valued property at most once, the payload format indicator
    0 or 1, a subscription identifier not 0, at most :data:`MAX_USER_PROPERTIES` user
    properties, no identifier a PUBLISH may not carry.  At the first fault it hands the
    block to :func:`_decode_properties`, which raises the error (and the reason code) a
    person reads: the errors have one source."""
    if pos >= end:
        return _decode_properties(buf, pos, end, "PUBLISH")
    length = buf[pos]
    start = pos + 1
    if length >= 0x80:  # a two-byte property length (128..16383 bytes); longer ones go generic
        if start >= end or not 0 < buf[start] < 0x80:
            return _decode_properties(buf, pos, end, "PUBLISH")
        length = (length & 0x7F) | (buf[start] << 7)
        start += 1
    pend = start + length
    if pend > end:
        return _decode_properties(buf, pos, end, "PUBLISH")
    if not length:
        return None, start
    pfi: int | None = None
    expiry: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation: bytes | None = None
    alias: int | None = None
    users: list[tuple[str, str]] = []
    subs: list[int] = []
    p = start
    try:
        while p < pend:
            ident = buf[p]
            p += 1
            if ident == 0x26 or ident == 0x03 or ident == 0x08:  # UTF-8 string (pair)
                if pend - p < 2:
                    break
                a = p + 2
                p = a + ((buf[p] << 8) | buf[p + 1])
                if p > pend:
                    break
                text = buf[a:p].decode("utf-8")  # (strict: ill-formed and surrogates refused)
                if "\x00" in text:
                    break
                if ident == 0x26:
                    if pend - p < 2:
                        break
                    a = p + 2
                    p = a + ((buf[p] << 8) | buf[p + 1])
                    if p > pend:
                        break
                    value = buf[a:p].decode("utf-8")
                    if "\x00" in value or len(users) >= MAX_USER_PROPERTIES:
                        break
                    users.append((text, value))
                elif ident == 0x03:
                    if content_type is not None:
                        break
                    content_type = text
                else:
                    if response_topic is not None:
                        break
                    response_topic = text
            elif ident == 0x01:
                if p >= pend or pfi is not None or buf[p] > 1:
                    break
                pfi = buf[p]
                p += 1
            elif ident == 0x02:
                if pend - p < 4 or expiry is not None:
                    break
                (expiry,) = _unpack_I(buf, p)
                p += 4
            elif ident == 0x09:
                if pend - p < 2 or correlation is not None:
                    break
                a = p + 2
                p = a + ((buf[p] << 8) | buf[p + 1])
                if p > pend:
                    break
                correlation = bytes(buf[a:p])
            elif ident == 0x23:
                if pend - p < 2 or alias is not None:
                    break
                alias = (buf[p] << 8) | buf[p + 1]
                p += 2
            elif ident == 0x0B:
                ident_value = 0
                shift = 0
                byte = 0
                while p < pend and shift < 28:
                    byte = buf[p]
                    p += 1
                    ident_value |= (byte & 0x7F) << shift
                    if not byte & 0x80:
                        break
                    shift += 7
                else:
                    break  # past the block, or a fifth byte
                if not ident_value or (not byte and shift):  # 0, or not minimal (MQTT-1.5.5-1)
                    break
                subs.append(ident_value)
            else:  # unknown, or not a PUBLISH property
                break
        else:
            props = Properties(payload_format_indicator=pfi, message_expiry_interval=expiry,
                               content_type=content_type, response_topic=response_topic,
                               correlation_data=correlation, topic_alias=alias)
            if users:
                props.user_properties = users
            if subs:
                props.subscription_identifiers = subs
            return props, pend
    except UnicodeDecodeError:
        pass
    return _decode_properties(buf, pos, end, "PUBLISH")


# --------------------------------------------------------------------------- record headers


def encode_message_headers(props: Properties | None) -> bytes:
    """A record's ``headers`` (segments.record.Record): the message properties of a PUBLISH or
    will (:data:`MESSAGE_PROPERTY_IDS`) as an MQTT 5.0 property section *without* its length,
    in identifier order (user properties in their wire order) -- the same bytes as the
    generic property encoder gives, built directly: this runs for every MQTT 5 PUBLISH with
    properties.  ``b""`` when there are none, so a 3.1.1 message, or one without message
    properties, is stored as before.  ValueError for a value out of its type's range."""
    if props is None:
        return b""
    out = bytearray()
    v = props.payload_format_indicator
    if v is not None:
        if v not in (0, 1):
            raise ValueError(f"payload format indicator must be 0..1, got {v}")
        out += b"\x01\x00" if v == 0 else b"\x01\x01"
    v = props.message_expiry_interval
    if v is not None:
        out.append(0x02)
        out += _pack_I(v)  # struct.error (a ValueError) outside 0..2**32-1
    t = props.content_type
    if t is not None:
        out.append(0x03)
        out += _str(t, "content type")
    t = props.response_topic
    if t is not None:
        out.append(0x08)
        out += _str(t, "response topic")
    b = props.correlation_data
    if b is not None:
        out.append(0x09)
        out += _bin(b, "correlation data")
    for key, val in props.user_properties:
        out.append(0x26)
        out += _str(key, "user property name")
        out += _str(val, "user property value")
    return bytes(out)


def _encode_message_headers_generic(props: Properties | None) -> bytes:
    """:func:`encode_message_headers` through the generic property encoder (the tests' oracle)."""
    if props is None:
        return b""
    msg = Properties(
        payload_format_indicator=props.payload_format_indicator,
        message_expiry_interval=props.message_expiry_interval,
        content_type=props.content_type,
        response_topic=props.response_topic,
        correlation_data=props.correlation_data,
        user_properties=props.user_properties,
    )
    section = _encode_properties(msg, "MESSAGE")
    _length, pos = read_vbi(section, 0, len(section), "property length", "MESSAGE")
    return section[pos:]


def decode_message_headers(headers: bytes) -> Properties | None:
    """The :class:`Properties` of a record's ``headers`` (None for ``b""``); raises
    :class:`ProtocolError` when they are not a valid message property section."""
    if not headers:
        return None
    section = encode_vbi(len(headers)) + headers
    props, pos = _decode_properties(section, 0, len(section), "MESSAGE")
    if pos != len(section):  # pragma: no cover - the length prefix is exact
        raise ProtocolError("record headers: trailing bytes", "MESSAGE")
    return props
