"""The MQTT client: ClientSession without I/O, then MQTTClient against real brokers
(Debian mosquitto and amqtt), and our Decoder against paho-mqtt's encoder."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.broker.server import free_port
from filemq.mqtt.client import ClientSession, ConnectionLost, ConnectionRefused, MQTTClient, Will
from filemq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
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
from tests.scripted_brokers import AnsweringBroker

MOSQUITTO = "/usr/sbin/mosquitto"

# ------------------------------------------------------------------ ClientSession (no I/O)


def test_qos1_publish_completes_on_puback() -> None:
    s = ClientSession()
    p = s.publish("t", b"v", 1)
    assert p.packet_id is not None and s.inflight == 1
    ev = s.receive(Puback(p.packet_id))
    assert ev.completed == [p.packet_id] and ev.send == []
    assert s.inflight == 0


def test_qos2_publish_flow() -> None:
    s = ClientSession()
    p = s.publish("t", b"v", 2)
    assert p.packet_id is not None
    ev = s.receive(Pubrec(p.packet_id))
    assert ev.send == [Pubrel(p.packet_id)] and ev.completed == []
    # Reconnect in the middle: PUBREL is what must go again, not the PUBLISH.
    assert s.resend() == [Pubrel(p.packet_id)]
    ev = s.receive(Pubcomp(p.packet_id))
    assert ev.completed == [p.packet_id]
    assert s.inflight == 0


def test_resend_after_reconnect_sets_dup_in_order() -> None:
    s = ClientSession()
    a = s.publish("a", b"1", 1)
    b = s.publish("b", b"2", 2)
    c = s.publish("c", b"3", 1)
    assert c.packet_id is not None
    s.receive(Puback(c.packet_id))
    again = s.resend()
    assert [p.packet_id for p in again] == [a.packet_id, b.packet_id]  # type: ignore[union-attr]
    assert all(isinstance(p, Publish) and p.dup for p in again)


def test_window_limits_inflight() -> None:
    s = ClientSession(max_inflight=2)
    s.publish("t", b"", 1)
    s.publish("t", b"", 2)
    assert not s.window_open()
    with pytest.raises(Exception, match="window of 2 publishes is full"):
        s.publish("t", b"", 1)
    s.publish("t", b"", 0)  # QoS 0 is never tracked


def test_packet_ids_wrap_and_skip_ids_in_use() -> None:
    s = ClientSession(max_inflight=10)
    first = s.publish("t", b"", 1).packet_id
    assert first == 1
    for _ in range(65533):
        sub = s.subscribe([("x", 0)])
        s.receive(Suback(sub.packet_id, [0]))
    assert s.subscribe([("x", 0)]).packet_id == 65535
    # Wrapped: 1 is still in flight, so the next id is 2.
    assert s.subscribe([("x", 0)]).packet_id == 2


def test_incoming_qos2_is_delivered_once() -> None:
    s = ClientSession()
    msg = Publish("t", b"v", 2, packet_id=5)
    ev = s.receive(msg)
    assert ev.message == msg
    assert s.accept(msg) == Pubrec(5)
    dup = Publish("t", b"v", 2, dup=True, packet_id=5)
    ev = s.receive(dup)
    assert ev.message is None and ev.send == [Pubrec(5)]
    assert s.receive(Pubrel(5)).send == [Pubcomp(5)]
    # After PUBREL the id is free again: a new message with it is a new delivery.
    assert s.receive(Publish("t", b"w", 2, packet_id=5)).message is not None


def test_accept_acks_by_qos() -> None:
    s = ClientSession()
    assert s.accept(Publish("t", b"", 0)) is None
    assert s.accept(Publish("t", b"", 1, packet_id=3)) == Puback(3)


def test_unexpected_acks_are_ignored() -> None:
    s = ClientSession()
    assert s.receive(Puback(77)).completed == []
    assert s.receive(Pubcomp(77)).completed == []


@given(st.lists(st.tuples(st.sampled_from(["pub1", "pub2", "ack", "reconnect"]), st.integers(0, 50)), max_size=60))
@settings(max_examples=150)
def test_session_against_a_model(ops: list[tuple[str, int]]) -> None:
    """Random publishes, broker acks (in any order) and reconnects, checked against a dict."""
    s = ClientSession(max_inflight=8)
    model: dict[int, list[Packet]] = {}  # id -> broker replies still to come, in order
    completed: list[int] = []
    for op, pick in ops:
        if op in ("pub1", "pub2") and s.window_open():
            qos = 1 if op == "pub1" else 2
            pid = s.publish("t", b"x", qos).packet_id
            assert pid is not None and pid not in model
            model[pid] = [Puback(pid)] if qos == 1 else [Pubrec(pid), Pubcomp(pid)]
        elif op == "ack" and model:
            pid = list(model)[pick % len(model)]
            reply = model[pid].pop(0)
            events = s.receive(reply)
            if isinstance(reply, Pubrec):
                assert events.send == [Pubrel(pid)]
            if not model[pid]:
                del model[pid]
                assert events.completed == [pid]
                completed.append(pid)
            else:
                assert events.completed == []
        elif op == "reconnect":
            resent = s.resend()
            assert [getattr(p, "packet_id", None) for p in resent] == list(model)
            for p in resent:
                # (each a PUBLISH or PUBREL with its id: the packet ids are the model's, above)
                assert isinstance(p, Publish | Pubrel) and p.packet_id is not None
                pending = model[p.packet_id]
                # Before PUBREC: PUBLISH again with DUP; after it: PUBREL.
                assert isinstance(p, Pubrel) == (pending == [Pubcomp(p.packet_id)])
                assert not isinstance(p, Publish) or p.dup
        assert s.inflight == len(model) <= 8
        assert s.outstanding() == list(model)


# ------------------------------------------------------------------ brokers


def wait_port(port: int, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = log_path.read_text(errors="replace")
            raise RuntimeError(f"mosquitto exited with {proc.returncode}: {err}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"broker did not listen on 127.0.0.1:{port} within {timeout}s")


@contextlib.contextmanager
def mosquitto(tmp_path: Path, *, anonymous: bool = True) -> Iterator[int]:
    if not (os.path.exists(MOSQUITTO) and os.access(MOSQUITTO, os.X_OK)):
        pytest.skip(f"{MOSQUITTO} is not installed (apt-get install mosquitto; `make system-deps`)")
    port = free_port()
    conf = tmp_path / f"mosquitto-{port}.conf"
    lines = [f"listener {port} 127.0.0.1", f"allow_anonymous {'true' if anonymous else 'false'}"]
    conf.write_text("\n".join(lines) + "\n")
    # Log to a file, not a pipe nobody drains (a full pipe would stall the broker).
    log_path = tmp_path / f"mosquitto-{port}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc, log_path)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@contextlib.asynccontextmanager
async def amqtt_broker() -> AsyncIterator[int]:
    try:
        from amqtt.broker import Broker
    except ImportError:
        pytest.skip("amqtt is not installed")
    port = free_port()
    broker = Broker(
        {
            "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
    )
    await broker.start()
    try:
        yield port
    finally:
        await asyncio.wait_for(broker.shutdown(), 10)


Scenario = Callable[[int], Awaitable[None]]


def run_against(broker: str, tmp_path: Path, scenario: Scenario) -> None:
    async def with_amqtt() -> None:
        async with amqtt_broker() as port:
            await asyncio.wait_for(scenario(port), 30)

    if broker == "mosquitto":
        with mosquitto(tmp_path) as port:
            asyncio.run(asyncio.wait_for(scenario(port), 30))
    else:
        asyncio.run(with_amqtt())


BROKERS = ["mosquitto", "amqtt"]


async def next_message(client: MQTTClient, timeout: float = 5.0) -> Publish:
    async with asyncio.timeout(timeout):
        async for message in client.messages():
            return message
    raise AssertionError("connection closed before a message arrived")


@pytest.mark.parametrize("broker", BROKERS)
@pytest.mark.parametrize("qos", [0, 1, 2])
def test_publish_and_receive_each_qos(broker: str, qos: int, tmp_path: Path) -> None:
    async def scenario(port: int) -> None:
        sub = MQTTClient(f"sub-{qos}", port=port)
        pub = MQTTClient(f"pub-{qos}", port=port, keepalive=5)
        assert (await sub.connect()).return_code == 0
        await pub.connect()
        assert await sub.subscribe([("sensors/+/temp", qos)]) == [qos]
        payloads = [f"{qos}-{i}".encode() for i in range(20)]
        futures = [pub.publish_nowait("sensors/a/temp", p, qos=qos) for p in payloads]
        await asyncio.wait_for(asyncio.gather(*futures), 10)
        got = [await next_message(sub) for _ in payloads]
        assert [m.payload for m in got] == payloads  # in order, none lost
        assert {m.qos for m in got} == {qos}
        assert all(m.topic == "sensors/a/temp" for m in got)
        assert pub.session.inflight == 0
        await pub.disconnect()
        await sub.disconnect()

    run_against(broker, tmp_path, scenario)


@pytest.mark.parametrize("broker", BROKERS)
def test_retained_message_and_unsubscribe(broker: str, tmp_path: Path) -> None:
    async def scenario(port: int) -> None:
        pub = MQTTClient("retainer", port=port)
        await pub.connect()
        await pub.publish("state/door", b"open", qos=1, retain=True)
        late = MQTTClient("late", port=port)
        await late.connect()
        await late.subscribe([("state/#", 1)])
        retained = await next_message(late)
        assert (retained.topic, retained.payload, retained.retain) == ("state/door", b"open", True)
        await late.unsubscribe(["state/#"])
        await pub.publish("state/door", b"closed", qos=1)
        # Unsubscribed: a round trip on another topic proves nothing from state/# is queued.
        await late.subscribe([("ping", 1)])
        await pub.publish("ping", b"1", qos=1)
        assert (await next_message(late)).topic == "ping"
        await pub.publish("state/door", b"", qos=1, retain=True)  # clear the retained message
        await late.disconnect()
        await pub.disconnect()

    run_against(broker, tmp_path, scenario)


@pytest.mark.parametrize("broker", BROKERS)
def test_on_message_callback_and_window(broker: str, tmp_path: Path) -> None:
    async def scenario(port: int) -> None:
        received: list[bytes] = []
        sub = MQTTClient("cb-sub", port=port, on_message=lambda m: received.append(m.payload))
        await sub.connect()
        await sub.subscribe([("load/#", 1)])
        pub = MQTTClient("cb-pub", port=port, max_inflight=4)
        await pub.connect()
        futures = [pub.publish_nowait("load/x", str(i).encode(), qos=1) for i in range(200)]
        assert pub.session.inflight <= 4
        await asyncio.wait_for(asyncio.gather(*futures), 15)
        async with asyncio.timeout(10):
            while len(received) < 200:
                await asyncio.sleep(0.01)
        assert received == [str(i).encode() for i in range(200)]
        await pub.disconnect()
        await sub.disconnect()

    run_against(broker, tmp_path, scenario)


@pytest.mark.parametrize("broker", BROKERS)
def test_will_is_published_when_client_vanishes(broker: str, tmp_path: Path) -> None:
    async def scenario(port: int) -> None:
        watcher = MQTTClient("watcher", port=port)
        await watcher.connect()
        await watcher.subscribe([("wills/#", 1)])
        doomed = MQTTClient("doomed", port=port, will=Will("wills/doomed", b"gone", qos=1))
        await doomed.connect()
        # Drop the TCP connection without DISCONNECT.
        assert doomed._writer is not None
        doomed._writer.transport.abort()
        message = await next_message(watcher, timeout=10)
        assert (message.topic, message.payload) == ("wills/doomed", b"gone")
        assert isinstance(await asyncio.wait_for(doomed.wait_closed(), 5), OSError | ConnectionLost)
        await watcher.disconnect()

    run_against(broker, tmp_path, scenario)


def test_connection_refused_names_the_return_code(tmp_path: Path) -> None:
    async def scenario(port: int) -> None:
        client = MQTTClient("nobody", port=port, username="nobody", password="wrong")
        with pytest.raises(ConnectionRefused, match="(bad user name or password|not authorized)"):
            await client.connect()
        assert not client.connected

    with mosquitto(tmp_path, anonymous=False) as port:
        asyncio.run(asyncio.wait_for(scenario(port), 20))


def test_connect_timeout_and_refused_port() -> None:
    async def scenario() -> None:
        with pytest.raises(OSError):
            await MQTTClient("x", port=free_port()).connect(timeout=2)
        # A server that accepts TCP but never answers CONNECT: bounded by the timeout.
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = MQTTClient("x", port=port)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.connect(timeout=0.3)
        assert time.monotonic() - started < 2
        assert not client.connected
        server.close()

    asyncio.run(scenario())


# ------------------------------------------------------------------ a scripted broker on our codec


def test_inflight_publishes_are_resent_with_dup_after_reconnect() -> None:
    def answer(packet: Packet, conn: int) -> list[Packet]:
        if isinstance(packet, Connect):
            return [Connack(session_present=conn > 1)]
        # First connection: swallow publishes (broker "crashes" before acking).
        if isinstance(packet, Publish) and conn > 1:
            assert packet.packet_id is not None
            return [Puback(packet.packet_id)] if packet.qos == 1 else [Pubrec(packet.packet_id)]
        if isinstance(packet, Pubrel):
            return [Pubcomp(packet.packet_id)]
        return []

    async def scenario() -> None:
        fake = AnsweringBroker(answer)
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = MQTTClient("resender", port=port, clean_session=False)
        await client.connect()
        f1 = client.publish_nowait("a", b"1", qos=1)
        f2 = client.publish_nowait("b", b"2", qos=2)
        await fake.wait_for(lambda got: sum(isinstance(p, Publish) for p in got) == 2)
        for w in fake.writers:
            w.transport.abort()  # the broker goes away without acking
        assert isinstance(await asyncio.wait_for(client.wait_closed(), 5), ConnectionLost | OSError)
        assert not f1.done() and not f2.done()
        await client.connect()
        await asyncio.wait_for(asyncio.gather(f1, f2), 5)
        resent = [p for p in fake.received if isinstance(p, Publish) and p.dup]
        assert [(p.topic, p.qos) for p in resent] == [("a", 1), ("b", 2)]
        await client.disconnect()
        await fake.wait_for(lambda got: isinstance(got[-1], Disconnect))
        server.close()

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_keepalive_sends_pingreq() -> None:
    def answer(packet: Packet, conn: int) -> list[Packet]:
        return [Connack()] if isinstance(packet, Connect) else []

    async def scenario() -> None:
        fake = AnsweringBroker(answer)
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = MQTTClient("pinger", port=port, keepalive=1)
        await client.connect()
        await fake.wait_for(lambda got: any(isinstance(p, Pingreq) for p in got), timeout=3)
        # No PINGRESP ever comes: the client gives up within about one keepalive period more.
        reason = await asyncio.wait_for(client.wait_closed(), 5)
        assert isinstance(reason, ConnectionLost) and "keepalive" in str(reason)
        server.close()

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_disconnect_fails_pending_publishes() -> None:
    def answer(packet: Packet, conn: int) -> list[Packet]:
        return [Connack()] if isinstance(packet, Connect) else []

    async def scenario() -> None:
        fake = AnsweringBroker(answer)
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        client = MQTTClient("quitter", port=server.sockets[0].getsockname()[1])
        await client.connect()
        future = client.publish_nowait("t", b"never acked", qos=1)
        await client.disconnect()
        with pytest.raises(ConnectionLost):
            await future
        server.close()

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_paho_encoded_packets_decode_with_our_decoder() -> None:
    paho = pytest.importorskip("paho.mqtt.client")

    def answer(packet: Packet, conn: int) -> list[Packet]:
        if isinstance(packet, Connect):
            return [Connack()]
        if isinstance(packet, Publish) and packet.qos == 1:
            assert packet.packet_id is not None
            return [Puback(packet.packet_id)]
        if isinstance(packet, Publish) and packet.qos == 2:
            assert packet.packet_id is not None
            return [Pubrec(packet.packet_id)]
        if isinstance(packet, Pubrel):
            return [Pubcomp(packet.packet_id)]
        if isinstance(packet, Subscribe):
            # Our encoder -> paho's decoder: a SUBACK, then a QoS 1 and a QoS 2 delivery.
            return [
                Suback(packet.packet_id, [q for _, q in packet.topics]),
                Publish("a/srv", b"from filemq", 1, retain=True, packet_id=42),
                Publish("b/srv/2", b"\x00" * 200, 2, packet_id=43),
            ]
        if isinstance(packet, Pubrec):
            return [Pubrel(packet.packet_id)]
        if isinstance(packet, Unsubscribe):
            return [Unsuback(packet.packet_id)]
        return []

    delivered: list[tuple[str, bytes, int, bool]] = []

    async def scenario() -> list[Packet]:
        fake = AnsweringBroker(answer)
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        def run_paho() -> None:
            c: Any = paho.Client(
                paho.CallbackAPIVersion.VERSION2, client_id="paho-1", protocol=paho.MQTTv311
            )
            c.on_message = lambda _c, _u, m: delivered.append((m.topic, m.payload, m.qos, m.retain))
            c.username_pw_set("user", "pa55")
            c.will_set("wills/paho", b"bye", qos=1, retain=True)
            c.connect("127.0.0.1", port, keepalive=30)
            c.loop_start()
            try:
                c.subscribe([("a/+", 1), ("b/#", 2)])
                c.publish("a/x", b"q0", qos=0)
                c.publish("a/x", b"q1", qos=1).wait_for_publish(5)
                c.publish("a/x", b"\x00\xff" * 300, qos=2, retain=True).wait_for_publish(5)
                deadline = time.monotonic() + 5
                while len(delivered) < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                c.unsubscribe("a/+")
                time.sleep(0.2)
                c.disconnect()
            finally:
                c.loop_stop()

        await asyncio.to_thread(run_paho)
        await fake.wait_for(lambda got: any(isinstance(p, Disconnect) for p in got))
        server.close()
        return fake.received

    got = asyncio.run(asyncio.wait_for(scenario(), 30))
    connect = got[0]
    assert connect == Connect(
        client_id="paho-1",
        clean_session=True,
        keepalive=30,
        will_topic="wills/paho",
        will_payload=b"bye",
        will_qos=1,
        will_retain=True,
        username="user",
        password=b"pa55",
    )
    subs = [p for p in got if isinstance(p, Subscribe)]
    assert len(subs) == 1 and subs[0].topics == [("a/+", 1), ("b/#", 2)]
    pubs = [p for p in got if isinstance(p, Publish)]
    assert [(p.payload, p.qos) for p in pubs] == [(b"q0", 0), (b"q1", 1), (b"\x00\xff" * 300, 2)]
    assert pubs[2].retain and not pubs[1].retain
    assert any(isinstance(p, Pubrel) for p in got)
    assert [p.topics for p in got if isinstance(p, Unsubscribe)] == [["a/+"]]
    # paho decoded what we encoded, and acknowledged each delivery the way the spec says.
    assert delivered == [("a/srv", b"from filemq", 1, True), ("b/srv/2", b"\x00" * 200, 2, False)]
    assert Puback(42) in got and Pubrec(43) in got and Pubcomp(43) in got
