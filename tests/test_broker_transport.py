"""The broker's transport: connections before CONNECT, back-pressure, listeners (TCP, TLS,
WebSockets).  Real sockets on loopback, port 0; every wait is bounded.

Issue 10 item 9 (slowloris), item 10 (a client that never reads), issue 11 item 5 (listeners).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from filemq.broker import Broker
from filemq.broker.session import AWAITING_CONNECT, CLOSED, MAX_CONNECT_PACKET
from filemq.config import Config, load_config
from filemq.mqtt.client import MQTTClient
from filemq.mqtt.codec import Decoder, encode
from filemq.mqtt.packets import Connack, Connect, Pingreq, Publish
from tests.test_broker_session import Harness

# MQTT 3.1.1 CONNECT for client id "slow": fixed header + variable header + payload.
_CONNECT = encode(Connect(client_id="slow"))


def make_config(data_dir: Path, **broker: Any) -> Config:
    overrides = {"data_dir": str(data_dir), "broker.port": 0}
    overrides.update({f"broker.{k}": v for k, v in broker.items()})
    return load_config(None, overrides)


@contextlib.asynccontextmanager
async def running(config: Config, **kw: Any) -> AsyncIterator[Broker]:
    broker = Broker(config, **kw)
    await broker.start()
    try:
        yield broker
    finally:
        await broker.stop()


async def _closed_by_peer(reader: asyncio.StreamReader, timeout: float) -> bool:
    """True when the broker closes the connection within ``timeout`` (EOF or reset)."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


# ---- slowloris (issue 10 item 9) ------------------------------------------------------------


def test_connect_deadline_is_absolute_from_accept(tmp_path: Path) -> None:
    """A CONNECT trickled a byte at a time is cut off connect_timeout after the accept:
    a byte received does not extend the deadline (it did: 1,000 such sockets locked out
    every real client)."""

    async def main() -> None:
        h = Harness(tmp_path)
        t0 = 1000.0
        conn = h.client().conn
        conn.connected_at = conn.last_rx = t0
        timeout = h.core.connect_timeout
        for i in range(len(_CONNECT) - 1):  # every byte but the last, well inside each deadline
            now = t0 + (i + 1) * timeout / len(_CONNECT)
            conn.receive_data(_CONNECT[i:i + 1], now=now)
            assert not conn.closed
        assert not conn.keepalive_expired(t0 + timeout - 0.01)
        assert conn.keepalive_expired(t0 + timeout + 0.01)
        h.core.tick(t0 + timeout + 0.01)
        assert conn.state == CLOSED and "no CONNECT within" in conn.close_reason

    asyncio.run(main())


def test_half_open_sockets_do_not_lock_out_clients(tmp_path: Path) -> None:
    """50 sockets that never finish their CONNECT, against max_connections = 20: real clients
    still log in (0 of 3 did), because half-open connections are counted apart from connected
    clients, and the oldest half-open one makes room for a new socket at max_connecting."""

    async def main() -> None:
        async with running(make_config(tmp_path, max_connections=20, max_connecting=8)) as b:
            assert b.core is not None
            held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
            try:
                for _ in range(50):
                    r, w = await asyncio.open_connection("127.0.0.1", b.port)
                    w.write(_CONNECT[:3])
                    held.append((r, w))
                    await w.drain()
                # Every socket was accepted and sent its bytes; only the 8 newest are kept.
                async with asyncio.timeout(5):
                    while sum(1 for c in b.core.conns if c.state == AWAITING_CONNECT) > 8:
                        await asyncio.sleep(0.01)
                for r, _ in held[:40]:
                    assert await _closed_by_peer(r, 5)
                for i in range(3):
                    c = MQTTClient(f"real-{i}", port=b.port)
                    ack = await c.connect(timeout=5)
                    assert ack.return_code == 0
                    await c.disconnect()
                assert sum(1 for c in b.core.conns if c.state == AWAITING_CONNECT) <= 8
            finally:
                for _, w in held:
                    w.close()

    asyncio.run(main())


def test_max_connections_counts_connected_clients_only(tmp_path: Path) -> None:
    """max_connections bounds CONNECTed clients: with 2 connected, a third CONNECT gets
    CONNACK 3 (server unavailable) and is closed; half-open sockets do not use the slots."""

    async def main() -> None:
        async with running(make_config(tmp_path, max_connections=2)) as b:
            half = [await asyncio.open_connection("127.0.0.1", b.port) for _ in range(3)]
            a, c = MQTTClient("a", port=b.port), MQTTClient("c", port=b.port)
            await a.connect(timeout=5)
            await c.connect(timeout=5)
            r, w = await asyncio.open_connection("127.0.0.1", b.port)
            w.write(encode(Connect(client_id="third")))
            data = await asyncio.wait_for(r.read(4), 5)
            assert data in (b"", b"\x20\x02\x00\x03")  # refused at accept, or CONNACK 3
            assert await _closed_by_peer(r, 5)
            w.close()
            for _, hw in half:
                hw.close()
            await a.disconnect()
            await c.disconnect()

    asyncio.run(main())


def test_pre_connect_packet_size_is_capped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before CONNECT a packet may be at most MAX_CONNECT_PACKET bytes (the largest CONNECT
    3.1.1 allows): a socket announcing a 1 MiB CONNECT is closed at its fixed header instead
    of having its bytes buffered (400 of them held 449 MB).  After CONNACK the configured
    max_packet_size applies again, also to a PUBLISH sent right behind the CONNECT."""

    async def main() -> None:
        async with running(make_config(tmp_path, max_packet_size="1 MiB")) as b:
            r, w = await asyncio.open_connection("127.0.0.1", b.port)
            size = (1 << 20) - 5
            header = bytes([0x10, 0x80 | (size & 0x7F), 0x80 | ((size >> 7) & 0x7F), size >> 14])
            with caplog.at_level(logging.WARNING, "filemq.broker"):
                w.write(header + b"\x00" * 65536)
                assert await _closed_by_peer(r, 3)
            assert "exceeds max_packet_size" in caplog.text
            w.close()
            # A large PUBLISH pipelined behind the CONNECT, in the same write, is accepted.
            r, w = await asyncio.open_connection("127.0.0.1", b.port)
            big = b"x" * (MAX_CONNECT_PACKET + 1000)
            w.write(encode(Connect(client_id="pipe")) + encode(Publish("big", big, 1, False, False, 1)))
            dec = Decoder(server=False)
            got: list[Any] = []
            async with asyncio.timeout(5):
                while len(got) < 2:
                    data = await r.read(65536)
                    assert data
                    dec.feed(data)
                    got += dec.packets()
            assert isinstance(got[0], Connack) and got[0].return_code == 0
            assert got[1].packet_id == 1  # PUBACK
            w.close()

    asyncio.run(main())


def test_pre_connect_buffer_is_bounded(tmp_path: Path) -> None:
    """Whatever a connection sends before its CONNECT is complete, the broker holds at most
    MAX_CONNECT_PACKET + one read of it (a partial CONNECT of the largest size is kept)."""

    async def main() -> None:
        h = Harness(tmp_path)
        c = h.client()
        size = MAX_CONNECT_PACKET - 4
        header = bytes([0x10, 0x80 | (size & 0x7F), 0x80 | ((size >> 7) & 0x7F), size >> 14])
        c.send_bytes(header + b"\x00" * (MAX_CONNECT_PACKET - 100))
        assert not c.conn.closed  # within the cap: a slow but possible CONNECT
        assert c.conn.decoder.buffered <= MAX_CONNECT_PACKET
        c2 = h.client()
        size += 5
        c2.send_bytes(bytes([0x10, 0x80 | (size & 0x7F), 0x80 | ((size >> 7) & 0x7F), size >> 14]))
        assert c2.conn.closed

    asyncio.run(main())


# ---- back-pressure (issue 10 item 10) -------------------------------------------------------


def _buffered(b: Broker, client_id: str) -> int:
    """Bytes the broker holds for ``client_id``'s output: its transport buffer + pending out."""
    assert b.core is not None
    for conn in b.core.conns:
        if conn.client_id == client_id and conn.transport is not None:
            size: int = conn.transport.get_write_buffer_size()  # type: ignore[attr-defined]
            return size + len(conn.out)
    return 0


def test_client_that_never_reads_stops_being_read(tmp_path: Path) -> None:
    """A raw client sends PINGREQs and never reads the PINGRESPs: once its write buffer is
    over the limit the broker stops reading from it (transport.pause_reading), so what the
    broker buffers for it stays bounded (it grew by 1.8 MB/s without limit)."""
    from filemq.broker.server import WRITE_BUFFER_HIGH

    async def main() -> None:
        async with running(make_config(tmp_path)) as b:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", b.port))
            sock.setblocking(False)
            r, w = await asyncio.open_connection(sock=sock, limit=1 << 16)
            w.write(encode(Connect(client_id="deaf")))
            assert await asyncio.wait_for(r.readexactly(4), 5) == b"\x20\x02\x00\x00"
            # Small kernel buffers on the broker's side too, so that what backs up is the
            # broker's own buffer (loopback would otherwise absorb megabytes first).
            assert b.core is not None
            (conn,) = [c for c in b.core.conns if c.client_id == "deaf"]
            bsock = conn.transport.get_extra_info("socket")  # type: ignore[union-attr]
            bsock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            chunk = encode(Pingreq()) * 65536  # 128 KiB of PINGREQs
            peak = 0
            deadline = time.monotonic() + 4.0
            sent = 0
            while time.monotonic() < deadline and sent < 64:  # up to 8 MiB of PINGREQs
                if w.transport.get_write_buffer_size() < 1 << 20:
                    w.write(chunk)
                    sent += 1
                await asyncio.sleep(0.02)
                peak = max(peak, _buffered(b, "deaf"))
            assert sent >= 8  # at least 1 MiB of PINGREQs offered
            # One read (<= 256 KiB) of PINGREQs answered after the limit was reached, at most.
            assert peak <= WRITE_BUFFER_HIGH + 512 * 1024, peak
            assert peak > 0
            w.close()

    asyncio.run(main())


def test_paused_connection_is_read_again_when_drained(tmp_path: Path) -> None:
    """After the client reads what was buffered, the broker resumes reading: every PINGREQ
    gets its PINGRESP, none lost while reading was paused."""
    from filemq.broker.server import WRITE_BUFFER_HIGH

    async def main() -> None:
        async with running(make_config(tmp_path)) as b:
            r, w = await asyncio.open_connection("127.0.0.1", b.port, limit=1 << 16)
            w.write(encode(Connect(client_id="slowreader")))
            assert await asyncio.wait_for(r.readexactly(4), 5) == b"\x20\x02\x00\x00"
            assert b.core is not None
            (conn,) = [c for c in b.core.conns if c.client_id == "slowreader"]
            bsock = conn.transport.get_extra_info("socket")  # type: ignore[union-attr]
            bsock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            n = 600_000  # 1.2 MB of PINGRESPs: more than the buffer limit and socket buffers
            w.write(encode(Pingreq()) * n)
            async with asyncio.timeout(10):  # until the broker holds more than its limit
                while _buffered(b, "slowreader") < WRITE_BUFFER_HIGH:
                    await asyncio.sleep(0.01)
            got = 0
            async with asyncio.timeout(30):
                while got < 2 * n:
                    data = await r.read(1 << 16)
                    assert data
                    got += len(data)
            assert got == 2 * n
            w.close()

    asyncio.run(main())
