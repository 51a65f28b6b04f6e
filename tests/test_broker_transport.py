"""The broker's transport: connections before CONNECT, back-pressure, listeners (TCP, TLS,
WebSockets).  Real sockets on loopback, port 0; every wait is bounded.

Issue 10 item 9 (slowloris), item 10 (a client that never reads), issue 11 item 5 (listeners).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from filemq.broker import Broker
from filemq.broker.session.connection import AWAITING_CONNECT, CLOSED, MAX_CONNECT_PACKET
from filemq.broker.tls import certificate_cn
from filemq.common.config import (
    ConfigError,
    Listener,
    broker_listeners,
    flag_overrides,
    load_config,
)
from filemq.mqtt.client import ConnectionLost, ConnectionRefused, MQTTClient
from filemq.mqtt.codec import Decoder, encode
from filemq.mqtt.packets import Connack, Connect, Pingreq, Publish
from tests.broker_harness import Harness
from tests.broker_process import closed_by_peer, collect, load_toml, make_config, running
from tests.tls_material import client_ctx, make_ca, signed_cert

# MQTT 3.1.1 CONNECT for client id "slow": fixed header + variable header + payload.
_CONNECT = encode(Connect(client_id="slow"))


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
            h.core.receive(conn, conn.receive_data(_CONNECT[i:i + 1], now))
            assert not conn.closed
        assert not conn.keepalive_expired(t0 + timeout - 0.01, timeout)
        assert conn.keepalive_expired(t0 + timeout + 0.01, timeout)
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
                    assert await closed_by_peer(r, 5)
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
            assert await closed_by_peer(r, 5)
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
                assert await closed_by_peer(r, 3)
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
    MAX_CONNECT_PACKET + one read of it (a partial CONNECT of the largest size is kept); a
    larger one is refused once its level byte is in and says it is no MQTT 5 CONNECT (which
    may be max_packet_size, tests/test_broker_conformance.py::
    test_mqtt5_connect_larger_than_the_largest_311_connect_is_accepted)."""

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
        c2.send_bytes(b"\x00\x04MQTT\x04")
        assert c2.conn.closed

    asyncio.run(main())


# ---- back-pressure (issue 10 item 10) -------------------------------------------------------


def _buffered(b: Broker, client_id: str) -> int:
    """Bytes the broker holds for ``client_id``'s output: its transport buffer + pending out."""
    assert b.core is not None
    for conn in b.core.conns:
        if conn.client_id == client_id and conn.write is not None:
            transport = conn.write.__self__  # type: ignore[attr-defined]  # (the shell's transport.write)
            size: int = transport.get_write_buffer_size()
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
            bsock = conn.write.__self__.get_extra_info("socket")  # type: ignore[union-attr]  # (the shell's transport)
            bsock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            chunk = encode(Pingreq()) * 65536  # 128 KiB of PINGREQs
            peak = 0
            start = time.monotonic()
            sent = 0
            # Up to 8 MiB of PINGREQs for 4 s, longer (30 s at most) until the first 1 MiB is
            # offered: on a machine loaded by parallel tests the broker's loop may not have
            # read that much within 4 s (sent was 3).
            while sent < 64 and (time.monotonic() < start + 4.0
                                 or (sent < 8 and time.monotonic() < start + 30.0)):
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
            bsock = conn.write.__self__.get_extra_info("socket")  # type: ignore[union-attr]  # (the shell's transport)
            bsock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            n = 600_000  # 1.2 MB of PINGRESPs: more than the buffer limit and socket buffers
            w.write(encode(Pingreq()) * n)
            # Until the broker held more than its limit and stopped reading: its transport
            # called pause_writing (conn.paused) when over WRITE_BUFFER_HIGH, and it stays paused
            # until drained below the low mark.  (Not the buffer's size polled: the client's
            # kernel takes some of it after the peak, so a poll could miss the peak.)
            async with asyncio.timeout(10):
                while not conn.paused:
                    await asyncio.sleep(0.01)
            transport = conn.write.__self__  # type: ignore[union-attr]  # (the shell's transport)
            assert not transport.is_reading()
            low, high = transport.get_write_buffer_limits()
            assert high == WRITE_BUFFER_HIGH and _buffered(b, "slowreader") > low  # not drained yet
            got = 0
            async with asyncio.timeout(30):
                while got < 2 * n:
                    data = await r.read(1 << 16)
                    assert data
                    got += len(data)
            assert got == 2 * n
            w.close()

    asyncio.run(main())


# ---- listeners (issue 11 item 5) ------------------------------------------------------------

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="openssl CLI is not installed; cannot make test certificates")


def test_listener_tables_and_flag_shorthand(tmp_path: Path) -> None:
    """[[listener]] tables parse into Listener values; the --listener string form gives the
    same; without them the --host/--port/--tls-* shorthand yields the listener list."""
    c = load_toml(tmp_path, '[[listener]]\nport = 1883\n\n[[listener]]\nhost = "127.0.0.2"\nport = 8883\n'
                        'tls_cert = "c.pem"\ntls_key = "k.pem"\ntls_ca = "ca.pem"\nrequire_certificate = true\n'
                        'use_identity_as_username = true\n\n[[listener]]\nport = 8080\nprotocol = "websockets"\n')
    assert c.listener == (
        Listener(port=1883),
        Listener(host="127.0.0.2", port=8883, tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem",
                 require_certificate=True, use_identity_as_username=True),
        Listener(port=8080, protocol="websockets"),
    )
    flags = load_config(None, flag_overrides("broker", {"listener": (
        "127.0.0.1:1883", "127.0.0.2:8883,tls_cert=c.pem,tls_key=k.pem,tls_ca=ca.pem,"
        "require_certificate=true,use_identity_as_username=true", "127.0.0.1:8080,protocol=websockets")}))
    assert flags.listener == c.listener and broker_listeners(flags) == c.listener
    short = load_config(None, {"broker.port": 1999, "broker.tls_cert": "c", "broker.tls_key": "k",
                               "broker.tls_port": 8999})
    assert broker_listeners(short) == (Listener(port=1999), Listener(port=8999, tls_cert="c", tls_key="k"))


@pytest.mark.parametrize(("text", "words"), [
    ('[[listener]]\nport = 1\nprotocol = "ws"\n', "protocol must be one of"),
    ('[[listener]]\nport = 1\nhots = "x"\n', "unknown key 'hots'"),
    ('[[listener]]\nport = 1\ntls_cert = "c"\n', "TLS needs both"),
    ('[[listener]]\nport = 1\ntls_cert = "c"\ntls_key = "k"\nrequire_certificate = true\n', "needs tls_ca"),
    ('[[listener]]\nport = 1\ntls_cert = "c"\ntls_key = "k"\ntls_ca = "a"\nuse_identity_as_username = true\n',
     "needs require_certificate"),
    ('[[listener]]\nhost = "0.0.0.0"\nport = 1\n', "no password file"),
    ('[broker]\nport = 5\n[[listener]]\nport = 1\n', "both set"),
    ('[[listener]]\nport = 1\nallowed_origins = ["https://a.example"]\n', "allowed_origins is for protocol"),
    ('[[listener]]\nport = 1\nprotocol = "websockets"\nallowed_origins = ["a.example"]\n', "a list of origins"),
    ('[[listener]]\nport = 1\nprotocol = "websockets"\nallowed_origins = "https://a.example"\n',
     "a list of origins"),
])
def test_listener_config_errors(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_toml(tmp_path, text)
    assert words in str(info.value)
    assert info.value.line is not None


@needs_openssl
def test_tls_client_certificate_identity_as_username(tmp_path: Path) -> None:
    """A plain listener and a TLS listener with require_certificate + use_identity_as_username
    on one broker: a client certificate with CN alice logs in as alice whatever username and
    password it sends (the password file is not consulted) and gets alice's ACL rights; no
    certificate, or one from another CA, fails the handshake.  The same bad login on the plain
    listener gets CONNACK 4."""
    from filemq.broker.auth import add_or_update

    ca = make_ca(tmp_path, "ca")
    server = signed_cert(tmp_path, "server", "broker", ca)
    alice = signed_cert(tmp_path, "alice", "alice", ca)
    rogue = signed_cert(tmp_path, "rogue", "alice", make_ca(tmp_path, "rogue-ca"))
    pw = tmp_path / "passwd"
    add_or_update(pw, "bob", "bob-secret", iterations=1000)
    acl = tmp_path / "acl"
    acl.write_text("user alice\ntopic readwrite alice/#\nuser bob\ntopic read #\n")
    text = (f'[broker]\npassword_file = "{pw}"\nacl_file = "{acl}"\n\n[[listener]]\nport = 0\n\n'
            f'[[listener]]\nport = 0\ntls_cert = "{server[0]}"\ntls_key = "{server[1]}"\n'
            f'tls_ca = "{ca[0]}"\nrequire_certificate = true\nuse_identity_as_username = true\n')

    async def main() -> None:
        async with running(load_toml(tmp_path, text)) as b:
            assert b.core is not None and b.tls_port is not None and b.ports == [b.port, b.tls_port]
            got: list[Publish] = []
            watcher = MQTTClient("watch", port=b.port, username="bob", password="bob-secret",
                                 on_message=got.append)
            await watcher.connect(timeout=10)
            await watcher.subscribe([("#", 1)])
            cert_client = MQTTClient("cert", port=b.tls_port, ssl=client_ctx(ca[0], alice),
                                     username="mallory", password="wrong")
            assert (await cert_client.connect(timeout=10)).return_code == 0
            assert b.core.connections["cert"].username == "alice"
            await cert_client.publish("mallory/x", b"denied", qos=1)  # ACL: alice/# only
            await cert_client.publish("alice/x", b"hello", qos=1)
            await collect(got, 1)
            assert [(m.topic, m.payload) for m in got] == [("alice/x", b"hello")]
            await cert_client.disconnect()
            for ctx in (client_ctx(ca[0]), client_ctx(ca[0], rogue)):
                c = MQTTClient("nocert", port=b.tls_port, ssl=ctx)
                with pytest.raises((ssl.SSLError, ConnectionError, ConnectionLost, OSError)):
                    await c.connect(timeout=10)
            plain = MQTTClient("plain", port=b.port, username="mallory", password="wrong")
            with pytest.raises(ConnectionRefused) as refused:
                await plain.connect(timeout=10)
            assert refused.value.return_code == 4
            await watcher.disconnect()

    asyncio.run(main())


def _peer_cn(port: int, ca: Path) -> str | None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            client_ctx(ca).wrap_socket(raw, server_hostname="127.0.0.1") as s:
        return certificate_cn(s.getpeercert())


@needs_openssl
def test_reload_tls(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Broker.reload_tls(): new connections get the certificate now in the files, an open one
    keeps working; files that fail to load keep the previous certificate, and say why."""
    ca = make_ca(tmp_path, "ca")
    first = signed_cert(tmp_path, "first", "first", ca)
    second = signed_cert(tmp_path, "second", "second", ca)
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    shutil.copy(first[0], cert)
    shutil.copy(first[1], key)

    async def main() -> None:
        async with running(make_config(tmp_path / "d", tls_cert=str(cert), tls_key=str(key), tls_port=0)) as b:
            assert b.tls_port is not None
            assert await asyncio.to_thread(_peer_cn, b.tls_port, ca[0]) == "first"
            open_client = MQTTClient("kept", port=b.tls_port, ssl=client_ctx(ca[0]))
            await open_client.connect(timeout=10)
            shutil.copy(second[0], cert)
            shutil.copy(second[1], key)
            assert b.reload()  # what SIGHUP calls: password file, ACL and TLS files
            assert await asyncio.to_thread(_peer_cn, b.tls_port, ca[0]) == "second"
            await open_client.publish("t", b"still here", qos=1)  # the old connection lives on
            cert.write_text("not a certificate\n")
            with caplog.at_level(logging.ERROR, "filemq.broker"):
                assert not b.reload_tls()
            assert "keeps its previous certificates" in caplog.text and str(cert) in caplog.text
            assert await asyncio.to_thread(_peer_cn, b.tls_port, ca[0]) == "second"
            await open_client.disconnect()

    asyncio.run(main())


def test_websockets_listener_with_paho(tmp_path: Path) -> None:
    """MQTT over WebSockets (subprotocol mqtt) on its own listener next to plain TCP, with
    paho-mqtt's transport="websockets" as the independent client: it connects, subscribes,
    publishes QoS 1 and receives what a TCP client publishes, and vice versa."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    text = '[[listener]]\nport = 0\n\n[[listener]]\nport = 0\nprotocol = "websockets"\n'

    async def main() -> None:
        async with running(load_toml(tmp_path, text)) as b:
            ws_port = b.ports[1]
            assert b.listening == f"127.0.0.1:{b.port} (also ws://127.0.0.1:{ws_port})"
            connected, subscribed = threading.Event(), threading.Event()
            received: list[tuple[str, bytes]] = []
            got_one = threading.Event()
            ws = paho.Client(CallbackAPIVersion.VERSION2, client_id="ws-client", transport="websockets")
            ws.on_connect = lambda c, u, f, rc, p: connected.set()
            ws.on_subscribe = lambda c, u, mid, rcs, p: subscribed.set()

            def on_message(c: Any, u: Any, m: Any) -> None:
                received.append((m.topic, m.payload))
                got_one.set()

            ws.on_message = on_message
            # paho's connect blocks on the upgrade: off the loop, which serves it.
            await asyncio.to_thread(ws.connect, "127.0.0.1", ws_port, 30)
            ws.loop_start()
            try:
                assert await asyncio.to_thread(connected.wait, 10)
                ws.subscribe("from/tcp", qos=1)
                assert await asyncio.to_thread(subscribed.wait, 10)
                tcp_got: list[Publish] = []
                tcp = MQTTClient("tcp", port=b.port, on_message=tcp_got.append)
                await tcp.connect(timeout=5)
                await tcp.subscribe([("from/ws", 1)])
                big = bytes(range(256)) * 1000  # spans many WebSocket frames / TCP reads
                info = ws.publish("from/ws", big, qos=1)
                await asyncio.to_thread(info.wait_for_publish, 10)
                await collect(tcp_got, 1)
                assert (tcp_got[0].topic, tcp_got[0].payload) == ("from/ws", big)
                await tcp.publish("from/tcp", b"hello browser", qos=1)
                assert await asyncio.to_thread(got_one.wait, 10)
                assert received == [("from/tcp", b"hello browser")]
                await tcp.disconnect()
            finally:
                ws.disconnect()
                ws.loop_stop()

    asyncio.run(main())


def test_websocket_upgrade_without_mqtt_subprotocol_is_refused(tmp_path: Path) -> None:
    """An upgrade that does not offer subprotocol mqtt gets HTTP 400 and is closed."""
    text = '[[listener]]\nport = 0\nprotocol = "websockets"\n'

    async def main() -> None:
        async with running(load_toml(tmp_path, text)) as b:
            r, w = await asyncio.open_connection("127.0.0.1", b.ports[0])
            w.write(b"GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                    b"Sec-WebSocket-Protocol: chat\r\n\r\n")
            head = await asyncio.wait_for(r.readline(), 5)
            assert head.startswith(b"HTTP/1.1 400")
            assert await closed_by_peer(r, 5)
            w.close()

    asyncio.run(main())


async def _upgrade(port: int, origin: bytes | None) -> bytes:
    """A WebSocket upgrade offering subprotocol mqtt, with ``origin`` as its Origin header
    (None: no header, as non-browser clients do); the status line of the answer."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(b"GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                + (b"Origin: " + origin + b"\r\n" if origin is not None else b"")
                + b"Sec-WebSocket-Protocol: mqtt\r\n\r\n")
        return await asyncio.wait_for(r.readline(), 5)
    finally:
        w.close()


def test_websocket_upgrade_from_a_foreign_origin_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Cross-site WebSocket hijacking: a page from a site the listener does not allow, opened
    in the device's browser, gets HTTP 403 (and a warning saying which key allows it); listed
    origins (case and a trailing slash aside), clients sending no Origin and clients sending
    their own (the Host header's host:port, as paho-mqtt does) get 101."""
    text = ('[[listener]]\nport = 0\nprotocol = "websockets"\n\n'
            '[[listener]]\nport = 0\nprotocol = "websockets"\nallowed_origins = ["https://dash.example:8443"]\n\n'
            '[[listener]]\nport = 0\nprotocol = "websockets"\nallowed_origins = ["*"]\n')

    async def main() -> None:
        async with running(load_toml(tmp_path, text)) as b:
            closed, listed, anyone = b.ports
            with caplog.at_level(logging.WARNING, logger="filemq"):
                assert (await _upgrade(closed, b"https://evil.example")).startswith(b"HTTP/1.1 403")
            assert "allowed_origins" in caplog.text and "https://evil.example" in caplog.text
            assert (await _upgrade(closed, None)).startswith(b"HTTP/1.1 101")
            assert (await _upgrade(closed, b"http://x")).startswith(b"HTTP/1.1 101")  # Host: x
            assert (await _upgrade(closed, b"http://x:1")).startswith(b"HTTP/1.1 403")
            assert (await _upgrade(listed, b"https://evil.example")).startswith(b"HTTP/1.1 403")
            assert (await _upgrade(listed, b"https://dash.example:8443")).startswith(b"HTTP/1.1 101")
            assert (await _upgrade(listed, b"HTTPS://Dash.Example:8443/")).startswith(b"HTTP/1.1 101")
            assert (await _upgrade(listed, b"https://dash.example")).startswith(b"HTTP/1.1 403")  # other port
            assert (await _upgrade(anyone, b"https://evil.example")).startswith(b"HTTP/1.1 101")

    asyncio.run(main())


@needs_openssl
def test_secure_websockets_with_client_certificate(tmp_path: Path) -> None:
    """protocol = "websockets" with TLS and use_identity_as_username (wss://): paho-mqtt over
    WebSockets with a client certificate logs in as the certificate's CN."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    ca = make_ca(tmp_path, "ca")
    server = signed_cert(tmp_path, "server", "broker", ca)
    carol = signed_cert(tmp_path, "carol", "carol", ca)
    text = (f'[[listener]]\nport = 0\nprotocol = "websockets"\ntls_cert = "{server[0]}"\n'
            f'tls_key = "{server[1]}"\ntls_ca = "{ca[0]}"\nrequire_certificate = true\n'
            f'use_identity_as_username = true\n')

    async def main() -> None:
        async with running(load_toml(tmp_path, text)) as b:
            assert b.core is not None
            codes: list[int] = []
            connected = threading.Event()

            def on_connect(c: Any, u: Any, f: Any, rc: Any, p: Any) -> None:
                codes.append(int(rc.value))
                connected.set()

            ws = paho.Client(CallbackAPIVersion.VERSION2, client_id="wss-client", transport="websockets")
            ws.tls_set(ca_certs=str(ca[0]), certfile=str(carol[0]), keyfile=str(carol[1]))
            ws.on_connect = on_connect
            await asyncio.to_thread(ws.connect, "127.0.0.1", b.ports[0], 30)
            ws.loop_start()
            try:
                assert await asyncio.to_thread(connected.wait, 10)
                assert codes == [0]
                assert b.core.connections["wss-client"].username == "carol"
            finally:
                ws.disconnect()
                ws.loop_stop()

    asyncio.run(main())


def test_websocket_upgrade_is_under_the_connect_deadline(tmp_path: Path) -> None:
    """A WebSocket connection is a half-open connection from the accept: an upgrade request
    trickled in forever is cut off at the CONNECT deadline like a slow CONNECT."""
    text = '[[listener]]\nport = 0\nprotocol = "websockets"\n'

    async def main() -> None:
        async with running(load_toml(tmp_path, text)) as b:
            assert b.core is not None
            b.core.connect_timeout = 0.5
            r, w = await asyncio.open_connection("127.0.0.1", b.ports[0])
            request = b"GET /mqtt HTTP/1.1\r\nHost: x\r\n"
            closed = False
            for i in range(len(request)):  # a byte every 0.1 s: well inside any idle timeout
                w.write(request[i:i + 1])
                if await closed_by_peer(r, 0.1):
                    closed = True
                    break
            assert closed
            w.close()

    asyncio.run(main())
