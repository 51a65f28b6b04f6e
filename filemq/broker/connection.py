"""The per-connection MQTT 3.1.1 state machine, without I/O (as h11 is for HTTP).

Bytes go in with :meth:`Connection.receive_data`; bytes to send collect in an output buffer
that the owner drains with :meth:`Connection.data_to_send` (the asyncio shell writes it with
one ``transport.write`` per event, so many PUBACKs of one group commit leave in one write).
Everything that concerns more than this connection -- authentication, storing a PUBLISH,
routing, subscriptions, retained messages, wills -- is delegated to the
:class:`~filemq.broker.core.BrokerCore` it was created with.

What a caller may rely on:

* The first packet must be CONNECT and a second CONNECT is a protocol violation; either
  closes the connection.  Before CONNACK no packet may be larger than
  :data:`MAX_CONNECT_PACKET` (nor ``max_packet_size``) but a level-5 CONNECT, which may be
  ``max_packet_size`` up to :data:`MAX_CONNECT5_PACKET`, and at most that many bytes are held for the connection (once the
  CONNECT's level byte is in); the CONNECT must be complete ``connect_timeout`` after the accept,
  however slowly its bytes arrive.  Any :class:`~filemq.mqtt.ProtocolError` closes it too, with the
  reason logged with client id and peer.  :meth:`receive_data` never raises.
* A QoS 1 PUBACK / QoS 2 PUBREC is queued only after the record's group-commit future has
  resolved (``ack_ready`` is driven by the core from the future's callback), in arrival
  order; a failed commit closes the connection instead of acknowledging.
* :attr:`closed` turns True exactly once; :attr:`close_reason` says why and
  :attr:`publish_will` whether the will message is (to be) published.
"""

from __future__ import annotations

import errno
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from filemq.common.config import DEFAULT_MAX_INFLIGHT
from filemq.mqtt.codec import (
    Decoder,
    ProtocolError,
    UnsupportedProtocolLevel,
    encode,
    encode5,
    publish_bytes,
    publish_bytes5,
)
from filemq.mqtt.packets import (
    CONNACK_REASON_CODES,
    CONNACK_SERVER_UNAVAILABLE,
    CONNACK_UNACCEPTABLE_PROTOCOL_VERSION,
    PROTOCOL_LEVEL_5,
    RC_PROTOCOL_ERROR,
    RC_TOPIC_ALIAS_INVALID,
    RC_UNSUPPORTED_PROTOCOL_VERSION,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Pingreq,
    Puback,
    Pubcomp,
    Publish,
    PublishRun,
    Pubrec,
    Pubrel,
    Subscribe,
    Unsubscribe,
)
from filemq.mqtt.pubacks import puback_ids
from segments.errors import DiskFull

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from filemq.broker.acl import ClientAcl
    from filemq.broker.session_state import SessionState
    from filemq.common.config import BrokerSection

log = logging.getLogger("filemq.broker")

PINGRESP = b"\xd0\x00"
# The largest CONNECT MQTT 3.1.1 allows: fixed header (5 bytes), variable header (10) and five
# length-prefixed fields of at most 65,535 bytes (client id, will topic, will message,
# username, password).  Before CONNACK no larger packet is accepted, and no more bytes than
# this are buffered for a connection: an unauthenticated socket cannot make the broker hold
# a 1 MiB "CONNECT" (issue 10 item 9).
MAX_CONNECT_PACKET = 5 + 10 + 5 * (2 + 65535)
# An MQTT 5 CONNECT has no largest size (its user properties); it may be up to
# max_packet_size, but never more than this before CONNACK, so what a half-open socket can
# make the broker hold stays bounded also where max_packet_size is large (a collector's is
# 64 MiB, for batches): max_connecting x 1 MiB at most.
MAX_CONNECT5_PACKET = 1 << 20

RC_RECEIVE_MAXIMUM_EXCEEDED = 0x93
RC_QUOTA_EXCEEDED = 0x97
_PUBACK_PUBCOMP = (0x40, 0x70)  # first bytes of PUBACK / PUBCOMP in ``pending_acks`` (PUBREC: 0x50)

AWAITING_CONNECT = "awaiting-connect"
AUTHENTICATING = "authenticating"
CONNECTED = "connected"
CLOSED = "closed"


def refusal_code(exc: BaseException | None) -> int:
    """The MQTT 5 PUBACK/PUBREC reason code for a PUBLISH the log refused or failed to commit:
    0x97 (quota exceeded) when the file system is full (below ``min_free_bytes``, ENOSPC,
    EDQUOT), 0x80 (unspecified error) for any other error (3.4.2.1)."""
    if isinstance(exc, DiskFull) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)):
        return 0x97
    return 0x80


def _publish_aliased(topic: str, alias: int, payload: bytes, qos: int, dup: bool, packet_id: int | None,
                     retain: bool, headers: bytes) -> bytes:
    """An MQTT 5 PUBLISH carrying Topic Alias ``alias`` (property 0x23, 3.3.2.3.4) after
    ``headers``; ``topic`` is "" once the client knows the alias."""
    return publish_bytes5(topic, payload, qos, dup, packet_id, retain,
                          headers + bytes((0x23, alias >> 8, alias & 0xFF)))


def _expand(packets: Sequence[object]) -> list[object]:
    """``packets`` with each :class:`PublishRun` as one :class:`Publish` per message."""
    out: list[object] = []
    for p in packets:
        if type(p) is PublishRun:
            out += p.publishes()
        else:
            out.append(p)
    return out


class Transport(Protocol):
    """The two things a connection needs from its socket (asyncio.Transport satisfies it)."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class Core(Protocol):
    """What a connection needs from the broker core (:class:`~filemq.broker.core.BrokerCore`
    satisfies it): the limits it enforces and the handlers its packets go to. A Protocol, so
    this lower module never imports the core."""

    config: BrokerSection
    connect_timeout: float
    connections: dict[str, Connection]

    def mark_dirty(self, conn: Connection) -> None: ...

    def on_connect(self, conn: Connection, p: Connect) -> None: ...

    def on_publish(self, conn: Connection, p: Publish) -> None: ...

    def on_publishes(self, conn: Connection, ps: Sequence[Publish]) -> None: ...

    def on_publish_run(self, conn: Connection, run: PublishRun) -> None: ...

    def on_puback(self, conn: Connection, pid: int) -> None: ...

    def on_pubacks(self, conn: Connection, pids: Sequence[int]) -> None: ...

    def on_pubrec(self, conn: Connection, pid: int, reason_code: int = 0) -> None: ...

    def on_pubrel(self, conn: Connection, pid: int) -> None: ...

    def on_pubcomp(self, conn: Connection, pid: int) -> None: ...

    def on_subscribe(self, conn: Connection, p: Subscribe) -> None: ...

    def on_unsubscribe(self, conn: Connection, p: Unsubscribe) -> None: ...

    def on_close(self, conn: Connection, prev_state: str) -> None: ...

    def on_disconnect(self, conn: Connection, p: Disconnect) -> None: ...


class Connection:
    """One client connection: protocol state, inbound acks waiting for commit, output buffer."""

    __slots__ = (
        "core", "peer", "transport", "decoder", "state", "out", "client_id", "username",
        "keepalive", "last_rx", "will", "session", "acl", "pending_acks", "closed",
        "close_reason", "publish_will", "paused", "max_inflight", "last_batch",
        "connected_at", "max_packet_size", "reading_changed", "identity", "protocol_level",
        "encode_packet", "assigned_id", "client_max_packet", "linger_close", "alias_max",
        "out_aliases", "topic_aliases", "acks_extra",
    )

    def __init__(
        self,
        core: Core,
        peer: str,
        transport: Transport | None = None,
        *,
        max_packet_size: int = 1 << 20,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        now: float | None = None,
    ) -> None:
        self.core = core
        self.peer = peer
        self.transport = transport
        self.max_packet_size = max_packet_size  # after CONNACK; less before (MAX_CONNECT_PACKET)
        # Before CONNACK: MQTT 3.1.1's largest CONNECT, unless the CONNECT's level byte says 5
        # (its properties have no such bound: max_packet_size then, capped; issue 33 item 5).
        self.decoder = Decoder(min(max_packet_size, MAX_CONNECT_PACKET), server=True, runs=True,
                               max_connect5=min(max_packet_size, MAX_CONNECT5_PACKET))
        self.state = AWAITING_CONNECT
        self.out = bytearray()
        self.client_id = ""
        self.username: str | None = None
        # The verified client certificate's CN on a use_identity_as_username listener: it is
        # the username, and the password file is not consulted.
        self.identity: str | None = None
        self.keepalive = 0
        self.last_rx = time.monotonic() if now is None else now
        self.connected_at = self.last_rx  # the accept: the CONNECT deadline counts from here
        self.will: Publish | None = None
        # The connection's session state, set by the core at CONNECT.
        self.session: SessionState | None = None
        self.acl: ClientAcl | None = None
        # (commit future or None, ack bytes), in arrival order: acks leave in this order.
        self.pending_acks: deque[tuple[asyncio.Future[None] | None, bytes, int]] = deque()
        # A run's PUBACKs are one entry of n 4-byte PUBACKs: n - 1 of them, over all entries,
        # so that len(pending_acks) + acks_extra bounds the unacknowledged QoS 1 count.
        self.acks_extra = 0
        self.closed = False
        self.close_reason = ""
        self.publish_will = False
        self.paused = False  # the transport's buffer is full: do not push deliveries
        # Called when the connection may want reading paused/resumed (the asyncio shell
        # reads nothing while the password is checked or while ``paused``).
        self.reading_changed: Callable[[], None] | None = None
        self.max_inflight = max_inflight
        self.last_batch: asyncio.Future[None] | None = None  # the commit batch it last joined
        # 4 (MQTT 3.1.1) until an MQTT 5.0 CONNECT is accepted; then 5, with the MQTT 5 encoder.
        self.protocol_level = 4
        self.encode_packet: Callable[[Any], bytes] = encode
        self.assigned_id = False  # MQTT 5: the server assigned the client id (CONNACK says it)
        # MQTT 5: the Maximum Packet Size the client stated in CONNECT (None: the protocol's
        # limit); no packet larger than it may be sent to it (MQTT-3.1.2-24).
        self.client_max_packet: int | None = None
        # Set by the asyncio shell: closes the transport once the peer has had time to read
        # the last bytes (a refusal CONNACK or a DISCONNECT with its reason code) instead of
        # at once, so packets the peer sends meanwhile do not reset the connection and
        # discard them unread (a lingering close).  None: close at once.
        self.linger_close: Callable[[], None] | None = None
        # MQTT 5 topic aliases broker -> client (3.3.2.3.4): the client's Topic Alias Maximum
        # (0: none) and the aliases given so far on this network connection, topic -> alias.
        self.alias_max = 0
        self.out_aliases: dict[str, int] = {}
        # MQTT 5: topic aliases the client set on this connection (alias -> topic, 3.3.2.3.4);
        # they die with the connection.
        self.topic_aliases: dict[int, str] | None = None

    def __repr__(self) -> str:
        return f"Connection({self.client_id!r}, peer={self.peer}, state={self.state})"

    # ---- bytes in ----------------------------------------------------------------------

    def receive_data(self, data: bytes, now: float | None = None) -> None:
        """Feed received bytes; handles every complete packet. Never raises."""
        if self.closed:
            return
        self.last_rx = time.monotonic() if now is None else now
        if (
            data
            and data[0] == 0x40  # (a read of PUBLISHes skips the slicer below)
            and self.state == CONNECTED
            and not self.decoder.buffered
        ):
            # Fast path: a read of nothing but PUBACKs (what a subscriber sends back) is
            # split with C-level slices instead of decoding packet by packet.
            pids = puback_ids(data)
            if pids is not None:
                try:
                    self.core.on_pubacks(self, pids)
                except Exception as exc:
                    log.exception("client %r from %s: internal error", self.client_id, self.peer)
                    self.close(f"internal error: {exc!r}", will=True, level=logging.ERROR)
                return
        try:
            self.decoder.feed(data)
        except ProtocolError as exc:
            if self.state == AWAITING_CONNECT:
                self._answer_bad_connect(exc)
            self.close(f"protocol error: {exc.reason}", will=True, level=logging.WARNING,
                       reason_code=exc.reason_code)
            return
        if self.state != CONNECTED:
            self._receive_before_connack()
        else:
            self._handle_buffered()

    def _handle_buffered(self) -> None:
        try:
            packets = self.decoder.packets()
        except ProtocolError as exc:
            self.close(f"protocol error: {exc.reason}", will=True, level=logging.WARNING,
                       reason_code=exc.reason_code)
            return
        try:
            self.handle_packets(packets)
        except Exception as err:  # not "exc": mypyc gives a name one type per function
            # A bug must cost this one connection, not the broker or the other clients.
            log.exception("client %r from %s: internal error", self.client_id, self.peer)
            self.close(f"internal error: {err!r}", will=True, level=logging.ERROR)

    def _receive_before_connack(self) -> None:
        """Decode the CONNECT alone (under the pre-CONNECT size cap); bytes behind it wait,
        undecoded and bounded, until the CONNECT is accepted (maybe after a password check)."""
        try:
            while self.state == AWAITING_CONNECT:
                packet = self.decoder.next_packet()
                if packet is None:
                    break
                self.handle_packets((packet,))
        except ProtocolError as exc:
            if self.state == AWAITING_CONNECT:
                self._answer_bad_connect(exc)
            self.close(f"protocol error: {exc.reason}", will=False, level=logging.WARNING)
            return
        except Exception as err:  # not "exc": mypyc gives a name one type per function
            log.exception("client %r from %s: internal error", self.client_id, self.peer)
            self.close(f"internal error: {err!r}", will=False, level=logging.ERROR)
            return
        if self.closed:
            return
        if self.state == CONNECTED:
            self.decoder.max_packet_size = self.max_packet_size
            self._handle_buffered()
        elif self.decoder.buffered > (held := max(MAX_CONNECT_PACKET, self.decoder.max_packet_size)):
            self.close(f"more than {held} bytes sent before CONNACK", will=False, level=logging.WARNING)

    def _answer_bad_connect(self, exc: ProtocolError) -> None:
        """The CONNACK for a CONNECT refused as malformed or invalid, in the shape the client
        speaks, before the close.  MQTT 5 (its level byte read, or the core found the fault):
        the reason code, 0x81 Malformed Packet or 0x82 Protocol Error (MQTT-3.1.4-1 allows it,
        4.13.1, MQTT-3.2.2-7).  A level filemq does not speak: 0x84 in the MQTT 5 shape, 0x01
        in the 3.1.1 one (MQTT-3.1.2-2 of both).  A 3.1.1 CONNECT (or one whose level is not
        known) gets none: 3.1.1 has no code for it."""
        if type(exc) is UnsupportedProtocolLevel:
            if exc.shape == PROTOCOL_LEVEL_5:
                self.encode_packet = encode5
                self.send_packet(Connack(False, RC_UNSUPPORTED_PROTOCOL_VERSION))
            else:
                self.send_packet(Connack(False, CONNACK_UNACCEPTABLE_PROTOCOL_VERSION))
        elif self.protocol_level == PROTOCOL_LEVEL_5 or exc.connect_level == PROTOCOL_LEVEL_5:
            self.encode_packet = encode5
            code = exc.reason_code if exc.reason_code in CONNACK_REASON_CODES else RC_PROTOCOL_ERROR
            self.send_packet(Connack(False, code))

    def handle_packets(self, packets: Sequence[object]) -> None:
        if len(packets) > 1 and self.state == CONNECTED:
            if self.protocol_level != PROTOCOL_LEVEL_5:
                self._handle_runs(packets)
            else:
                self._handle_runs5(packets)
        elif packets and type(packets[0]) is PublishRun and self.protocol_level == PROTOCOL_LEVEL_5:
            self._handle_runs5(packets)  # (its Receive Maximum check)
        else:
            self._dispatch(packets)

    def _handle_runs5(self, packets: Sequence[object]) -> None:
        """MQTT 5, connected: a run of QoS 1 PUBLISHes without a topic alias (the core stores
        their message properties as record headers) goes to the core in one call, as 3.1.1's do,
        when our Receive Maximum has room for all of it (3.2.2.3.3; otherwise, and for every
        other packet, one at a time, so a 0x93 comes at the very PUBLISH over the limit).
        The decoder's :class:`PublishRun` (QoS 1, no properties) counts each of its messages
        and goes to ``on_publish_run`` whole when there is room, else one :class:`Publish` at a
        time."""
        limit = self.core.config.receive_maximum
        n = len(packets)
        i = 0
        while i < n:
            j = i
            count = 0
            while j < n:
                p = packets[j]
                if type(p) is PublishRun:
                    count += len(p.payloads)
                elif type(p) is not Publish or p.qos != 1 or (p.properties is not None
                                                               and p.properties.topic_alias is not None):
                    break
                else:
                    count += 1
                j += 1
            # Room: the cheap upper bound of the unacknowledged count first (as _inbound5).
            session = self.session
            assert session is not None  # (connected: the core set it at CONNECT)
            if count > 1 and (len(self.pending_acks) + self.acks_extra + len(session.qos2_in) + count <= limit
                              or self._unacknowledged() + count <= limit):
                while i < j:  # each PublishRun to on_publish_run, the PUBLISHes between as one run
                    k = i + 1
                    if type(packets[i]) is PublishRun:
                        self._dispatch(packets[i:k])
                    else:
                        while k < j and type(packets[k]) is Publish:
                            k += 1
                        if not self._publishes(packets[i:k]):
                            return
                    i = k
                    if self.closed:
                        return
                continue
            if count > 1:
                self._dispatch(_expand(packets[i:j]))
            else:
                j = max(j, i + 1)
                self._dispatch(packets[i:j])
            i = j
            if self.closed:
                return

    def _publishes(self, run: Sequence[object]) -> bool:
        """A run of PUBLISHes to the core in one call; False if it was a protocol error (the
        connection is closed)."""
        try:
            self.core.on_publishes(self, run)  # type: ignore[arg-type]
        except ProtocolError as exc:
            self.close(f"protocol error: {exc.reason}", will=True, level=logging.WARNING,
                       reason_code=exc.reason_code)
            return False
        return True

    def _unacknowledged(self) -> int:
        """The client's QoS 1/2 PUBLISHes we have not acknowledged yet (MQTT 5 Receive Maximum):
        PUBACKs waiting in pending_acks (a run's entry counts each), PUBCOMPs waiting there,
        and QoS 2 ids before PUBREL (qos2_in)."""
        session = self.session
        assert session is not None  # (connected: the core set it at CONNECT)
        return sum((len(ack) >> 2 if ack[1] == 2 else 1) for _, ack, _ in self.pending_acks
                   if ack[0] in _PUBACK_PUBCOMP) + len(session.qos2_in)

    def _handle_runs(self, packets: Sequence[object]) -> None:
        """MQTT 3.1.1, connected: each run of PUBLISHes goes to the core in one call
        (:meth:`Core.on_publishes`), every other packet alone, all in order."""
        n = len(packets)
        i = 0
        while i < n:
            j = i
            while j < n and type(packets[j]) is Publish:
                j += 1
            if j - i > 1:
                if not self._publishes(packets[i:j]):
                    return
                i = j
            else:
                if type(packets[i]) is Disconnect:
                    self._dispatch(packets[i:])
                    return
                self._dispatch(packets[i:i + 1])
                i += 1
            if self.closed:
                return

    def _dispatch(self, packets: Sequence[object]) -> None:
        core = self.core
        for packet in packets:
            if self.closed:
                return
            try:
                if type(packet) is Publish:
                    if self.state != CONNECTED:
                        raise ProtocolError("PUBLISH before CONNECT")
                    if self.protocol_level == PROTOCOL_LEVEL_5:
                        self._inbound5(packet)
                    core.on_publish(self, packet)
                elif type(packet) is PublishRun:  # (MQTT 5: from _handle_runs5, the Receive Maximum checked)
                    if self.state != CONNECTED:
                        raise ProtocolError("PUBLISH before CONNECT")
                    core.on_publish_run(self, packet)
                elif type(packet) is Puback:
                    self._require_connected("PUBACK")
                    core.on_puback(self, packet.packet_id)
                elif type(packet) is Connect:
                    if self.state != AWAITING_CONNECT:
                        # It parses: a Protocol Error, 0x82 on MQTT 5 (MQTT-3.1.0-2).
                        raise ProtocolError("second CONNECT on one connection (MQTT-3.1.0-2)", "CONNECT",
                                            RC_PROTOCOL_ERROR)
                    if self._server_full(packet.client_id, packet.protocol_level):
                        return
                    core.on_connect(self, packet)
                elif type(packet) is Pubrec:
                    self._require_connected("PUBREC")
                    core.on_pubrec(self, packet.packet_id, packet.reason_code)
                elif type(packet) is Pubrel:
                    self._require_connected("PUBREL")
                    core.on_pubrel(self, packet.packet_id)
                elif type(packet) is Pubcomp:
                    self._require_connected("PUBCOMP")
                    core.on_pubcomp(self, packet.packet_id)
                elif type(packet) is Subscribe:
                    self._require_connected("SUBSCRIBE")
                    core.on_subscribe(self, packet)
                elif type(packet) is Unsubscribe:
                    self._require_connected("UNSUBSCRIBE")
                    core.on_unsubscribe(self, packet)
                elif type(packet) is Pingreq:
                    self._require_connected("PINGREQ")
                    self.send(PINGRESP)
                elif type(packet) is Disconnect:
                    self._require_connected("DISCONNECT")
                    core.on_disconnect(self, packet)
                    return
                elif type(packet) is Auth:
                    # filemq offers no extended authentication: a CONNECT with an authentication
                    # method is refused (0x8C), so an AUTH is never part of an exchange the
                    # client may have started (3.15, MQTT-4.12.0-2/-6).
                    raise ProtocolError("AUTH without an authentication method accepted in CONNECT (4.12)",
                                        "AUTH", RC_PROTOCOL_ERROR)
                else:  # pragma: no cover - the server-side decoder yields only the types above
                    raise ProtocolError(f"unexpected packet {type(packet).__name__}")
            except ProtocolError as exc:
                self.close(f"protocol error: {exc.reason}", will=True, level=logging.WARNING,
                           reason_code=exc.reason_code)
                return

    def _inbound5(self, p: Publish) -> None:
        """An MQTT 5 PUBLISH before the core sees it: its topic alias resolved (3.3.2.3.4) and
        the client's unacknowledged QoS 1/2 PUBLISHes checked against our Receive Maximum
        (3.2.2.3.3, MQTT-3.3.4-7..9).  Raises :class:`ProtocolError` with the reason code."""
        props = p.properties
        if props is not None and props.topic_alias is not None:
            alias = props.topic_alias
            limit = self.core.config.topic_alias_maximum
            if not 0 < alias <= limit:
                raise ProtocolError(f"topic alias {alias} outside 1..{limit} (MQTT-3.3.2-9/-10)", "PUBLISH",
                                    RC_TOPIC_ALIAS_INVALID)
            aliases = self.topic_aliases
            if p.topic:
                if aliases is None:
                    aliases = self.topic_aliases = {}
                aliases[alias] = p.topic
            else:
                topic = None if aliases is None else aliases.get(alias)
                if topic is None:
                    raise ProtocolError(f"topic alias {alias} was never set on this connection (3.3.2.3.4)",
                                        "PUBLISH", RC_PROTOCOL_ERROR)
                p.topic = topic
        if p.qos:
            limit = self.core.config.receive_maximum
            session = self.session
            assert session is not None  # (connected: the core set it at CONNECT)
            qos2_in = session.qos2_in
            # Unacknowledged: QoS 1 whose PUBACK waits in pending_acks, QoS 2 ids before PUBREL
            # (qos2_in) and after it while the PUBCOMP waits (for the session write).  Cheap
            # upper bound first (pending acks + qos2_in); counted exactly only near the limit.
            if (len(self.pending_acks) + self.acks_extra + len(qos2_in) >= limit
                    and not (p.qos == 2 and p.packet_id in qos2_in) and self._unacknowledged() >= limit):
                raise ProtocolError(f"more than Receive Maximum ({limit}) unacknowledged QoS 1/2 PUBLISHes "
                                    "(3.2.2.3.3)", "PUBLISH", RC_RECEIVE_MAXIMUM_EXCEEDED)

    def _require_connected(self, name: str) -> None:
        if self.state != CONNECTED:
            raise ProtocolError(f"{name} before CONNECT (the first packet must be CONNECT)")

    def _server_full(self, client_id: str, protocol_level: int = 4) -> bool:
        """Refuse a CONNECT with CONNACK 3 (MQTT 5: 0x97) when ``max_connections`` clients are connected
        (a client taking over its own id does not add one).  Half-open connections do not
        count: they are capped apart (``max_connecting``, in the asyncio shell)."""
        core = self.core
        limit = core.config.max_connections
        if len(core.connections) < limit or client_id in core.connections:
            return False
        if protocol_level == PROTOCOL_LEVEL_5:
            # 3.2.2.2: 0x97 Quota exceeded, "an implementation or administrative imposed
            # limit" -- what max_connections is (0x89 Server busy suggests a passing state).
            self.protocol_level = PROTOCOL_LEVEL_5
            self.encode_packet = encode5
            self.send_packet(Connack(False, RC_QUOTA_EXCEEDED))
        else:
            self.send_packet(Connack(False, CONNACK_SERVER_UNAVAILABLE))
        self.close(f"CONNECT refused (server unavailable): max_connections ({limit}) clients connected",
                   will=False, level=logging.WARNING)
        return True

    def resume_after_auth(self) -> None:
        """Handle the bytes that arrived while the CONNECT was being authenticated."""
        if self.closed:
            return
        if self.state == CONNECTED:
            self.decoder.max_packet_size = self.max_packet_size
            self._handle_buffered()
        if self.reading_changed is not None and not self.closed:
            self.reading_changed()

    # ---- bytes out ---------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        if not self.closed:
            self.out += data
            self.core.mark_dirty(self)

    def send_packet(self, packet: object) -> None:
        """Encode ``packet`` at this connection's protocol level and queue it.

        MQTT 5: never larger than the client's Maximum Packet Size (MQTT-3.1.2-24): optional
        properties are left out (Reason String and User Properties, MQTT-3.2.2-19/-20; a
        CONNACK's Topic Alias Maximum: absent = 0, the client then asks less of us); a packet
        that still does not fit is not sent and the connection is closed.  (PUBLISH
        deliveries do not come through here.)"""
        data = self.encode_packet(packet)
        limit = self.client_max_packet
        if limit is not None and len(data) > limit:
            props = getattr(packet, "properties", None)
            if props is not None:
                props.reason_string = None
                props.user_properties = []
                if type(packet) is Connack:
                    props.topic_alias_maximum = None
                data = self.encode_packet(packet)
            if len(data) > limit:
                log.warning("client %r from %s: %s of %d bytes not sent: larger than its Maximum Packet Size %d",
                            self.client_id, self.peer, type(packet).__name__, len(data), limit)
                if not self.closed:
                    self.close(f"a {type(packet).__name__} does not fit its Maximum Packet Size {limit}",
                               will=False, level=logging.WARNING)
                return
        self.send(data)

    def publish_bytes(self, topic: str, payload: bytes, qos: int, dup: bool, packet_id: int | None,
                      retain: bool = False, headers: bytes = b"") -> bytes:
        """A PUBLISH to this client at its protocol level; ``headers`` (a record's stored MQTT 5
        message properties) go on the MQTT 5 wire only."""
        if self.protocol_level == PROTOCOL_LEVEL_5:
            if self.alias_max:
                alias = self.out_aliases.get(topic)
                if alias is not None:  # only aliases the client already has (never assigned here)
                    return _publish_aliased("", alias, payload, qos, dup, packet_id, retain, headers)
            return publish_bytes5(topic, payload, qos, dup, packet_id, retain, headers)
        return publish_bytes(topic, payload, qos, dup, packet_id, retain)

    def aliased(self, data: bytes, topic: str, payload: bytes, qos: int, dup: bool, packet_id: int | None,
                retain: bool, headers: bytes, limit: int | None) -> bytes:
        """``data`` (the MQTT 5 PUBLISH about to be sent, which fits ``limit``) with a topic
        alias when the client takes them (3.3.2.3.4): the topic's alias and an empty topic
        once it has one; the first PUBLISH of a topic carries the topic and assigns the next
        free alias, while the client's Topic Alias Maximum allows (then topics stay unaliased:
        aliases are never reassigned).  Called only for a packet that is sent, so the client
        always knows an alias before it is used alone."""
        alias = self.out_aliases.get(topic)
        if alias is not None:
            return _publish_aliased("", alias, payload, qos, dup, packet_id, retain, headers)
        if len(self.out_aliases) >= self.alias_max or (limit is not None and len(data) + 3 > limit):
            return data
        alias = self.out_aliases[topic] = len(self.out_aliases) + 1
        return _publish_aliased(topic, alias, payload, qos, dup, packet_id, retain, headers)

    def data_to_send(self) -> bytes:
        """Everything queued for the peer since the last call (possibly empty)."""
        if not self.out:
            return b""
        data = bytes(self.out)
        self.out.clear()
        return data

    def queue_ack(self, future: asyncio.Future[None] | None, ack: bytes, offset: int = -1) -> None:
        """Send ``ack`` once ``future`` (a commit) has resolved, after every ack queued before."""
        if future is None and not self.pending_acks:
            self.send(ack)
            return
        if len(ack) > 7 and ack[1] == 2:  # a run's PUBACKs (n x 4 bytes)
            self.acks_extra += (len(ack) >> 2) - 1
        self.pending_acks.append((future, ack, offset))

    def ack_ready(self) -> bool:
        """Move acks whose commits resolved to the output, in order.

        MQTT 3.1.1: returns False (and closes the connection) if a commit failed: the client
        gets no acknowledgement and will re-send after reconnecting.  MQTT 5: a PUBACK/PUBREC
        whose commit failed leaves with the reason code of :func:`refusal_code` (0x97 on a full
        disk, else 0x80) and the connection stays (issue 13 item 6); any other ack (a PUBCOMP
        waiting for a session-file write) still closes.
        """
        acks = self.pending_acks
        parts: list[bytes] = []
        while acks:
            future, ack, _ = acks[0]
            if future is not None:
                if not future.done():
                    break
                if future.cancelled() or future.exception() is not None:
                    exc = None if future.cancelled() else future.exception()
                    if self.protocol_level == PROTOCOL_LEVEL_5 and ack[0] in (0x40, 0x50):
                        acks.popleft()
                        code = refusal_code(exc)
                        log.error("client %r: storing a PUBLISH failed (%r): %s 0x%02x", self.client_id, exc,
                                  "PUBACK" if ack[0] == 0x40 else "PUBREC", code)
                        if len(ack) > 7 and ack[1] == 2:  # a run's PUBACKs: each with the reason code
                            self.acks_extra -= (len(ack) >> 2) - 1
                            parts.extend(bytes((0x40, 3, ack[k + 2], ack[k + 3], code))
                                         for k in range(0, len(ack), 4))
                        else:
                            parts.append(bytes((ack[0], 3, ack[2], ack[3], code)))
                        continue
                    acks.clear()
                    self.acks_extra = 0
                    if parts:
                        self.send(b"".join(parts))
                    self.close(f"storing a PUBLISH failed ({exc!r}); not acknowledged", will=True,
                               level=logging.ERROR)
                    return False
            acks.popleft()
            if len(ack) > 7 and ack[1] == 2:
                self.acks_extra -= (len(ack) >> 2) - 1
            parts.append(ack)
        if parts:
            self.send(parts[0] if len(parts) == 1 else b"".join(parts))
        return True

    # ---- closing -----------------------------------------------------------------------

    def close(self, reason: str, *, will: bool, level: int = logging.INFO, reason_code: int | None = None) -> None:
        """Close this connection (once): log why, tell the core, close the transport.

        On an MQTT 5 connection past CONNACK, ``reason_code`` (a DISCONNECT reason code, e.g.
        0x81 Malformed Packet, 0x82 Protocol Error, 0x93, 0x95) is sent in a DISCONNECT first
        (4.13.2, MQTT-4.13.2-1)."""
        if self.closed:
            return
        if reason_code is not None and self.protocol_level == PROTOCOL_LEVEL_5 and self.state == CONNECTED:
            self.send_packet(Disconnect(reason_code))
        self.closed = True
        self.close_reason = reason
        self.publish_will = will and self.will is not None and self.state == CONNECTED
        log.log(level, "closing connection of client %r from %s: %s", self.client_id, self.peer, reason)
        prev_state = self.state
        self.state = CLOSED
        self.core.on_close(self, prev_state)
        if self.transport is not None:
            data = self.data_to_send()
            if data:
                self.transport.write(data)
                if self.linger_close is not None:
                    self.linger_close()
                    return
            self.transport.close()

    def connection_lost(self, reason: str = "connection lost") -> None:
        """The peer went away without DISCONNECT (abnormal: the will is published)."""
        self.close(reason, will=True, level=logging.INFO)

    def keepalive_expired(self, now: float) -> bool:
        """True when no packet arrived for 1.5 x keepalive (spec 3.1.2.10)."""
        return now > self.deadline()

    def deadline(self) -> float:
        """When this connection times out unless a packet arrives: 1.5 x keepalive after the
        last one (spec 3.1.2.10), or the CONNECT deadline; inf without a keepalive."""
        if self.state == AWAITING_CONNECT:
            # Absolute from the accept: a byte trickled now and then must not extend it.
            return self.connected_at + self.core.connect_timeout
        return self.last_rx + self.keepalive * 1.5 if self.keepalive > 0 else math.inf
