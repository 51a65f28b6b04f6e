"""Retained messages and ``$SYS`` at the edges: the SUBSCRIBE race, bounded retained
delivery, ``$SYS`` topics and rights.

Packet level over raw sockets where it is protocol (MQTT 3.1.1 section and rule cited per
test); the core-level tests use the fake queue of :mod:`tests.broker_harness`, whose
commits the test controls.  Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from filemq.broker import Broker
from filemq.common.config import load_config
from filemq.mqtt.codec import Decoder, encode
from filemq.mqtt.packets import Connack, Connect, Disconnect, Publish, Suback, Subscribe

REPO = Path(__file__).resolve().parents[1]


# ---- packet-level helpers ---------------------------------------------------------------------


def _recv_packets(s: socket.socket, dec: Decoder, until: float) -> list[Any]:
    """The packets of the next read on ``s`` (empty at the monotonic deadline ``until``)."""
    out: list[Any] = []
    while not out:
        left = until - time.monotonic()
        if left <= 0:
            return out
        s.settimeout(left)
        try:
            data = s.recv(65536)
        except TimeoutError:
            return out
        if not data:
            return out
        dec.feed(data)
        out.extend(dec.packets())
    return out


def _connect(port: int, client_id: str) -> tuple[socket.socket, Decoder]:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(encode(Connect(client_id=client_id)))
    dec = Decoder(server=False)
    got = _recv_packets(s, dec, time.monotonic() + 5)
    assert got and isinstance(got[0], Connack) and got[0].return_code == 0, got
    return s, dec


def _publish_retained_then_subscribe(port: int, i: int, sub_qos: int, pub_qos: int) -> list[Any]:
    """MQTT-3.3.1-6 as conformance suites test it: A publishes retained and disconnects at
    once; B connects and subscribes right after.  Returns what B got besides its SUBACK."""
    topic = f"test/topic/{i}"
    a, _ = _connect(port, f"a{i}")
    a.sendall(encode(Publish(topic, b"retained-%d" % i, pub_qos, True, packet_id=1 if pub_qos else None))
              + encode(Disconnect()))
    a.close()
    b, dec = _connect(port, f"b{i}")
    try:
        b.sendall(encode(Subscribe(1, [(topic, sub_qos)])))
        got: list[Any] = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not any(isinstance(p, Publish) for p in got):
            got.extend(_recv_packets(b, dec, min(deadline, time.monotonic() + 0.2)))
        assert got and isinstance(got[0], Suback), got
        return [p for p in got[1:] if isinstance(p, Publish)]
    finally:
        b.close()


def _check_no_gap(port: int, rounds: int) -> None:
    lost = []
    for i in range(rounds):
        qos = i % 3
        pubs = _publish_retained_then_subscribe(port, i, qos, qos)
        # Published before the SUBSCRIBE: sent because of the new subscription, RETAIN 1 (MQTT-3.3.1-8).
        if [(p.payload, p.retain) for p in pubs] != [(b"retained-%d" % i, True)]:
            lost.append((i, pubs))
    assert not lost, f"{len(lost)} of {rounds} subscribers missed the retained message: {lost[:3]}"


def test_retained_published_just_before_subscribe_is_delivered_in_process(tmp_path: Path) -> None:
    """MQTT-3.3.1-6 / 3.3.1-5: a retained message published and DISCONNECTed right before
    another client's SUBSCRIBE reaches it (as retained or live), fsync = always."""
    cfg = load_config(None, {"data_dir": str(tmp_path), "broker.port": 0, "log.fsync": "always"})

    async def main() -> None:
        broker = Broker(cfg)
        await broker.start()
        try:
            await broker.wait_retained_ready()
            await asyncio.to_thread(_check_no_gap, broker.port, 40)
        finally:
            await broker.stop()
    asyncio.run(main())


@contextlib.contextmanager
def _broker_process(data_dir: Path, *args: str) -> Iterator[int]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "broker", "--data-dir", str(data_dir), "--port", "0", *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("filemq broker listening on 127.0.0.1:"), line
        yield int(line.split("127.0.0.1:")[1].split(",")[0])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_retained_published_just_before_subscribe_is_delivered_by_the_broker_process(tmp_path: Path) -> None:
    """MQTT-3.3.1-6 against `filemq broker` (fsync = always, its default)."""
    with _broker_process(tmp_path) as port:
        _check_no_gap(port, 40)


# ---- the same race at core level, deterministic (the fake queue commits when told) -------------


@pytest.mark.parametrize("qos", [0, 1, 2])
@pytest.mark.parametrize("kind", ["clean", "persistent", "share"])
def test_record_appended_before_subscribe_and_committed_after_is_delivered(
        tmp_path: Path, qos: int, kind: str) -> None:
    """MQTT-3.3.1-6: no gap between "retained when I subscribed" and "live after": a record
    appended before the SUBSCRIBE but committed after it is not in the retained store at
    SUBSCRIBE time, so it must arrive live -- at every QoS, and for ``$share`` members too
    (which get no retained messages, as in MQTT 5)."""
    from tests.broker_harness import Harness

    async def main() -> None:
        h = Harness(tmp_path)
        p = h.connected("p")
        p.send(Publish("test/topic", b"v1", qos, True, packet_id=1 if qos else None))
        assert h.queue.log.committed_offset == 0  # appended, not committed
        s = h.connected("s", clean=kind != "persistent")
        f = "$share/g/test/topic" if kind == "share" else "test/topic"
        s.send(Subscribe(1, [(f, qos)]))
        assert s.received() == [Suback(1, [qos])]
        await h.commit()
        got = [(m.topic, m.payload, m.qos, m.retain) for m in s.received() if isinstance(m, Publish)]
        # MQTT-3.3.1-8: published before the SUBSCRIBE, so it is sent because of the new
        # subscription: RETAIN 1 (a $share subscription gets no retained messages: live, 0).
        assert got == [("test/topic", b"v1", qos, kind != "share")]
    from tests.broker_harness import run
    run(main())


@pytest.mark.parametrize("overlap", [False, True])
def test_retained_appended_before_subscribe_is_sent_as_retained_mqtt_3_3_1_8(tmp_path: Path, overlap: bool) -> None:
    """MQTT-3.3.1-8/-6 and MQTT-3.3.5-1: the last retained message of a topic, appended before
    the SUBSCRIBE but committed after it, is sent with RETAIN 1 once per new subscription
    that matches it (overlapping filters included); superseded and cleared ones are not sent
    (MQTT-3.3.1-10: an empty retained payload removes it, MQTT-3.3.1-7: only the last is kept)."""
    from tests.broker_harness import Harness, run

    async def main() -> None:
        h = Harness(tmp_path)
        p = h.connected("p")
        p.send(Publish("t/a", b"old", 0, True))
        p.send(Publish("t/a", b"new", 1, True, packet_id=1))
        p.send(Publish("t/b", b"gone", 0, True))
        p.send(Publish("t/b", b"", 0, True))
        s = h.connected("s")
        filters = [("t/a", 1), ("t/#", 1)] if overlap else [("t/#", 1)]
        s.send(Subscribe(1, filters))
        assert s.received() == [Suback(1, [1] * len(filters))]
        await h.commit()
        got = [(m.topic, m.payload, m.retain) for m in s.received() if isinstance(m, Publish)]
        assert got == [("t/a", b"new", True)] * len(filters)
        p.send(Publish("t/a", b"live", 1, True, packet_id=2))  # MQTT-3.3.1-9: live, RETAIN 0
        await h.commit()
        got = [(m.topic, m.payload, m.retain) for m in s.received() if isinstance(m, Publish)]
        assert got and set(got) == {("t/a", b"live", False)}
    run(main())


def test_record_committed_but_not_yet_routed_is_not_skipped_by_a_new_filter(tmp_path: Path) -> None:
    """The log's commit becomes visible (committed_offset, set by the commit thread) before the
    broker routes it: a persistent session's group must not read past the routed offset, or a
    filter subscribed in between would miss a record that is neither retained nor live."""
    from tests.broker_harness import Harness, run

    async def main() -> None:
        h = Harness(tmp_path)
        s = h.connected("s", clean=False, subscribe=Subscribe(1, [("other", 1)]))
        p = h.connected("p")
        p.send(Publish("test/topic", b"v1", 1, True, packet_id=1))
        h.queue.log.committed_offset = h.queue.log.next_offset  # committed, listener not run yet
        s.send(Subscribe(2, [("more", 1)]))  # pumps the session's group
        s.send(Subscribe(3, [("test/topic", 1)]))
        assert [type(m) for m in s.received()] == [Suback, Suback]
        await h.commit()  # runs the commit listener: routes offset 0
        got = [(m.topic, m.payload) for m in s.received() if isinstance(m, Publish)]
        assert got == [("test/topic", b"v1")]
    run(main())


def test_repeated_subscribe_resends_a_retained_message_appended_before_it_mqtt_3_8_4_3(tmp_path: Path) -> None:
    """MQTT-3.8.4-3: a SUBSCRIBE repeating an existing filter re-sends the matching retained
    messages -- also one appended before it and committed after it, which the existing
    subscription gets live (RETAIN 0, MQTT-3.3.1-9) besides."""
    from tests.broker_harness import Harness, run

    async def main() -> None:
        h = Harness(tmp_path)
        s = h.connected("s", subscribe=Subscribe(1, [("t/#", 1)]))
        p = h.connected("p")
        p.send(Publish("t/a", b"v1", 1, True, packet_id=1))
        s.send(Subscribe(2, [("t/#", 1)]))
        assert s.received() == [Suback(2, [1])]
        await h.commit()
        got = [(m.topic, m.payload, m.retain) for m in s.received() if isinstance(m, Publish)]
        assert sorted(got) == [("t/a", b"v1", False), ("t/a", b"v1", True)]
    run(main())


def test_a_failed_commit_does_not_hold_a_subscribers_retained_replay(tmp_path: Path) -> None:
    """The retained replay of a SUBSCRIBE that came while a record was appended but not
    committed waits for that commit; when the commit fails (disk full, the offsets are given
    back) it is sent at once, so the subscriber's deliveries are not held until the next
    successful commit."""
    from tests.broker_harness import Harness, run

    async def main() -> None:
        h = Harness(tmp_path)
        p = h.connected("p")
        p.send(Publish("t/old", b"kept", 1, True, packet_id=1))
        await h.commit()
        p.send(Publish("t/new", b"lost", 1, True, packet_id=2))
        s = h.connected("s")
        s.send(Subscribe(1, [("t/#", 1)]))
        assert s.received() == [Suback(1, [1])]
        h.queue.fail_next = True
        await h.commit()
        got = [(m.topic, m.payload, m.retain) for m in s.received() if isinstance(m, Publish)]
        assert got == [("t/old", b"kept", True)]
        assert s.conn not in h.core.retained.after
    run(main())


def test_retained_semantics_for_existing_and_repeated_subscriptions(tmp_path: Path) -> None:
    """MQTT-3.3.1-9: a retained PUBLISH reaches an existing subscriber with RETAIN 0;
    MQTT-3.3.1-10/-11: an empty retained payload is delivered to it as normal and removes the
    retained message (a later subscriber gets nothing); MQTT-3.8.4-3: a SUBSCRIBE repeating an
    existing filter re-sends the retained messages, RETAIN 1, at the new QoS."""
    from tests.broker_harness import Harness, run

    async def main() -> None:
        h = Harness(tmp_path)
        s = h.connected("s", subscribe=Subscribe(1, [("t/#", 1)]))
        p = h.connected("p")
        p.send(Publish("t/a", b"v1", 1, True, packet_id=1))
        await h.commit()
        assert [(m.topic, m.payload, m.qos, m.retain) for m in s.received()] == [("t/a", b"v1", 1, False)]
        s.send(Subscribe(2, [("t/#", 0)]))
        assert s.received() == [Suback(2, [0]), Publish("t/a", b"v1", 0, True)]
        p.send(Publish("t/a", b"", 1, True, packet_id=2))
        await h.commit()
        assert [(m.topic, m.payload, m.retain) for m in s.received()] == [("t/a", b"", False)]
        s.send(Subscribe(3, [("t/#", 0)]))
        assert s.received() == [Suback(3, [0])]
        late = h.connected("late")
        late.send(Subscribe(1, [("t/#", 1)]))
        assert late.received() == [Suback(1, [1])]
    run(main())


def test_retained_waiting_for_the_rebuild_are_not_sent_twice(tmp_path: Path) -> None:
    """While the retained store is rebuilt at start-up a SUBSCRIBE waits; retained records
    routed after the SUBSCRIBE reach it live, and the rebuilt store does not send them again."""
    from filemq.queue.retained import RetainedStore
    from tests.broker_harness import Harness, run

    async def main() -> None:
        h = Harness(tmp_path)
        h.core.retained.ready = False
        s = h.connected("s")
        s.send(Subscribe(1, [("r/#", 0)]))
        assert s.received() == [Suback(1, [0])]
        p = h.connected("p")
        p.send(Publish("r/a", b"after", 0, True))
        await h.commit()
        assert [(m.topic, m.payload, m.retain) for m in s.received()] == [("r/a", b"after", False)]
        h.core.retained.recovered(RetainedStore(tmp_path))
        assert s.received() == []
    run(main())


# ---- retained amplification (issue 10 item 8) ---------------------------------------------------


class _PausingTransport:
    """Buffers writes like asyncio's transport; over ``high`` bytes it pauses the connection
    (what ``pause_writing`` does in the server) until the test drains it."""

    def __init__(self, high: int) -> None:
        self.high = high
        self.buffered = 0
        self.data = bytearray()
        self.conn: Any = None
        self.closed = False

    def write(self, data: bytes) -> None:
        self.buffered += len(data)
        self.data += data
        if self.buffered > self.high and self.conn is not None:
            self.conn.paused = True

    def close(self) -> None:
        self.closed = True


def test_subscribes_of_a_client_that_does_not_read_queue_bounded_retained_bytes(tmp_path: Path) -> None:
    """20 big retained messages and a client that never reads sending 30 SUBSCRIBEs to them:
    the broker hands its transport at most about one high-water mark of retained PUBLISHes
    (not 30 x 20 x 32 KiB); once the client reads, every retained message arrives, newest
    values, retain = 1 (MQTT-3.3.1-8), QoS 1 ones within the in-flight window."""
    from filemq.broker.core import RETAINED_OUT_HIGH
    from filemq.broker.session.connection import Connection
    from filemq.mqtt.packets import Puback
    from tests.broker_harness import Harness, run

    size = 32 * 1024

    async def main() -> None:
        h = Harness(tmp_path)
        p = h.connected("p")
        for i in range(20):
            p.send(Publish(f"ret/{i}", bytes([i]) * size, 1, True, packet_id=i + 1))
        await h.commit()
        t = _PausingTransport(high=64 * 1024)
        conn = Connection(h.config, "10.0.0.9:1", now=time.monotonic(), output_ready=h.core.mark_dirty,
                          closed=h.core.on_close, max_inflight=h.config.max_inflight)
        conn.write = t.write
        t.conn = conn
        h.core.new_connection(conn)
        h.core.receive(conn, conn.receive_data(encode(Connect(client_id="slow")), time.monotonic()))
        h.core.flush()
        for i in range(30):
            h.core.receive(conn, conn.receive_data(encode(Subscribe(i + 1, [("ret/#", i % 2)])), time.monotonic()))
            h.core.flush()
            for _ in range(3):
                await asyncio.sleep(0)  # scheduled re-pumps run (and find the transport paused)
        assert t.buffered <= t.high + RETAINED_OUT_HIGH + size + 4096, t.buffered
        # The client reads now: drain like resume_writing does until nothing more comes.
        dec = Decoder(server=False)
        got: list[Any] = []
        for _ in range(10_000):
            dec.feed(bytes(t.data))
            t.data.clear()
            t.buffered = 0
            new = dec.packets()
            got.extend(new)
            acks = [Puback(m.packet_id) for m in new if isinstance(m, Publish) and m.packet_id is not None]
            conn.paused = False
            if acks:
                h.core.receive(conn, conn.receive_data(b"".join(encode(a) for a in acks), time.monotonic()))
            h.core.pump(conn)
            h.core.flush()
            for _ in range(3):
                await asyncio.sleep(0)
            if not t.data:
                break
        pubs = [m for m in got if isinstance(m, Publish)]
        assert {m.topic for m in pubs} == {f"ret/{i}" for i in range(20)}
        assert all(m.retain and m.payload == bytes([int(m.topic[4:])]) * size for m in pubs)
        assert len([m for m in got if isinstance(m, Suback)]) == 30
        assert not h.core.retained.out
    run(main())


# ---- $SYS (issue 10 item 7) ---------------------------------------------------------------------


def test_sys_deliveries_follow_acl_deny_rules(tmp_path: Path) -> None:
    """A deny rule covers ``$SYS`` like any topic: neither the periodic messages nor the ones
    sent on SUBSCRIBE reach a client denied them."""
    from filemq.broker.acl import Acl
    from tests.broker_harness import Harness, run

    async def main() -> None:
        h = Harness(tmp_path)
        h.core.acl = Acl.parse("pattern read $SYS/#\npattern deny $SYS/broker/backlog/#\n")
        s = h.connected("s", subscribe=Subscribe(1, [("$SYS/#", 0)]))
        msgs = [("$SYS/broker/uptime", b"5 seconds"), ("$SYS/broker/backlog/mqtt-session:alice", b"7")]
        h.core.publish_sys(msgs)
        assert [m.topic for m in s.received()] == ["$SYS/broker/uptime"]
        s2 = h.connected("s2")
        s2.send(Subscribe(1, [("$SYS/#", 0)]))
        out = s2.received()
        assert out[0] == Suback(1, [0])
        assert [m.topic for m in out[1:]] == ["$SYS/broker/uptime"]
    run(main())


def test_sys_topic_over_the_limit_is_skipped_once_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A 65,535-byte client id makes ``$SYS/broker/backlog/mqtt-session:<id>`` longer than a
    topic may be (MQTT 1.5.3): it is skipped and counted with one warning, while new ``$SYS/#``
    subscribers keep their connection and get every valid topic."""
    from tests.broker_harness import Harness, run

    long_topic = "$SYS/broker/backlog/mqtt-session:" + "x" * 65535

    async def main() -> None:
        h = Harness(tmp_path)
        s = h.connected("s", subscribe=Subscribe(1, [("$SYS/#", 0)]))
        with caplog.at_level("WARNING", logger="filemq.broker"):
            for _ in range(3):  # three ticks
                h.core.publish_sys([(long_topic, b"1"), ("$SYS/broker/uptime", b"5 seconds")])
        assert [m.topic for m in s.received()] == ["$SYS/broker/uptime"] * 3
        assert h.stats.sys_skipped == 3
        warnings = [r for r in caplog.records if "$SYS message not published" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].exc_info is None
        late = h.connected("late")
        late.send(Subscribe(1, [("$SYS/#", 0)]))
        out = late.received()
        assert out[0] == Suback(1, [0]) and [m.topic for m in out[1:]] == ["$SYS/broker/uptime"]
        assert not late.conn.closed
    run(main())


def test_sys_backlog_of_a_discarded_session_is_no_longer_retained(tmp_path: Path) -> None:
    """The broker's backlog topics are published as a complete set: the backlog topic of a
    session discarded since the previous tick is not sent to new subscribers any more, and
    ``$SYS`` topics of another source (the agent's forwarder) are kept."""
    from tests.broker_harness import Harness, run

    async def main() -> None:
        h = Harness(tmp_path)
        backlog = "$SYS/broker/backlog/"
        h.core.publish_sys([(backlog + "mqtt-session:gone", b"3"), ("$SYS/broker/uptime", b"1 seconds")],
                           replace=backlog)
        h.core.publish_sys([("$SYS/broker/forwarder/lag", b"0")])
        h.core.publish_sys([("$SYS/broker/uptime", b"2 seconds")], replace=backlog)
        s = h.connected("s")
        s.send(Subscribe(1, [("$SYS/#", 0)]))
        assert sorted((m.topic, m.payload) for m in s.received()[1:]) == [
            ("$SYS/broker/forwarder/lag", b"0"), ("$SYS/broker/uptime", b"2 seconds")]
    run(main())


def test_sys_backlog_of_a_discarded_session_disappears_in_the_broker(tmp_path: Path) -> None:
    """End to end: a persistent session's backlog topic goes away once clean_session = 1
    discards the session (within one ``sys_interval_s``)."""
    cfg = load_config(None, {"data_dir": str(tmp_path), "broker.port": 0, "broker.sys_interval_s": 1})

    def topics(port: int) -> set[str]:
        s, dec = _connect(port, "watch")
        try:
            s.sendall(encode(Subscribe(1, [("$SYS/broker/backlog/#", 0)])))
            got: list[Any] = []
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                got.extend(_recv_packets(s, dec, deadline))
            return {p.topic for p in got if isinstance(p, Publish)}
        finally:
            s.close()

    async def until(cond: Any) -> None:
        async with asyncio.timeout(5):
            while not cond():
                await asyncio.sleep(0.02)

    async def main() -> None:
        b = Broker(cfg)
        await b.start()
        try:
            c = socket.create_connection(("127.0.0.1", b.port), timeout=5)
            c.sendall(encode(Connect(client_id="dev", clean_session=False)) + encode(Subscribe(1, [("a", 1)])))
            assert b.core is not None
            core = b.core
            await until(lambda: "a" in getattr(core.sessions.get("dev"), "subs", {}))
            c.close()
            await until(lambda: "$SYS/broker/backlog/mqtt-session:dev" in core.sys_retained)
            assert "$SYS/broker/backlog/mqtt-session:dev" in await asyncio.to_thread(topics, b.port)
            c = socket.create_connection(("127.0.0.1", b.port), timeout=5)
            c.sendall(encode(Connect(client_id="dev", clean_session=True)) + encode(Disconnect()))
            await until(lambda: "dev" not in core.sessions)
            c.close()
            await until(lambda: "$SYS/broker/backlog/mqtt-session:dev" not in core.sys_retained)
            assert "$SYS/broker/backlog/mqtt-session:dev" not in await asyncio.to_thread(topics, b.port)
        finally:
            await b.stop()
    asyncio.run(main())


# ---- the retained replay through the delivery planner (issue 31) -------------------------------


def test_retained_replay_goes_through_the_planner_mqtt_3_3_1_8_3_3_2_6_3_3_4_3(tmp_path: Path) -> None:
    """A retained message sent because of a SUBSCRIBE is planned by Delivery._deliver as a
    replay: RETAIN 1 (MQTT-3.3.1-8), at min(subscription QoS, message QoS) (3.8.4), expired
    ones not sent (MQTT-3.3.2-5), the remaining expiry interval (MQTT-3.3.2-6) and the
    subscription's identifier (MQTT-3.3.4-3) on the wire and in flight (4.4: re-sent with
    them), in flight with no consumer group (nothing acked in a group)."""
    from filemq.mqtt.packets import Properties, subscription_options
    from tests.broker_harness import run
    from tests.broker_harness5 import Harness5, append_old_record, publishes

    async def main() -> None:
        h = Harness5(tmp_path)
        append_old_record(h, "r/a", b"a", 2, 2.5, 60, retain=True)
        append_old_record(h, "r/gone", b"x", 1, 3.0, 2, retain=True)
        await h.commit()
        delivery = h.core.delivery
        planned: list[Any] = []
        deliver = delivery._deliver

        def spy(*args: Any) -> bool:
            planned.append((args[3][0].topic, args[2], args[5] if len(args) > 5 else None))
            return deliver(*args)
        delivery._deliver = spy  # type: ignore[method-assign, assignment]  # (a spy over its positional args)
        s = h.sub5("s", ("r/#", subscription_options(1)), props=Properties(subscription_identifiers=[7]))
        (m,) = publishes(s)
        assert (m.topic, m.payload, m.qos, m.retain) == ("r/a", b"a", 1, True)
        assert m.properties is not None and m.properties.message_expiry_interval in (57, 58)
        assert m.properties.subscription_identifiers == [7]
        assert planned == [("r/a", None, (1, b"\x0b\x07")), ("r/gone", None, (1, b"\x0b\x07"))]
        state = s.conn.session
        assert state is not None and m.packet_id is not None
        out = state.qos.inflight[m.packet_id]
        assert out.group is None and out.retain and out.qos == 1 and out.headers.endswith(b"\x0b\x07")
        s4 = h.connected("s4")  # MQTT 3.1.1: the same plan, RETAIN 1 too (3.3.1.3), no identifier
        s4.send(Subscribe(1, [("r/#", 2)]))
        pubs = [p for p in s4.received() if isinstance(p, Publish)]
        assert [(p.topic, p.qos, p.retain) for p in pubs] == [("r/a", 2, True)]
    run(main())


def test_retained_replay_too_large_is_discarded_and_takes_no_packet_id_mqtt_3_1_2_25(tmp_path: Path) -> None:
    """MQTT-3.1.2-25: a retained message whose PUBLISH is larger than the client's Maximum
    Packet Size is not sent and counts as delivered; as in the planner's group path it takes
    no packet id (the next one gets 1)."""
    from filemq.mqtt.packets import Properties, subscription_options
    from tests.broker_harness import run
    from tests.broker_harness5 import Harness5, publishes

    async def main() -> None:
        h = Harness5(tmp_path)
        p = h.connected("p")
        p.send(Publish("big/a", b"x" * 200, 1, True, packet_id=1), Publish("big/b", b"y", 1, True, packet_id=2))
        await h.commit()
        s = h.sub5("s", ("big/#", subscription_options(1)), properties=Properties(maximum_packet_size=64))
        (m,) = publishes(s)
        assert (m.topic, m.packet_id, m.retain) == ("big/b", 1, True)
        assert h.core.delivery.dropped_too_large == 1
        state = s.conn.session
        assert state is not None and list(state.qos.inflight) == [1]
    run(main())


def test_retained_replay_takes_topic_aliases_as_a_live_delivery_3_3_2_3_4(tmp_path: Path) -> None:
    """3.3.2.3.4: a retained replay uses the topic alias the client already has for its topic
    (assigned by a live delivery) and assigns the next free one to a topic without one, as
    the planner does for any delivery (MQTT-3.3.2-12: the client maps it on receipt)."""
    from filemq.mqtt.packets import Properties, subscription_options
    from tests.broker_harness import run
    from tests.broker_harness5 import Harness5, client5, publishes

    async def main() -> None:
        h = Harness5(tmp_path)
        s = client5(h)
        s.connect("s", properties=Properties(topic_alias_maximum=4))
        s.send(Subscribe(1, [("al/a", subscription_options(0))]))
        p = h.connected("p")
        p.send(Publish("al/a", b"1", 1, True, packet_id=1), Publish("al/b", b"2", 1, True, packet_id=2))
        await h.commit()
        live = publishes(s)
        assert [(m.topic, m.properties.topic_alias if m.properties else None) for m in live] == [("al/a", 1)]
        s.send(Subscribe(2, [("al/#", subscription_options(0))]))
        got = publishes(s)
        assert [(m.topic, m.payload, m.retain, m.properties.topic_alias if m.properties else None)
                for m in got] == [("", b"1", True, 1), ("al/b", b"2", True, 2)]
        assert s.conn.out_aliases == {"al/a": 1, "al/b": 2}
    run(main())


def test_retained_qos2_replay_waits_for_the_session_file_mqtt_4_3_3(tmp_path: Path) -> None:
    """4.3.3 / MQTT-2.2.1-3: a retained message sent at QoS 2 to a persistent session leaves
    only once the session file holds its packet id (the planner's hold, qos2_sent -1: no
    group record); the rest of the queue follows that write, in order, RETAIN 1 (MQTT-3.3.1-8)."""
    from tests.broker_harness import Harness, run

    async def main() -> None:
        h = Harness(tmp_path)
        p = h.connected("p")
        p.send(Publish("q/1", b"1", 2, True, packet_id=1), Publish("q/2", b"2", 2, True, packet_id=2))
        await h.commit()
        delivery = h.core.delivery
        held: list[bool] = []
        deliver = delivery.deliver_retained

        def spy(*args: Any) -> bool:
            held.append(deliver(*args))
            return held[-1]
        delivery.deliver_retained = spy  # type: ignore[method-assign, assignment]  # (a spy over its positional args)
        s = h.connected("s", clean=False)
        s.send(Subscribe(1, [("q/#", 2)]))
        await h.settle()
        await h.settle()
        got = [m for m in s.received() if isinstance(m, Publish)]
        assert [(m.topic, m.qos, m.retain, m.packet_id) for m in got] == [("q/1", 2, True, 1), ("q/2", 2, True, 2)]
        assert held == [True, True]
        state = s.conn.session
        assert state is not None and state.qos.qos2_sent == {1: -1, 2: -1}
        assert all(o.group is None and o.retain for o in state.qos.inflight.values())
    run(main())


def test_retained_replay_does_not_overtake_output_held_for_the_session_file_mqtt_4_3_3(tmp_path: Path) -> None:
    """4.3.3 / MQTT-2.2.1-3: while a live QoS 2 delivery to a persistent session waits for the
    session file (its packet id), a SUBSCRIBE's retained messages wait too: they leave after
    the held PUBLISH, in order, once the write is done (Retained.drain asks
    ``SessionState.holding``, as Delivery.pump does)."""
    from tests.broker_harness import Harness, run

    async def main() -> None:
        h = Harness(tmp_path)
        p = h.connected("p")
        p.send(Publish("r/a", b"old", 1, True, packet_id=1))
        await h.commit()
        s = h.connected("s", clean=False)
        s.send(Subscribe(1, [("live/x", 2)]))
        await h.settle()
        s.received()
        registry = h.core.delivery.registry
        real_save = registry.save_soon
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        calls: list[int] = []

        def first_held(state: Any) -> asyncio.Future[None]:
            calls.append(1)  # the QoS 2 id's write is held; later ones (the SUBSCRIBE's) are real
            return written if len(calls) == 1 else real_save(state)
        registry.save_soon = first_held  # type: ignore[method-assign]
        p.send(Publish("live/x", b"new", 2, False, packet_id=2))
        await h.commit()
        await h.settle()
        state = s.conn.session
        assert state is not None and state.holding()
        assert [m for m in s.received() if isinstance(m, Publish)] == []
        s.send(Subscribe(2, [("r/#", 1)]))
        for _ in range(20):
            await h.settle()
            got = s.received()
            if any(isinstance(m, Suback) for m in got):
                break
        assert [m for m in got if isinstance(m, Publish)] == []  # behind the held one
        assert len(calls) >= 2  # the SUBSCRIBE's own write was not the held one
        registry.save_soon = real_save  # type: ignore[method-assign]
        written.set_result(None)
        await h.settle()
        await h.settle()
        got = [(m.topic, m.qos, m.retain) for m in s.received() if isinstance(m, Publish)]
        assert got == [("live/x", 2, False), ("r/a", 1, True)]
    run(main())
