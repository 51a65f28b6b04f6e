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

This module holds the entry points (:func:`encode`, :func:`encode5`, :func:`encoder`,
:func:`encode_puback`, :func:`publish_bytes`), :class:`Decoder` with its PUBLISH fast paths and
the run decoder.  Below it, each importing only the ones under it: :mod:`.codec311` (the MQTT
3.1.1 bodies), :mod:`.codec5` (the MQTT 5.0 bodies, and CONNECT at either level),
:mod:`.properties` (MQTT 5.0 properties), :mod:`.wire` (:class:`ProtocolError` and the
primitives both levels share).  ``ProtocolError`` and the public constants and property
tables are re-exported here, so ``from filemq.mqtt.codec import ...`` keeps working.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from itertools import repeat
from operator import eq
from typing import Any

from filemq.mqtt.codec5 import _ENCODERS5, _connect_level, _decode_body5, _publish_properties
from filemq.mqtt.codec311 import _ENCODERS, _decode_body
from filemq.mqtt.packets import (
    AUTH,
    CONNACK,
    CONNECT,
    DISCONNECT,
    PACKET_NAMES,
    PACKET_NAMES_V5,
    PINGREQ,
    PINGRESP,
    PROTOCOL_LEVEL,
    PROTOCOL_LEVEL_5,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    RC_PACKET_TOO_LARGE,
    RC_PROTOCOL_ERROR,
    SUBACK,
    SUBSCRIBE,
    UNSUBACK,
    UNSUBSCRIBE,
    Packet,
    Properties,
    Publish,
    PublishRun,
)
from filemq.mqtt.properties import ALLOWED_PROPERTIES as ALLOWED_PROPERTIES
from filemq.mqtt.properties import PROPERTY_NAMES as PROPERTY_NAMES
from filemq.mqtt.properties import PROPERTY_TYPES as PROPERTY_TYPES
from filemq.mqtt.properties import encode_message_headers, encode_vbi
from filemq.mqtt.wire import MAX_REMAINING_LENGTH as MAX_REMAINING_LENGTH
from filemq.mqtt.wire import ProtocolError as ProtocolError
from filemq.mqtt.wire import UnsupportedProtocolLevel as UnsupportedProtocolLevel
from filemq.mqtt.wire import (
    _fixed_header,
    _pack_BBH,
    _pack_H,
)

DEFAULT_MAX_PACKET_SIZE = 1 << 20
_TOPIC_CACHE_SIZE = 1024
_PROPS_CACHE_SIZE = 64  # PUBLISH property sections a decoder remembers (each <= 127 bytes)

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


# --------------------------------------------------------------------------- encoding


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


def _cache_topic(topic: str) -> bytes:
    """The length-prefixed UTF-8 topic field, cached in :data:`_topic_bytes` (bounded with
    unbounded distinct topics); the publish encoders look the cache up inline first."""
    raw = topic.encode("utf-8")
    tb = _pack_H(len(raw)) + raw
    if len(_topic_bytes) >= 4096:
        _topic_bytes.clear()
    _topic_bytes[topic] = tb
    return tb


def publish_bytes(topic: str, payload: bytes, qos: int, dup: bool, packet_id: int | None,
                  retain: bool = False, _props: bytes = b"") -> bytes:
    """PUBLISH bytes, the same as ``encode(Publish(...))``, without building a :class:`Publish`
    and with each topic's encoding cached: a record fanned out to N subscribers encodes its
    topic once (the broker's delivery hot path; the topic was validated when it was stored).
    ``_props`` is accepted and dropped (3.1.1 has no properties), so one call site serves
    both levels (:func:`publish_bytes5`)."""
    tb = _topic_bytes.get(topic)
    if tb is None:
        tb = _cache_topic(topic)
    first = 0x30 | (qos << 1) | (0x08 if dup else 0) | (0x01 if retain else 0)
    if qos:
        assert packet_id is not None
        return b"".join((_fixed_header(first, len(tb) + 2 + len(payload)), tb, _pack_H(packet_id), payload))
    return b"".join((_fixed_header(first, len(tb) + len(payload)), tb, payload))


def publish_bytes5(topic: str, payload: bytes, qos: int, dup: bool, packet_id: int | None,
                   retain: bool = False, props: bytes = b"") -> bytes:
    """MQTT 5.0 PUBLISH bytes as :func:`publish_bytes`; ``props`` is an already encoded
    property section body without its length (e.g. a record's headers, plus subscription
    identifiers), so a delivery splices stored properties without decoding them."""
    tb = _topic_bytes.get(topic)
    if tb is None:
        tb = _cache_topic(topic)
    first = 0x30 | (qos << 1) | (0x08 if dup else 0) | (0x01 if retain else 0)
    plen = encode_vbi(len(props)) if props else b"\x00"
    size = len(tb) + len(plen) + len(props) + len(payload)
    if qos:
        assert packet_id is not None
        return b"".join((_fixed_header(first, size + 2), tb, _pack_H(packet_id), plen, props, payload))
    return b"".join((_fixed_header(first, size), tb, plen, props, payload))


# --------------------------------------------------------------------------- decoding


_RUN_MIN = 4  # the fewest packets worth the run check of _publish_run
_UNCACHED = False  # _publish_run's answer when the topic is not in the cache yet


def _publish_run(buf: bytes, pos: int, n: int, maxsize: int, cache: dict[bytes, str],
                 as_run: bool = False, v5: bool = False,
                 sections: Callable[[bytes], tuple[Properties, bytes]] | None = None,
                 ) -> tuple[list[Packet], int] | bool | None:
    """MQTT 3.1.1 PUBLISHes at ``buf[pos:]`` that all have the first one's size, fixed header
    and topic (a device publishing fixed-size messages to one topic): decoded with C-level
    maps, no bytecode per packet, into what the per-packet fast path of ``Decoder._decode``
    gives (``as_run``: one :class:`PublishRun` of them), with the offset after them; None
    (nothing decoded) unless at least :data:`_RUN_MIN` complete ones do, and
    :data:`_UNCACHED` if they would but their topic is not in ``cache``.  ``v5``: MQTT 5.0
    PUBLISHes, of which those with the first one's property section join the run: none
    (property length 0), or, with ``sections`` (a section's properties and record headers,
    validated as the general path does; raises ProtocolError), the same bytes in every
    packet, validated once (a section with a topic alias makes no run)."""
    first = buf[pos]
    second = buf[pos + 1]
    if second < 0x80:
        head = 2
        remaining = second
    elif n - pos >= 3 and 0 < buf[pos + 2] < 0x80:  # (0: not minimal, MQTT-1.5.5-1)
        head = 3
        remaining = (second & 0x7F) | (buf[pos + 2] << 7)
    else:
        return None
    size = head + remaining
    count = (n - pos) // size
    qos = (first >> 1) & 0x03
    if count < _RUN_MIN or size > maxsize or remaining < 2 or qos == 3:
        return None
    tstart = pos + head + 2
    tend = tstart + ((buf[pos + head] << 8) | buf[pos + head + 1])
    pstart = tend + 2 if qos else tend
    k = 0  # the property section's length, the same in every packet of the run (checked below)
    if v5:
        if pstart >= pos + size:
            return None
        k = buf[pstart]
        if k >= 0x80 or (k and sections is None):
            return None
        pstart += 1 + k
    if pstart > pos + size:
        return None
    topic = cache.get(buf[tstart:tend])
    if topic is None:
        return _UNCACHED
    # The run: the packets from ``pos`` on that start with the first one's fixed header (so
    # have its size), topic length and topic, up to the first that does not. Every field of
    # every packet is cut out by struct unpacks (one per power-of-two piece of the count, of
    # cached Structs), with no Python object per packet besides the fields themselves.
    lead = tend - pos
    plen = pos + size - pstart
    fields = _run_fields(buf, pos, size, lead, plen, qos != 0, v5, count, k)
    # fields per packet: lead, [packet id], [property length, [property section]], payload
    width = 2 + (qos != 0) + v5 + (k != 0)
    heads = fields[0::width]
    first_head = heads[0]
    if heads.count(first_head) != count:
        count = list(map(eq, heads, repeat(first_head))).index(False)
        if count < _RUN_MIN:
            return None
    if v5:
        at = 1 + (qos != 0)
        plens = fields[at::width]  # the run ends at the first packet with other properties
        if plens.count(k) != len(plens):
            count = min(count, list(map(eq, plens, repeat(k))).index(False))
            if count < _RUN_MIN:
                return None
        if k:
            secs = fields[at + 1::width]
            first_sec = secs[0]
            if secs.count(first_sec) != len(secs):
                count = min(count, list(map(eq, secs, repeat(first_sec))).index(False))
                if count < _RUN_MIN:
                    return None
    stop = count * width
    end = pos + count * size
    packet_ids: list[int] | None = None
    if qos:
        packet_ids = list(fields[1:stop:width])
        if 0 in packet_ids:  # invalid: the general path reports it
            return None
    props: Properties | None = None
    headers: bytes | None = None
    if k:
        assert sections is not None
        props, headers = sections(first_sec)  # (raises for the run's first packet, as its own decode would)
        if props.topic_alias is not None:  # (the connection resolves an alias packet by packet)
            return None
    payloads = list(fields[width - 1:stop:width])
    if as_run:
        return [PublishRun(topic, payloads, qos, bool(first & 1), bool(first & 8), packet_ids, props, headers)], end
    pids: Iterable[int | None] = packet_ids if packet_ids is not None else repeat(None)
    return list(map(Publish, repeat(topic), payloads, repeat(qos), repeat(bool(first & 1)), repeat(bool(first & 8)),
                    pids, repeat(props), repeat(headers))), end


# Structs for _publish_run: (lead, payload size, has packet id, v5, section size, 2^k) -> a
# Struct of 2^k packets' fields (lead bytes, [id], [property length, [section]], payload),
# k <= _RUN_PIECE_LOG; cleared
# when full (~6 us to build one, <= ~9 KiB each: <= ~1.2 MiB whatever layouts clients send).
_run_structs: dict[tuple[int, int, bool, bool, int, int], struct.Struct] = {}
_RUN_STRUCTS_MAX = 128
_RUN_PIECE_LOG = 6  # pieces of at most 64 packets


def _run_fields(buf: bytes, pos: int, size: int, lead: int, plen: int, has_id: bool, v5: bool,
                count: int, section: int = 0) -> tuple[Any, ...]:
    """The fields of the ``count`` packets of ``size`` bytes from ``buf[pos]`` on, each ``lead``
    bytes, [a packet id (u16)], [a property length (u8) [and a property section of ``section``
    bytes]] and a payload of ``plen`` bytes, in
    one flat tuple: unpacked in pieces of 2^k packets, largest first (one cached Struct per
    piece size and layout)."""
    out: tuple[Any, ...] = ()
    piece = 1 << _RUN_PIECE_LOG
    structs = _run_structs
    while count:
        while piece > count:
            piece >>= 1
        key = (lead, plen, has_id, v5, section, piece)
        layout = structs.get(key)
        if layout is None:
            if len(structs) >= _RUN_STRUCTS_MAX:
                structs.clear()
            one = f"{lead}s" + ("H" if has_id else "") + ("B" if v5 else "") + (f"{section}s" if section else "") \
                + f"{plen}s"
            layout = structs[key] = struct.Struct(">" + one * piece)
        out += layout.unpack_from(buf, pos)
        pos += piece * size
        count -= piece
    return out


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
    any, else None (always None on 3.1.1).  Level 5 has the same PUBLISH fast path and runs
    as 3.1.1 for packets without properties; the fast path also takes PUBLISHes whose property
    section it has validated before on this connection, and those share one
    :class:`Properties` object (read-only to the caller) and carry its record ``headers``.

    After a :class:`ProtocolError` the decoder is poisoned: every later call re-raises it,
    because a byte stream cannot be resynchronised after a framing error.
    """

    __slots__ = ("_allowed", "_buf", "_error", "_max", "_max_connect5", "_names", "_pos", "_props", "_runs",
                 "_server", "_topics", "_v5")

    def __init__(self, max_packet_size: int = DEFAULT_MAX_PACKET_SIZE, *, server: bool = True,
                 protocol_level: int = PROTOCOL_LEVEL, runs: bool = False, max_connect5: int = 0) -> None:
        if max_packet_size < 2:
            raise ValueError(f"max_packet_size must be at least 2 bytes, got {max_packet_size}")
        # A level-5 CONNECT may be up to this size although max_packet_size is lower (a
        # server's pre-CONNECT cap, MQTT 3.1.1's largest CONNECT); its arrival lifts the cap.
        self._max_connect5 = max_connect5
        # packets(): a run of equal-shaped PUBLISHes comes as one PublishRun (MQTT 5: QoS 1 ones
        # without properties).
        self._runs = runs
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
        # MQTT 5: validated PUBLISH property sections (of up to 127 bytes) -> their properties
        # and record headers, so a device sending the same properties with every message
        # (a content type, a user property) has them decoded once (issue 33 item 6).
        self._props: dict[bytes, tuple[Properties, bytes]] = {}

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
                if not byte and shift:  # e.g. "80 00": a shorter encoding exists (MQTT-1.5.5-1)
                    raise ProtocolError("remaining length is not in its minimal encoding (MQTT-1.5.5-1)", name)
                break
            shift += 7
            if shift >= 28:
                raise ProtocolError("remaining length exceeds 4 bytes", name)
        total = i - pos + remaining
        if total > self._max:
            level = _connect_level(buf, i, n) if ptype == CONNECT else None
            if level == PROTOCOL_LEVEL_5 and total <= self._max_connect5:
                self._max = self._max_connect5
            elif level is None and ptype == CONNECT and total <= self._max_connect5:
                return None  # its level byte decides, a few bytes on
            else:
                exc = ProtocolError(f"packet of {total} bytes exceeds max_packet_size {self._max}", name,
                                    RC_PACKET_TOO_LARGE)
                exc.connect_level = level  # (a level-5 CONNECT gets CONNACK 0x95)
                raise exc
        return ptype, flags, i - pos, remaining

    def _decode(self, limit: int) -> list[Packet]:
        """Up to ``limit`` complete packets (-1: every one buffered), for either protocol level.

        Fast path: a PUBLISH with a 1- or 2-byte remaining length and a topic seen before on
        this connection -- nearly all traffic -- and with :meth:`packets`, a run of
        equal-shaped PUBLISHes as one :class:`PublishRun` (:func:`_publish_run`).  Anything
        unusual falls through to the general path, which also produces the error messages.
        MQTT 5 differs in three places, each marked ``v5``: a property length follows the
        packet id (0: none; a section seen before is taken from the cache, otherwise validated
        now), only a QoS 1 run comes as one run, and the general path decodes with
        :func:`_decode_body5`.  A 3.1.1 server's decoder switches to MQTT 5 at a level-5
        CONNECT, for it and everything pipelined behind it."""
        if self._error is not None:
            raise self._error
        out: list[Packet] = []
        v5 = self._v5
        switch = False
        buf = self._buf
        n = len(buf)
        pos = self._pos
        maxsize = self._max
        cache = self._topics
        as_bytes = type(buf) is bytes
        runs = limit < 0 and as_bytes  # packets(): look for runs of equal-shaped PUBLISHes
        try:
            while limit and n - pos >= 2:
                first = buf[pos]
                if first >> 4 == PUBLISH:
                    if runs:
                        if v5:
                            run = _publish_run(buf, pos, n, maxsize, cache,  # type: ignore[arg-type]
                                               self._runs and first & 0x06 == 0x02, True, self._section)
                        else:
                            run = _publish_run(buf, pos, n, maxsize, cache, self._runs)  # type: ignore[arg-type]
                        if type(run) is tuple:
                            out += run[0]
                            pos = run[1]
                            continue
                        # Tried once per call after a run ends; again after this packet when
                        # only its topic was unknown (the general path caches it).
                        runs = run is _UNCACHED
                    second = buf[pos + 1]
                    if second < 0x80:
                        start = pos + 2
                        end = start + second
                    elif n - pos >= 3 and 0 < buf[pos + 2] < 0x80:  # (0: not minimal, MQTT-1.5.5-1)
                        start = pos + 3
                        end = start + ((second & 0x7F) | (buf[pos + 2] << 7))
                    else:
                        end = 0
                    if end:
                        if end - pos > maxsize or end - start < 2 + v5:  # (v5: a property length too)
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
                        if pstart + v5 <= end and pid != 0 and qos != 3:  # (v5: the property length)
                            key = buf[start + 2 : tend]
                            topic = cache.get(key if as_bytes else bytes(key))  # type: ignore[arg-type]
                            if topic is not None:
                                if not v5:
                                    payload = buf[pstart:end] if as_bytes else bytes(buf[pstart:end])
                                    out.append(Publish(topic, payload, qos, bool(first & 1), bool(first & 8), pid))  # type: ignore[arg-type]
                                    pos = end
                                    limit -= 1
                                    continue
                                size = buf[pstart]
                                pstart += 1
                                if not size:
                                    payload = buf[pstart:end] if as_bytes else bytes(buf[pstart:end])
                                    out.append(Publish(topic, payload, qos, bool(first & 1), bool(first & 8), pid))  # type: ignore[arg-type]
                                    pos = end
                                    limit -= 1
                                    continue
                                if size < 0x80 and pstart + size <= end:
                                    # v5 properties: a section seen before, or validated now.
                                    pend = pstart + size
                                    section = bytes(buf[pstart:pend])
                                    known = self._props.get(section)
                                    if known is None:
                                        known = self._publish_properties(section)
                                    payload = buf[pend:end] if as_bytes else bytes(buf[pend:end])
                                    out.append(Publish(topic, payload, qos, bool(first & 1), bool(first & 8), pid,  # type: ignore[arg-type]
                                                       known[0], known[1]))
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
                if v5:
                    packet = _decode_body5(ptype, flags, buf, pos + header_len, end, self._server)
                else:
                    packet = _decode_body(ptype, flags, buf, pos + header_len, end)
                if ptype == PUBLISH:
                    if packet.topic:  # type: ignore[union-attr]  # (v5: empty with a topic alias)
                        self._remember_topic(packet.topic)  # type: ignore[union-attr]
                elif not v5 and ptype == CONNECT and self._server and packet.protocol_level == PROTOCOL_LEVEL_5:  # type: ignore[union-attr]
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
                out.extend(self._decode(limit))
        return out

    def _section(self, section: bytes) -> tuple[Properties, bytes]:
        """A PUBLISH property section's properties and record headers, from the cache or
        validated now (:meth:`_publish_properties`)."""
        known = self._props.get(section)
        return known if known is not None else self._publish_properties(section)

    def _publish_properties(self, section: bytes) -> tuple[Properties, bytes]:
        """A PUBLISH property section (without its length) validated as the general path
        does (:func:`~filemq.mqtt.codec5._publish_properties`), with its record headers,
        remembered for the next PUBLISH that carries the same bytes; raises ProtocolError."""
        props = _publish_properties(bytes((len(section),)) + section, 0, len(section) + 1, self._server)[0]
        assert props is not None  # (a section of 1..127 bytes)
        known = (props, encode_message_headers(props))
        cache = self._props
        if len(cache) >= _PROPS_CACHE_SIZE:
            cache.clear()
        cache[section] = known
        return known

    def _remember_topic(self, topic: str) -> None:
        # Only topics that passed full validation enter; bounded so a client cycling
        # through many topics cannot grow it without limit.
        cache = self._topics
        if len(cache) >= _TOPIC_CACHE_SIZE:
            cache.clear()
        cache[topic.encode("utf-8")] = topic
