"""The broker's connection state machine and core, driven by packets without sockets (h11 style).

A fake queue gives the test full control over commits: a PUBLISH's commit future resolves
only when the test says so, which lets us check that no PUBACK/PUBREC ever leaves before its
record is committed (the harness: tests/broker_harness.py).  A few tests use the real Queue on a
temporary directory.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from filemq.broker.acl import Acl
from filemq.broker.core import BrokerCore, HookResult
from filemq.broker.session.connection import CLOSED, CONNECTED, Connection
from filemq.broker.session_store import SessionStore
from filemq.broker.sysinfo import BrokerStats
from filemq.broker.tailcache import TailCache
from filemq.common.config import AutoSubscribe, BrokerSection
from filemq.mqtt.codec import encode
from filemq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
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
from filemq.queue.groups import ConsumerGroup
from filemq.queue.retained import RetainedStore
from segments.record import Record
from tests.broker_harness import (
    Client,
    Clients,
    FakeQueue,
    FakeTransport,
    Harness,
    deliveries,
    one_delivery,
    run,
)


class CountingTransport(FakeTransport):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        super().write(data)


def test_acks_and_deliveries_to_one_connection_leave_in_one_write_per_loop_pass(tmp_path: Path) -> None:
    """Issue 16 item 2: a commit releases a connection's PUBACKs (the batch future's callback)
    and routes the committed records to it (the commit listener); both reach the socket in
    one transport write in the next loop pass, not one write each."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("self", subscribe=Subscribe(1, [("t", 1)]))
        counting = CountingTransport()
        c.transport = counting
        c.conn.write = counting.write
        c._read = 0
        c.send(Publish("t", b"1", 1, packet_id=1), Publish("t", b"2", 1, packet_id=2))
        assert counting.writes == 0  # the PUBACKs wait for the commit (MQTT-4.3.2-2 durable first)
        h.queue.commit()
        for _ in range(3):
            await asyncio.sleep(0)  # the loop runs its passes; nobody calls flush() here
        got = c.received()
        assert sorted(type(p).__name__ for p in got) == ["Puback", "Puback", "Publish", "Publish"]
        assert counting.writes == 1
    run(main())


# ---- CONNECT -------------------------------------------------------------------------------


def test_first_packet_must_be_connect(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.client()
        with caplog.at_level(logging.WARNING, "filemq.broker"):
            c.send(Publish("a", b"x"))
        assert c.conn.state == CLOSED and c.transport.closed
        assert c.received() == []
        assert "PUBLISH before CONNECT" in caplog.text and "10.0.0.1:1001" in caplog.text
    run(main())


def test_second_connect_is_a_protocol_violation(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.client()
        assert c.connect("a").return_code == 0
        c.send(Connect(client_id="a"))
        assert c.conn.closed and "second CONNECT" in c.conn.close_reason
    run(main())


@pytest.mark.parametrize(
    ("connect", "code"),
    [
        (Connect(client_id="x", protocol_level=3), 0x01),
        (Connect(client_id="x", protocol_name="MQIsdp", protocol_level=3), 0x01),
        (Connect(client_id="", clean_session=False), 0x02),
    ],
)
def test_connack_refusals(tmp_path: Path, connect: Connect, code: int) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.client()
        c.send(connect)
        out = c.received()
        assert out == [Connack(False, code)]
        assert c.conn.closed and c.transport.closed
    run(main())


def test_zero_length_client_id_gets_an_assigned_id(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        c1, c2 = h.client(), h.client()
        assert c1.connect("", clean=True).return_code == 0
        assert c2.connect("", clean=True).return_code == 0
        assert c1.conn.client_id and c2.conn.client_id and c1.conn.client_id != c2.conn.client_id
        assert not c1.conn.closed and not c2.conn.closed
    run(main())


def test_password_checks(tmp_path: Path) -> None:
    from filemq.broker.auth import PasswordFile, add_or_update

    pw_file = tmp_path / "pw"
    add_or_update(pw_file, "alice", "secret", iterations=1000)

    async def main() -> None:
        h = Harness(tmp_path, host="127.0.0.1", password_file=str(pw_file), allow_anonymous=False)
        h.core.passwords = PasswordFile.load(pw_file)
        h.core.anonymous_allowed = False
        anon = h.client()
        assert anon.connect("anon").return_code == 0x05
        nopw = h.client()
        assert nopw.connect("n", username="alice").return_code == 0x04
        bad = h.client()
        bad.send(Connect(client_id="b", username="alice", password=b"wrong"))
        for _ in range(200):
            if bad.conn.closed:
                break
            await asyncio.sleep(0.01)
        assert bad.received() == [Connack(False, 0x04)]
        good = h.client()
        # SUBSCRIBE pipelined right behind CONNECT waits for the (threaded) password check.
        good.send(Connect(client_id="g", username="alice", password=b"secret"), Subscribe(1, [("t", 1)]))
        for _ in range(200):
            if good.conn.state == CONNECTED:
                break
            await asyncio.sleep(0.01)
        assert good.received() == [Connack(False, 0), Suback(1, [1])]
        again = h.client()  # cached now: accepted synchronously
        assert again.connect("g2", username="alice", password=b"secret").return_code == 0
    run(main())


# ---- PUBLISH in: durable acks ----------------------------------------------------------------


def test_puback_only_after_commit_and_batched(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("p")
        c.send(*[Publish("t/a", b"%d" % i, qos=1, packet_id=i + 1) for i in range(50)])
        await asyncio.sleep(0)
        assert c.received() == []  # not committed yet: nothing acknowledged
        writes_before = len(c.transport.data)
        await h.commit()
        acks = c.received()
        assert acks == [Puback(i + 1) for i in range(50)]
        assert len(c.transport.data) - writes_before == 50 * 4
        assert [r.payload for r in h.queue.log.records] == [b"%d" % i for i in range(50)]
    run(main())


def test_failed_commit_closes_without_ack(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("p")
        c.send(Publish("t", b"x", qos=1, packet_id=7))
        h.queue.fail_next = True
        await h.commit()
        assert c.received() == []
        assert c.conn.closed and "storing a PUBLISH failed" in c.conn.close_reason
    run(main())


def test_qos2_inbound_is_stored_once(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("q2", clean=False)
        c.send(Publish("t", b"once", qos=2, packet_id=5))
        c.send(Publish("t", b"once", qos=2, packet_id=5, dup=True))
        await h.commit()
        assert c.received() == [Pubrec(5), Pubrec(5)]
        assert len(h.queue.log.records) == 1
        # The id is durable before PUBREC: it is in the session file now.
        stored = h.store.load("q2")
        assert stored is not None and stored.qos2_inbound == {5}
        c.send(Pubrel(5))
        await h.settle()
        assert c.received() == [Pubcomp(5)]
        # After PUBREL the id may be reused for a new message.
        c.send(Publish("t", b"second", qos=2, packet_id=5))
        await h.commit()
        assert c.received() == [Pubrec(5)]
        assert [r.payload for r in h.queue.log.records] == [b"once", b"second"]
    run(main())


def test_qos2_ids_survive_a_restart(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("q2", clean=False)
        c.send(Publish("t", b"m", qos=2, packet_id=9))
        await h.commit()
        assert c.received() == [Pubrec(9)]
        # "Crash": a new core over the same store; the client re-sends with DUP.
        core2 = h.make_core()
        h.core = core2
        c2 = h.client()
        assert c2.connect("q2", clean=False).session_present
        c2.send(Publish("t", b"m", qos=2, packet_id=9, dup=True))
        await h.commit()
        assert c2.received() == [Pubrec(9)]
        assert len(h.queue.log.records) == 1
        # A new message that reuses a possibly stale id without DUP is stored.
        c2.send(Pubrel(9), Publish("t", b"new", qos=2, packet_id=9))
        await h.commit()
        assert len(h.queue.log.records) == 2
    run(main())


def test_missing_group_directory_restarts_the_session_at_the_log_start_not_its_end(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """issue 10 item 13: a stored persistent session whose consumer-group directory is gone
    must not be resumed at the log's end (that silently lost every queued message): the group
    is re-created at the log's first offset, loudly; acknowledged messages are never lost."""
    import shutil

    from filemq.queue.groups import escape_group_name

    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("s1", clean=False, subscribe=Subscribe(1, [("t", 1), ("$share/g/s", 1)]))
        c.send(Disconnect())
        p = h.connected("pub")
        p.send(*[Publish("t", b"m%d" % i, qos=1, packet_id=i + 1) for i in range(5)])
        p.send(*[Publish("s", b"s%d" % i, qos=1, packet_id=i + 11) for i in range(3)])
        await h.commit()
        # The broker stops; the groups' directories are lost (deleted by hand, bad restore).
        shutil.rmtree(tmp_path / "groups" / escape_group_name("mqtt-session:s1"))
        shutil.rmtree(tmp_path / "groups" / escape_group_name("mqtt-share:g/s"))
        log_ = h.queue.log
        h.queue = FakeQueue(tmp_path / "groups")
        h.queue.log = log_
        h.core = h.make_core()
        c2 = h.client()
        with caplog.at_level(logging.ERROR, "filemq.broker"):
            assert c2.connect("s1", clean=False).session_present
        got = [x.payload for x in c2.received() if isinstance(x, Publish)]
        assert sorted(got) == sorted([b"m%d" % i for i in range(5)] + [b"s%d" % i for i in range(3)])
        assert "'mqtt-session:s1' is missing" in caplog.text and "'mqtt-share:g/s' is missing" in caplog.text
    run(main())


def test_full_disk_refuses_a_new_persistent_session_with_server_unavailable(tmp_path: Path) -> None:
    """issue 10 item 14 (MQTT-3.2.2-4/-5, return code 0x03): CONNACK 0 promises a session
    that survives a restart; when its file cannot be written the CONNECT is refused instead."""
    from tests.faults import FaultyFileIO

    async def main() -> None:
        h = Harness(tmp_path)
        io = FaultyFileIO(tmp_path)
        h.store = SessionStore(tmp_path, io)
        h.core = h.make_core()
        io.disk_full = True
        c = h.client()
        ack = c.connect("new-persistent", clean=False)
        assert ack.return_code == 0x03 and not ack.session_present
        assert c.conn.state == CLOSED and c.transport.closed
        assert h.store.load("new-persistent") is None
        # A clean session needs no file: still accepted on the full disk.
        assert h.client().connect("clean", clean=True).return_code == 0
    run(main())


def test_full_disk_repeated_subscribe_changes_nothing_durable_and_is_acknowledged(tmp_path: Path) -> None:
    """issue 10 items 12/14, MQTT-3.8.4-3: a persistent session that repeats a SUBSCRIBE it
    already has (as clients do on every connect) changes nothing a restart needs, so a full
    disk must not close it: SUBACK, and its queued messages keep flowing."""
    from tests.faults import FaultyFileIO

    async def main() -> None:
        h = Harness(tmp_path)
        io = FaultyFileIO(tmp_path)
        h.store = SessionStore(tmp_path, io)
        h.core = h.make_core()
        c = h.connected("p1", clean=False, subscribe=Subscribe(1, [("t", 1)]))
        io.disk_full = True
        c.send(Subscribe(2, [("t", 1)]))
        assert [x for x in c.received() if isinstance(x, Suback)] == [Suback(2, [1])]
        assert c.conn.state != CLOSED and not c.transport.closed
        # A subscription that is new, or whose QoS changes, still needs the file: refused.
        c.send(Subscribe(3, [("t", 2)]))
        assert not [x for x in c.received() if isinstance(x, Suback)]
        assert c.conn.state == CLOSED
    run(main())


def test_full_disk_subscribe_that_cannot_be_persisted_closes_cleanly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """issue 10 item 14: a persistent session's SUBSCRIBE whose state cannot be made durable
    gets no SUBACK (it would promise a subscription a restart forgets); the connection is
    closed with the reason logged, not an internal error."""
    from tests.faults import FaultyFileIO

    async def main() -> None:
        h = Harness(tmp_path)
        io = FaultyFileIO(tmp_path)
        h.store = SessionStore(tmp_path, io)
        h.core = h.make_core()
        c = h.connected("p1", clean=False)
        io.disk_full = True
        with caplog.at_level(logging.ERROR, "filemq.broker"):
            c.send(Subscribe(1, [("t", 1)]))
        assert not [x for x in c.received() if isinstance(x, Suback)]
        assert c.conn.state == CLOSED and c.transport.closed
        assert "internal error" not in caplog.text
        assert "SUBSCRIBE" in caplog.text and "persist" in caplog.text
        # Same when the new consumer group's files cannot be written (a clean session too).
        io.disk_full = False

        def no_space(*args: Any, **kw: Any) -> ConsumerGroup:
            raise OSError(28, "No space left on device")

        h.queue.group = no_space  # type: ignore[method-assign]
        caplog.clear()
        c2 = h.connected("c2", clean=True)
        with caplog.at_level(logging.ERROR, "filemq.broker"):
            c2.send(Subscribe(1, [("t", 1)]))
        assert not [x for x in c2.received() if isinstance(x, Suback)]
        assert c2.conn.state == CLOSED and "internal error" not in caplog.text
        assert "SUBSCRIBE refused" in caplog.text
    run(main())


def test_acl_denied_and_dollar_publishes_are_acked_and_dropped(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        h.core.acl = Acl.parse("topic write allowed/#\n")
        c = h.connected("p")
        c.send(Publish("denied/x", b"1", qos=1, packet_id=1), Publish("$SYS/x", b"2", qos=1, packet_id=2),
               Publish("allowed/x", b"3", qos=1, packet_id=3))
        assert c.received() == [Puback(1), Puback(2)]
        await h.commit()
        assert c.received() == [Puback(3)]
        assert [r.topic for r in h.queue.log.records] == ["allowed/x"]
        assert h.stats.publish_dropped == 2
    run(main())


def test_publish_hook(tmp_path: Path) -> None:
    seen = []

    def hook(info: Any, p: Publish) -> HookResult:
        seen.append((info.client_id, info.peer, p.topic))
        if p.topic == "dup":
            return HookResult.ack_drop("duplicate")
        if p.topic == "bad":
            return HookResult.reject("CRC mismatch")
        return HookResult.store(p.payload.upper())

    async def main() -> None:
        h = Harness(tmp_path)
        h.hook = hook
        h.core = h.make_core()
        c = h.connected("hk")
        c.send(Publish("ok", b"abc", qos=1, packet_id=1), Publish("dup", b"x", qos=1, packet_id=2))
        await h.commit()
        assert c.received() == [Puback(1), Puback(2)]
        assert [(r.topic, r.payload) for r in h.queue.log.records] == [("ok", b"ABC")]
        c.send(Publish("bad", b"x", qos=1, packet_id=3))
        assert c.conn.closed and "CRC mismatch" in c.conn.close_reason
        assert c.received() == []
        assert seen[0] == ("hk", c.conn.peer, "ok")
    run(main())


# ---- SUBSCRIBE and delivery -----------------------------------------------------------------


def test_suback_codes_and_delivery_qos(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        h.core.acl = Acl.parse("topic read a/#\ntopic write #\n")
        s = h.connected("s")
        s.send(Subscribe(1, [("a/+", 1), ("a/#/x", 1), ("b/#", 0), ("a/q2", 2)]))
        assert s.received() == [Suback(1, [1, 0x80, 0x80, 2])]
        p = h.connected("p")
        p.send(Publish("a/b", b"q0", 0), Publish("a/b", b"q2", 2, packet_id=1),
               Publish("a/q2", b"q2b", 2, packet_id=2))
        await h.commit()
        got = s.received()
        assert [(m.topic, m.payload, m.qos, m.retain) for m in got] == [
            ("a/b", b"q0", 0, False), ("a/b", b"q2", 1, False), ("a/q2", b"q2b", 2, False)]
        s.send(Puback(got[1].packet_id), Pubrec(got[2].packet_id))
        assert s.received() == [Pubrel(got[2].packet_id)]
        s.send(Pubcomp(got[2].packet_id))
        s.send(Unsubscribe(2, ["a/+"]))
        assert s.received() == [Unsuback(2)]
        p.send(Publish("a/b", b"after", 1, packet_id=3))
        await h.commit()
        assert s.received() == []
    run(main())


def test_inflight_window_and_pingreq(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path, max_inflight=3)
        s = h.connected("s", subscribe=Subscribe(1, [("t", 1)]))
        p = h.connected("p")
        p.send(*[Publish("t", b"%d" % i, 1, packet_id=i + 1) for i in range(10)])
        await h.commit()
        first = s.received()
        assert [m.payload for m in first] == [b"0", b"1", b"2"]
        # One PUBACK frees a third of the window: not refilled yet (QosAcks._refill: at
        # most a quarter of it, at least one message, in flight), so the PINGREQ is answered alone.
        s.send(Puback(first[0].packet_id), Pingreq())
        assert s.received() == [Pingresp()]
        s.send(Puback(first[1].packet_id), Pingreq())
        out = s.received()
        assert sorted(type(x).__name__ for x in out) == ["Pingresp", "Publish", "Publish"]
        assert [x.payload for x in out if isinstance(x, Publish)] == [b"3", b"4"]
    run(main())


def test_window_refilled_in_three_quarter_window_steps_whatever_the_ack_pattern(tmp_path: Path) -> None:
    """PUBACKs one at a time, in any order: the window is refilled once at most a quarter of
    it is in flight (one write of three quarters of a window), never overfilled, and every
    record arrives once, in order."""
    async def main() -> None:
        h = Harness(tmp_path, max_inflight=10)
        s = h.connected("s", subscribe=Subscribe(1, [("t", 1)]))
        p = h.connected("p")
        p.send(*[Publish("t", b"%d" % i, 1, packet_id=i + 1) for i in range(60)])
        await h.commit()
        inflight = s.received()
        assert len(inflight) == 10
        got = [m.payload for m in inflight]
        pending = 50  # records not sent yet
        rounds = 0
        while inflight and rounds < 200:
            rounds += 1
            m = inflight.pop(len(inflight) // 2)  # out of order
            s.send(Puback(m.packet_id))
            new = [x for x in s.received() if isinstance(x, Publish)]
            assert not new or len(inflight) <= 2, "refilled before three quarters of the window were free"
            assert new or len(inflight) > 2 or not pending, "not refilled with three quarters free"
            pending -= len(new)
            inflight += new
            assert len(inflight) <= 10
            got += [x.payload for x in new]
        assert got == [b"%d" % i for i in range(60)]
    run(main())


def test_new_filter_in_a_lagging_session_gets_only_newer_records(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        s = h.connected("s", clean=False, subscribe=Subscribe(1, [("a", 1)]))
        s.send(Disconnect())
        p = h.connected("p")
        p.send(Publish("a", b"a1", 1, packet_id=1), Publish("b", b"b-old", 1, packet_id=2))
        await h.commit()
        s2 = h.connected("s", clean=False)
        s2.send(Subscribe(2, [("b", 1)]))
        p.send(Publish("b", b"b-new", 1, packet_id=3))
        await h.commit()
        got = [m.payload for m in s2.received() if isinstance(m, Publish)]
        assert got == [b"a1", b"b-new"]
    run(main())


def test_persistent_session_redelivers_with_dup_and_same_ids(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        s = h.connected("s", clean=False, subscribe=Subscribe(1, [("t/#", 1)]))
        p = h.connected("p")
        p.send(Publish("t/1", b"m1", 1, packet_id=1), Publish("t/1", b"m2", 1, packet_id=2))
        await h.commit()
        got = s.received()
        s.send(Puback(got[0].packet_id))
        s.conn.connection_lost()
        s2 = h.client()
        ack = s2.connect("s", clean=False)
        assert ack.session_present
        again = s2.received()
        assert [(m.payload, m.dup, m.packet_id) for m in again] == [(b"m2", True, got[1].packet_id)]
    run(main())


def test_clean_session_discards_persistent_state(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        s = h.connected("s", clean=False)
        s.send(Subscribe(1, [("t", 1)]), Disconnect())
        assert h.store.load("s") is not None
        c = h.client()
        assert not c.connect("s", clean=True).session_present
        assert h.store.load("s") is None
        c.send(Disconnect())
        again = h.client()
        assert not again.connect("s", clean=False).session_present
    run(main())


def test_takeover_closes_old_connection_and_publishes_its_will(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        old = h.connected("dev", will_topic="status/dev", will_payload=b"gone", will_qos=1)
        new = h.client()
        assert new.connect("dev").return_code == 0
        assert old.conn.closed and "taken over" in old.conn.close_reason
        await h.commit()
        assert [(r.topic, r.payload) for r in h.queue.log.records] == [("status/dev", b"gone")]
        # A clean DISCONNECT publishes no will.
        new.send(Disconnect())
        await h.commit()
        assert len(h.queue.log.records) == 1
    run(main())


def test_keepalive_expiry_publishes_will(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("k", keepalive=2, will_topic="w", will_payload=b"bye")
        t0 = c.conn.last_rx
        h.core.tick(t0 + 2.9)
        assert not c.conn.closed
        h.core.tick(t0 + 3.1)
        assert c.conn.closed and "keepalive" in c.conn.close_reason
        await h.commit()
        assert [r.topic for r in h.queue.log.records] == ["w"]
    run(main())


def test_next_keepalive_deadline_is_known_between_ticks(tmp_path: Path) -> None:
    """MQTT-3.1.2-24: the server disconnects a client silent for 1.5 x its keepalive. The core
    reports the earliest deadline (the server sleeps until it, not until its next tick), and
    a packet moves a client's deadline on."""
    async def main() -> None:
        h = Harness(tmp_path)
        a = h.connected("a", keepalive=2)
        b = h.connected("b", keepalive=10)
        h.connected("forever", keepalive=0)
        h.core.tick(a.conn.last_rx)
        assert h.core.next_timeout == a.conn.last_rx + 3.0
        assert h.core.check_timeouts(a.conn.last_rx + 2.99) == a.conn.last_rx + 3.0
        assert not a.conn.closed
        a.send(Pingreq())
        assert h.core.check_timeouts(b.conn.last_rx + 1) == a.conn.last_rx + 3.0
        assert h.core.check_timeouts(a.conn.last_rx + 3.01) == b.conn.last_rx + 15.0
        assert a.conn.closed and "keepalive" in a.conn.close_reason and not b.conn.closed
    run(main())


def test_retained_delivered_on_subscribe_and_cleared(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        p = h.connected("p")
        p.send(Publish("r/1", b"one", 1, True, packet_id=1), Publish("r/2", b"two", 0, True))
        await h.commit()
        s = h.connected("s")
        s.send(Subscribe(1, [("r/#", 1)]))
        out = s.received()
        assert out[0] == Suback(1, [1])
        assert sorted((m.topic, m.payload, m.qos, m.retain) for m in out[1:]) == [
            ("r/1", b"one", 1, True), ("r/2", b"two", 0, True)]
        p.send(Publish("r/1", b"", 0, True))
        await h.commit()
        s2 = h.connected("s2")
        s2.send(Subscribe(1, [("r/#", 0)]))
        assert [m.topic for m in s2.received()[1:]] == ["r/2"]
    run(main())


def test_shared_subscription_splits_records(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        a, b, solo = h.client(), h.client(), h.client()
        a.connect("a")
        b.connect("b")
        solo.connect("solo")
        a.send(Subscribe(1, [("$share/g/jobs/#", 1)]))
        b.send(Subscribe(1, [("$share/g/jobs/#", 1)]))
        solo.send(Subscribe(1, [("jobs/#", 1)]))
        for c in (a, b, solo):
            c.received()
        p = h.connected("p")
        n = 30
        for i in range(n):
            p.send(Publish("jobs/x", b"%d" % i, 1, packet_id=i + 1))
        await h.commit()
        got_a = a.received()
        got_b = b.received()
        for c, got in ((a, got_a), (b, got_b)):
            c.send(*[Puback(m.packet_id) for m in got])
        got_a += a.received()
        got_b += b.received()
        pa = {m.payload for m in got_a}
        pb = {m.payload for m in got_b}
        assert not pa & pb
        assert len(pa | pb) == n
        assert pa and pb
        solo_got = solo.received()
        solo.send(*[Puback(m.packet_id) for m in solo_got])
        solo_got += solo.received()
        assert len({m.payload for m in solo_got}) == n
    run(main())


def test_auto_subscribe_rule(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path, auto_subscribe=(AutoSubscribe("cmd/%c/#", 1),))
        d = h.connected("dev7", clean=False)
        p = h.connected("p")
        p.send(Publish("cmd/dev7/reboot", b"now", 1, packet_id=1), Publish("cmd/other/x", b"no", 1, packet_id=2))
        await h.commit()
        assert [m.payload for m in d.received()] == [b"now"]
    run(main())


def test_dollar_topics_not_matched_by_wildcards_and_sys_messages(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        s = h.connected("s", subscribe=Subscribe(1, [("#", 0), ("$SYS/broker/uptime", 0)]))
        h.core.publish_sys([("$SYS/broker/uptime", b"5 seconds"), ("$SYS/broker/clients/connected", b"1")])
        assert [(m.topic, m.payload) for m in s.received()] == [("$SYS/broker/uptime", b"5 seconds")]
        s.send(Subscribe(2, [("$SYS/#", 0)]))
        out = s.received()
        assert out[0] == Suback(2, [0])
        assert {m.topic for m in out[1:]} == {"$SYS/broker/uptime", "$SYS/broker/clients/connected"}
    run(main())


def test_oversized_or_malformed_packet_closes_only_that_connection(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path, max_packet_size=1024)
        good, bad, big = h.client(), h.client(), h.client()
        good.connect("good")
        bad.connect("bad")
        big.connect("big")
        bad.send_bytes(b"\x30\xff\xff\xff\xff\x01")  # remaining length over 4 bytes
        big.send(Publish("t", b"x" * 2000))
        assert bad.conn.closed and "protocol error" in bad.conn.close_reason
        assert big.conn.closed and "exceeds" in big.conn.close_reason
        good.send(Pingreq())
        assert good.received() == [Pingresp()] and not good.conn.closed
    run(main())


# ---- Hypothesis: random valid packet sequences ------------------------------------------------

_topics = st.sampled_from(["a", "a/b", "b/c", "$SYS/x", "c"])
_filters = st.sampled_from(["a", "a/#", "+/c", "#", "$share/g/a/#", "x/+/y", "a/#/b"])
_pid = st.integers(1, 6)

_op = st.one_of(
    st.tuples(st.just("pub"), _topics, st.integers(0, 2), _pid, st.booleans(), st.booleans()),
    st.tuples(st.just("sub"), _filters, st.integers(0, 2), _pid),
    st.tuples(st.just("unsub"), _filters, _pid),
    st.tuples(st.just("puback"), _pid),
    st.tuples(st.just("pubrec"), _pid),
    st.tuples(st.just("pubrel"), _pid),
    st.tuples(st.just("pubcomp"), _pid),
    st.tuples(st.just("ping")),
    st.tuples(st.just("commit")),
    st.tuples(st.just("reconnect"), st.booleans()),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, max_size=40))
def test_random_packet_sequences(tmp_path: Path, ops: list[tuple[Any, ...]]) -> None:
    """Never raises; every PUBACK/PUBREC for a stored PUBLISH leaves only after its commit."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(dir=tmp_path))

    async def main() -> None:
        h = Harness(d)
        c = h.connected("hyp", clean=False)
        other = h.connected("other", subscribe=Subscribe(1, [("#", 2)]))
        # pid -> committed?  Filled as PUBLISHes are sent; checked against acks received.
        waiting: dict[int, int] = {}
        for op in ops:
            kind = op[0]
            if kind == "pub":
                _, topic, qos, pid, retain, dup = op
                if qos and pid not in waiting and topic[0] != "$":
                    assert c.conn.session is not None
                    known = qos == 2 and pid in c.conn.session.qos.qos2_in
                    waiting[pid] = -1 if known else h.queue.log.next_offset
                c.send(Publish(topic, b"p", qos, retain, dup and qos > 0, pid if qos else None))
            elif kind == "sub":
                c.send(Subscribe(op[3], [(op[1], op[2])]))
            elif kind == "unsub":
                c.send(Unsubscribe(op[2], [op[1]]))
            elif kind in ("puback", "pubrec", "pubcomp"):
                assert c.conn.session is not None
                out = c.conn.session.qos.inflight.get(op[1])
                fits = out is None or (kind == "puback") == (out.qos == 1) and (
                    kind != "pubcomp" or out.stage == 1)
                if fits:  # a wrong one closes the connection (tested on its own)
                    c.send({"puback": Puback, "pubrec": Pubrec, "pubcomp": Pubcomp}[kind](op[1]))
            elif kind == "pubrel":
                c.send(Pubrel(op[1]))
            elif kind == "ping":
                c.send(Pingreq())
            elif kind == "commit":
                await h.commit()
            elif kind == "reconnect":
                c.conn.connection_lost()
                c = h.connected("hyp", clean=op[1])
                waiting.clear()
            for packet in c.received():
                if isinstance(packet, (Puback, Pubrec)) and packet.packet_id in waiting:
                    offset = waiting.pop(packet.packet_id)
                    assert h.queue.log.committed_offset > offset, "acknowledged before commit"
            assert not c.conn.closed, c.conn.close_reason
        await h.commit()
        other.received()

    try:
        run(main())
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_retained_rebuilt_in_background(tmp_path: Path) -> None:
    """While the retained store is being rebuilt, SUBSCRIBE waits for its retained messages and
    retained records routed meanwhile are applied on top of the rebuilt store."""
    async def main() -> None:
        h = Harness(tmp_path)
        old = RetainedStore(tmp_path)
        old.apply(Record(0, 0, "r/a", b"from-snapshot", 1, True))
        h.core.retained.ready = False
        p = h.connected("p")
        p.send(Publish("r/b", b"live", 0, True), Publish("r/a", b"", 0, True))
        await h.commit()
        s = h.connected("s")
        s.send(Subscribe(1, [("r/#", 0)]))
        assert s.received() == [Suback(1, [0])]
        h.core.retained.recovered(old)
        assert [(m.topic, m.payload, m.retain) for m in s.received()] == [("r/b", b"live", True)]
    run(main())


# ---- the session store and the tail cache ------------------------------------------------------


def test_session_store_round_trip_and_damage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from filemq.broker.session_store import StoredSession, StoredSubscription

    store = SessionStore(tmp_path)
    weird = "dev/1 +#%é"
    s = StoredSession(weird, {"a/#": StoredSubscription(1, 5), "$share/g/b": StoredSubscription(2, 0)}, {3, 9})
    store.save(s)
    assert store.load(weird) == s
    assert list(store.client_ids()) == [weird]
    path = store.path_of(weird)
    assert "/" not in path.name[:-5] and path.parent == store.directory
    path.write_bytes(path.read_bytes()[:20])  # torn
    with caplog.at_level(logging.WARNING):
        assert store.load(weird) is None
    assert "starting client" in caplog.text and path.with_name(path.name + ".corrupt").exists()
    assert store.load("never-seen") is None
    store.save(s)
    assert store.delete(weird) and store.load(weird) is None and not store.delete(weird)


def test_tail_cache_reads_like_the_log(tmp_path: Path) -> None:
    from segments import Log

    lg = Log.open(tmp_path / "log")
    for i in range(500):
        lg.append(f"t/{i % 7}", b"p%d" % i)
    lg.flush()
    cache = TailCache(lg, max_bytes=20_000, read_ahead=64)
    for r in lg.read(450, 50):
        cache.put(r)  # the live tail
    for start, n in [(0, 10), (445, 20), (460, 100), (499, 5), (500, 5), (130, 1), (0, 1000), (5, 256)]:
        assert cache.read(start, n) == lg.read(start, n), (start, n)
        for max_bytes in (1, 100, 1000):
            assert cache.read(start, n, max_bytes) == lg.read(start, n, max_bytes), (start, n, max_bytes)
    for i in range(500, 600):  # the live tail keeps growing; old entries are evicted
        lg.append("t/new", b"q%d" % i)
        lg.flush()
        cache.put(lg.read(i, 1)[0])
    assert cache.read(590, 50) == lg.read(590, 50)
    assert cache.cached_bytes <= 20_000
    assert cache.hits > 0 and cache.misses > 0
    lg.close()


def test_tail_cache_read_ahead_runs_read_like_the_log_for_many_lagging_readers(tmp_path: Path) -> None:
    """Issue 16 item 3: readers behind the tail are served from gap-free read-ahead runs by
    list slices; whatever the offsets, counts and byte limits, a read returns exactly what
    ``Log.read`` returns, and the read-ahead stays within ``max_bytes``."""
    import random

    from segments import Log

    lg = Log.open(tmp_path / "log")
    rng = random.Random(16)
    for i in range(3000):
        lg.append(f"t/{i % 5}", bytes(rng.choice((1, 10, 100, 1500))))
    lg.flush()
    cache = TailCache(lg, max_bytes=64_000, read_ahead=128)
    for r in lg.read(2900, 100):
        cache.put(r)
    readers = [rng.randrange(0, 2900) for _ in range(10)]
    for step in range(400):
        k = step % len(readers)
        n = rng.choice((1, 7, 100, 300))
        max_bytes = rng.choice((1, 500, 4000, 1 << 20))
        got = cache.read(readers[k], n, max_bytes)
        assert got == lg.read(readers[k], n, max_bytes), (readers[k], n, max_bytes)
        readers[k] = got[-1].offset + 1 if got and got[-1].offset < 2999 else rng.randrange(0, 2900)
        assert cache.cached_bytes <= 64_000
    assert cache.hits > 0 and cache.misses > 0
    lg.close()


def test_qos2_resend_on_takeover_waits_for_the_first_commit(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        old = h.connected("q", clean=False)
        old.send(Publish("t", b"m", 2, packet_id=4))
        new = h.client()  # takes over before the first copy is committed
        new.connect("q", clean=False)
        new.send(Publish("t", b"m", 2, dup=True, packet_id=4))
        assert new.received() == []
        await h.commit()
        assert new.received() == [Pubrec(4)]
        assert len(h.queue.log.records) == 1
        stored = h.store.load("q")
        assert stored is not None and stored.qos2_inbound == {4}
    run(main())


def test_qos2_resend_after_failed_commit_is_stored(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("q", clean=False)
        c.send(Publish("t", b"m", 2, packet_id=4))
        h.queue.fail_next = True
        await h.commit()
        assert c.conn.closed and c.received() == []
        c2 = h.connected("q", clean=False)
        c2.send(Publish("t", b"m", 2, dup=True, packet_id=4))
        await h.commit()
        assert c2.received() == [Pubrec(4)]
        assert [r.payload for r in h.queue.log.records] == [b"m"]
    run(main())


@settings(max_examples=200, deadline=None)
@given(topic=st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00+#"), min_size=1,
                     max_size=40),
       payload=st.binary(max_size=20000), qos=st.integers(0, 2), dup=st.booleans(), retain=st.booleans(),
       pid=st.integers(1, 0xFFFF))
def test_publish_bytes_matches_the_codec(topic: str, payload: bytes, qos: int, dup: bool, retain: bool,
                                         pid: int) -> None:
    from filemq.mqtt.codec import publish_bytes

    dup = dup and qos > 0
    expected = encode(Publish(topic, payload, qos, retain, dup, pid if qos else None))
    assert publish_bytes(topic, payload, qos, dup, pid if qos else None, retain) == expected


def test_live_delivery_wakes_only_matching_sessions_and_reads_from_memory(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path)
        subs = []
        for i in range(5):
            c = h.connected(f"s{i}", clean=i % 2 == 0, subscribe=Subscribe(1, [(f"dev/{i}/#", 1)]))
            subs.append(c)
        p = h.connected("p")
        woken: list[str] = []
        real_pump = h.core.delivery.pump

        def pump(conn: Connection) -> None:
            woken.append(conn.client_id)
            real_pump(conn)

        h.core.delivery.pump = pump  # type: ignore[method-assign]
        reads = 0
        real_read = h.queue.log.read

        def read(*a: Any, **kw: Any) -> list[Record]:
            nonlocal reads
            reads += 1
            return real_read(*a, **kw)

        h.queue.log.read = read  # type: ignore[method-assign]
        p.send(*[Publish("dev/3/temp", b"%d" % i, 1, packet_id=i + 1) for i in range(30)])
        await h.commit()
        got = subs[3].received()
        subs[3].send(*[Puback(m.packet_id) for m in got])
        got += subs[3].received()
        assert [m.payload for m in got] == [b"%d" % i for i in range(30)]
        assert set(woken) == {"s3"}
        assert reads == 0
        assert all(c.received() == [] for i, c in enumerate(subs) if i != 3)
    run(main())


def test_bulk_pubacks_and_a_bad_one(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path, max_inflight=50)
        s = h.connected("s", subscribe=Subscribe(1, [("t", 1)]))
        p = h.connected("p")
        p.send(*[Publish("t", b"%d" % i, 1, packet_id=i + 1) for i in range(40)])
        await h.commit()
        got = s.received()
        assert len(got) == 40
        s.send_bytes(b"".join(encode(Puback(m.packet_id)) for m in got))  # one read of PUBACKs
        assert s.conn.session is not None and s.conn.session.qos.inflight == {}
        s.send_bytes(b"\x40\x02\x00\x00")  # packet id 0
        assert s.conn.closed and "packet id" in s.conn.close_reason
    run(main())


@pytest.mark.parametrize("count", [3, 64, 65, 100])
def test_a_read_of_pubacks_with_id_0_inside_is_a_protocol_error(tmp_path: Path, count: int) -> None:
    """MQTT-2.3.1-1 (a packet id is non-zero): a PUBACK with id 0 anywhere in a read of
    whole PUBACKs (the fast paths for up to 64 and for more) closes the connection."""
    async def main() -> None:
        h = Harness(tmp_path, max_inflight=200)
        s = h.connected("s", subscribe=Subscribe(1, [("t", 1)]))
        p = h.connected("p")
        p.send(*[Publish("t", b"%d" % i, 1, packet_id=i + 1) for i in range(count)])
        await h.commit()
        got = s.received()
        assert len(got) == count
        acks = [encode(Puback(m.packet_id)) for m in got]
        acks[count // 2] = b"\x40\x02\x00\x00"
        s.send_bytes(b"".join(acks))
        assert s.conn.closed and "packet id" in s.conn.close_reason
    run(main())


def test_unsubscribing_from_a_share_leaves_it(tmp_path: Path) -> None:
    async def main() -> None:
        h = Harness(tmp_path, max_inflight=5)
        a, b = h.client(), h.client()
        a.connect("a")
        b.connect("b")
        for c in (a, b):
            c.send(Subscribe(1, [("$share/g/t", 1)]))
            c.received()
        p = h.connected("p")
        p.send(*[Publish("t", b"%d" % i, 1, packet_id=i + 1) for i in range(6)])
        await h.commit()
        got_a = a.received()
        assert got_a  # a holds some, unacked
        a.send(Unsubscribe(2, ["$share/g/t"]))
        assert a.received() == [Unsuback(2)]
        p.send(*[Publish("t", b"%d" % i, 1, packet_id=i + 10) for i in range(6, 10)])
        await h.commit()
        seen = []
        for _ in range(10):
            got = [m for m in b.received() if isinstance(m, Publish)]
            if not got:
                break
            seen += got
            b.send(*[Puback(m.packet_id or 0) for m in got])
        assert sorted(int(m.payload) for m in seen) == list(range(10))  # a's unacked ones too
        assert a.received() == []
    run(main())


# ---- at-least-once across disconnects and restarts, on the real queue --------------------------


class RealHarness(Clients):
    """BrokerCore over a real Queue (fsync = never for speed; restarts are clean here)."""

    peer_prefix = "10.0.0.2:"

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.config = BrokerSection(max_inflight=7)
        self.core: BrokerCore
        self.queue: Any = None
        self._n = 0

    async def start(self) -> None:
        from filemq.queue import Queue, QueueConfig
        from segments import LogConfig

        self.queue = Queue.open(self.tmp, QueueConfig(log=LogConfig(fsync="never")))
        await self.queue.start()
        self.store = SessionStore(self.tmp)
        self.retained = RetainedStore(self.tmp)
        self.retained.recover(self.queue.log)
        self.core = BrokerCore(self.queue, TailCache(self.queue.log), config=self.config, store=self.store,
                               retained=self.retained, stats=BrokerStats(started_at=0.0), acl=Acl.permissive())
        self.core.session_writer = functools.partial(Harness._write_inline, self)  # type: ignore[arg-type]

    async def restart(self) -> None:
        await self.settle()
        self.core.close_all("restart")
        self.core.save_sessions()
        await self.queue.close()
        await self.start()

    async def settle(self) -> None:
        for _ in range(50):
            pending = self.core.pending_commits()
            if not pending and self.queue.log.committed_offset == self.queue.log.next_offset:
                break
            await asyncio.sleep(0.002)
        for _ in range(3):
            await asyncio.sleep(0)
        self.core.flush()


_sub_ops = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.integers(1, 12)),
        st.tuples(st.just("ack"), st.integers(0, 7)),
        st.just(("drop",)),
        st.just(("reconnect",)),
        st.just(("restart",)),
    ),
    max_size=25,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_sub_ops)
def test_persistent_subscriber_gets_every_acked_message(tmp_path: Path, ops: list[tuple[Any, ...]]) -> None:
    """Whatever happens (disconnects, broker restarts, partial acks), a persistent subscriber
    that comes back and acks everything has received every message whose PUBACK was sent."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(dir=tmp_path))

    async def main() -> None:
        h = RealHarness(d)
        await h.start()
        sub: Client | None = h.client()
        assert sub is not None
        sub.connect("durable", clean=False)
        sub.send(Subscribe(1, [("data/#", 1)]))
        received: set[bytes] = set()
        unacked: list[int] = []
        acked_payloads: set[bytes] = set()
        sent: dict[int, bytes] = {}
        pub = h.connected("pub")
        counter = 0

        def take(c: Client) -> None:
            for m in c.received():
                if isinstance(m, Publish):
                    received.add(m.payload)
                    unacked.append(m.packet_id)  # type: ignore[arg-type]

        for op in ops:
            if op[0] == "publish":
                for _ in range(op[1]):
                    counter += 1
                    pid = counter % 60000 + 1
                    sent[pid] = b"m%d" % counter
                    pub.send(Publish("data/x", sent[pid], 1, packet_id=pid))
                await h.settle()
                acked_payloads |= {sent[m.packet_id] for m in pub.received() if isinstance(m, Puback)}
            elif op[0] == "ack" and sub is not None:
                take(sub)
                ids, unacked[:] = unacked[:op[1]], unacked[op[1]:]
                sub.send(*[Puback(i) for i in ids])
            elif op[0] == "drop" and sub is not None:
                take(sub)
                sub.conn.connection_lost()
                sub, unacked[:] = None, []
            elif op[0] == "reconnect":
                if sub is not None:
                    sub.conn.connection_lost()
                sub = h.connected("durable", clean=False)
                unacked[:] = []
            elif op[0] == "restart":
                await h.restart()
                sub, unacked[:] = None, []
                pub = h.connected("pub")
            if sub is not None:
                take(sub)
        # Come back and ack everything until nothing more arrives.
        if sub is None:
            sub = h.connected("durable", clean=False)
            unacked[:] = []
        for _ in range(200):
            await h.settle()
            take(sub)
            if not unacked:
                break
            ids, unacked[:] = list(unacked), []
            sub.send(*[Puback(i) for i in ids])
        missing = acked_payloads - received
        assert not missing, f"acknowledged but never delivered: {sorted(missing)[:5]}"
        await h.queue.close()

    try:
        run(main())
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_group_offsets_persisted_soon_after_acks(tmp_path: Path) -> None:
    """Under traffic, a persistent subscriber's Pending is on disk ~100 ms after its acks
    (not only at the queue's once-a-second housekeeping)."""
    from filemq.queue.offsets import OffsetFile

    async def main() -> None:
        h = Harness(tmp_path)
        s = h.connected("s", clean=False, subscribe=Subscribe(1, [("t", 1)]))
        p = h.connected("p")
        p.send(*[Publish("t", b"x", 1, packet_id=i + 1) for i in range(5)])
        await h.commit()
        got = s.received()
        s.send(*[Puback(m.packet_id) for m in got])
        group = h.core.sessions["s"].group
        assert group is not None and group.pending_offset == 5
        pending = OffsetFile(group.directory / "pending")  # type: ignore[operator]
        for _ in range(100):
            if pending.read() == 5:
                break
            await asyncio.sleep(0.01)
        assert pending.read() == 5
        await h.core.stop_persisting()
    run(main())


# ---- protocol conformance: DUP on QoS 0, topic length in bytes, pattern substitution -------------


def test_qos0_publish_with_dup_closes_the_connection_mqtt_3_3_1_2(tmp_path: Path) -> None:
    """MQTT-3.3.1-2: DUP MUST be 0 for QoS 0; a QoS 0 PUBLISH with DUP = 1 is a protocol
    violation: the connection is closed and nothing is stored or forwarded."""
    async def main() -> None:
        h = Harness(tmp_path)
        s = h.connected("s", subscribe=Subscribe(1, [("t", 0)]))
        p = h.connected("p")
        p.send_bytes(b"\x38\x04\x00\x01tx")  # PUBLISH, DUP=1, QoS 0, topic "t", payload "x"
        assert p.conn.closed and "MQTT-3.3.1-2" in p.conn.close_reason
        await h.commit()
        assert h.queue.log.records == [] and s.received() == []
    run(main())


def test_max_topic_length_counts_utf8_bytes(tmp_path: Path) -> None:
    """``max_topic_length`` is in bytes (docs/CONFIG.md): 4 characters of 3 bytes each are
    12 bytes, over a limit of 10, for PUBLISH topics and SUBSCRIBE filters alike."""
    async def main() -> None:
        h = Harness(tmp_path, max_topic_length=10)
        s = h.connected("s")
        s.send(Subscribe(1, [("\u20ac\u20ac\u20ac\u20ac", 0), ("abcdefghij", 0)]))
        assert s.received() == [Suback(1, [0x80, 0])]
        p = h.connected("p")
        p.send(Publish("abcdefghij", b"ok", 1, packet_id=1))  # exactly 10 bytes: allowed
        p.send(Publish("\u20ac\u20ac\u20ac\u20ac", b"x", 1, packet_id=2))
        assert p.conn.closed and "12 bytes exceeds max_topic_length 10" in p.conn.close_reason
        await h.commit()
        assert [r.topic for r in h.queue.log.records] == ["abcdefghij"]
    run(main())


def test_auto_subscribe_substitutes_in_one_pass(tmp_path: Path) -> None:
    """A client id containing ``%u`` is inserted literally, not substituted again with the
    username: the rule ``cmd/%c/#`` subscribes client ``%u`` (user ``alice``) to
    ``cmd/%u/#``, never to ``cmd/alice/#``."""
    async def main() -> None:
        h = Harness(tmp_path, auto_subscribe=(AutoSubscribe("cmd/%c/#", 1),))
        d = h.connected("%u", clean=False, username="alice")
        assert d.conn.session is not None and list(d.conn.session.subs) == ["cmd/%u/#"]
    run(main())


def test_qos2_id_reused_after_a_crash_is_stored_before_pubrec(tmp_path: Path) -> None:
    """Issue 10 item 1 (in-process): after a completed QoS 2 flow (PUBLISH, PUBREC, PUBREL,
    PUBCOMP) and a crash, a *new* message under the same id with DUP = 1 is stored before its
    PUBREC: the id's removal was durable before PUBCOMP left, so the session file no longer
    lists it (no PUBREC for anything not in the log)."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("q2", clean=False)
        c.send(Publish("t", b"first", qos=2, packet_id=1))
        await h.commit()
        assert c.received() == [Pubrec(1)]
        c.send(Pubrel(1))
        await h.settle()
        assert c.received() == [Pubcomp(1)]
        stored = h.store.load("q2")
        assert stored is not None and stored.qos2_inbound == set()
        h.core = h.make_core()  # "kill -9": no shutdown save
        c2 = h.client()
        assert c2.connect("q2", clean=False).session_present
        c2.send(Publish("t", b"second", qos=2, packet_id=1, dup=True))
        await h.commit()
        assert c2.received() == [Pubrec(1)]
        assert [r.payload for r in h.queue.log.records] == [b"first", b"second"]
    run(main())


def test_qos2_pubcomp_waits_for_the_durable_removal(tmp_path: Path) -> None:
    """PUBCOMP leaves only after the session file without the id is written; a failed write
    sends no PUBCOMP and closes the connection (the client re-sends PUBREL)."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("q2", clean=False)
        c.send(Publish("t", b"m", qos=2, packet_id=3))
        await h.commit()
        assert c.received() == [Pubrec(3)]
        writes = h.store.writes
        c.send(Pubrel(3), Pubrel(3))
        assert c.received() == []  # not written yet
        await h.settle()
        assert c.received() == [Pubcomp(3), Pubcomp(3)]
        assert h.store.writes == writes + 1  # both removals in one write
        c.send(Publish("t", b"m2", qos=2, packet_id=4))
        await h.commit()
        assert c.received() == [Pubrec(4)]

        def fail(snap: Any) -> None:
            raise OSError(28, "No space left on device")

        h.store.write = fail  # type: ignore[method-assign]
        c.send(Pubrel(4))
        await h.settle()
        assert c.received() == [] and c.conn.closed
    run(main())


# ---- outbound acknowledgements of the wrong type (MQTT-4.8.0-1) ---------------------------------


@pytest.mark.parametrize(
    ("qos", "acks", "resent"),
    [
        (2, [Pubcomp], "publish"),  # PUBCOMP without PUBREC
        (2, [Puback], "publish"),  # PUBACK to QoS 2
        (2, [Pubrec, Puback], "pubrel"),  # PUBACK after PUBREL
        (1, [Pubrec], "publish"),  # PUBREC to QoS 1 (was answered with PUBREL)
        (1, [Pubcomp], "publish"),  # PUBCOMP to QoS 1
    ],
)
def test_wrong_ack_type_closes_and_keeps_the_message_in_flight_mqtt_4_8_0_1(
        tmp_path: Path, qos: int, acks: list[Any], resent: str) -> None:
    """MQTT-4.8.0-1 / 4.3: an acknowledgement that does not fit the packet id's state is a
    protocol violation: the connection is closed, nothing else is sent, the delivery is not
    completed, and the persistent session re-sends it on reconnect (PUBLISH with DUP = 1,
    or PUBREL when PUBREC had been received)."""
    async def main() -> None:
        h = Harness(tmp_path)
        s, m = await one_delivery(h, qos)
        pid = m.packet_id
        assert pid is not None
        for i, ack in enumerate(acks):
            s.send(ack(pid))
            if i < len(acks) - 1:
                assert s.received() == [Pubrel(pid)] and not s.conn.closed
        assert s.conn.closed and "MQTT-4.8.0-1" in s.conn.close_reason
        assert s.received() == []
        s2 = h.client()
        assert s2.connect("s", clean=False).session_present
        again = s2.received()
        if resent == "publish":
            assert again == [Publish("t", b"m", qos, False, True, pid)]
        else:
            assert again == [Pubrel(pid)]
    run(main())


def test_wrong_ack_in_a_read_of_pubacks_closes(tmp_path: Path) -> None:
    """The PUBACK fast path (a read of nothing but PUBACKs) applies the same rule."""
    async def main() -> None:
        h = Harness(tmp_path)
        s, m = await one_delivery(h, 2)
        assert m.packet_id is not None
        s.send_bytes(encode(Puback(m.packet_id)))
        assert s.conn.closed and "MQTT-4.8.0-1" in s.conn.close_reason
    run(main())


def test_acks_for_unknown_packet_ids_are_ignored(tmp_path: Path) -> None:
    """Policy: an ack for an id not in flight (e.g. for a message re-sent under a new id after
    a restart, or already completed) is ignored -- not closed -- so legitimate late acks
    never cost the connection; PUBREC for an unknown id is still answered with PUBREL."""
    async def main() -> None:
        h = Harness(tmp_path)
        s = h.connected("s", clean=False)
        s.send(Puback(7), Pubcomp(8), Pubrec(9))
        assert s.received() == [Pubrel(9)] and not s.conn.closed
        s.send(Pubcomp(9))
        assert s.received() == [] and not s.conn.closed
    run(main())


# ---- message_size_limit (payload bytes, like Mosquitto's) ----------------------------------------


def test_message_size_limit_closes_without_storing_or_acking(tmp_path: Path) -> None:
    """A PUBLISH whose payload exceeds ``message_size_limit`` closes the connection (MQTT
    3.1.1 has no negative ack): nothing stored, nothing acknowledged, for every QoS; a payload
    of exactly the limit is accepted."""
    async def main() -> None:
        h = Harness(tmp_path, message_size_limit=100)
        p = h.connected("p")
        p.send(Publish("t", b"x" * 100, 1, packet_id=1))
        await h.commit()
        assert p.received() == [Puback(1)]
        for qos in (0, 1, 2):
            c = h.connected(f"big{qos}", clean=False)
            c.send(Publish("t", b"x" * 101, qos, packet_id=qos or None))
            assert c.conn.closed and "message_size_limit 100" in c.conn.close_reason
            await h.commit()
            assert c.received() == []
        assert [len(r.payload) for r in h.queue.log.records] == [100]
    run(main())


def test_message_size_limit_refuses_a_larger_will_at_connect(tmp_path: Path) -> None:
    """A will payload over ``message_size_limit`` refuses the CONNECT: the connection is
    closed without CONNACK (3.1.1 has no return code for it) and no session is made."""
    async def main() -> None:
        h = Harness(tmp_path, message_size_limit=10)
        c = h.client()
        c.send(Connect(client_id="w", clean_session=False, will_topic="w/t", will_payload=b"x" * 11))
        assert c.received() == [] and c.conn.closed
        assert "will payload of 11 bytes exceeds message_size_limit 10" in c.conn.close_reason
        assert h.store.load("w") is None
        ok = h.client()
        assert ok.connect("w2", will_topic="w/t", will_payload=b"x" * 10).return_code == 0
    run(main())


# ---- session files are written off the event loop, before CONNACK ------------------------------


def test_new_persistent_session_is_written_off_the_loop_before_connack(tmp_path: Path) -> None:
    """Issue 10 item 15: creating a persistent session writes (fsyncs) its file in a worker
    thread, not on the event loop, and CONNACK leaves only once it is durable; packets sent
    behind the CONNECT wait for it.  A failed write refuses the CONNECT (0x03) and leaves no
    session behind."""
    import threading

    async def main() -> None:
        h = Harness(tmp_path)
        h.threaded_writes = True
        h.core = h.make_core()
        threads: list[threading.Thread] = []
        real_write = h.store.write

        def write(snap: Any) -> None:
            threads.append(threading.current_thread())
            real_write(snap)

        h.store.write = write  # type: ignore[method-assign]
        c = h.client()
        c.send(Connect(client_id="new", clean_session=False), Subscribe(1, [("t", 1)]))
        assert c.received() == []  # not durable yet: no CONNACK
        await h.settle()
        assert c.received() == [Connack(False, 0), Suback(1, [1])]
        assert threads[0] is not threading.main_thread()  # the creation write
        stored = h.store.load("new")
        assert stored is not None and "t" in stored.subscriptions

        def fail(snap: Any) -> None:
            raise OSError(28, "No space left on device")

        h.store.write = fail  # type: ignore[method-assign]
        bad = h.client()
        bad.send(Connect(client_id="full", clean_session=False))
        await h.settle()
        assert bad.received() == [Connack(False, 0x03)] and bad.conn.closed
        h.store.write = real_write  # type: ignore[method-assign]
        again = h.client()
        again.send(Connect(client_id="full", clean_session=False))
        await h.settle()
        assert again.received() == [Connack(False, 0)]  # not "present": nothing was on disk
    run(main())


def test_a_session_write_due_when_the_session_is_discarded_does_not_revive_it(tmp_path: Path) -> None:
    """A session-file write still due (PUBREL) when clean_session = 1 discards the session is
    dropped: the discarded session's file does not come back."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("x", clean=False)
        c.send(Publish("t", b"m", 2, packet_id=1))
        await h.commit()
        assert c.received() == [Pubrec(1)]
        c.send(Pubrel(1))  # its write is due, not started
        h.connected("x", clean=True)
        await h.settle()
        assert h.store.load("x") is None
    run(main())


def test_loaded_qos2_id_suppresses_a_store_only_for_the_same_logged_message(tmp_path: Path) -> None:
    """Issue 10 item 1: an id read from the session file may suppress a re-store only if it
    provably names the same message: the log's record at the id's stored offset has the
    re-sent topic and payload.  An id whose offset holds another message (e.g. a tail lost
    under fsync = never, offsets reused since) or that has no offset (a file from before
    offsets were recorded) is stored again -- at worst a duplicate, never a PUBREC for a
    message that is not in the log."""
    from filemq.broker.session_store import StoredSession

    async def main() -> None:
        h = Harness(tmp_path)
        p = h.connected("p")
        p.send(Publish("t", b"same", 1, packet_id=1), Publish("t", b"other", 1, packet_id=2))
        await h.commit()
        h.store.save(StoredSession("q", {}, {4, 5, 6}, qos2_offsets={4: 0, 5: 1}))
        c = h.connected("q", clean=False)
        c.send(Publish("t", b"same", 2, dup=True, packet_id=4),  # offset 0 holds it: duplicate
               Publish("t", b"new", 2, dup=True, packet_id=5),  # offset 1 holds another message
               Publish("t", b"old", 2, dup=True, packet_id=6))  # no offset recorded
        await h.commit()
        assert c.received() == [Pubrec(4), Pubrec(5), Pubrec(6)]
        assert [r.payload for r in h.queue.log.records] == [b"same", b"other", b"new", b"old"]
        stored = h.store.load("q")
        assert stored is not None and stored.qos2_offsets == {4: 0, 5: 2, 6: 3}
        c.send(Publish("t", b"new", 2, dup=True, packet_id=5))  # a re-send now: not stored again
        await h.commit()
        assert c.received() == [Pubrec(5)] and len(h.queue.log.records) == 4
    run(main())


def test_connect_waiting_for_its_session_file_when_a_clean_connect_discards_it(tmp_path: Path) -> None:
    """A CONNECT whose new session file is still being written when another connection with
    clean_session = 1 discards that session is refused (0x03), not connected to a session
    that no longer exists; the clean connection stays."""
    async def main() -> None:
        h = Harness(tmp_path)
        h.threaded_writes = True
        h.core = h.make_core()
        a = h.client()
        a.send(Connect(client_id="x", clean_session=False))
        b = h.client()
        # (its CONNACK may wait for the removal of the file a's write just made: issue 33 item 2)
        b.send(Connect(client_id="x", clean_session=True))
        await h.settle()
        assert a.received() == [Connack(False, 0x03)] and a.conn.closed
        assert b.received() == [Connack(False, 0)]
        assert not b.conn.closed and h.store.load("x") is None
    run(main())


# ---- a bug in the broker costs one connection (both builds) --------------------------------------


def test_a_bug_while_handling_packets_closes_only_that_connection(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception from the broker while it handles a connected client's packets, or its
    CONNECT, closes that connection with the exception in the reason and logs it; the caller
    (the event loop's read callback) sees nothing and other connections go on.  In the compiled
    build too: the ``except Exception`` after an ``except ProtocolError`` must not be cast to
    ProtocolError (tests/test_build.py::test_hot_path_except_variables_keep_one_type)."""
    async def main() -> None:
        h = Harness(tmp_path)
        p = h.connected("p")
        other = h.connected("o")

        def broken(*args: Any) -> None:
            raise RuntimeError("bug")

        with caplog.at_level(logging.ERROR, "filemq.broker"):
            monkeypatch.setattr(h.core, "on_publish", broken)
            p.send(Publish("t", b"x", 1, packet_id=1))
            assert p.conn.state == CLOSED and "internal error: RuntimeError('bug')" in p.conn.close_reason
            monkeypatch.setattr(h.core, "on_connect", broken)
            c = h.client()
            c.send(Connect(client_id="c"))
            assert c.conn.state == CLOSED and "internal error: RuntimeError('bug')" in c.conn.close_reason
        assert caplog.text.count("internal error: RuntimeError('bug')") == 2
        assert other.conn.state == CONNECTED
    run(main())


def test_a_read_of_pubacks_with_repeated_unknown_and_qos2_ids(tmp_path: Path) -> None:
    """A read of PUBACKs completes each QoS 1 delivery it names (MQTT 4.3.2); in one read a
    repeated or unknown id is ignored, and a PUBACK for a QoS 2 delivery closes
    (MQTT-4.8.0-1), the deliveries acked before it in the read staying acked."""
    async def main() -> None:
        h = Harness(tmp_path, max_inflight=50)
        s = h.connected("s", clean=False, subscribe=Subscribe(1, [("t", 1), ("q2", 2)]))
        p = h.connected("p")
        p.send(*[Publish("t", b"%d" % i, 1, packet_id=i + 1) for i in range(12)])
        await h.commit()
        got = s.received()
        state = s.conn.session
        assert state is not None and state.group is not None and len(got) == 12
        group = state.group
        ids = [m.packet_id for m in got]
        s.send_bytes(b"".join(encode(Puback(i)) for i in ids[:6]))  # one read
        assert sorted(state.qos.inflight) == ids[6:] and group.pending_offset == 6
        s.send_bytes(b"".join(encode(Puback(i)) for i in [ids[6], ids[6], 999, ids[7]]))
        assert sorted(state.qos.inflight) == ids[8:] and group.pending_offset == 8
        assert not s.conn.closed
        p.send(Publish("q2", b"x", 2, packet_id=100))
        await h.commit()
        q2 = [m for m in s.received() if isinstance(m, Publish)]
        assert len(q2) == 1 and q2[0].qos == 2
        s.send_bytes(b"".join(encode(Puback(i)) for i in [ids[8], q2[0].packet_id, ids[9]]))
        assert s.conn.closed and "MQTT-4.8.0-1" in s.conn.close_reason
        assert sorted(state.qos.inflight) == [*ids[9:], q2[0].packet_id] and group.pending_offset == 9
    run(main())


@settings(max_examples=200, deadline=None)
@given(msgs=st.lists(st.tuples(st.sampled_from(["a", "a/b", "é/x"]), st.binary(max_size=300)), min_size=1,
                     max_size=30),
       pid=st.integers(1, 0xFFFF))
def test_publish_run_matches_publish_bytes(msgs: list[tuple[str, bytes]], pid: int) -> None:
    """publish_run (the fanout run path's encoder) gives the bytes of one publish_bytes (MQTT 5:
    publish_bytes5, empty property section 3.3.2.3.1) per message: QoS 1, DUP 0, RETAIN 0,
    consecutive packet ids (MQTT 3.3.1, 3.3.2.2)."""
    from filemq.mqtt.codec import publish_bytes, publish_bytes5
    from filemq.mqtt.runcodec import publish_prefixes, publish_run, publish_run_prefixed

    msgs = msgs[:0x10000 - pid]
    expected = b"".join(publish_bytes(t, p, 1, False, pid + i) for i, (t, p) in enumerate(msgs))
    assert publish_run([t for t, _ in msgs], [p for _, p in msgs], pid) == expected
    # The same from the prefixes the tail cache keeps per record (made once for all subscribers).
    prefixes = publish_prefixes([t for t, _ in msgs], [p for _, p in msgs])
    assert publish_run_prefixed(prefixes, [p for _, p in msgs], pid) == expected
    expected5 = b"".join(publish_bytes5(t, p, 1, False, pid + i) for i, (t, p) in enumerate(msgs))
    assert publish_run([t for t, _ in msgs], [p for _, p in msgs], pid, v5=True) == expected5


_run_ops = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.lists(st.tuples(st.sampled_from(["a/1", "a/2", "b/1", "c/1"]),
                                                         st.integers(0, 2), st.booleans()),
                                               min_size=1, max_size=12)),
        st.tuples(st.just("ack"), st.integers(0, 12), st.booleans()),
        st.tuples(st.just("subscribe"), st.sampled_from(["b/#", "c/1", "#"]), st.integers(0, 2)),
        st.just(("reconnect",)),
    ),
    max_size=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_run_ops, first_pid=st.sampled_from([1, 500, 0xFFF8, 0xFFFF]))
def test_deliver_run_sends_what_the_record_loop_sends(tmp_path: Path, ops: list[tuple[Any, ...]],
                                                      first_pid: int) -> None:
    """_deliver's run path (C loops over a run of QoS 1 records) and its per-record loop give
    the subscriber the same packets (QoS min(granted, published) 3.8.4 / MQTT-3.8.4-6, DUP on
    redelivery MQTT-3.3.1-1, packet ids unused among those in flight MQTT-2.3.1-2, the ACL's
    read rules) and leave the same messages in flight, under publishes, reads of PUBACKs
    (with duplicate ids), subscriptions added mid-way and reconnects; ids wrap past 0xFFFF."""
    import tempfile

    loop_result, _ = deliveries(ops, first_pid, Path(tempfile.mkdtemp(dir=tmp_path)), run_path=False)
    run_result, _ = deliveries(ops, first_pid, Path(tempfile.mkdtemp(dir=tmp_path)), run_path=True)
    assert run_result == loop_result


def test_deliver_run_takes_a_fanout_batch(tmp_path: Path) -> None:
    """The fanout case (QoS 1 records to a QoS 1 subscription, new to the group) goes the run
    path, and its PUBACKs in one read empty the in-flight map."""
    ops: list[tuple[Any, ...]] = [("publish", [("a/1", 1, False), ("a/2", 1, False)] * 5), ("ack", 10, False)]
    (got, inflight, next_pid), calls = deliveries(ops, 0xFFF6, tmp_path, run_path=True)
    assert calls == 1
    assert [(m.packet_id, m.qos, m.dup, m.payload) for m in got if isinstance(m, Publish)] == [
        (0xFFF6 + i, 1, False, b"%d" % (i + 1)) for i in range(10)]
    assert inflight == {} and next_pid == 1  # the last id was 0xFFFF
