"""The asyncio broker on real sockets, driven by our MQTTClient and raw sockets.

Every wait is bounded (asyncio.timeout / socket timeouts); brokers listen on port 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from filemq.broker import Broker, HookResult
from filemq.common.config import load_config
from filemq.mqtt.client import ConnectionLost, ConnectionRefused, MQTTClient, Will
from filemq.mqtt.codec import Decoder, encode
from filemq.mqtt.packets import Connect, Pingreq, Pingresp, Publish
from tests.broker_process import collect, make_config, running

REPO = Path(__file__).resolve().parents[1]


def test_qos_0_1_2_both_ways(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(make_config(tmp_path)) as b:
            got: list[Publish] = []
            sub = MQTTClient("sub", port=b.port, on_message=got.append)
            await sub.connect()
            assert await sub.subscribe([("t/0", 0), ("t/1", 1), ("t/2", 2)]) == [0, 1, 2]
            pub = MQTTClient("pub", port=b.port)
            await pub.connect()
            for q in (0, 1, 2):
                await pub.publish(f"t/{q}", b"m%d" % q, qos=q)
            await collect(got, 3)
            assert sorted((m.topic, m.payload, m.qos) for m in got) == [
                ("t/0", b"m0", 0), ("t/1", b"m1", 1), ("t/2", b"m2", 2)]
            await pub.disconnect()
            await sub.disconnect()
    asyncio.run(main())


def test_persistent_session_across_broker_restart(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = make_config(tmp_path)
        async with running(cfg) as b:
            sub = MQTTClient("durable-sub", port=b.port, clean_session=False)
            await sub.connect()
            await sub.subscribe([("data/#", 1)])
            await sub.disconnect()
            pub = MQTTClient("pub", port=b.port)
            await pub.connect()
            for i in range(100):
                await pub.publish("data/x", b"%d" % i, qos=1)
            await pub.publish("keep/r", b"retained!", qos=1, retain=True)
            await pub.disconnect()
        async with running(cfg) as b:
            got: list[Publish] = []
            sub = MQTTClient("durable-sub", port=b.port, clean_session=False, on_message=got.append)
            ack = await sub.connect()
            assert ack.session_present
            await collect(got, 100)
            assert [m.payload for m in got[:100]] == [b"%d" % i for i in range(100)]
            await sub.subscribe([("keep/#", 1)])
            await collect(got, 101)
            assert (got[100].topic, got[100].payload, got[100].retain) == ("keep/r", b"retained!", True)
            await sub.disconnect()
    asyncio.run(main())


def test_broker_starts_below_min_free_bytes_and_delivers_its_backlog(tmp_path: Path) -> None:
    """issue 10 item 12: less free space than ``log.min_free_bytes`` at start-up with an
    acknowledged backlog: the broker starts and delivers the backlog to its persistent
    subscriber; only a new PUBLISH is refused (3.1.1: the connection closes, no PUBACK)."""

    async def main() -> None:
        async with running(make_config(tmp_path)) as b:
            sub = MQTTClient("durable-sub", port=b.port, clean_session=False)
            await sub.connect()
            await sub.subscribe([("data/#", 1)])
            await sub.disconnect()
            pub = MQTTClient("pub", port=b.port)
            await pub.connect()
            for i in range(20):
                await pub.publish("data/x", b"%d" % i, qos=1)
            await pub.disconnect()
        # The disk filled up while the broker was down: the floor is above any free space.
        full = load_config(None, {"data_dir": str(tmp_path), "broker.port": 0, "log.min_free_bytes": 1 << 60})
        async with running(full) as b:
            got: list[Publish] = []
            sub = MQTTClient("durable-sub", port=b.port, clean_session=False, on_message=got.append)
            assert (await sub.connect()).session_present
            await collect(got, 20)
            assert [m.payload for m in got] == [b"%d" % i for i in range(20)]
            pub = MQTTClient("pub", port=b.port)
            await pub.connect()
            with pytest.raises((ConnectionLost, TimeoutError)):
                await pub.publish("data/x", b"refused", qos=1, timeout=5.0)
            await sub.disconnect()
    asyncio.run(main())


def test_will_on_abnormal_close(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(make_config(tmp_path)) as b:
            got: list[Publish] = []
            watcher = MQTTClient("w", port=b.port, on_message=got.append)
            await watcher.connect()
            await watcher.subscribe([("status/#", 1)])
            dev = MQTTClient("dev", port=b.port, will=Will("status/dev", b"offline", 1))
            await dev.connect()
            assert dev._writer is not None
            dev._writer.transport.abort()  # vanish without DISCONNECT
            await collect(got, 1)
            assert (got[0].topic, got[0].payload) == ("status/dev", b"offline")
            await watcher.disconnect()
    asyncio.run(main())


def test_silent_client_is_closed_at_one_and_a_half_keepalives_not_a_tick_later(tmp_path: Path) -> None:
    """MQTT-3.1.2-24: a client silent for 1.5 x its keepalive (1 s) is disconnected then: not
    before 1.5 s, and well before the next whole-second tick after it could close it (2.5 s)."""
    async def main() -> None:
        async with running(make_config(tmp_path)) as b:
            # Connect 0.6 s into the broker's once-a-second tick: the deadline (+1.5 s) then
            # falls 0.9 s before the tick after it, which a tick-only check would wait for.
            await asyncio.sleep(0.6)
            r, w = await asyncio.open_connection("127.0.0.1", b.port)
            # The silence counts from the CONNECT's send, the last packet we send: the broker
            # receives it later, so its deadline cannot fall before quiet_since + 1.5 s. (Taken
            # after reading the CONNACK instead, the reply's round trip fell inside the 1.5 s
            # and the measured silence could read 1.49998 s with the broker right.)
            quiet_since = time.monotonic()
            w.write(encode(Connect("silent", keepalive=1)))
            assert await asyncio.wait_for(r.read(4), 5) == b"\x20\x02\x00\x00"
            assert await asyncio.wait_for(r.read(), 5) == b""
            silent = time.monotonic() - quiet_since
            w.close()
            assert 1.5 <= silent < 1.9, silent
    asyncio.run(main())


def test_max_connections(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with running(make_config(tmp_path, max_connections=2)) as b:
            a, c = MQTTClient("a", port=b.port), MQTTClient("c", port=b.port)
            await a.connect()
            await c.connect()
            third = MQTTClient("third", port=b.port)
            with caplog.at_level(logging.WARNING, "filemq.broker"), pytest.raises((ConnectionLost, OSError)):
                await third.connect(timeout=2)
            assert "max_connections" in caplog.text
            await a.disconnect()
            await c.disconnect()
    asyncio.run(main())


def test_password_and_acl(tmp_path: Path) -> None:
    from filemq.broker.auth import add_or_update

    pw = tmp_path / "pw"
    add_or_update(pw, "dev", "s3cret", iterations=1000)
    acl = tmp_path / "acl"
    acl.write_text("user dev\ntopic write up/#\ntopic read down/#\n")

    async def main() -> None:
        cfg = make_config(tmp_path / "d", password_file=str(pw), acl_file=str(acl), allow_anonymous=False)
        async with running(cfg) as b:
            with pytest.raises(ConnectionRefused):
                await MQTTClient("x", port=b.port, username="dev", password="nope").connect()
            with pytest.raises(ConnectionRefused):
                await MQTTClient("anon", port=b.port).connect()
            c = MQTTClient("d1", port=b.port, username="dev", password="s3cret")
            await c.connect()
            assert await c.subscribe([("down/#", 1), ("up/#", 1)]) == [1, 0x80]
            await c.publish("up/x", b"ok", qos=1)
            await c.publish("elsewhere", b"denied but acked", qos=1)
            assert b.queue is not None
            topics = [r.topic for r in b.queue.log.read(0)]
            assert topics == ["up/x"]
            await c.disconnect()
    asyncio.run(main())


def test_acl_denied_publish_disconnect_mode_never_acks(tmp_path: Path) -> None:
    """With acl_denied_publish = "disconnect" (what the collector uses) a denied PUBLISH gets no
    PUBACK and its connection is closed, so the sender still holds the message."""
    acl = tmp_path / "acl"
    acl.write_text("topic write up/#\n")

    async def main() -> None:
        cfg = make_config(tmp_path / "d", acl_file=str(acl), acl_denied_publish="disconnect")
        async with running(cfg) as b:
            c = MQTTClient("d1", port=b.port)
            await c.connect()
            await c.publish("up/x", b"ok", qos=1)
            with pytest.raises(TimeoutError):
                await c.publish("elsewhere", b"denied, not acked", qos=1, timeout=2)
            assert c.closed.is_set()
            assert b.queue is not None
            assert [r.topic for r in b.queue.log.read(0)] == ["up/x"]
    asyncio.run(main())


def test_publish_hook_over_the_wire(tmp_path: Path) -> None:
    def hook(info: Any, p: Publish) -> HookResult:
        return HookResult.reject("bad batch") if p.payload == b"bad" else HookResult.store()

    async def main() -> None:
        async with running(make_config(tmp_path), publish_hook=hook) as b:
            c = MQTTClient("h", port=b.port)
            await c.connect()
            await c.publish("x", b"good", qos=1)
            fut = c.publish_nowait("x", b"bad", qos=1)
            async with asyncio.timeout(5):
                await c.closed.wait()
            assert not fut.done() or fut.exception() is not None
            assert b.queue is not None
            assert [r.payload for r in b.queue.log.read(0)] == [b"good"]
    asyncio.run(main())


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed; cannot make a test certificate")
def test_tls_listener(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)

    async def main() -> None:
        cfg = make_config(tmp_path / "d", tls_cert=str(cert), tls_key=str(key), tls_port=0)
        async with running(cfg) as b:
            assert b.tls_port
            ctx = ssl.create_default_context(cafile=str(cert))
            ctx.check_hostname = False
            got: list[Publish] = []
            c = MQTTClient("tls", port=b.tls_port, host="127.0.0.1", ssl=ctx, on_message=got.append)
            await c.connect()
            await c.subscribe([("t", 1)])
            await c.publish("t", b"over tls", qos=1)
            await collect(got, 1)
            assert got[0].payload == b"over tls"
            await c.disconnect()
    asyncio.run(main())


def test_cli_broker_process(tmp_path: Path) -> None:
    """`filemq broker` prints its ready line, serves, and exits 0 on SIGTERM."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "broker", "--data-dir", str(tmp_path), "--port", "0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("filemq broker listening on 127.0.0.1:"), line
        port = int(line.split("127.0.0.1:")[1].split(",")[0])

        async def use() -> None:
            c = MQTTClient("cli", port=port)
            await c.connect()
            await c.publish("x", b"y", qos=1)
            await c.disconnect()
        asyncio.run(use())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    bad = subprocess.run([sys.executable, "-m", "cli", "broker", "--data-dir", str(tmp_path), "--host", "0.0.0.0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "password" in bad.stderr
    nofile = subprocess.run([sys.executable, "-m", "cli", "broker", "--data-dir", str(tmp_path), "--port", "0",
                             "--password-file", str(tmp_path / "missing")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert nofile.returncode == 2 and "cannot read password file" in nofile.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        in_use = subprocess.run([sys.executable, "-m", "cli", "broker", "--data-dir", str(tmp_path), "--port",
                                 str(taken)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert in_use.returncode == 1 and "address already in use" in in_use.stderr


# ---- server fuzz: hostile byte streams on a live broker ---------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def live_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, _Records]]:
    """A broker on its own loop in a thread, shared by the fuzz examples."""
    data = tmp_path_factory.mktemp("fuzz")
    handler = _Records()
    logging.getLogger("filemq.broker").addHandler(handler)
    logging.getLogger("filemq.broker").setLevel(logging.INFO)
    loop = asyncio.new_event_loop()
    broker = Broker(make_config(data, max_packet_size=4096))
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(broker.start())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(30)
    try:
        yield broker.port, handler
    finally:
        asyncio.run_coroutine_threadsafe(broker.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        logging.getLogger("filemq.broker").removeHandler(handler)


def _raw_connect(port: int, client_id: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(encode(Connect(client_id=client_id)))
    assert s.recv(4) == b"\x20\x02\x00\x00"
    return s


_valid_start = st.sampled_from([b"", encode(Connect(client_id="fz"))])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=_valid_start, junk=st.binary(min_size=1, max_size=300))
def test_fuzz_live_broker(live_broker: tuple[int, _Records], prefix: bytes, junk: bytes) -> None:
    port, records = live_broker
    bystander = _raw_connect(port, "bystander")
    try:
        before = len(records.messages)
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        try:
            s.sendall(prefix + junk)
            s.settimeout(0.3)
            closed = False
            deadline = time.monotonic() + 0.3
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                while time.monotonic() < deadline:
                    if not s.recv(65536):
                        closed = True
                        break
        finally:
            s.close()
        if closed:
            time.sleep(0.02)
            reasons = [m for m in records.messages[before:] if m.startswith("closing connection")]
            assert reasons, "connection closed without a logged reason"
        # The other client is unaffected.
        bystander.sendall(encode(Pingreq()))
        dec = Decoder(server=False)
        bystander.settimeout(5)
        dec.feed(bystander.recv(2))
        assert dec.packets() == [Pingresp()]
    finally:
        bystander.close()


def test_slow_subscriber_does_not_block_others(tmp_path: Path) -> None:
    """A QoS 0 subscriber that stops reading is paused, others keep receiving."""
    async def main() -> None:
        async with running(make_config(tmp_path)) as b:
            stuck = socket.create_connection(("127.0.0.1", b.port))
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.sendall(encode(Connect(client_id="stuck")))
            from filemq.mqtt.packets import Subscribe
            stuck.sendall(encode(Subscribe(1, [("#", 0)])))
            got: list[Publish] = []
            fine = MQTTClient("fine", port=b.port, on_message=got.append)
            await fine.connect()
            await fine.subscribe([("#", 1)])
            pub = MQTTClient("pub", port=b.port)
            await pub.connect()
            payload = b"z" * 1000
            await asyncio.gather(*[pub.publish_nowait("bulk", payload, qos=1) for _ in range(3000)])
            await collect(got, 3000, timeout=20)
            await pub.disconnect()
            await fine.disconnect()
            stuck.close()
    asyncio.run(main())


def test_sys_topics_published_periodically(tmp_path: Path) -> None:
    async def main() -> None:
        async with running(make_config(tmp_path, sys_interval_s=1)) as b:
            got: list[Publish] = []
            c = MQTTClient("sys", port=b.port, on_message=got.append)
            await c.connect()
            await c.subscribe([("$SYS/broker/clients/connected", 0), ("#", 0)])
            await collect(got, 1, timeout=5)
            assert got[0].topic == "$SYS/broker/clients/connected" and got[0].payload == b"1"
            assert all(m.topic == "$SYS/broker/clients/connected" for m in got)
            assert b.queue is not None and b.queue.log.next_offset == 0  # not stored in the log
            await c.disconnect()
    asyncio.run(main())


def test_clean_sessions_leave_no_groups_and_shared_group_survives_restart(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = make_config(tmp_path)
        async with running(cfg) as b:
            assert b.queue is not None
            for i in range(5):
                c = MQTTClient(f"clean{i}", port=b.port)
                await c.connect()
                await c.subscribe([("x/#", 1)])
                await c.disconnect()
            member = MQTTClient("member", port=b.port, clean_session=False)
            await member.connect()
            await member.subscribe([("$share/pool/jobs/#", 1)])
            await member.disconnect()
            for _ in range(50):
                if not any(g.name.startswith("mqtt-clean:") for g in b.queue.groups()):
                    break
                await asyncio.sleep(0.02)
            names = sorted(g.name for g in b.queue.groups())
            assert names == ["mqtt-share:pool/jobs/#"]
            pub = MQTTClient("pub", port=b.port)
            await pub.connect()
            for i in range(10):
                await pub.publish("jobs/a", b"%d" % i, qos=1)
            await pub.disconnect()
        async with running(cfg) as b:
            got: list[Publish] = []
            member = MQTTClient("member", port=b.port, clean_session=False, on_message=got.append)
            assert (await member.connect()).session_present
            await collect(got, 10)
            assert [m.payload for m in got[:10]] == [b"%d" % i for i in range(10)]
            await member.disconnect()
    asyncio.run(main())
