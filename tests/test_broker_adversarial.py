"""Adversarial review of issue 10 / issue 11 fixes: what an outside adversarial run or
conformance suite would still find.  Packet level through the core (tests/broker_harness.py
harness) where that reproduces it, real processes where it takes one."""

from __future__ import annotations

import asyncio
import base64
import os
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import filemq.broker.connect as connect_module
from filemq.broker.auth import MAX_ITERATIONS, SCHEME, PasswordFile, PasswordHash
from filemq.broker.session.connection import AUTHENTICATING
from filemq.common.config import ConfigError
from filemq.mqtt.client import MQTTClient
from filemq.mqtt.codec import Decoder, encode
from filemq.mqtt.packets import (
    Connack,
    Connect,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
)
from tests.broker_harness import Harness, one_delivery, run, users_file, with_logins
from tests.broker_process import (
    REPO,
    BlockingClient,
    closed_by_peer,
    load_toml,
    make_config,
    running,
    start_broker_process,
)
from tests.tls_material import make_ca

# ---- password checks (issue 11 item 9) and session writes share no worker threads -----------


def test_wrong_password_flood_does_not_delay_another_clients_qos2_flow(tmp_path: Path) -> None:
    """Unauthenticated clients sending wrong passwords (one PBKDF2 each, ~0.1-0.3 s, in a
    worker thread) must not hold up the session-file writes that an authenticated client's
    QoS 2 PUBREC and PUBCOMP wait for.  They did: the checks and the writes shared the loop's
    default executor, and 100 wrong-password CONNECTs against the real broker delayed a QoS 2
    flow from 0.02 s to 33 s."""
    async def main() -> None:
        h = Harness(tmp_path)
        h.threaded_writes = True
        h.core = h.make_core()
        with_logins(h, users_file(tmp_path, "alice"))
        alice = h.client()
        alice.send(Connect(client_id="alice-1", clean_session=False, username="alice",
                           password=b"alice-pw"))
        async with asyncio.timeout(10):
            while not alice.received():
                await asyncio.sleep(0.01)  # first login: a real PBKDF2 check, then cached
        assert h.core.passwords is not None
        release = threading.Event()
        started: list[str] = []
        real_check = h.core.passwords.check

        def stuck_check(user: str, password: str | bytes) -> bool:
            started.append(user)
            release.wait(20)  # a check that takes long (huge $7$ iteration count, a slow core)
            return real_check(user, password)

        h.core.passwords.check = stuck_check  # type: ignore[method-assign]
        attackers = [h.client() for _ in range(40)]
        try:
            for i, a in enumerate(attackers):
                a.send(Connect(client_id=f"bad{i}", username="alice", password=b"wrong"))
            alice.send(Publish("alice/t", b"m", 2, packet_id=1))
            h.queue.commit()
            got: list[object] = []
            async with asyncio.timeout(5):
                while Pubrec(1) not in got:
                    await asyncio.sleep(0.01)
                    got += alice.received()
                alice.send(Pubrel(1))
                while Pubcomp(1) not in got:
                    await asyncio.sleep(0.01)
                    got += alice.received()
            # Connections that went away before their check started cost no check at all.
            for a in attackers:
                a.conn.connection_lost()
            assert len(started) < 10
        finally:
            release.set()
        await h.settle()
        await asyncio.sleep(0.2)
        assert len(started) < 10
        assert all(a.received() == [] for a in attackers)
        assert Connack(False, 0) not in got
    run(main())


@pytest.mark.parametrize("scheme", ["7", SCHEME])
def test_password_file_refuses_an_iteration_count_over_the_cap(tmp_path: Path, scheme: str) -> None:
    """A ``$7$`` (or filemq) line with a huge iteration count made every login attempt --
    for that user, and for unknown users, who are checked against the first entry's count --
    run PBKDF2 for hours: two such CONNECTs took every auth thread and SIGTERM no longer ended
    the broker (it waits for worker threads).  The file is refused at load, naming the line."""
    salt = base64.b64encode(b"s" * 12).decode()
    digest = base64.b64encode(b"h" * 64).decode()
    p = tmp_path / "pw"
    p.write_text(f"alice:${scheme}${MAX_ITERATIONS}${salt}${digest}\n"
                 f"bob:${scheme}${MAX_ITERATIONS + 1}${salt}${digest}\n"
                 f"carol:${scheme}$2000000000${salt}${digest}\n")
    with pytest.raises(ConfigError, match="iterations") as info:
        PasswordFile.load(p)
    assert info.value.line == 2 and f"{MAX_ITERATIONS:,}" in str(info.value)
    with pytest.raises(ValueError):
        PasswordHash.create("x", MAX_ITERATIONS + 1)


# ---- slowloris over TLS (issue 10 item 9, issue 11 item 5) ----------------------------------


def test_tls_handshake_that_never_completes_is_cut_off_at_the_connect_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CONNECT deadline counts from the accept on a TLS listener too.  It did not: asyncio
    runs the handshake before the broker sees the socket, with its own 60 s default, so a
    socket that never sent its ClientHello held a file descriptor for 60 s (300 of them held
    309 fds of a broker with max_connecting = 16) -- the slowloris of issue 10 item 9 over TLS."""
    monkeypatch.setattr(connect_module, "CONNECT_TIMEOUT", 0.5)
    cert, key = make_ca(tmp_path, "server")
    text = (f'[[listener]]\nport = 0\ntls_cert = "{cert}"\ntls_key = "{key}"\n')

    async def main() -> None:
        async with running(load_toml(tmp_path, text)) as b:
            r, w = await asyncio.open_connection("127.0.0.1", b.ports[0])  # no ClientHello
            t0 = time.monotonic()
            assert await closed_by_peer(r, 5.0)
            assert time.monotonic() - t0 < 2.0
            w.close()

    asyncio.run(main())


def test_tls_handshakes_count_in_max_connecting(tmp_path: Path) -> None:
    """Sockets in their TLS handshake are half-open like sockets before CONNECT: at
    max_connecting the oldest gives way at once, not at the deadline (10 s here), and a
    real TLS client still gets in. Before, asyncio ran the handshake before the broker saw
    the socket, so any number of silent TLS sockets were held until the deadline."""
    cert, key = make_ca(tmp_path, "server")
    text = (f'[broker]\nmax_connecting = 4\n[[listener]]\nport = 0\ntls_cert = "{cert}"\n'
            f'tls_key = "{key}"\n')

    async def main() -> None:
        async with running(load_toml(tmp_path, text)) as b:
            port = b.ports[0]
            silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(10)]  # no ClientHello
            t0 = time.monotonic()
            closed = [await closed_by_peer(r, 3.0) for r, _ in silent[:6]]
            assert all(closed) and time.monotonic() - t0 < 5.0
            ctx = ssl.create_default_context(cafile=str(cert))
            ctx.check_hostname = False
            c = MQTTClient("real", port=port, ssl=ctx)
            await c.connect(timeout=5)  # makes room: the oldest silent one goes
            await c.publish("t", b"in", qos=1)
            await c.disconnect()
            assert not await closed_by_peer(silent[-1][0], 0.2)  # the newest still waits
            for _, w in silent:
                w.close()

    asyncio.run(main())


# ---- outbound QoS 2: the id awaiting PUBCOMP is session state (MQTT-4.3.3, 3.1.2.4) ----------


def test_outbound_pubrel_is_resent_after_a_restart_mqtt_4_3_3(tmp_path: Path) -> None:
    """A QoS 2 delivery whose PUBREC arrived awaits PUBCOMP; the broker's PUBREL is what
    releases the message to a receiver using 4.3.3's Method A -- paho-mqtt hands a QoS 2
    message to the application only on PUBREL.  Such ids are session state (3.1.2.4: "QoS 2
    messages which have been sent to the Client, but have not been completely
    acknowledged"): after a restart of the broker -- the group's ack already durable -- the
    persistent session must get PUBREL again.  It got nothing: the message was lost to paho
    (and the next message under that id overwrote it in paho's store)."""
    async def main() -> None:
        h = Harness(tmp_path)
        s, m = await one_delivery(h, 2)
        pid = m.packet_id
        assert pid is not None
        s.send(Pubrec(pid))
        await h.settle()
        assert s.received() == [Pubrel(pid)]
        s.conn.connection_lost()  # the PUBREL never reached the client
        stored = h.store.load("s")
        assert stored is not None and stored.qos2_outbound == {pid}
        h.core = h.make_core()  # restart; the group (in memory here) keeps its ack
        s2 = h.client()
        assert s2.connect("s", clean=False).session_present
        assert s2.received() == [Pubrel(pid)]  # released again, not re-sent as a PUBLISH
        s2.send(Pubcomp(pid))
        assert not s2.conn.closed
        p = h.connected("p2")
        p.send(Publish("t", b"next", 2, packet_id=1))
        await h.commit()
        [nxt] = s2.received()
        assert isinstance(nxt, Publish) and nxt.payload == b"next"
        s2.send(Pubrec(nxt.packet_id or 0))
        await h.settle()
        assert s2.received() == [Pubrel(nxt.packet_id or 0)]
        s2.send(Pubcomp(nxt.packet_id or 0))
        s2.conn.close("bye", will=False)
        await h.settle()
        stored = h.store.load("s")
        assert stored is not None and stored.qos2_outbound == set()
    run(main())


# ---- listeners (issue 11 item 5) ------------------------------------------------------------


def test_the_same_listener_address_twice_is_a_config_error(tmp_path: Path) -> None:
    """Two [[listener]] tables on one host and port are refused as a configuration error
    (exit 2, naming both), not a bind failure reported as "cannot start the broker on
    127.0.0.1:1883" -- the shorthand address, which was not even in use."""
    text = '[[listener]]\nport = 18831\n\n[[listener]]\nport = 18831\ntls_cert = "c"\ntls_key = "k"\n'
    with pytest.raises(ConfigError, match=r"listeners 1 and 2 .*127\.0\.0\.1:18831"):
        load_toml(tmp_path, text)
    load_toml(tmp_path, '[[listener]]\nport = 0\n\n[[listener]]\nport = 0\n')  # any free port, twice
    load_toml(tmp_path, '[[listener]]\nport = 18831\n\n[[listener]]\nhost = "::1"\nport = 18831\n')


# ---- max_topic_length (issue 10 item 15) ----------------------------------------------------


def test_will_topic_longer_than_max_topic_length_refuses_the_connect(tmp_path: Path) -> None:
    """docs/CONFIG.md: "longer topics or filters are a protocol error" -- the will topic is a
    topic the client publishes to as well.  A CONNECT whose will topic was over
    max_topic_length (in UTF-8 bytes) was accepted and the will stored at disconnect."""
    async def main() -> None:
        h = Harness(tmp_path, max_topic_length=16)
        c = h.client()
        c.send(Connect(client_id="w", will_topic="é" * 9, will_payload=b"x"))  # 18 bytes, 9 chars
        assert c.conn.closed and "max_topic_length" in c.conn.close_reason
        assert c.received() == []
        ok = h.client()
        assert ok.connect("w2", will_topic="é" * 8, will_payload=b"x").return_code == 0
        ok.conn.connection_lost()
        await h.commit()
        assert [r.topic for r in h.queue.log.records] == ["é" * 8]
    run(main())


def test_outbound_pubrel_is_resent_after_kill9(tmp_path: Path) -> None:
    """The real process, kill -9 after the subscriber's PUBREC and after the group's ack is on
    disk: the reconnecting persistent subscriber gets PUBREL for its id (it got nothing)."""
    proc, port = start_broker_process(tmp_path)
    try:
        sub = BlockingClient(port, Connect(client_id="sub", clean_session=False))
        sub.send(Subscribe(1, [("t", 2)]))
        assert sub.next() == Suback(1, [2])
        pub = BlockingClient(port, Connect(client_id="pub"))
        pub.send(Publish("t", b"m", 2, packet_id=1))
        assert pub.next() == Pubrec(1)
        pub.send(Pubrel(1))
        assert pub.next() == Pubcomp(1)
        m = sub.next()
        assert isinstance(m, Publish) and m.qos == 2 and m.packet_id is not None
        pending = tmp_path / "groups" / "mqtt-session%3Asub" / "pending"
        before = pending.read_bytes() if pending.exists() else b""
        sub.send(Pubrec(m.packet_id))
        assert sub.next() == Pubrel(m.packet_id)
        for _ in range(200):  # the group's ack reaches its offset file (~0.1 s after the ack)
            if pending.exists() and pending.read_bytes() != before:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the group's ack was never written")
        proc.kill()
        proc.wait(timeout=10)
        sub.close()
        proc, port = start_broker_process(tmp_path)
        sub = BlockingClient(port, Connect(client_id="sub", clean_session=False))
        assert sub.next() == Pubrel(m.packet_id)
        sub.send(Pubcomp(m.packet_id))
        sub.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_connections_stuck_in_password_checks_do_not_lock_out_clients(tmp_path: Path) -> None:
    """Issue 10 item 9 with logins: when every half-open slot (max_connecting) holds a
    connection whose password is being checked, a new socket makes the oldest of them give
    way, as sockets still waiting for their CONNECT do.  It was refused instead: 40 threads
    sending wrong passwords (each reconnecting when refused) kept all slots authenticating
    and locked out even a client whose login was cached -- 0 of 10 logins in 50 s against
    the real broker."""
    pw = users_file(tmp_path, "alice")
    config = make_config(tmp_path / "data", max_connecting=2, password_file=str(pw))
    login = Connect(client_id="good", username="alice", password=b"alice-pw")

    async def connack(port: int, connect: Connect) -> Connack | None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(encode(connect))
        decoder = Decoder(server=False)
        try:
            async with asyncio.timeout(5):
                while data := await r.read(65536):
                    decoder.feed(data)
                    for p in decoder.packets():
                        return p if isinstance(p, Connack) else None
        finally:
            w.close()
        return None

    async def main() -> None:
        async with running(config) as b:
            assert b.core is not None and b.core.passwords is not None
            assert await connack(b.port, login) == Connack(False, 0)  # now cached
            release = threading.Event()
            real_check = b.core.passwords.check

            def stuck_check(user: str, password: str | bytes) -> bool:
                release.wait(20)
                return real_check(user, password)

            b.core.passwords.check = stuck_check  # type: ignore[method-assign]
            try:
                held = []
                for i in range(2):
                    r, w = await asyncio.open_connection("127.0.0.1", b.port)
                    w.write(encode(Connect(client_id=f"bad{i}", username="alice", password=b"wrong")))
                    held.append(w)
                async with asyncio.timeout(5):
                    while sum(c.state == AUTHENTICATING for c in b.core.conns) < 2:
                        await asyncio.sleep(0.01)
                assert await connack(b.port, login) == Connack(False, 0)
                for w in held:
                    w.close()
            finally:
                release.set()

    asyncio.run(main())


# ---- SIGHUP (issue 11 item 4) ---------------------------------------------------------------

_SIGHUP_DURING_START = """
import asyncio, logging, os, signal, sys
from filemq.ops.service import serve_until_signalled

class Slow:
    reloads = 0
    async def start(self):  # recovery of a big log: SIGHUP (systemctl reload, kill -HUP) now
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.sleep(0.2)
    async def stop(self):
        pass
    def reload(self):
        Slow.reloads += 1

async def main():
    stop = asyncio.Event()
    svc = Slow()
    def ready(line):
        asyncio.get_running_loop().call_later(0.2, stop.set)
    code = await serve_until_signalled(lambda: svc, name="broker", where="x", describe=lambda s: "up",
                                       log=logging.getLogger("t"), ready=ready, stop=stop)
    print(code, Slow.reloads)

asyncio.run(main())
"""


def test_sighup_during_start_up_does_not_end_the_service(tmp_path: Path) -> None:
    """Issue 11 item 4: SIGHUP never ends the broker, agent or collector -- during start-up
    (log recovery, which takes seconds on a big log) too.  It did: the handler was installed
    only once the service was up, so a SIGHUP in that window ended the process by the
    signal's default action.  It is now taken from the start and the reload done once up."""
    out = subprocess.run([sys.executable, "-c", _SIGHUP_DURING_START], cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["0", "1"]


def test_outbound_qos2_completed_although_its_session_write_failed(tmp_path: Path) -> None:
    """The group's ack of a PUBREC'd record waits for the session file; if that write fails
    (a full disk) the ack is still given at PUBCOMP -- the client has the message for sure --
    so the record does not stay outstanding for ever, holding the group's Pending offset."""
    async def main() -> None:
        h = Harness(tmp_path)
        s, m = await one_delivery(h, 2)
        pid = m.packet_id
        assert pid is not None
        real_write = h.store.write

        def fail(snap: object) -> None:
            raise OSError(28, "No space left on device")

        h.store.write = fail  # type: ignore[method-assign]
        s.send(Pubrec(pid))
        await h.settle()
        assert s.received() == [Pubrel(pid)]
        h.store.write = real_write  # type: ignore[method-assign]
        s.send(Pubcomp(pid))
        await h.settle()
        group = h.queue.group("mqtt-session:s")
        assert group.pending_offset == group.doing_offset  # nothing outstanding
    run(main())
