"""An MQTT 3.1.1 client: a sans-I/O :class:`ClientSession` and a thin asyncio :class:`MQTTClient`.

:class:`ClientSession` holds the protocol state a client must keep: packet ids, the in-flight
window of QoS 1/2 publishes (PUBACK, or PUBREC -> PUBREL -> PUBCOMP), incoming QoS 2 ids
awaiting PUBREL, and what to resend with DUP after a reconnect.  It is fed packets and
returns packets to send, so Hypothesis and plain tests drive it without a socket.

:class:`MQTTClient` moves bytes between a TCP (or TLS) stream, the codec and the session.
It is used by the forwarder upstream, the benchmark load generator and the demo sensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl as ssl_module
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from filemq.common.aio import cancel_and_wait
from filemq.mqtt.codec import Decoder, ProtocolError, encode
from filemq.mqtt.packets import (
    CONNACK_ACCEPTED,
    CONNACK_RETURN_CODE_NAMES,
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

log = logging.getLogger(__name__)


class MQTTClientError(Exception):
    """Base class of the client's errors."""


class ConnectionRefused(MQTTClientError):
    """The broker answered CONNECT with a non-zero return code."""

    def __init__(self, client_id: str, return_code: int) -> None:
        self.client_id = client_id
        self.return_code = return_code
        self.reason = CONNACK_RETURN_CODE_NAMES.get(return_code, f"unknown code {return_code}")
        super().__init__(f"broker refused client {client_id!r}: {self.reason} (CONNACK {return_code})")


class ConnectionLost(MQTTClientError):
    """The connection closed (or was never open) while an operation needed it."""


@dataclass(slots=True)
class Will:
    """The message the broker publishes if this client disappears without DISCONNECT."""

    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False


# Stages of an outgoing QoS>0 publish.
_AWAIT_ACK = 0  # PUBLISH sent; waiting for PUBACK (QoS 1) or PUBREC (QoS 2)
_AWAIT_COMP = 1  # PUBREL sent; waiting for PUBCOMP (QoS 2)


@dataclass(slots=True)
class SessionEvents:
    """What :meth:`ClientSession.receive` made of one packet.

    ``send``: packets to write now; ``completed``: packet ids of outgoing publishes now
    fully acknowledged; ``message``: an application message to hand out (then call
    :meth:`ClientSession.accept`); ``reply``: a SUBACK/UNSUBACK/CONNACK/PINGRESP for the caller.
    """

    send: list[Packet] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    message: Publish | None = None
    reply: Connack | Suback | Unsuback | Pingresp | None = None


class ClientSession:
    """Client-side MQTT session state, without I/O.

    Outgoing QoS 1/2 publishes stay in flight (at most ``max_inflight``) until PUBACK or
    PUBCOMP; :meth:`resend` lists what to send again after a reconnect, in original order:
    PUBLISH with DUP set for those not yet PUBACK'd/PUBREC'd, PUBREL for those PUBREC'd.
    The session survives reconnects; only :meth:`clear` drops it.
    """

    def __init__(self, max_inflight: int = 100) -> None:
        if not 1 <= max_inflight <= 65535:
            raise ValueError(f"max_inflight must be 1..65535, got {max_inflight}")
        self.max_inflight = max_inflight
        self._next_id = 1
        self._outgoing: dict[int, tuple[Publish, int]] = {}
        self._requests: set[int] = set()  # SUBSCRIBE/UNSUBSCRIBE ids awaiting their ack
        self._incoming_qos2: set[int] = set()  # PUBREC'd, waiting for PUBREL

    @property
    def inflight(self) -> int:
        """Outgoing QoS 1/2 publishes not yet completely acknowledged."""
        return len(self._outgoing)

    def window_open(self) -> bool:
        """True if a QoS 1/2 publish may start now."""
        return len(self._outgoing) < self.max_inflight

    def _allocate_id(self) -> int:
        # At most 65535 ids can be taken; the window and request count keep us below that.
        for _ in range(65535):
            pid = self._next_id
            self._next_id = pid % 65535 + 1
            if pid not in self._outgoing and pid not in self._requests:
                return pid
        raise MQTTClientError("all 65535 packet ids are in use")

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, dup: bool = False) -> Publish:
        """The PUBLISH to send; QoS 1/2 ones are tracked until acknowledged.

        ``dup`` sets DUP on the first send: the caller may have sent this message before, in an
        earlier session this object does not remember (a store-and-forward agent after a restart).
        Raises ``MQTTClientError`` if the window is full (check :meth:`window_open`).
        """
        if qos not in (0, 1, 2):
            raise ValueError(f"QoS must be 0, 1 or 2, got {qos}")
        if qos == 0:
            return Publish(topic, payload, 0, retain)
        if not self.window_open():
            raise MQTTClientError(f"in-flight window of {self.max_inflight} publishes is full")
        packet = Publish(topic, payload, qos, retain, dup, self._allocate_id())
        self._outgoing[packet.packet_id] = (packet, _AWAIT_ACK)  # type: ignore[index]
        return packet

    def subscribe(self, topics: Iterable[tuple[str, int]]) -> Subscribe:
        """The SUBSCRIBE to send; its SUBACK comes back as ``reply``."""
        packet = Subscribe(self._allocate_id(), list(topics))
        if not packet.topics:
            raise ValueError("SUBSCRIBE needs at least one topic filter")
        self._requests.add(packet.packet_id)
        return packet

    def unsubscribe(self, topics: Iterable[str]) -> Unsubscribe:
        """The UNSUBSCRIBE to send; its UNSUBACK comes back as ``reply``."""
        packet = Unsubscribe(self._allocate_id(), list(topics))
        if not packet.topics:
            raise ValueError("UNSUBSCRIBE needs at least one topic filter")
        self._requests.add(packet.packet_id)
        return packet

    def receive(self, packet: Packet) -> SessionEvents:
        """Apply one packet from the broker."""
        events = SessionEvents()
        if isinstance(packet, Publish):
            if packet.qos == 2 and packet.packet_id in self._incoming_qos2:
                # A redelivery of a message already handed out: acknowledge, don't deliver twice.
                events.send.append(Pubrec(packet.packet_id))
            else:
                if packet.qos == 2:
                    self._incoming_qos2.add(packet.packet_id)  # type: ignore[arg-type]
                events.message = packet
        elif isinstance(packet, Puback):
            entry = self._outgoing.get(packet.packet_id)
            if entry is not None and entry[0].qos == 1:
                del self._outgoing[packet.packet_id]
                events.completed.append(packet.packet_id)
            else:
                log.warning("PUBACK for packet id %d that is not an in-flight QoS 1 publish", packet.packet_id)
        elif isinstance(packet, Pubrec):
            entry = self._outgoing.get(packet.packet_id)
            if entry is not None and entry[0].qos == 2:
                self._outgoing[packet.packet_id] = (entry[0], _AWAIT_COMP)
            else:
                log.warning("PUBREC for packet id %d that is not an in-flight QoS 2 publish", packet.packet_id)
            # Answer even an unknown id so the broker can finish its side (spec 4.3.3).
            events.send.append(Pubrel(packet.packet_id))
        elif isinstance(packet, Pubcomp):
            entry = self._outgoing.get(packet.packet_id)
            if entry is not None and entry[1] == _AWAIT_COMP:
                del self._outgoing[packet.packet_id]
                events.completed.append(packet.packet_id)
            else:
                log.warning("PUBCOMP for packet id %d that is not awaiting it", packet.packet_id)
        elif isinstance(packet, Pubrel):
            self._incoming_qos2.discard(packet.packet_id)
            events.send.append(Pubcomp(packet.packet_id))
        elif isinstance(packet, Suback | Unsuback):
            self._requests.discard(packet.packet_id)
            events.reply = packet
        elif isinstance(packet, Connack | Pingresp):
            events.reply = packet
        else:
            raise ProtocolError(f"{type(packet).__name__} is not a packet a client may receive")
        return events

    def complete_qos1(self, packet_id: int) -> bool:
        """Apply a PUBACK if it completes an in-flight QoS 1 publish (True); else change nothing."""
        entry = self._outgoing.get(packet_id)
        if entry is None or entry[0].qos != 1:
            return False
        del self._outgoing[packet_id]
        return True

    def accept(self, message: Publish) -> Packet | None:
        """The acknowledgement to send once ``message`` was handed to the application:
        PUBACK for QoS 1, PUBREC for QoS 2, nothing for QoS 0."""
        if message.qos == 1:
            return Puback(message.packet_id)  # type: ignore[arg-type]
        if message.qos == 2:
            return Pubrec(message.packet_id)  # type: ignore[arg-type]
        return None

    def resend(self) -> list[Packet]:
        """What to send again after a reconnect, oldest first (spec 4.4)."""
        out: list[Packet] = []
        for packet, stage in self._outgoing.values():
            if stage == _AWAIT_ACK:
                packet.dup = True
                out.append(packet)
            else:
                out.append(Pubrel(packet.packet_id))  # type: ignore[arg-type]
        return out

    def outstanding(self) -> list[int]:
        """Packet ids of in-flight outgoing publishes, oldest first."""
        return list(self._outgoing)

    def clear(self) -> list[int]:
        """Forget all state; returns the ids of the outgoing publishes dropped."""
        dropped = list(self._outgoing)
        self._outgoing.clear()
        self._requests.clear()
        self._incoming_qos2.clear()
        return dropped


_CLOSED = object()  # end-of-stream marker in the message queue


class MQTTClient:
    """An asyncio MQTT 3.1.1 client.

    Publishing: :meth:`publish_nowait` returns a future that resolves when the broker has
    acknowledged the message (PUBACK for QoS 1, PUBCOMP for QoS 2; at once for QoS 0).  When
    ``max_inflight`` publishes are in flight, further ones wait in an in-memory queue and
    are sent as acknowledgements free the window.  If the connection drops, in-flight
    publishes stay pending and are resent (DUP) by the next :meth:`connect`;
    :meth:`disconnect` fails whatever is still pending with :class:`ConnectionLost`.

    Receiving: either pass ``on_message`` (called in the reader task, must not block) or
    iterate :meth:`messages`.  The acknowledgement (PUBACK for QoS 1, PUBREC for QoS 2) is
    sent right after the message is handed out -- after ``on_message`` returns, or when
    the iterator yields it -- so a consumer that dies after that point loses the message.
    """

    def __init__(
        self,
        client_id: str,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        clean_session: bool = True,
        keepalive: int = 60,
        username: str | None = None,
        password: bytes | str | None = None,
        ssl: ssl_module.SSLContext | None = None,
        max_inflight: int = 100,
        will: Will | None = None,
        on_message: Callable[[Publish], None] | None = None,
        max_queued_messages: int = 1000,
        max_packet_size: int = 1 << 20,
    ) -> None:
        self.client_id = client_id
        self.host = host
        self.port = port
        self.clean_session = clean_session
        self.keepalive = keepalive
        self.username = username
        self.password = password.encode() if isinstance(password, str) else password
        self.ssl = ssl
        self.will = will
        self.on_message = on_message
        # publish_batch(): called with the packet ids completed by each chunk read from the socket.
        self.on_complete: Callable[[list[int]], None] | None = None
        self._completed: list[int] = []
        self._cork: list[bytes] | None = None
        self.session = ClientSession(max_inflight)
        self._max_packet_size = max_packet_size
        self._max_queued = max_queued_messages
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self._publish_futures: dict[int, asyncio.Future[None]] = {}
        self._waiting: deque[tuple[Publish, asyncio.Future[None]]] = deque()
        self._replies: dict[int, asyncio.Future[Suback | Unsuback]] = {}
        self._connack: asyncio.Future[Connack] | None = None
        self._pingresp_due: float | None = None
        self._last_sent = 0.0
        self._messages: asyncio.Queue[Publish | object] = asyncio.Queue(max_queued_messages)
        self._closing_marker: asyncio.Future[None] | None = None
        self.closed = asyncio.Event()
        self.closed.set()
        self.close_reason: BaseException | None = None

    # ------------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        """True between a successful :meth:`connect` and the connection's end."""
        return not self.closed.is_set()

    async def connect(self, timeout: float = 10.0) -> Connack:
        """Open the connection, send CONNECT and wait for CONNACK (all within ``timeout``).

        Resends the session's in-flight publishes afterwards.  Raises
        :class:`ConnectionRefused` for a non-zero return code, ``TimeoutError``, or ``OSError``.
        """
        if self.connected:
            raise MQTTClientError(f"client {self.client_id!r} is already connected")
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                self.host, self.port, ssl=self.ssl, limit=1 << 16
            )
            self._writer = writer
            self.closed.clear()
            self.close_reason = None
            self._messages = asyncio.Queue(self._max_queued)
            loop = asyncio.get_running_loop()
            self._connack = loop.create_future()
            self._reader_task = asyncio.create_task(self._read_loop(reader), name=f"mqtt-read-{self.client_id}")
            will = self.will
            self._send(
                Connect(
                    client_id=self.client_id,
                    clean_session=self.clean_session,
                    keepalive=self.keepalive,
                    will_topic=will.topic if will else None,
                    will_payload=will.payload if will else b"",
                    will_qos=will.qos if will else 0,
                    will_retain=will.retain if will else False,
                    username=self.username,
                    password=self.password,
                )
            )
            try:
                connack = await self._connack
            except BaseException:
                await self._abort(ConnectionLost(f"client {self.client_id!r}: no CONNACK"))
                raise
        if connack.return_code != CONNACK_ACCEPTED:
            await self._abort(ConnectionRefused(self.client_id, connack.return_code))
            raise ConnectionRefused(self.client_id, connack.return_code)
        for packet in self.session.resend():
            self._send(packet)
        self._fill_window()
        if self.keepalive:
            self._keepalive_task = asyncio.create_task(self._keepalive_loop(), name=f"mqtt-ping-{self.client_id}")
        log.info("client %r connected to %s:%d (session present: %s)", self.client_id, self.host, self.port, connack.session_present)
        return connack

    async def disconnect(self, timeout: float = 5.0) -> None:
        """Send DISCONNECT and close; pending publish futures fail with :class:`ConnectionLost`."""
        if self._writer is not None and self.connected:
            with contextlib.suppress(OSError, TimeoutError):
                self._send(Disconnect())
                async with asyncio.timeout(timeout):
                    await self._writer.drain()
        await self._abort(None)
        self._fail_pending(ConnectionLost(f"client {self.client_id!r} disconnected"))

    async def wait_closed(self) -> BaseException | None:
        """Wait until the connection ends; returns why (None for a clean :meth:`disconnect`)."""
        await self.closed.wait()
        return self.close_reason

    # ------------------------------------------------------------------ publishing

    def publish_nowait(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, dup: bool = False
    ) -> asyncio.Future[None]:
        """Queue a publish; the future resolves once the broker acknowledged it (see class doc).

        ``dup`` (QoS 1/2): send it with DUP set, for a message possibly sent before (MQTT-3.3.1-1)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if qos == 0:
            if not self.connected:
                future.set_exception(ConnectionLost(f"client {self.client_id!r} is not connected"))
                return future
            self._send(self.session.publish(topic, payload, 0, retain))
            future.set_result(None)
            return future
        if qos not in (1, 2):
            raise ValueError(f"QoS must be 0, 1 or 2, got {qos}")
        if self._waiting or not self.session.window_open():
            self._waiting.append((Publish(topic, payload, qos, retain, dup), future))
            return future
        self._start_publish(Publish(topic, payload, qos, retain, dup), future)
        return future

    def publish_batch(self, messages: Iterable[tuple[str, bytes, bool, bool]], qos: int = 1) -> list[int]:
        """Start QoS 1/2 publishes of ``(topic, payload, retain, dup)`` without a future each, written
        to the socket in one call; returns their packet ids, in order.

        For a high-rate producer that tracks completion itself: ``on_complete(ids)`` is called
        with the packet ids fully acknowledged (PUBACK / PUBCOMP), once per chunk read from the
        socket. They are in the session like any publish: resent with DUP by the next
        :meth:`connect` if the connection drops. Raises ``MQTTClientError`` if they do not fit
        the in-flight window (check ``session.max_inflight - session.inflight``) or publishes
        queued by :meth:`publish_nowait` are waiting.
        """
        if qos not in (1, 2):
            raise ValueError(f"publish_batch needs QoS 1 or 2, got {qos}")
        if self._waiting:
            raise MQTTClientError("publish_batch while publish_nowait() messages wait for the window")
        session = self.session
        ids: list[int] = []
        send = self.connected and self._writer is not None
        self._cork = [] if send else None
        try:
            for topic, payload, retain, dup in messages:
                packet = session.publish(topic, payload, qos, retain, dup)
                ids.append(packet.packet_id)  # type: ignore[arg-type]
                if send:
                    self._send(packet)
        finally:
            data, self._cork = self._cork, None
            if data and self._writer is not None:
                self._writer.write(b"".join(data))
                self._last_sent = time.monotonic()
        return ids

    async def publish(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, *, timeout: float | None = 30.0
    ) -> None:
        """Publish and wait for the acknowledgement; ``TimeoutError`` after ``timeout`` seconds
        (the message then stays queued/in flight and may still be delivered)."""
        future = self.publish_nowait(topic, payload, qos, retain)
        if qos == 0 and self._writer is not None and self.connected:
            with contextlib.suppress(OSError):
                await self._writer.drain()
        async with asyncio.timeout(timeout):
            await asyncio.shield(future)

    def _start_publish(self, template: Publish, future: asyncio.Future[None]) -> None:
        packet = self.session.publish(template.topic, template.payload, template.qos, template.retain, template.dup)
        self._publish_futures[packet.packet_id] = future  # type: ignore[index]
        if self.connected:
            self._send(packet)
        # Not connected: it is in the session and goes out with the next connect()'s resend.

    def _fill_window(self) -> None:
        while self._waiting and self.session.window_open():
            template, future = self._waiting.popleft()
            if not future.done():
                self._start_publish(template, future)

    # ------------------------------------------------------------------ subscriptions

    async def subscribe(self, topics: Iterable[tuple[str, int]], timeout: float = 10.0) -> list[int]:
        """Subscribe; returns the SUBACK return codes (granted QoS, or 0x80 for refused)."""
        packet = self.session.subscribe(topics)
        reply = await self._request(packet, packet.packet_id, timeout)
        assert isinstance(reply, Suback)
        return reply.return_codes

    async def unsubscribe(self, topics: Iterable[str], timeout: float = 10.0) -> None:
        """Unsubscribe and wait for UNSUBACK."""
        packet = self.session.unsubscribe(topics)
        await self._request(packet, packet.packet_id, timeout)

    async def _request(self, packet: Packet, packet_id: int, timeout: float) -> Suback | Unsuback:
        if not self.connected:
            raise ConnectionLost(f"client {self.client_id!r} is not connected")
        future: asyncio.Future[Suback | Unsuback] = asyncio.get_running_loop().create_future()
        self._replies[packet_id] = future
        self._send(packet)
        try:
            async with asyncio.timeout(timeout):
                return await future
        finally:
            self._replies.pop(packet_id, None)

    # ------------------------------------------------------------------ receiving

    async def messages(self) -> AsyncIterator[Publish]:
        """Incoming messages until the connection closes (each acknowledged as it is yielded)."""
        queue = self._messages
        while True:
            item = await queue.get()
            if item is _CLOSED:
                return
            assert isinstance(item, Publish)
            self._ack(item)
            yield item

    def _ack(self, message: Publish) -> None:
        ack = self.session.accept(message)
        if ack is not None and self.connected:
            self._send(ack)

    # ------------------------------------------------------------------ internals

    def _send(self, packet: Packet) -> None:
        if self._writer is None:
            raise ConnectionLost(f"client {self.client_id!r} is not connected")
        if self._cork is not None:
            self._cork.append(encode(packet))
            return
        self._writer.write(encode(packet))
        self._last_sent = time.monotonic()

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        decoder = Decoder(self._max_packet_size, server=False)
        reason: BaseException | None = ConnectionLost(f"client {self.client_id!r}: broker closed the connection")
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                decoder.feed(data)
                for packet in decoder.packets():
                    # Fast path for the common case of a publish_batch() producer: a PUBACK
                    # completing a QoS 1 publish nobody holds a future for.
                    if type(packet) is Puback and packet.packet_id not in self._publish_futures \
                            and self.session.complete_qos1(packet.packet_id):
                        self._completed.append(packet.packet_id)
                        continue
                    await self._dispatch(packet)
                self._flush_completed()
                if self._waiting:
                    self._fill_window()
        except (OSError, ProtocolError) as exc:
            log.warning("client %r: connection to %s:%d failed: %s", self.client_id, self.host, self.port, exc)
            reason = exc
        except Exception as exc:
            # A bug, not the network: log it loudly, but still close cleanly.
            log.exception("client %r: reader failed", self.client_id)
            reason = exc
        except asyncio.CancelledError:
            reason = None
            raise
        finally:
            self._flush_completed()
            self._connection_ended(reason)

    def _flush_completed(self) -> None:
        if self._completed:
            completed, self._completed = self._completed, []
            if self.on_complete is not None:
                self.on_complete(completed)

    async def _dispatch(self, packet: Packet) -> None:
        events = self.session.receive(packet)
        for out in events.send:
            self._send(out)
        for pid in events.completed:
            future = self._publish_futures.pop(pid, None)
            if future is None:
                self._completed.append(pid)  # a publish_batch() one
            if future is not None and not future.done():
                future.set_result(None)
        if events.completed:
            self._fill_window()
        reply = events.reply
        if isinstance(reply, Connack):
            if self._connack is not None and not self._connack.done():
                self._connack.set_result(reply)
        elif isinstance(reply, Pingresp):
            self._pingresp_due = None
        elif reply is not None:
            waiter = self._replies.get(reply.packet_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(reply)
        message = events.message
        if message is not None:
            if self.on_message is not None:
                try:
                    self.on_message(message)
                except Exception:
                    # Not acknowledged: the broker redelivers it after a reconnect.
                    log.exception("client %r: on_message failed for topic %r", self.client_id, message.topic)
                    return
                self._ack(message)
            else:
                # Blocks the reader when the consumer lags: TCP backpressure, bounded memory.
                await self._messages.put(message)

    async def _keepalive_loop(self) -> None:
        interval = self.keepalive
        while self.connected:
            await asyncio.sleep(min(interval / 2, 30))
            if not self.connected:
                return
            now = time.monotonic()
            if self._pingresp_due is not None and now > self._pingresp_due:
                log.warning("client %r: no PINGRESP within %ss, closing", self.client_id, interval)
                await self._abort(ConnectionLost(f"client {self.client_id!r}: keepalive timeout"))
                return
            if now - self._last_sent >= interval / 2 and self._pingresp_due is None:
                self._send(Pingreq())
                self._pingresp_due = now + interval

    def _connection_ended(self, reason: BaseException | None) -> None:
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        self._pingresp_due = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._connack is not None and not self._connack.done():
            self._connack.set_exception(reason or ConnectionLost("connection closed"))
        for waiter in self._replies.values():
            if not waiter.done():
                waiter.set_exception(ConnectionLost(f"client {self.client_id!r}: connection closed"))
        if self._keepalive_task is not None and self._keepalive_task is not asyncio.current_task():
            self._keepalive_task.cancel()
        # Wake an iterating consumer.  If the queue is full, the marker goes in once the
        # consumer has drained a slot (the task ends with the queue, so it cannot leak work).
        try:
            self._messages.put_nowait(_CLOSED)
        except asyncio.QueueFull:
            self._closing_marker = asyncio.ensure_future(self._messages.put(_CLOSED))

    async def _abort(self, reason: BaseException | None) -> None:
        self._connection_ended(reason)
        task = self._reader_task
        if task is not None and task is not asyncio.current_task():
            await cancel_and_wait(task)
        self._reader_task = None

    def _fail_pending(self, exc: BaseException) -> None:
        for future in self._publish_futures.values():
            if not future.done():
                future.set_exception(exc)
        for _, future in self._waiting:
            if not future.done():
                future.set_exception(exc)
        self._publish_futures.clear()
        self._waiting.clear()
        self.session.clear()
