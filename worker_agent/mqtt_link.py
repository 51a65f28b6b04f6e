"""The MQTT export's connection upstream: a lean MQTT 5.0 / 3.1.1 publisher for a record backlog.

:class:`ExportLink` does what :class:`worker_agent.mqtt_export.MqttExport` needs of an upstream
client and nothing else: CONNECT (clean session as asked), QoS 1 or 2 publishes of log records
with their acknowledgements, the resend of the in-flight window after a reconnect, keepalive.
It exists because the general client (:class:`filemq.mqtt.client.MQTTClient`) builds a
``Publish`` object per message and decodes every acknowledgement into a packet object, which
cost the export more CPU per record than the upstream broker spends on it.

Per batch of records it builds every PUBLISH frame into one ``b"".join`` and writes once;
packet ids come from a counter (an id still in flight is skipped). A read made only of
4-byte PUBACKs (what a broker sends back) is split with C-level slices instead of decoding
packet by packet; anything else goes through the codec's :class:`Decoder`.

The protocol rules it keeps, as the general client does:

* Outgoing QoS 1/2 publishes stay in flight until PUBACK (QoS 1) or PUBCOMP (QoS 2); the
  window survives a lost connection and :meth:`ExportLink.connect` sends it again first, in
  original order, with the same packet ids: PUBLISH with DUP set when not yet PUBACK'd /
  PUBREC'd, PUBREL when PUBREC'd (MQTT-4.4.0-1).
* A PUBREC is answered with PUBREL even for an unknown id, so the broker can finish (4.3.3).
* ``dup`` on the first send marks a record possibly sent before a restart (MQTT-3.3.1-1).

MQTT 5 (``protocol = "5"``, or ``"auto"``: tried first, 3.1.1 when the destination refuses
the level -- CONNACK 0x01 or 0x84, or a close before any CONNACK -- and then accepts a 3.1.1
CONNECT; :attr:`ExportLink.fallback` says why, for the status): each PUBLISH carries the
record's message properties (payload format, content type, response topic, correlation
data, user properties in wire order) with the message expiry interval lowered by the time
the record has spent in the log (MQTT-3.3.2-6); the session is persistent with a Session
Expiry Interval of 0xFFFFFFFF (never, as 3.1.1's clean session 0); the CONNACK's Receive
Maximum (:attr:`ExportLink.send_quota`), Maximum Packet Size, Retain Available and Maximum
QoS are kept. A PUBACK or PUBREC with a failure reason code (>= 0x80) does not complete
the message: it stays in flight (logged once per code) and is resent after the export's
ack timeout reconnects; a DISCONNECT from the destination ends the connection with its
reason code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl as ssl_module
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import chain, repeat
from operator import attrgetter
from typing import Protocol, cast

from filemq.broker.session_state import message_expiry
from filemq.mqtt.client import ConnectionRefused
from filemq.mqtt.codec import Decoder, ProtocolError, encode
from filemq.mqtt.packets import (
    CONNACK_ACCEPTED,
    PROTOCOL_LEVEL,
    PROTOCOL_LEVEL_5,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingresp,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
)
from filemq.mqtt.properties import encode_vbi
from filemq.mqtt.pubacks import puback_ids

log = logging.getLogger(__name__)

DISCONNECT = b"\xe0\x00"
PINGREQ = b"\xc0\x00"
COALESCE_S = 0.002  # how long acknowledgements may gather while the window is well filled
_PREFIX_CACHE_MAX = 4096  # (topic, payload length) -> fixed header + topic, per flags byte
_PAYLOAD = attrgetter("payload")
_TOPIC = attrgetter("topic")
_RETAIN = attrgetter("retain")
_HEADERS = attrgetter("headers")
NEVER_EXPIRES = 0xFFFFFFFF  # MQTT 5 Session Expiry Interval: the session outlives every connection
PROTOCOLS = ("auto", "5", "3.1.1")
# MQTT 5 CONNACK reason codes (3.2.2.2), for the export's last_error.
CONNACK5_NAMES = {
    0x80: "unspecified error", 0x81: "malformed packet", 0x82: "protocol error",
    0x83: "implementation specific error", 0x84: "unsupported protocol version",
    0x85: "client identifier not valid", 0x86: "bad user name or password", 0x87: "not authorized",
    0x88: "server unavailable", 0x89: "server busy", 0x8A: "banned", 0x8C: "bad authentication method",
    0x90: "topic name invalid", 0x95: "packet too large", 0x97: "quota exceeded",
    0x99: "payload format invalid", 0x9A: "retain not supported", 0x9B: "QoS not supported",
    0x9C: "use another server", 0x9D: "server moved", 0x9F: "connection rate exceeded",
}
_PACK_ID = struct.Struct(">H").pack


class Message(Protocol):
    """What the link publishes: a log record (``segments.Record`` fits)."""

    @property
    def offset(self) -> int: ...

    @property
    def topic(self) -> str: ...

    @property
    def payload(self) -> bytes: ...

    @property
    def retain(self) -> bool: ...

    @property
    def headers(self) -> bytes: ...  # MQTT 5 message properties (segments format 2), b"" if none

    @property
    def timestamp_us(self) -> int: ...


def message_properties(headers: bytes, timestamp_us: int, now_us: int) -> bytes:
    """The MQTT 5 property section (length included) of a record's PUBLISH upstream: its
    headers with the message expiry interval lowered by the whole seconds spent since
    ``timestamp_us`` (MQTT-3.3.2-6); a message past its expiry goes with 1 s left (it is
    in flight already; the export does not start sending expired records)."""
    if not headers:
        return b"\x00"
    left = message_expiry(headers, timestamp_us, now_us)
    if left is None:
        i = 1 if headers[0] == 0x02 else 3
        interval = int.from_bytes(headers[i:i + 4], "big")
        left = message_expiry(headers, timestamp_us, timestamp_us + (interval - 1) * 1_000_000) or headers
    return encode_vbi(len(left)) + left


def remaining_length(n: int) -> bytes:
    """The MQTT variable byte integer ``n`` (spec 2.2.3)."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | 0x80 if n else byte)
        if not n:
            return bytes(out)


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection of a link: hands received bytes and the end to it."""

    def __init__(self, link: ExportLink) -> None:
        self.link = link
        self.transport: asyncio.Transport | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (uvloop transports do not subclass it)
        self.transport = transport
        # Each write is a whole run of PUBLISHes already; with a small window (an MQTT 5
        # Receive Maximum of 20, mosquitto's default) Nagle would hold the next run for the
        # destination's delayed ACK instead (measured: 433 records/s to mosquitto).
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        link = self.link
        link._received(self, data)
        # A broker acknowledges each PUBLISH with its own small write: while plenty is in flight,
        # let acknowledgements gather in the socket for a moment and read them in one go.
        if len(link.inflight) >= link.coalesce_above and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
            asyncio.get_running_loop().call_later(link.coalesce_s, self._resume)

    def _resume(self) -> None:
        self._paused = False
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.link._lost(self, exc)


class ExportLink:
    """A persistent-session MQTT 3.1.1 publisher of records, QoS 1 or 2 (see the module doc).

    ``on_complete(messages)`` is called with the messages the broker fully acknowledged, once
    per read from the socket. ``topic_of`` maps a record's topic to the published one.
    While at least ``coalesce_above`` publishes are in flight, reading pauses for ``coalesce_s``
    after each read, so acknowledgements are handled in bulk (the export sets it to half its
    window: enough stays in flight to keep the broker busy meanwhile).
    """

    def __init__(
        self,
        client_id: str,
        host: str,
        port: int,
        *,
        qos: int = 1,
        clean_session: bool = False,
        keepalive: int = 30,
        username: str | None = None,
        password: bytes | str | None = None,
        ssl: ssl_module.SSLContext | None = None,
        max_packet_size: int = 1 << 20,
        protocol: str = "3.1.1",
    ) -> None:
        if qos not in (1, 2):
            raise ValueError(f"an export publishes with QoS 1 or 2, not {qos}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
        # "auto": MQTT 5 first, 3.1.1 for the life of the link once the destination refused 5
        # and took 3.1.1 (``fallback`` says why).
        self.protocol = protocol
        self.protocol_level = PROTOCOL_LEVEL if protocol == "3.1.1" else PROTOCOL_LEVEL_5
        self.fallback: str | None = None
        # From an MQTT 5 CONNACK (3.2.2.3): publishes in flight at once, the destination's
        # packet limit, whether it takes retained messages.
        self.send_quota = 65535
        self.server_max_packet: int | None = None
        self.retain_available = True
        self._connect_sent = False
        self._refusals_logged: set[int] = set()
        self.client_id = client_id
        self.host = host
        self.port = port
        self.qos = qos
        self.clean_session = clean_session
        self.keepalive = keepalive
        self.username = username
        self.password = password.encode() if isinstance(password, str) else password
        self.ssl = ssl
        self.on_complete: Callable[[list[Message]], None] | None = None
        self.topic_of: Callable[[str], str] = _same
        self.coalesce_above = 1 << 30  # never, unless the caller sets it
        self.coalesce_s = COALESCE_S
        self.closed = asyncio.Event()
        self.closed.set()
        self.close_reason: BaseException | None = None
        # In flight, in send order: packet id -> message. QoS 2 ids PUBREC'd are also in _released.
        self.inflight: dict[int, Message] = {}
        self._released: set[int] = set()
        self._next_id = 1
        self._max_packet_size = max_packet_size
        self._conn: _Connection | None = None
        self._decoder = Decoder(max_packet_size, server=False)
        self._connack: asyncio.Future[Connack] | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self._last_sent = 0.0
        self._ping_due: float | None = None
        self._base = 0x30 | (qos << 1)  # PUBLISH first byte without DUP and RETAIN
        self._prefixes: dict[int, dict[tuple[str, int], bytes]] = {}
        self._unexpected_logged = False

    @property
    def connected(self) -> bool:
        return not self.closed.is_set()

    # -- connection -------------------------------------------------------------------------------

    async def connect(self, timeout: float = 10.0) -> Connack:
        """Connect, send CONNECT, wait for CONNACK, then resend the in-flight window first.

        Raises :class:`ConnectionRefused` (non-zero return code), ``TimeoutError``, ``OSError``
        (``ConnectionError`` when the broker closes before its CONNACK).  ``protocol = "auto"``:
        a destination that refuses MQTT 5 (see the module doc) is asked again at once in 3.1.1,
        and the link stays there if that succeeds."""
        if self.protocol != "auto" or self.protocol_level != PROTOCOL_LEVEL_5:
            return await self._connect_once(timeout)
        try:
            return await self._connect_once(timeout)
        except (ConnectionRefused, ConnectionError, ProtocolError) as exc:
            refused = isinstance(exc, ConnectionRefused) and exc.return_code in (0x01, 0x84)
            if not (refused or (self._connect_sent and not isinstance(exc, ConnectionRefused))):
                raise
            why = (f"CONNACK 0x{exc.return_code:02x} to an MQTT 5 CONNECT" if isinstance(exc, ConnectionRefused)
                   else f"no CONNACK to an MQTT 5 CONNECT ({exc})")
        self.protocol_level = PROTOCOL_LEVEL
        try:
            connack = await self._connect_once(timeout)
        except BaseException:
            self.protocol_level = PROTOCOL_LEVEL_5  # not shown to take 3.1.1 either: 5 next time
            raise
        self.fallback = why
        log.warning("export link %r: %s:%d does not speak MQTT 5 (%s); using MQTT 3.1.1 for this process: "
                    "message properties are not carried", self.client_id, self.host, self.port, why)
        return connack

    async def _connect_once(self, timeout: float) -> Connack:
        if self.connected:
            raise RuntimeError(f"export link {self.client_id!r} is already connected")
        loop = asyncio.get_running_loop()
        v5 = self.protocol_level == PROTOCOL_LEVEL_5
        self._decoder = Decoder(self._max_packet_size, server=False, protocol_level=self.protocol_level)
        self._connack = loop.create_future()
        self._connect_sent = False
        async with asyncio.timeout(timeout):
            _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self.ssl)
            self._conn = conn
            self.closed.clear()
            self.close_reason = None
            self._ping_due = None
            try:
                # (inside: a CONNECT that cannot be written -- the transport already gone, or
                # its protocol's connection_made failed -- must leave the link closed, not
                # "connected" for every later connect() to refuse)
                props = None
                if v5:
                    # Persistent as 3.1.1's clean session 0: the session never expires; a clean
                    # one (QoS 2 reset) ends with the connection (absent = 0, 3.1.2.11.2).
                    props = Properties(session_expiry_interval=None if self.clean_session else NEVER_EXPIRES,
                                       maximum_packet_size=self._max_packet_size)
                self._write(encode(Connect(client_id=self.client_id, clean_session=self.clean_session,
                                           keepalive=self.keepalive, username=self.username,
                                           password=self.password, protocol_level=self.protocol_level,
                                           properties=props)))
                self._connect_sent = True
                connack = await self._connack
            except BaseException:
                self._close(ConnectionError(f"export link {self.client_id!r}: no CONNACK"))
                raise
        if connack.return_code != CONNACK_ACCEPTED:
            refused = ConnectionRefused(self.client_id, connack.return_code)
            if v5 and connack.return_code >= 0x80:
                refused.reason = CONNACK5_NAMES.get(connack.return_code, refused.reason)
                refused.args = (f"broker refused client {self.client_id!r}: {refused.reason} "
                                f"(MQTT 5 CONNACK 0x{connack.return_code:02x})",)
            self._close(refused)
            raise refused
        p = connack.properties if v5 else None
        self.send_quota = (p.receive_maximum if p is not None and p.receive_maximum else 65535)
        self.server_max_packet = p.maximum_packet_size if p is not None else None
        self.retain_available = p is None or p.retain_available != 0
        if p is not None and p.maximum_qos is not None and p.maximum_qos < self.qos:
            error = ConnectionError(f"{self.host}:{self.port} takes at most QoS {p.maximum_qos} (its CONNACK's "
                                    f"Maximum QoS); the export publishes QoS {self.qos}: set its qos")
            self._close(error)
            raise error
        if self.clean_session:
            # The broker dropped the session: nothing in flight is known to it any more; the
            # messages are sent again as new publishes by the caller (it still holds them).
            self._released.clear()
        self._resend()
        if self.keepalive:
            self._keepalive_task = asyncio.create_task(self._keepalive_loop(), name=f"export-ping-{self.client_id}")
        log.info("export link %r connected to %s:%d (session present: %s, %d in flight resent)",
                 self.client_id, self.host, self.port, connack.session_present, len(self.inflight))
        return connack

    def _resend(self) -> None:
        """The in-flight window again, oldest first, same ids (MQTT-4.4.0-1)."""
        if not self.inflight:
            return
        pieces: list[bytes] = []
        released = self._released
        topic_of = self.topic_of
        v5 = self.protocol_level == PROTOCOL_LEVEL_5
        now_us = time.time_ns() // 1000
        for pid, m in self.inflight.items():
            if pid in released:
                pieces.append(b"\x62\x02" + pid.to_bytes(2, "big"))
                continue
            topic = topic_of(m.topic).encode()
            payload = m.payload
            props = message_properties(m.headers, m.timestamp_us, now_us) if v5 else b""
            first = self._base | 0x08 | (1 if m.retain and self.retain_available else 0)
            pieces += (bytes((first,)), remaining_length(4 + len(topic) + len(props) + len(payload)),
                       len(topic).to_bytes(2, "big"), topic, pid.to_bytes(2, "big"), props, payload)
        self._write(b"".join(pieces))

    async def disconnect(self, timeout: float = 5.0) -> None:
        """Send DISCONNECT and close (the in-flight window is kept for the next connect)."""
        conn = self._conn
        if conn is not None and self.connected:
            with contextlib.suppress(Exception):
                self._write(DISCONNECT)
        self._close(None)
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    def forget(self) -> list[Message]:
        """Drop the in-flight window (a clean session replaces it); returns what it held."""
        dropped = list(self.inflight.values())
        self.inflight.clear()
        self._released.clear()
        return dropped

    # -- publishing ---------------------------------------------------------------------------------

    def publish(self, messages: Sequence[Message], retain: bool, redelivered: Callable[[int], bool] | None) -> int:
        """Publish ``messages`` (QoS of the link) in one write; they are in flight until
        acknowledged. ``retain``: pass each record's retained flag through (else never set);
        ``redelivered(offset)``: True to set DUP on the first send (None: never). Returns
        payload bytes sent.
        Not connected: they are only put in flight (the next connect sends them)."""
        inflight = self.inflight
        n = len(messages)
        v5 = self.protocol_level == PROTOCOL_LEVEL_5
        retain = retain and self.retain_available  # (MQTT 5: Retain Available 0, MQTT-3.3.1-... 3.2.2.3.5)
        last = self._next_id  # the id used last: the next one is last + 1 (wrapping 65535 -> 1)
        if (n > 8 and redelivered is None and last + n <= 65535
                and not (retain and any(map(_RETAIN, messages)))
                and not (v5 and any(map(_HEADERS, messages)))
                and not any(map(inflight.__contains__, range(last + 1, last + 1 + n)))):
            return self._publish_run(messages, last + 1, v5)
        pieces: list[bytes] = []
        append = pieces.append
        base = self._base
        prefixes = self._prefixes
        topic_of = self.topic_of
        pid = self._next_id
        size = 0
        props = b""
        now_us = time.time_ns() // 1000 if v5 else 0
        for m in messages:
            pid = pid % 65535 + 1
            if pid in inflight:
                pid = self._free_id(pid)
            inflight[pid] = m
            payload = m.payload
            first = base | 1 if retain and m.retain else base
            if redelivered is not None and redelivered(m.offset):
                first |= 0x08
            cache = prefixes.get(first)
            if cache is None:
                cache = prefixes[first] = {}
            if v5:
                props = message_properties(m.headers, m.timestamp_us, now_us)
            # (the prefix depends on the topic and the bytes after the packet id only)
            key = (m.topic, len(payload) + len(props))
            prefix = cache.get(key)
            if prefix is None:
                if len(cache) >= _PREFIX_CACHE_MAX:
                    cache.clear()
                topic = topic_of(m.topic).encode()
                prefix = cache[key] = (bytes((first,)) + remaining_length(4 + len(topic) + key[1])
                                       + len(topic).to_bytes(2, "big") + topic)
            append(prefix)
            append(pid.to_bytes(2, "big"))
            if v5:
                append(props)
            append(payload)
            size += len(payload)
        self._next_id = pid
        if self.connected and pieces:
            self._write(b"".join(pieces))
        return size

    def _publish_run(self, messages: Sequence[Message], pid: int, v5: bool = False) -> int:
        """:meth:`publish` of a run with no DUP, no RETAIN (MQTT 5: no message properties)
        and the free packet ids ``pid`` .. ``pid + len - 1``: the same bytes, built by C-level
        maps instead of a loop per record."""
        n = len(messages)
        ids = range(pid, pid + n)
        self.inflight.update(zip(ids, messages, strict=True))
        self._next_id = pid + n - 1
        payloads = list(map(_PAYLOAD, messages))
        first = self._base
        cache = self._prefixes.get(first)
        if cache is None:
            cache = self._prefixes[first] = {}
        sizes = map(len, payloads)
        if v5:  # the property length byte 0 after the packet id counts in the remaining length
            sizes = map((1).__add__, sizes)
        keys = list(zip(map(_TOPIC, messages), sizes, strict=True))
        prefixes = list(map(cache.get, keys))
        if None in prefixes:  # a topic or payload size not seen yet
            topic_of = self.topic_of
            for i, key in enumerate(keys):
                if prefixes[i] is None:
                    prefix = cache.get(key)
                    if prefix is None:
                        if len(cache) >= _PREFIX_CACHE_MAX:
                            cache.clear()
                        topic = topic_of(key[0]).encode()
                        prefix = cache[key] = (bytes((first,)) + remaining_length(4 + len(topic) + key[1])
                                               + len(topic).to_bytes(2, "big") + topic)
                    prefixes[i] = prefix
        if self.connected:
            heads = cast("list[bytes]", prefixes)  # every None was filled above
            if v5:
                self._write(b"".join(chain.from_iterable(zip(heads, map(_PACK_ID, ids), repeat(b"\x00"), payloads))))
            else:
                self._write(b"".join(chain.from_iterable(zip(heads, map(_PACK_ID, ids), payloads, strict=True))))
        return sum(map(len, payloads))

    def _free_id(self, pid: int) -> int:
        inflight = self.inflight
        for _ in range(65535):
            if pid not in inflight:
                return pid
            pid = pid % 65535 + 1
        raise RuntimeError("all 65535 packet ids are in flight")

    def _write(self, data: bytes) -> None:
        conn = self._conn
        if conn is None or conn.transport is None:
            raise ConnectionError(f"export link {self.client_id!r} is not connected")
        conn.transport.write(data)
        self._last_sent = time.monotonic()

    # -- receiving ----------------------------------------------------------------------------------

    def _received(self, conn: _Connection, data: bytes) -> None:
        if conn is not self._conn or self.closed.is_set():
            return
        ids = puback_ids(data) if self.qos == 1 and not self._decoder.buffered else None
        if ids is not None:
            # Fast path: nothing but PUBACKs, split and looked up in C, not packet by packet.
            inflight = self.inflight
            try:
                done = list(map(inflight.__getitem__, ids))
            except KeyError:  # an id not in flight (nothing removed yet): one by one
                done = self._complete_ids(ids, [])
            else:
                try:
                    deque(map(inflight.__delitem__, ids), maxlen=0)
                except KeyError:  # an id twice in this read: remove the rest, complete each once
                    for pid in ids:
                        inflight.pop(pid, None)
                    done = list({id(m): m for m in done}.values())
            self._complete(done)
            return
        try:
            self._decoder.feed(data)
            packets = self._decoder.packets()
        except ProtocolError as exc:
            log.warning("export link %r: protocol error from %s:%d: %s", self.client_id, self.host, self.port, exc)
            self._close(exc)
            return
        done = []
        for packet in packets:
            m = self._handle(packet)
            if m is not None:
                done.append(m)
        self._complete(done)

    def _complete_ids(self, ids: Sequence[int], done: list[Message]) -> list[Message]:
        """PUBACKs one by one (the rare case the fast path cannot take)."""
        pop = self.inflight.pop
        for pid in ids:
            m = pop(pid, None)
            if m is None:
                self._note_unexpected(f"PUBACK for packet id {pid} that is not in flight")
            else:
                done.append(m)
        return done

    def _handle(self, packet: Packet) -> Message | None:
        """Apply one packet from the broker; the message it completes, if any."""
        if isinstance(packet, Puback | Pubcomp):
            pid = packet.packet_id
            m = self.inflight.get(pid)
            qos1 = isinstance(packet, Puback)
            if qos1 and packet.reason_code >= 0x80 and m is not None:
                self._refused(pid, "PUBACK", packet.reason_code)
                return None
            if m is not None and (self.qos == 1) == qos1 and (qos1 or pid in self._released):
                del self.inflight[pid]
                self._released.discard(pid)
                return m
            self._note_unexpected(f"{type(packet).__name__} for packet id {pid} that is not awaiting it")
        elif isinstance(packet, Pubrec):
            pid = packet.packet_id
            if packet.reason_code >= 0x80 and pid in self.inflight:
                self._refused(pid, "PUBREC", packet.reason_code)  # the exchange ends: no PUBREL (4.3.3)
                return None
            if pid in self.inflight and self.qos == 2:
                self._released.add(pid)
            else:
                self._note_unexpected(f"PUBREC for packet id {pid} that is not an in-flight QoS 2 publish")
            self._write(b"\x62\x02" + pid.to_bytes(2, "big"))  # answer even an unknown id (4.3.3)
        elif isinstance(packet, Connack):
            if self._connack is not None and not self._connack.done():
                self._connack.set_result(packet)
        elif isinstance(packet, Pingresp):
            self._ping_due = None
        elif isinstance(packet, Publish):
            # Not subscribed: a message the broker kept for an old session of this client id.
            # Acknowledge it so the broker forgets it; it is not ours to deliver.
            self._note_unexpected(f"a PUBLISH on {packet.topic!r}")
            if packet.qos and packet.packet_id is not None:
                self._write(encode(Puback(packet.packet_id) if packet.qos == 1 else Pubrec(packet.packet_id)))
        elif isinstance(packet, Pubrel):
            self._write(encode(Pubcomp(packet.packet_id)))
        elif isinstance(packet, Disconnect):
            self._close(ConnectionError(f"the destination sent DISCONNECT 0x{packet.reason_code:02x}"))
        else:
            self._note_unexpected(f"a {type(packet).__name__} packet")
        return None

    def _refused(self, pid: int, ack: str, code: int) -> None:
        """An MQTT 5 failure reason code: the message stays in flight, unacknowledged (the
        export's ack timeout reconnects and resends it); logged once per code."""
        if code not in self._refusals_logged:
            self._refusals_logged.add(code)
            log.warning("export link %r: %s:%d answered packet id %d with %s reason code 0x%02x; the message "
                        "stays in flight and is resent after a reconnect (logged once per code)",
                        self.client_id, self.host, self.port, pid, ack, code)

    def _note_unexpected(self, what: str) -> None:
        if not self._unexpected_logged:
            self._unexpected_logged = True
            log.warning("export link %r: %s from %s:%d (ignored; logged once)", self.client_id, what,
                        self.host, self.port)

    def _complete(self, done: list[Message]) -> None:
        if done and self.on_complete is not None:
            self.on_complete(done)

    # -- the end of a connection ------------------------------------------------------------------

    def _lost(self, conn: _Connection, exc: Exception | None) -> None:
        if conn is self._conn:
            self._close(exc or ConnectionError(f"export link {self.client_id!r}: the broker closed the connection"))

    def _close(self, reason: BaseException | None) -> None:
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()
        if self._connack is not None and not self._connack.done():
            self._connack.set_exception(reason or ConnectionError("connection closed"))
        task, self._keepalive_task = self._keepalive_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if reason is not None:
            log.warning("export link %r: connection to %s:%d lost: %s", self.client_id, self.host, self.port, reason)

    async def _keepalive_loop(self) -> None:
        interval = self.keepalive
        while self.connected:
            await asyncio.sleep(min(interval / 2, 30))
            if not self.connected:
                return
            now = time.monotonic()
            if self._ping_due is not None and now > self._ping_due:
                self._close(ConnectionError(f"export link {self.client_id!r}: no PINGRESP within {interval} s"))
                return
            if now - self._last_sent >= interval / 2 and self._ping_due is None:
                self._write(PINGREQ)
                self._ping_due = now + interval


def _same(topic: str) -> str:
    return topic
