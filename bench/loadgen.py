"""The MQTT load generator shared by every broker under test (filemq, mosquitto, amqtt).

Each publisher and each subscriber runs in its own process (``multiprocessing``, fork) on a
plain blocking socket with our codec, so the generator is not the bottleneck:

* a publisher pre-encodes its PUBLISH packets (one per packet id), keeps ``inflight`` of
  them outstanding, and counts PUBACKs in bulk (a buffer of back-to-back PUBACKs is checked
  with two strided slice compares, not packet by packet);
* a paced publisher (``rate`` > 0) stamps ``time.monotonic_ns()`` into each payload when it
  sends it, for publish -> subscriber latency (CLOCK_MONOTONIC is system-wide on Linux, so
  the stamps compare across processes);
* a subscriber answers every QoS 1 delivery with one ``sendall`` of all the PUBACKs for what
  one ``recv`` brought, built in bulk by :class:`PublishAcker` (strided slices over uniform
  packets; :class:`filemq.mqtt.codec.Decoder` for anything else, and for stamped payloads);
  a ``client="single"`` subscriber sends the same PUBACKs one ``sendall`` each, as a naive
  raw-socket client answering packet by packet does; ``client="nagle"`` does the same on a
  socket left as it comes, Nagle's algorithm on (no ``TCP_NODELAY``), as such a client's
  usually is.  (Every other client here sets ``TCP_NODELAY``.)

:func:`run_null_sink` is a fake broker that acks every PUBLISH the same bulk way; running
publishers against it measures the generator's own ceiling.

MQTT 5 (``protocol=5`` on the specs, :class:`RawClient`, :class:`PublishAcker` and the null
sink): CONNECT at level 5 with a property section (a session expiry interval for a persistent
session), PUBLISH with its property section (pre-built bytes, so optional message properties
cost the generator nothing per message), SUBSCRIBE with the options byte, PUBACKs in the short
form of 3.4.2.1 from the subscribers; PUBACKs from the broker are counted in bulk in either the
2-byte or the 3-byte (reason code) form, and a PUBACK with a reason code >= 0x80 counts as
refused, not acked.  A publisher never keeps more in flight than the broker's receive maximum.

What a caller may rely on: :func:`run_load` returns when every process finished or was
stopped at its deadline; no process outlives it.  Errors inside a process (connection
refused, closed by the broker) come back as ``error`` strings in the results, not raised; a
refused CONNECT also as ``connack_code``.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

from bench.loadspec import (
    LoadResult,
    PublisherResult,
    PublisherSpec,
    SubscriberResult,
    SubscriberSpec,
)
from bench.paho_sub import paho_subscriber_main, require_paho
from filemq.mqtt.codec import Decoder, ProtocolError, encode, encode_puback, encoder
from filemq.mqtt.packets import (
    CONNACK_RETURN_CODE_NAMES,
    PROTOCOL_LEVEL,
    PROTOCOL_LEVEL_5,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Properties,
    Puback,
    Publish,
    Suback,
    Subscribe,
    subscription_options,
)

_CTX = mp.get_context("fork")
_RECV = 1 << 18
_MAX_PID = 65535
# Payload layout of stamped messages: send time (ns, monotonic), then a sequence number.
_STAMP = struct.Struct(">QQ")
STAMP_BYTES = _STAMP.size
# MQTT 5 persistent sessions (clean start 0) of the load clients outlive a disconnect by this much.
SESSION_EXPIRY_S = 3600


class LoadError(RuntimeError):
    """A load client could not connect or subscribe; carries the client id and, for a refused
    CONNECT, the CONNACK's return code (3.1.1) or reason code (MQTT 5)."""

    def __init__(self, client_id: str, detail: str, connack_code: int | None = None) -> None:
        super().__init__(f"client {client_id!r}: {detail}")
        self.client_id = client_id
        self.connack_code = connack_code


def connect_packet(client_id: str, clean_session: bool, keepalive: int, protocol: int = PROTOCOL_LEVEL) -> bytes:
    """The CONNECT a load client sends: 3.1.1, or level 5 with a property section (a session
    expiry interval of :data:`SESSION_EXPIRY_S` when the session is persistent, 3.1.2.11.2)."""
    if protocol != PROTOCOL_LEVEL_5:
        return encode(Connect(client_id=client_id, clean_session=clean_session, keepalive=keepalive))
    props = None if clean_session else Properties(session_expiry_interval=SESSION_EXPIRY_S)
    return encoder(protocol)(Connect(client_id=client_id, clean_session=clean_session, keepalive=keepalive,
                                     protocol_level=PROTOCOL_LEVEL_5, properties=props))


def connack_reason(code: int, protocol: int) -> str:
    """A CONNACK code as text: 3.1.1's names (a 3.1.1 server may refuse a level-5 CONNECT with
    one, 3.1.4), MQTT 5 reason codes in hex."""
    name = CONNACK_RETURN_CODE_NAMES.get(code) if code < 0x80 else None
    return f"{name} (CONNACK 0x{code:02X})" if name else f"CONNACK 0x{code:02X}"


class RawClient:
    """A blocking MQTT 3.1.1 or 5 connection for load generation (no keepalive pings: runs are
    short).  ``receive_maximum`` is the server's (CONNACK property, 3.2.2.3.3; 65535 when absent
    and on 3.1.1)."""

    def __init__(self, sock: socket.socket, client_id: str, session_present: bool, decoder: Decoder,
                 protocol: int = PROTOCOL_LEVEL, receive_maximum: int = 65535) -> None:
        self.sock = sock
        self.client_id = client_id
        self.session_present = session_present
        self.decoder = decoder
        self.protocol = protocol
        self.receive_maximum = receive_maximum

    @classmethod
    def connect(cls, host: str, port: int, client_id: str, *, clean_session: bool = True,
                keepalive: int = 600, timeout: float = 10.0, protocol: int = PROTOCOL_LEVEL,
                nodelay: bool = True) -> RawClient:
        """Open a connection and complete CONNECT/CONNACK; raises :class:`LoadError` on refusal.
        ``nodelay=False`` leaves Nagle's algorithm on (the socket default)."""
        sock = socket.create_connection((host, port), timeout=timeout)
        if nodelay:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.sendall(connect_packet(client_id, clean_session, keepalive, protocol))
            decoder = Decoder(max_packet_size=1 << 24, server=False, protocol_level=protocol)
            while True:
                data = sock.recv(_RECV)
                if not data:
                    raise LoadError(client_id, f"{host}:{port} closed the connection before CONNACK")
                decoder.feed(data)
                packet = decoder.next_packet()
                if packet is None:
                    continue
                if not isinstance(packet, Connack):
                    raise LoadError(client_id, f"expected CONNACK, got {type(packet).__name__}")
                if packet.return_code:
                    raise LoadError(client_id, f"CONNECT refused: {connack_reason(packet.return_code, protocol)}",
                                    packet.return_code)
                props = packet.properties
                receive_maximum = props.receive_maximum if props and props.receive_maximum else 65535
                return cls(sock, client_id, packet.session_present, decoder, protocol, receive_maximum)
        except BaseException:
            sock.close()
            raise

    def subscribe(self, filters: Sequence[tuple[str, int]], packet_id: int = 1,
                  timeout: float = 10.0) -> tuple[list[int], list[Packet]]:
        """SUBSCRIBE and wait for SUBACK: (return codes, packets that arrived before the SUBACK).

        ``filters`` are (filter, QoS); on MQTT 5 the QoS becomes the options byte (3.8.3.1:
        no local 0, retain as published 0, retain handling 0)."""
        if self.protocol == PROTOCOL_LEVEL_5:
            filters = [(f, subscription_options(qos)) for f, qos in filters]
        self.sock.sendall(encoder(self.protocol)(Subscribe(packet_id, list(filters))))
        early: list[Packet] = []
        deadline = time.monotonic() + timeout
        while True:
            for packet in self.decoder.packets():
                if isinstance(packet, Suback) and packet.packet_id == packet_id:
                    return packet.return_codes, early
                early.append(packet)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LoadError(self.client_id, "no SUBACK")
            self.sock.settimeout(remaining)
            data = self.sock.recv(_RECV)
            if not data:
                raise LoadError(self.client_id, "connection closed before SUBACK")
            self.decoder.feed(data)

    def close(self, disconnect: bool = True) -> None:
        if disconnect:
            with contextlib.suppress(OSError):
                self.sock.sendall(encoder(self.protocol)(Disconnect()))
        self.sock.close()


# --------------------------------------------------------------------------- publishers


def publish_template(topic: str, payload_size: int, qos: int, protocol: int = PROTOCOL_LEVEL,
                     properties: Properties | None = None) -> tuple[bytes, bytes]:
    """(prefix, middle) of a PUBLISH for ``payload_size``: a packet is ``prefix + packet id +
    middle + payload`` (no packet id at QoS 0).  ``prefix`` is the fixed header and the topic,
    ``middle`` the MQTT 5 property section (3.3.2.3; ``b""`` on 3.1.1)."""
    payload = bytes(payload_size)
    sample = encoder(protocol)(Publish(topic, payload, qos, packet_id=1 if qos else None,
                                       properties=properties if protocol == PROTOCOL_LEVEL_5 else None))
    pid_at = _header_length(sample, 0) + 2 + len(topic.encode("utf-8"))
    after = pid_at + (2 if qos else 0)
    return sample[:pid_at], sample[after : len(sample) - payload_size]


class PubackCounter:
    """Counts PUBACKs in a byte stream; bulk when the buffer holds nothing else.

    Bulk takes runs of one PUBACK form: 3.1.1's (and MQTT 5's short form, 3.4.2.1) ``40 02
    id id``, or on MQTT 5 ``40 03 id id RC`` with one success reason code (mosquitto answers
    0x10 "no matching subscribers" to every PUBLISH nobody subscribed to).  Anything else goes
    through a :class:`Decoder` from then on; there a reason code >= 0x80 counts in ``refused``.
    """

    def __init__(self, protocol: int = PROTOCOL_LEVEL) -> None:
        self._rest = b""
        self._decoder: Decoder | None = None
        self._protocol = protocol
        self._head = b""  # the form's bytes compared at every stride: 40 02, or 40 03 + RC at offset 4
        self.refused = 0  # PUBACKs with a failure reason code (MQTT 5)
        self.refused_codes: set[int] = set()

    @property
    def decoding(self) -> bool:
        """True once the stream held something other than one PUBACK form: from then on every
        read goes through a :class:`Decoder`, not the bulk path."""
        return self._decoder is not None

    def count(self, data: bytes) -> int:
        """PUBACKs (successful or refused) completed by ``data``: each frees a window slot."""
        if self._decoder is not None:
            self._decoder.feed(data)
            n = 0
            for p in self._decoder.packets():
                if isinstance(p, Puback):
                    n += 1
                    if p.reason_code >= 0x80:
                        self.refused += 1
                        self.refused_codes.add(p.reason_code)
            return n
        buf = self._rest + data if self._rest else data
        head = self._head
        if not head:
            first = buf[:2]
            if first == b"\x40\x02" and len(buf) >= 4:
                head = first
            elif first == b"\x40\x03" and self._protocol == PROTOCOL_LEVEL_5 and len(buf) >= 5 and buf[4] < 0x80:
                head = first + buf[4:5]
            elif len(buf) < 5 and first in (b"\x40", b"\x40\x02", b"\x40\x03"):
                self._rest = buf  # the first PUBACK is not complete yet
                return 0
            self._head = head
        if head:
            stride = 2 + head[1]
            whole = len(buf) // stride
            end = whole * stride
            if (buf[0:end:stride] == head[0:1] * whole and buf[1:end:stride] == head[1:2] * whole
                    and (stride == 4 or buf[4:end:stride] == head[2:3] * whole)):
                self._rest = buf[end:]
                return whole
        # Something other than one PUBACK form (PINGRESP, a stray PUBLISH, a reason code):
        # decode properly from now on.
        self._decoder = Decoder(max_packet_size=1 << 24, server=False, protocol_level=self._protocol)
        self._rest = b""
        return self.count(buf)


def publisher_main(spec: PublisherSpec, start: MpEvent | None, ready: Synchronized[int] | None,
                   out: Any) -> None:
    """Process body: connect, pre-encode, count itself in ``ready``, wait for ``start``, publish.

    Puts one :class:`PublisherResult` on ``out`` whatever happens.
    """
    result = PublisherResult(spec.client_id)
    client: RawClient | None = None
    try:
        client = RawClient.connect(spec.host, spec.port, spec.client_id, protocol=spec.protocol,
                                   nodelay=spec.client != "nagle")
        run = _paced(client, spec, result) if spec.rate > 0 else flat_out(client, spec, result)
    except (OSError, LoadError, ValueError) as exc:
        result.error = str(exc)
        result.connack_code = getattr(exc, "connack_code", None)
        run = None
    if ready is not None:
        with ready.get_lock():
            ready.value += 1
    try:
        if start is not None:
            start.wait(60)
        if run is not None:
            run()
    except (OSError, ProtocolError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if client is not None:
            client.close()
        out.put(result)


def flat_out(client: RawClient, spec: PublisherSpec, result: PublisherResult) -> Callable[[], None]:
    """Pre-encode every packet; return the function that publishes them flat out."""
    qos = spec.qos
    prefix, middle = publish_template(spec.topic, spec.payload_size, qos, spec.protocol, spec.properties)
    tail = middle + bytes(spec.payload_size)
    n_pre = min(spec.messages, _MAX_PID)
    # Packet id of message i is i % 65535 + 1; the window (<= 65535) keeps ids unique.
    packets = [prefix + ((i + 1).to_bytes(2, "big") if qos else b"") + tail for i in range(n_pre)]
    sock = client.sock
    sock.settimeout(30.0)
    counter = PubackCounter(spec.protocol)
    one_by_one = spec.client != "loadgen"

    def send(first: int, k: int) -> None:
        if one_by_one:  # "single" / "nagle": a send per PUBLISH
            for i in range(first, first + k):
                sock.sendall(packets[i % _MAX_PID])  # (n_pre: every id of the run, or all 65,535)
        else:
            sock.sendall(batch(first, k))

    def batch(first: int, k: int) -> bytes:
        a = first % _MAX_PID
        if a + k <= n_pre:
            return b"".join(packets[a : a + k])
        return b"".join(packets[(first + j) % _MAX_PID] for j in range(k))

    def run() -> None:
        limit = spec.messages
        window = min(spec.inflight, client.receive_maximum, limit)
        result.started = time.monotonic()
        deadline = result.started + spec.max_seconds
        if qos == 0:
            # Nothing to wait for: send in windows, done when the bytes are on the socket.
            while result.sent < limit and time.monotonic() < deadline:
                k = min(window, limit - result.sent)
                send(result.sent, k)
                result.sent += k
            result.acked = result.sent
            result.finished = time.monotonic()
            return
        send(0, window)
        sent = window
        acked = 0
        try:
            while acked < sent:
                data = sock.recv(_RECV)
                if not data:
                    raise ConnectionError(f"broker closed the connection after {acked} PUBACKs")
                n = counter.count(data)
                acked += n
                if sent < limit:
                    if time.monotonic() > deadline:
                        limit = sent
                    else:
                        k = min(n, limit - sent)
                        if k:
                            send(sent, k)
                            sent += k
        finally:
            result.finished = time.monotonic()
            _settle(result, sent, acked, counter)

    return run


def _settle(result: PublisherResult, sent: int, acked: int, counter: PubackCounter) -> None:
    """Final counts: PUBACKs with a failure reason code are refused, not acked."""
    result.sent, result.acked, result.refused = sent, acked - counter.refused, counter.refused
    if counter.refused and result.error is None:
        codes = ", ".join(f"0x{c:02X}" for c in sorted(counter.refused_codes))
        result.error = f"{counter.refused} PUBACKs refused (reason code {codes})"


def _paced(client: RawClient, spec: PublisherSpec, result: PublisherResult) -> Callable[[], None]:
    """Return the function sending at ``spec.rate`` messages/s (1 ms ticks), stamping each payload."""
    if spec.payload_size < STAMP_BYTES:
        raise ValueError(f"stamped payloads need at least {STAMP_BYTES} bytes, not {spec.payload_size}")
    qos = spec.qos
    prefix, middle = publish_template(spec.topic, spec.payload_size, qos, spec.protocol, spec.properties)
    filler = bytes(spec.payload_size - STAMP_BYTES)
    sock = client.sock
    counter = PubackCounter(spec.protocol)
    pack = _STAMP.pack
    inflight = min(spec.inflight, client.receive_maximum)

    def run() -> None:
        limit = spec.messages
        sent = acked = 0
        result.started = t0 = time.monotonic()
        deadline = t0 + spec.max_seconds
        try:
            while acked < limit:
                now = time.monotonic()
                if now > deadline:
                    break
                due = min(int((now - t0) * spec.rate) + 1, limit) - sent
                k = min(due, inflight - (sent - acked)) if qos else due
                if k > 0:
                    stamp = time.monotonic_ns()
                    chunks = []
                    for i in range(sent, sent + k):
                        pid = (i % _MAX_PID + 1).to_bytes(2, "big") if qos else b""
                        chunks.append(prefix + pid + middle + pack(stamp, i) + filler)
                    sock.sendall(b"".join(chunks))
                    sent += k
                    if not qos:
                        acked = sent
                wait = max(0.0, min(t0 + (sent + 1) / spec.rate - time.monotonic(), 0.001))
                readable, _, _ = select.select([sock], [], [], wait)
                if readable:
                    data = sock.recv(_RECV)
                    if not data:
                        raise ConnectionError(f"broker closed the connection after {acked} PUBACKs")
                    acked += counter.count(data)
        finally:
            result.finished = time.monotonic()
            _settle(result, sent, acked, counter)

    return run


# --------------------------------------------------------------------------- bulk PUBACKs


def _frame_length(buf: bytes, pos: int) -> int | None:
    """Length of the packet starting at ``pos`` (fixed header included), None if incomplete."""
    n = len(buf)
    remaining = 0
    shift = 0
    i = pos + 1
    while i < n and i <= pos + 4:
        byte = buf[i]
        remaining |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            total = i - pos + remaining
            return total if pos + total <= n else None
        shift += 7
    if i > pos + 4:
        raise ProtocolError("remaining length longer than 4 bytes")
    return None


class PublishAcker:
    """Splits a stream into packets and answers QoS 1 PUBLISHes with PUBACKs, in bulk.

    After one QoS 1 PUBLISH (not DUP) has been decoded normally, runs of packets with the same
    length and the same header and topic-length bytes are acked with strided slices (no
    per-packet Python): the load generator sends uniform packets, and brokers deliver them
    back uniform.  Anything else (CONNACK, SUBACK, DUP redeliveries, other sizes) goes
    through :class:`Decoder` one packet at a time and is returned to the caller.

    ``protocol`` 5 decodes MQTT 5 packets (a PUBLISH's property section sits between its packet
    id and its payload; the PUBACKs sent are the short form of 3.4.2.1, valid on both levels).
    A server-side acker (the null sink) switches to 5 by itself on a level-5 CONNECT.
    """

    def __init__(self, server: bool, protocol: int = PROTOCOL_LEVEL) -> None:
        self._server = server
        self._protocol = protocol
        self._rest = b""
        self._frame = 0
        self._check_len = 0  # fixed header + 2 topic-length bytes: compared at every stride
        self._head = b""
        self._pid_at = 0
        self.publishes = 0

    def feed(self, data: bytes, acks: bytearray) -> list[Packet]:
        """Consume ``data``; append PUBACK bytes to ``acks``; return the non-bulk packets that
        are not QoS 1 PUBLISHes (and count every PUBLISH in :attr:`publishes`)."""
        buf = self._rest + data if self._rest else data
        n = len(buf)
        pos = 0
        others: list[Packet] = []
        while pos < n:
            frame = self._frame
            if frame:
                k = (n - pos) // frame
                if k:
                    end = pos + k * frame
                    head = self._head
                    if all(buf[pos + j : end : frame] == head[j : j + 1] * k for j in range(self._check_len)):
                        pid_at = pos + self._pid_at
                        out = bytearray(4 * k)
                        out[0::4] = b"\x40" * k
                        out[1::4] = b"\x02" * k
                        out[2::4] = buf[pid_at : end : frame]
                        out[3::4] = buf[pid_at + 1 : end : frame]
                        acks += out
                        self.publishes += k
                        pos = end
                        continue
            total = _frame_length(buf, pos)
            if total is None:
                break
            decoder = Decoder(max_packet_size=1 << 24, server=self._server, protocol_level=self._protocol)
            decoder.feed(buf[pos : pos + total])
            packet = decoder.next_packet()
            if isinstance(packet, Publish):
                self.publishes += 1
                if packet.packet_id is not None:
                    acks += encode_puback(packet.packet_id)
                if packet.qos == 1 and not packet.dup and not packet.retain:
                    header = _header_length(buf, pos)
                    self._frame = total
                    self._check_len = header + 2
                    self._head = buf[pos : pos + header + 2]
                    # Fixed header, topic length, topic: then the packet id (3.3.2), on both levels.
                    self._pid_at = header + 2 + ((buf[pos + header] << 8) | buf[pos + header + 1])
            elif packet is not None:
                if isinstance(packet, Connect) and packet.protocol_level == PROTOCOL_LEVEL_5:
                    self._protocol = PROTOCOL_LEVEL_5
                others.append(packet)
            pos += total
        self._rest = buf[pos:]
        return others


def _header_length(buf: bytes, pos: int) -> int:
    """Bytes of the fixed header (type byte + remaining-length varint) at ``pos``."""
    i = pos + 1
    while buf[i] & 0x80:
        i += 1
    return i + 1 - pos


# --------------------------------------------------------------------------- subscribers


def subscriber_main(spec: SubscriberSpec, ready: MpEvent, expected: Synchronized[int], out: Any) -> None:
    """Process body: connect, subscribe, set ``ready``; receive until ``expected`` messages.

    ``expected`` is -1 until the publishers are done (then their acked total); the
    subscriber also stops after ``idle_seconds`` without data once it is set, or at
    ``max_seconds``.
    """
    result = SubscriberResult(spec.client_id)
    try:
        client = RawClient.connect(spec.host, spec.port, spec.client_id, clean_session=spec.clean_session,
                                   protocol=spec.protocol, nodelay=spec.client != "nagle")
        codes, early = client.subscribe([(spec.topic_filter, spec.qos)])
        if codes[0] >= 0x80:  # 3.1.1: 0x80 only; MQTT 5: every reason code >= 0x80 (3.9.3)
            raise LoadError(spec.client_id, f"subscription to {spec.topic_filter!r} refused (0x{codes[0]:02X})")
    except (OSError, LoadError, ProtocolError) as exc:
        result.error = str(exc)
        result.connack_code = getattr(exc, "connack_code", None)
        out.put(result)
        ready.set()
        return
    ready.set()
    try:
        _receive(client, spec, expected, result, early)
    except (OSError, ProtocolError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        client.close()
        out.put(result)


def _receive(client: RawClient, spec: SubscriberSpec, expected: Synchronized[int],
             result: SubscriberResult, early: list[Packet]) -> None:
    """Receive and ack until done.  Stamped payloads are decoded one by one (latencies need
    them); otherwise a :class:`PublishAcker` takes over once the connect-time decoder holds
    no partial packet."""
    sock = client.sock
    decoder = client.decoder
    acker: PublishAcker | None = None
    latencies = result.latencies_ns
    stamped = spec.stamped
    unpack = _STAMP.unpack_from
    sock.settimeout(0.2)
    send_acks = sock.sendall if spec.client == "loadgen" else functools.partial(send_one_by_one, sock)
    deadline = time.monotonic() + spec.max_seconds
    last_data = time.monotonic()
    packets: list[Packet] = early
    received = 0
    while True:
        if packets:
            now_ns = time.monotonic_ns()
            acks = bytearray()
            for p in packets:
                if isinstance(p, Publish):
                    received += 1
                    if p.packet_id is not None:
                        acks += encode_puback(p.packet_id)
                    if stamped:
                        latencies.append(now_ns - unpack(p.payload)[0])
            if acks:
                send_acks(acks)
                result.first = result.first or now_ns / 1e9
                result.last = now_ns / 1e9
            packets = []
        if acker is None and not stamped and decoder.buffered == 0:
            acker = PublishAcker(server=False, protocol=client.protocol)
        want = expected.value
        now = time.monotonic()
        if 0 <= want <= received or now > deadline:
            break
        if want >= 0 and now - last_data > spec.idle_seconds:
            break
        try:
            data = sock.recv(_RECV)
        except TimeoutError:
            continue
        if not data:
            raise ConnectionError(f"broker closed the connection after {received} messages")
        last_data = time.monotonic()
        if acker is None:
            decoder.feed(data)
            packets = decoder.packets()
            continue
        acks = bytearray()
        before = acker.publishes
        acker.feed(data, acks)  # other packets (PINGRESP, ...) need no answer here
        received += acker.publishes - before
        if acks:
            send_acks(acks)
            now_s = time.monotonic()
            result.first = result.first or now_s
            result.last = now_s
    result.received = received


def send_one_by_one(sock: socket.socket, acks: bytearray) -> None:
    """Each PUBACK in a ``sendall`` of its own, as a client that answers packet by packet does
    (every PUBACK this generator sends is the 4-byte short form)."""
    view = memoryview(acks)
    for i in range(0, len(acks), 4):
        sock.sendall(view[i:i + 4])


# --------------------------------------------------------------------------- orchestration


def run_load(publishers: Sequence[PublisherSpec], subscribers: Sequence[SubscriberSpec] = (),
             timeout: float = 180.0) -> LoadResult:
    """Start subscribers (and wait until subscribed), then publishers together; collect results.

    Subscribers stop once they received the publishers' total acked count (QoS 1 at
    least once: a duplicate counts as delivered), or after their idle timeout.
    """
    targets = {"loadgen": subscriber_main, "single": subscriber_main, "nagle": subscriber_main}
    if any(s.client == "paho" for s in subscribers):
        require_paho()
        targets["paho"] = paho_subscriber_main
    out = _CTX.Queue()
    expected: Synchronized[int] = _CTX.Value("q", -1)
    start = _CTX.Event()
    ready_count: Synchronized[int] = _CTX.Value("q", 0)
    procs: list[Any] = []
    try:
        for sspec in subscribers:
            ready = _CTX.Event()
            proc = _CTX.Process(target=targets[sspec.client], args=(sspec, ready, expected, out), daemon=True)
            proc.start()
            procs.append(proc)
            if not ready.wait(30):
                raise LoadError(sspec.client_id, "not subscribed within 30 s")
        pub_procs: list[Any] = []
        for pspec in publishers:
            proc = _CTX.Process(target=publisher_main, args=(pspec, start, ready_count, out), daemon=True)
            proc.start()
            pub_procs.append(proc)
            procs.append(proc)
        # Every publisher connects and pre-encodes before the clock starts.
        ready_deadline = time.monotonic() + 60
        while ready_count.value < len(publishers) and time.monotonic() < ready_deadline:
            if not any(p.is_alive() for p in pub_procs):
                break
            time.sleep(0.01)
        start.set()
        deadline = time.monotonic() + timeout
        pub_results: list[PublisherResult] = []
        sub_results: list[SubscriberResult] = []
        wanted = len(publishers) + len(subscribers)
        while len(pub_results) + len(sub_results) < wanted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                item = out.get(timeout=min(remaining, 1.0))
            except queue.Empty:  # a process that died never reports: stop once all are gone
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if isinstance(item, PublisherResult):
                pub_results.append(item)
                if len(pub_results) == len(publishers):
                    expected.value = sum(r.acked for r in pub_results)
            else:
                sub_results.append(item)
        return LoadResult(pub_results, sub_results)
    finally:
        for proc in procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        out.close()


# --------------------------------------------------------------------------- null sink


def _sink_connection(conn: socket.socket, counted: list[int]) -> None:
    """Answer CONNECT with CONNACK and every QoS 1 PUBLISH with PUBACK, in bulk where possible."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    acker = PublishAcker(server=True)
    with conn:
        while True:
            data = conn.recv(_RECV)
            if not data:
                break
            out = bytearray()
            others = acker.feed(data, out)
            if any(isinstance(p, Disconnect) for p in others):
                break
            connect = next((p for p in others if isinstance(p, Connect)), None)
            if connect is not None:
                out[:0] = encoder(connect.protocol_level)(Connack())
            if out:
                conn.sendall(out)
    counted.append(acker.publishes)


def _sink_main(listener: socket.socket, stop: MpEvent) -> None:
    counted: list[int] = []
    listener.settimeout(0.2)
    threads = []
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        t = threading.Thread(target=_sink_connection, args=(conn, counted), daemon=True)
        t.start()
        threads.append(t)
    listener.close()


@contextlib.contextmanager
def null_sink(host: str = "127.0.0.1") -> Any:
    """A fake broker in its own process that acks everything; yields its port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    stop = _CTX.Event()
    proc = _CTX.Process(target=_sink_main, args=(listener, stop), daemon=True)
    proc.start()
    listener.close()
    try:
        yield port
    finally:
        stop.set()
        proc.join(timeout=2)
        if proc.is_alive():
            proc.kill()
            proc.join()


def run_null_sink(publishers: int, messages: int, payload_size: int, inflight: int,
                  progress: Callable[[str], None] | None = None, max_seconds: float = 10.0,
                  protocol: int = PROTOCOL_LEVEL, properties: Properties | None = None) -> LoadResult:
    """The generator's ceiling: ``publishers`` flat-out publishers against :func:`null_sink`."""
    with null_sink() as port:
        specs = [PublisherSpec("127.0.0.1", port, f"sink-pub-{i}", "bench/sink", messages // publishers,
                               payload_size, inflight, max_seconds=max_seconds, protocol=protocol,
                               properties=properties) for i in range(publishers)]
        result = run_load(specs)
    if progress is not None:
        progress(f"  generator ceiling (null sink): {result.ack_rate:,.0f} PUBACKs/s")
    return result

