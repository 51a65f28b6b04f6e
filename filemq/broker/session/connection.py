"""One network connection of the MQTT session, without I/O (the session package's
:class:`Connection`; what the package owns and why it is split so: :mod:`filemq.broker.session`).

A :class:`Connection` holds one network connection's protocol state: where it is in the
CONNECT handshake, its decoder, the keepalive deadline, MQTT 5 topic aliases both ways and our
Receive Maximum window, and the inbound acks waiting for their commit (the inbound in-flight
window).  It has no socket, event loop or clock: the shell that owns the socket passes bytes
and the time in and takes bytes out, and the broker core gives its answers (``queue_ack``,
``send_packet``, ``close``).

* :meth:`Connection.receive_data` takes the bytes of one read and returns the **events** they
  make, in order: the packets that passed this connection's checks (:class:`Connect`,
  :class:`Publish`, the decoder's :class:`PublishRun`, :class:`Publishes` for a run of
  PUBLISHes from one read, :class:`Acks` for a read of bare PUBACKs, :class:`Puback`,
  :class:`Pubrec`, :class:`Pubrel`, :class:`Pubcomp`, :class:`Subscribe`,
  :class:`Unsubscribe`, :class:`Disconnect`).  The core (:meth:`BrokerCore.receive`) hands
  each to its part.  The events are produced lazily, one after the core handled the one
  before: a check that depends on the core's answers (MQTT 5 Receive Maximum counts the
  acks the core queued) sees them, and after a CONNECT the bytes behind it are decoded only
  once the core accepted it.  A violation raises :class:`~filemq.mqtt.ProtocolError` from
  the iteration; the core answers it with :meth:`protocol_error`.
* Bytes to send collect in an output buffer: :meth:`data_to_send` drains it.  Each time bytes
  are queued, ``output_ready(conn)`` is called (the core marks the connection dirty), and the
  core's flush hands the bytes to ``write``, the shell's sink, once per loop pass.
* :meth:`close` marks the connection closed once and calls ``closed(conn, prev_state)``: the
  shell tells the core and closes its socket after writing what is left.

What a caller may rely on:

* The first packet must be CONNECT and a second CONNECT is a protocol violation; either
  closes the connection.  Before CONNACK no packet may be larger than
  :data:`MAX_CONNECT_PACKET` (nor ``max_packet_size``) but a level-5 CONNECT, which may be
  ``max_packet_size`` up to :data:`MAX_CONNECT5_PACKET`, and at most that many bytes are held for the connection (once the
  CONNECT's level byte is in); the CONNECT must be complete ``connect_timeout`` after the accept,
  however slowly its bytes arrive.  Any :class:`~filemq.mqtt.ProtocolError` closes it too, with the
  reason logged with client id and peer.  :meth:`receive_data` never raises; iterating its
  events raises only :class:`~filemq.mqtt.ProtocolError`.
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
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, cast

from filemq.broker.session.events import Acks, Commit, Event, Publishes
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
    CONNACK_UNACCEPTABLE_PROTOCOL_VERSION,
    PROTOCOL_LEVEL_5,
    RC_PROTOCOL_ERROR,
    RC_TOPIC_ALIAS_INVALID,
    RC_UNSUPPORTED_PROTOCOL_VERSION,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
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


# Packets allowed only once connected, by type: the name a violation gives.
_AFTER_CONNECT: dict[type, str] = {
    Puback: "PUBACK", Pubrec: "PUBREC", Pubrel: "PUBREL", Pubcomp: "PUBCOMP", Subscribe: "SUBSCRIBE",
    Unsubscribe: "UNSUBSCRIBE", Disconnect: "DISCONNECT",
}


def _expand(packets: Sequence[object]) -> list[object]:
    """``packets`` with each :class:`PublishRun` as one :class:`Publish` per message."""
    out: list[object] = []
    for p in packets:
        if type(p) is PublishRun:
            out += p.publishes()
        else:
            out.append(p)
    return out


def _closed_nowhere(conn: Connection, prev_state: str) -> None:
    """The default ``closed`` notification: nobody to tell (a connection used on its own)."""


def _ready_nowhere(conn: Connection) -> None:
    """The default ``output_ready`` notification: nobody to tell."""


class Connection:
    """One client connection: protocol state, inbound acks waiting for commit, output buffer.

    ``config`` gives the limits it enforces (``receive_maximum``, ``topic_alias_maximum``);
    ``output_ready`` and ``closed`` are its two notifications to its owner (see the module
    docstring); ``now`` is the accept time (the CONNECT deadline counts from it)."""

    __slots__ = (
        "config", "peer", "write", "decoder", "state", "out", "client_id", "username",
        "keepalive", "last_rx", "will", "session", "acl", "pending_acks", "closed",
        "close_reason", "publish_will", "paused", "max_inflight", "last_batch",
        "connected_at", "max_packet_size", "reading_changed", "identity", "protocol_level",
        "encode_packet", "assigned_id", "client_max_packet", "output_ready", "alias_max",
        "out_aliases", "topic_aliases", "acks_extra", "on_closed", "_acks", "_acks_event",
    )

    def __init__(
        self,
        config: BrokerSection,
        peer: str,
        *,
        now: float,
        output_ready: Callable[[Connection], None] = _ready_nowhere,
        closed: Callable[[Connection, str], None] = _closed_nowhere,
        max_packet_size: int = 1 << 20,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
    ) -> None:
        self.config = config
        self.peer = peer
        self.output_ready = output_ready
        self.on_closed = closed
        # The shell's sink for data_to_send(), called by the core's flush (never by this
        # class); None while there is no socket to write to.
        self.write: Callable[[bytes], object] | None = None
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
        self.last_rx = now
        self.connected_at = now  # the accept: the CONNECT deadline counts from here
        self.will: Publish | None = None
        # The connection's session state, set by the core at CONNECT.
        self.session: SessionState | None = None
        self.acl: ClientAcl | None = None
        # (commit future or None, ack bytes, offset), in arrival order: acks leave in this order.
        self.pending_acks: deque[tuple[Commit | None, bytes, int]] = deque()
        # A run's PUBACKs are one entry of n 4-byte PUBACKs: n - 1 of them, over all entries,
        # so that len(pending_acks) + acks_extra bounds the unacknowledged QoS 1 count.
        self.acks_extra = 0
        self.closed = False
        self.close_reason = ""
        self.publish_will = False
        self.paused = False  # the shell's write buffer is full: do not push deliveries
        # Called when the connection may want reading paused/resumed (the shell reads nothing
        # while the password is checked or while ``paused``).
        self.reading_changed: Callable[[], None] | None = None
        self.max_inflight = max_inflight
        self.last_batch: Commit | None = None  # the commit batch it last joined
        # 4 (MQTT 3.1.1) until an MQTT 5.0 CONNECT is accepted; then 5, with the MQTT 5 encoder.
        self.protocol_level = 4
        self.encode_packet: Callable[[Packet], bytes] = encode
        self.assigned_id = False  # MQTT 5: the server assigned the client id (CONNACK says it)
        # MQTT 5: the Maximum Packet Size the client stated in CONNECT (None: the protocol's
        # limit); no packet larger than it may be sent to it (MQTT-3.1.2-24).
        self.client_max_packet: int | None = None
        # MQTT 5 topic aliases broker -> client (3.3.2.3.4): the client's Topic Alias Maximum
        # (0: none) and the aliases given so far on this network connection, topic -> alias.
        self.alias_max = 0
        self.out_aliases: dict[str, int] = {}
        # MQTT 5: topic aliases the client set on this connection (alias -> topic, 3.3.2.3.4);
        # they die with the connection.
        self.topic_aliases: dict[int, str] | None = None
        # The one Acks event of this connection, refilled by each read of bare PUBACKs (the
        # events of a read are handled before the next read is taken in): no object per read.
        self._acks = Acks(())
        self._acks_event = (self._acks,)

    def __repr__(self) -> str:
        return f"Connection({self.client_id!r}, peer={self.peer}, state={self.state})"

    # ---- bytes in ----------------------------------------------------------------------

    def receive_data(self, data: bytes, now: float) -> Iterable[Event]:
        """Take the bytes of one read, received at ``now``; returns their events (see the
        module docstring), to be iterated once, in order, by whoever handles them.  Never
        raises (a malformed read closes the connection and makes no events)."""
        if self.closed:
            return ()
        self.last_rx = now
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
                acks = self._acks
                acks.ids = pids
                return self._acks_event
        try:
            self.decoder.feed(data)
        except ProtocolError as exc:
            self.protocol_error(exc)
            return ()
        if self.state != CONNECTED:
            return self._before_connack()
        return self._connected()

    def resume_after_auth(self) -> Iterable[Event]:
        """The events of the bytes that arrived while the CONNECT was being authenticated
        (or its session file written): none unless the CONNECT was accepted meanwhile."""
        if self.closed or self.state != CONNECTED:
            return ()
        self.decoder.max_packet_size = self.max_packet_size
        return self._connected()

    def protocol_error(self, exc: ProtocolError) -> None:
        """Answer a protocol violation (this connection's or one the core found): a CONNACK
        with the reason if the CONNECT was refused, a DISCONNECT with its reason code on an
        MQTT 5 connection past CONNACK; then close (with the will, if connected)."""
        if self.closed:
            return
        if self.state == AWAITING_CONNECT:
            self._answer_bad_connect(exc)
        self.close(f"protocol error: {exc.reason}", will=True, level=logging.WARNING,
                   reason_code=exc.reason_code)

    def internal_error(self, err: BaseException) -> None:
        """A bug while handling this connection's events costs this one connection, not the
        broker or the other clients: logged with its traceback, closed."""
        log.error("client %r from %s: internal error", self.client_id, self.peer, exc_info=err)
        self.close(f"internal error: {err!r}", will=True, level=logging.ERROR)

    def _before_connack(self) -> Iterator[Event]:
        """The CONNECT alone (decoded under the pre-CONNECT size cap); bytes behind it wait,
        undecoded and bounded, until the core accepted it (maybe after a password check)."""
        while self.state == AWAITING_CONNECT:
            packet = self.decoder.next_packet()
            if packet is None:
                break
            event = self._event(packet)  # (anything but a CONNECT raises here)
            if event is not None:
                yield event
        if self.closed:
            return
        if self.state == CONNECTED:
            self.decoder.max_packet_size = self.max_packet_size
            yield from self._connected()
        elif self.decoder.buffered > (held := max(MAX_CONNECT_PACKET, self.decoder.max_packet_size)):
            self.close(f"more than {held} bytes sent before CONNACK", will=False, level=logging.WARNING)

    def _connected(self) -> Iterator[Event]:
        """The events of the buffered packets, once connected."""
        packets = self.decoder.packets()
        if len(packets) > 1:
            if self.protocol_level != PROTOCOL_LEVEL_5:
                yield from self._runs(packets)
            else:
                yield from self._runs5(packets)
        elif packets:
            packet = packets[0]
            if type(packet) is PublishRun and self.protocol_level == PROTOCOL_LEVEL_5:
                yield from self._runs5(packets)  # (its Receive Maximum check)
                return
            event = self._event(packet)
            if event is not None:
                yield event

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


    def _event(self, packet: object) -> Event | None:
        """``packet`` checked against this connection's state: the event it makes, or None
        when it is answered here (PINGREQ).  Raises :class:`ProtocolError`."""
        if type(packet) is Publish:
            if self.state != CONNECTED:
                raise ProtocolError("PUBLISH before CONNECT")
            if self.protocol_level == PROTOCOL_LEVEL_5:
                self._inbound5(packet)
            return packet
        if type(packet) is PublishRun:  # (MQTT 5: from _runs5, the Receive Maximum checked)
            if self.state != CONNECTED:
                raise ProtocolError("PUBLISH before CONNECT")
            return packet
        if type(packet) is Connect:
            if self.state != AWAITING_CONNECT:
                # It parses: a Protocol Error, 0x82 on MQTT 5 (MQTT-3.1.0-2).
                raise ProtocolError("second CONNECT on one connection (MQTT-3.1.0-2)", "CONNECT",
                                    RC_PROTOCOL_ERROR)
            return packet
        if type(packet) is Pingreq:
            self._require_connected("PINGREQ")
            self.send(PINGRESP)
            return None
        if type(packet) is Auth:
            # filemq offers no extended authentication: a CONNECT with an authentication
            # method is refused (0x8C), so an AUTH is never part of an exchange the
            # client may have started (3.15, MQTT-4.12.0-2/-6).
            raise ProtocolError("AUTH without an authentication method accepted in CONNECT (4.12)",
                                "AUTH", RC_PROTOCOL_ERROR)
        name = _AFTER_CONNECT.get(type(packet))
        if name is None:  # pragma: no cover - the server-side decoder yields only the types above
            raise ProtocolError(f"unexpected packet {type(packet).__name__}")
        self._require_connected(name)
        return cast(Event, packet)  # (one of _AFTER_CONNECT's types)

    def _events(self, packets: Sequence[object]) -> Iterator[Event]:
        """Each of ``packets`` as its own event, in order, up to a DISCONNECT."""
        for packet in packets:
            if self.closed:
                return
            event = self._event(packet)
            if event is not None:
                yield event
                if type(event) is Disconnect:
                    return

    def _runs(self, packets: Sequence[object]) -> Iterator[Event]:
        """MQTT 3.1.1, connected: each run of PUBLISHes is one :class:`Publishes` event,
        every other packet its own, all in order."""
        n = len(packets)
        i = 0
        while i < n:
            j = i
            while j < n and type(packets[j]) is Publish:
                j += 1
            if j - i > 1:
                yield Publishes(packets[i:j])  # type: ignore[arg-type]
                i = j
            else:
                event = self._event(packets[i])
                i += 1
                if event is not None:
                    yield event
                    if type(event) is Disconnect:
                        return
            if self.closed:
                return

    def _runs5(self, packets: Sequence[object]) -> Iterator[Event]:
        """MQTT 5, connected: a run of QoS 1 PUBLISHes without a topic alias (the core stores
        their message properties as record headers) is one event, as 3.1.1's are, when our
        Receive Maximum has room for all of it (3.2.2.3.3; otherwise, and for every other
        packet, one at a time, so a 0x93 comes at the very PUBLISH over the limit).  The
        decoder's :class:`PublishRun` (QoS 1, no properties) counts each of its messages and
        is one event when there is room, else one :class:`Publish` at a time."""
        limit = self.config.receive_maximum
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
            if count > 1 and (len(self.pending_acks) + self.acks_extra + len(session.qos.qos2_in) + count <= limit
                              or self._unacknowledged() + count <= limit):
                while i < j:  # each PublishRun alone, the PUBLISHes between as one run
                    k = i + 1
                    p = packets[i]
                    if type(p) is PublishRun:
                        yield p
                    else:
                        while k < j and type(packets[k]) is Publish:
                            k += 1
                        yield Publishes(packets[i:k])  # type: ignore[arg-type]
                    i = k
                    if self.closed:
                        return
                continue
            if count > 1:
                yield from self._events(_expand(packets[i:j]))
            else:
                j = max(j, i + 1)
                yield from self._events(packets[i:j])
            i = j
            if self.closed:
                return

    def _unacknowledged(self) -> int:
        """The client's QoS 1/2 PUBLISHes we have not acknowledged yet (MQTT 5 Receive Maximum):
        PUBACKs waiting in pending_acks (a run's entry counts each), PUBCOMPs waiting there,
        and QoS 2 ids before PUBREL (qos2_in)."""
        session = self.session
        assert session is not None  # (connected: the core set it at CONNECT)
        return sum((len(ack) >> 2 if ack[1] == 2 else 1) for _, ack, _ in self.pending_acks
                   if ack[0] in _PUBACK_PUBCOMP) + len(session.qos.qos2_in)


    def _inbound5(self, p: Publish) -> None:
        """An MQTT 5 PUBLISH before the core sees it: its topic alias resolved (3.3.2.3.4) and
        the client's unacknowledged QoS 1/2 PUBLISHes checked against our Receive Maximum
        (3.2.2.3.3, MQTT-3.3.4-7..9).  Raises :class:`ProtocolError` with the reason code."""
        props = p.properties
        if props is not None and props.topic_alias is not None:
            alias = props.topic_alias
            limit = self.config.topic_alias_maximum
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
            limit = self.config.receive_maximum
            session = self.session
            assert session is not None  # (connected: the core set it at CONNECT)
            qos2_in = session.qos.qos2_in
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

    # ---- bytes out ---------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Queue ``data`` for the peer (nothing once closed)."""
        if not self.closed:
            self.out += data
            self.output_ready(self)

    def send_packet(self, packet: Packet) -> None:
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
        """``data`` (the MQTT 5 PUBLISH about to be sent) with a topic alias when the client
        takes them (3.3.2.3.4): the topic's alias and an empty topic once it has one; the
        first PUBLISH of a topic carries the topic and assigns the next free
        alias, while the client's Topic Alias Maximum allows and the PUBLISH with the alias
        still fits ``limit`` (then topics stay unaliased: aliases are never reassigned).  The
        caller checks the result against ``limit`` (the packet as sent: an alias of a short
        topic may lengthen it; one that does not fit is not sent and assigned nothing) and
        sends it, so the client always knows an alias before it is used alone."""
        alias = self.out_aliases.get(topic)
        if alias is not None:
            return _publish_aliased("", alias, payload, qos, dup, packet_id, retain, headers)
        if len(self.out_aliases) >= self.alias_max:
            return data
        alias = len(self.out_aliases) + 1
        out = _publish_aliased(topic, alias, payload, qos, dup, packet_id, retain, headers)
        if limit is not None and len(out) > limit:
            return data
        self.out_aliases[topic] = alias
        return out

    def data_to_send(self) -> bytes:
        """Everything queued for the peer since the last call (possibly empty)."""
        if not self.out:
            return b""
        data = bytes(self.out)
        self.out.clear()
        return data

    def queue_ack(self, future: Commit | None, ack: bytes, offset: int = -1) -> None:
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
        """Close this connection (once): log why, then notify the owner (``closed``), which
        tells the core and closes the socket after writing what is left in :attr:`out`.

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
        self.on_closed(self, prev_state)

    def connection_lost(self, reason: str = "connection lost") -> None:
        """The peer went away without DISCONNECT (abnormal: the will is published)."""
        self.close(reason, will=True, level=logging.INFO)

    def keepalive_expired(self, now: float, connect_timeout: float) -> bool:
        """True when no packet arrived for 1.5 x keepalive (spec 3.1.2.10), or no CONNECT
        within ``connect_timeout`` of the accept."""
        return now > self.deadline(connect_timeout)

    def deadline(self, connect_timeout: float) -> float:
        """When this connection times out unless a packet arrives: 1.5 x keepalive after the
        last one (spec 3.1.2.10), or ``connect_timeout`` after the accept before CONNECT; inf
        without a keepalive."""
        if self.state == AWAITING_CONNECT:
            # Absolute from the accept: a byte trickled now and then must not extend it.
            return self.connected_at + connect_timeout
        return self.last_rx + self.keepalive * 1.5 if self.keepalive > 0 else math.inf
