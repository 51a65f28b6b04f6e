"""MQTT over WebSockets (subprotocol ``mqtt``) for a ``protocol = "websockets"`` listener.

A thin asyncio shell around ``wsproto`` (sans-I/O, like our codec): the HTTP upgrade and the
WebSocket framing happen here; the MQTT byte stream -- the concatenated payloads of binary
messages, in which a packet may span messages -- goes to the same per-connection protocol as a
TCP listener's (:class:`filemq.broker.server._MQTTProtocol`), through a transport that wraps
every write into one binary message.  The connection exists (is counted half-open, its
CONNECT deadline runs) from the accept, so a slow upgrade is cut off like a slow CONNECT;
the upgrade request is bounded here (:data:`MAX_UPGRADE_REQUEST`, however it is split: h11's
own 16 KiB bound holds only for a request still incomplete) and wsproto hands frame data on
as it arrives.  A frame that breaks RFC 6455 (unmasked, reserved bits, a control frame too
long, ...) fails the connection with a close frame carrying the status code wsproto names
(1002 protocol error; 1007, 1009), RFC 6455 §7.1.7.

``wsproto`` is imported lazily: it is the ``websockets`` extra (``pip install
filemq[websockets]``), needed only when such a listener is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, cast

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

log = logging.getLogger("filemq.broker")

SUBPROTOCOL = "mqtt"
MAX_UPGRADE_REQUEST = 16 * 1024
"""The most bytes the HTTP upgrade request may take (h11's default bound on an incomplete one)."""
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n"
              b"connection: close\r\n\r\n")


class _WSTransport(asyncio.Transport):
    """What the MQTT protocol writes to: each write is one binary WebSocket message."""

    def __init__(self, outer: WebSocketProtocol, raw: asyncio.Transport) -> None:
        super().__init__()
        self._outer = outer
        self._raw = raw

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._outer.send_message(bytes(data))

    def close(self) -> None:
        self._outer.close(1000)

    def abort(self) -> None:
        self._raw.abort()

    def is_closing(self) -> bool:
        return self._raw.is_closing()

    def pause_reading(self) -> None:
        self._raw.pause_reading()

    def resume_reading(self) -> None:
        self._raw.resume_reading()

    def is_reading(self) -> bool:
        return self._raw.is_reading()

    def get_write_buffer_size(self) -> int:
        return self._raw.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._raw.set_write_buffer_limits(high, low)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._raw.get_extra_info(name, default)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The value of header ``name`` (lower case), decoded; None if absent."""
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class WebSocketProtocol(asyncio.Protocol):
    """One WebSocket connection carrying MQTT to ``inner`` (an ``asyncio.Protocol``)."""

    def __init__(self, inner: asyncio.Protocol, allowed_origins: tuple[str, ...] = ()) -> None:
        self.inner = inner
        self.allowed_origins = allowed_origins
        self.ws = WSConnection(ConnectionType.SERVER)
        self.raw: asyncio.Transport | None = None
        self.peer = "?"
        self.upgrade_bytes = 0  # received before the handshake ended

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (uvloop transports do not subclass it)
        self.raw = transport
        peername = transport.get_extra_info("peername")
        self.peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)
        self.inner.connection_made(_WSTransport(self, transport))

    def _write(self, data: bytes) -> None:
        if data and self.raw is not None and not self.raw.is_closing():
            self.raw.write(data)

    def send_message(self, data: bytes) -> None:
        if self.ws.state is ConnectionState.OPEN:
            self._write(self.ws.send(BytesMessage(data=data)))

    def close(self, code: int, reason: str = "") -> None:
        """Close the WebSocket (a close frame when open) and the socket."""
        if self.ws.state is ConnectionState.OPEN:
            with contextlib.suppress(LocalProtocolError):
                self._write(self.ws.send(CloseConnection(code=code, reason=reason)))
        if self.raw is not None:
            self.raw.close()

    def data_received(self, data: bytes) -> None:
        if self.ws.state is ConnectionState.CONNECTING:
            self.upgrade_bytes += len(data)
            if self.upgrade_bytes > MAX_UPGRADE_REQUEST:
                log.warning("refusing WebSocket connection from %s: an upgrade request over %d bytes",
                            self.peer, MAX_UPGRADE_REQUEST)
                self._write(_TOO_LARGE)
                self.close(1002)
                return
        try:
            self.ws.receive_data(data)
            events = list(self.ws.events())
        except RemoteProtocolError as exc:
            log.warning("closing WebSocket connection from %s: %s", self.peer, exc)
            if self.ws.state is ConnectionState.CONNECTING and exc.event_hint is not None:
                with contextlib.suppress(LocalProtocolError):
                    self._write(self.ws.send(exc.event_hint))  # (an HTTP 400 for a bad request)
            self.close(1002)
            return
        for event in events:
            if self.raw is None or self.raw.is_closing():
                return
            if isinstance(event, BytesMessage):
                self.inner.data_received(bytes(event.data))
            elif isinstance(event, Request):
                origin = _header(event.extra_headers, b"origin")
                if origin is not None and not self._origin_allowed(origin, event.host):
                    log.warning("refusing WebSocket connection from %s: Origin %r is not in this "
                                "listener's allowed_origins (add it to let that site's pages connect)",
                                self.peer, origin)
                    self._write(self.ws.send(RejectConnection(status_code=403)))
                    self.raw.close()
                elif SUBPROTOCOL in event.subprotocols:
                    self._write(self.ws.send(AcceptConnection(subprotocol=SUBPROTOCOL)))
                else:
                    log.warning("refusing WebSocket connection from %s: subprotocol %r is not "
                                "offered (got %s)", self.peer, SUBPROTOCOL, event.subprotocols)
                    self._write(self.ws.send(RejectConnection(status_code=400)))
                    self.raw.close()
            elif isinstance(event, Ping):
                self._write(self.ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                if self.ws.state is ConnectionState.OPEN:
                    # Not the peer's close: wsproto failed a frame (its state stays OPEN) and
                    # names the status code; the connection fails with it (RFC 6455 §7.1.7).
                    log.warning("closing WebSocket connection from %s: %s (%d)", self.peer, event.reason,
                                event.code)
                    self.close(event.code)
                    return
                if self.ws.state is ConnectionState.REMOTE_CLOSING:
                    self._write(self.ws.send(event.response()))
                self.raw.close()
            elif isinstance(event, TextMessage):
                log.warning("closing WebSocket connection from %s: a text message (MQTT is binary)",
                            self.peer)
                self.close(1003, "MQTT needs binary messages")

    def _origin_allowed(self, origin: str, host: str) -> bool:
        """A listed origin, any with ``"*"``, or the request's own: the Origin's host[:port] is
        the Host header (what paho-mqtt and other non-browser clients send)."""
        allowed = self.allowed_origins
        origin = origin.strip().lower().rstrip("/")
        if "*" in allowed or origin in allowed:
            return True
        _, sep, netloc = origin.partition("://")
        return bool(sep) and netloc == host.strip().lower()

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()
