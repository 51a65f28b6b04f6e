"""MQTT over WebSockets at the frame level (RFC 6455), through
:class:`filemq.broker.websocket.WebSocketProtocol` with a fake socket: no network.  The
listener end to end (paho-mqtt, wss://, origins, the CONNECT deadline) is in
tests/test_broker_transport.py."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

pytest.importorskip("wsproto", reason="the websockets extra (pip install filemq[websockets]) is not installed")

from wsproto import ConnectionType, WSConnection  # noqa: E402
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Request  # noqa: E402

from filemq.broker.websocket import MAX_UPGRADE_REQUEST, WebSocketProtocol  # noqa: E402


class RawSocket:
    """The asyncio transport under the WebSocket: what the broker wrote, and whether it closed."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.out += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class MQTTSide(asyncio.Protocol):
    """Stands for the broker's MQTT protocol: collects the byte stream it is handed."""

    def __init__(self) -> None:
        self.stream = b""
        self.lost = False

    def data_received(self, data: bytes) -> None:
        self.stream += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


def opened() -> tuple[WebSocketProtocol, RawSocket, MQTTSide, WSConnection]:
    """A WebSocket the broker accepted (subprotocol mqtt), and the client's wsproto end."""
    inner, raw = MQTTSide(), RawSocket()
    ws = WebSocketProtocol(inner)
    ws.connection_made(raw)  # type: ignore[arg-type]
    client = WSConnection(ConnectionType.CLIENT)
    ws.data_received(client.send(Request(host="broker", target="/mqtt", subprotocols=["mqtt"])))
    client.receive_data(bytes(raw.out))
    assert [type(e) for e in client.events()] == [AcceptConnection]
    raw.out.clear()
    return ws, raw, inner, client


MASK = b"\x00\x00\x00\x00"  # (a zero mask: the payload bytes are sent as they are)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        pytest.param(b"\x82\x01\x00", 1002, id="unmasked client frame (RFC 6455 5.1)"),
        pytest.param(b"\xc2\x81" + MASK + b"\x00", 1002, id="RSV1 without an extension (5.2)"),
        pytest.param(b"\x83\x81" + MASK + b"\x00", 1002, id="reserved opcode 0x3 (5.2)"),
        pytest.param(b"\x80\x81" + MASK + b"\x00", 1002, id="continuation without a first frame (5.4)"),
        pytest.param(b"\x09\x80" + MASK, 1002, id="fragmented ping (5.5)"),
        pytest.param(b"\x89\xfe\x00\x7e" + MASK + b"p" * 126, 1002, id="ping of 126 bytes (5.5)"),
        pytest.param(b"\x88\x82" + MASK + b"\x03\xe7", 1002, id="close code 999 (7.4.1)"),
        pytest.param(b"\x81\x82" + MASK + b"\xc0\x80", 1007, id="text frame not UTF-8 (8.1)"),
    ],
)
def test_protocol_error_fails_the_connection_with_a_close_frame_rfc6455_7_1_7(frame: bytes, code: int) -> None:
    """RFC 6455 §7.1.7 (Fail the WebSocket Connection): a frame that breaks the protocol gets
    a Close frame with the status code for it -- 1002 protocol error (§7.4.1), 1007 for a
    text payload that is not UTF-8 -- and then the socket closes; nothing reaches MQTT.
    Before, the socket just closed."""
    ws, raw, inner, client = opened()
    ws.data_received(frame)
    client.receive_data(bytes(raw.out))
    events = list(client.events())
    assert [type(e) for e in events] == [CloseConnection] and cast(CloseConnection, events[0]).code == code
    assert raw.closed and inner.stream == b""


def test_mqtt_bytes_and_a_clean_close_still_work() -> None:
    """The good path beside the errors: binary messages reach MQTT as one byte stream; the
    client's close is answered with a close (§5.5.1) and the socket closes."""
    ws, raw, inner, client = opened()
    ws.data_received(client.send(BytesMessage(data=b"\x10\x0c")) + client.send(BytesMessage(data=b"rest")))
    assert inner.stream == b"\x10\x0crest"
    ws.data_received(client.send(CloseConnection(code=1000)))
    client.receive_data(bytes(raw.out))
    assert [(type(e), cast(CloseConnection, e).code) for e in client.events()] == [(CloseConnection, 1000)]
    assert raw.closed


def _request(extra: int) -> bytes:
    """An upgrade request with a header of ``extra`` bytes (a large cookie)."""
    return (b"GET /mqtt HTTP/1.1\r\nHost: broker\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            b"Sec-WebSocket-Protocol: mqtt\r\nCookie: " + b"c" * extra + b"\r\n\r\n")


@pytest.mark.parametrize("split", [None, 1000])
def test_upgrade_request_over_16_kib_is_refused_however_it_arrives(split: int | None) -> None:
    """The upgrade request is bounded at MAX_UPGRADE_REQUEST = 16 KiB (docs/BROKER.md), also
    when it arrives in one write (h11's own bound only holds a request that is still
    incomplete): a 100 KB one gets HTTP 431 and the close, in one read or in many."""
    inner, raw = MQTTSide(), RawSocket()
    ws = WebSocketProtocol(inner)
    ws.connection_made(raw)  # type: ignore[arg-type]
    request = _request(100_000)
    step = split or len(request)
    for k in range(0, len(request), step):
        if raw.closed:
            break
        ws.data_received(request[k:k + step])
    assert bytes(raw.out).startswith(b"HTTP/1.1 431 ") and raw.closed
    assert ws.upgrade_bytes <= MAX_UPGRADE_REQUEST + step


def test_upgrade_request_within_16_kib_is_accepted() -> None:
    """A 15 KB upgrade request (a big cookie) is within the bound: accepted."""
    inner, raw = MQTTSide(), RawSocket()
    ws = WebSocketProtocol(inner)
    ws.connection_made(raw)  # type: ignore[arg-type]
    request = _request(15_000)
    assert len(request) <= MAX_UPGRADE_REQUEST
    ws.data_received(request)
    assert bytes(raw.out).startswith(b"HTTP/1.1 101 ") and not raw.closed


def test_malformed_upgrade_request_gets_http_400() -> None:
    """A request that is not HTTP gets 400 Bad Request before the close (RFC 6455 §4.2.1:
    the server answers an invalid handshake with an HTTP error)."""
    inner, raw = MQTTSide(), RawSocket()
    ws = WebSocketProtocol(inner)
    ws.connection_made(raw)  # type: ignore[arg-type]
    ws.data_received(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00\r\n\r\n")
    assert bytes(raw.out).startswith(b"HTTP/1.1 400 ") and raw.closed
