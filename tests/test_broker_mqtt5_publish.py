"""MQTT 5 PUBLISH and SUBSCRIBE in the broker (issue 13 items 3, 4, 6): message properties
through the log, message expiry, payload format, response topic, subscription options and
identifiers, SUBACK reason codes, reason codes for refused PUBLISHes, the client's maximum
packet size.  Packet level, through the sans-I/O connection and core (the harness of
tests/broker_harness.py, with a fake queue that keeps headers and can refuse appends)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from filemq.broker.acl import Acl
from filemq.broker.session_state import message_expiry
from filemq.broker.session_store import StoredSession, StoredSubscription
from filemq.mqtt.packets import (
    Disconnect,
    Properties,
    Puback,
    Publish,
    Pubrec,
    Suback,
    Subscribe,
    subscription_options,
)
from filemq.mqtt.properties import encode_message_headers
from segments.fileio import DiskFull
from segments.record import Record
from tests.broker_harness import run
from tests.broker_harness5 import Harness5, append_old_record, client5, publishes

USER = [("b", "2"), ("a", "1"), ("b", "0")]


# ---- 1. message properties through the log ---------------------------------------------------


def test_message_properties_are_stored_and_delivered_to_mqtt5_subscribers_only(tmp_path: Path) -> None:
    """3.3.2.3 / MQTT-3.3.2-4 (payload format passed on), MQTT-3.3.2-15/-16 (response topic,
    correlation data), MQTT-3.3.2-17/-18 (user properties, order kept); 3.1.1 subscribers get
    the message without them; the topic alias (MQTT-3.3.2-... not forwarded) is never stored."""
    async def main() -> None:
        h = Harness5(tmp_path)
        s5 = h.sub5("s5", ("t", subscription_options(1)))
        s4 = h.connected("s4", subscribe=Subscribe(1, [("t", 1)]))
        p = client5(h)
        p.connect("p")
        props = Properties(payload_format_indicator=1, content_type="text/plain", response_topic="r/1",
                           correlation_data=b"\x00id", user_properties=list(USER))
        p.send(Publish("t", "é".encode(), 1, packet_id=3, properties=props))
        await h.commit()
        assert p.received() == [Puback(3)]
        assert h.queue.log.records[0].headers == encode_message_headers(props)
        (m5,) = publishes(s5)
        assert m5.properties == props
        (m4,) = publishes(s4)
        assert m4.payload == "é".encode() and m4.properties is None
    run(main())


def test_properties_reach_a_queued_backlog_after_reconnect(tmp_path: Path) -> None:
    """4.1 / 3.3.2.3.7: a persistent MQTT 5 session's queued messages keep their properties."""
    async def main() -> None:
        h = Harness5(tmp_path)
        s = h.sub5("s", ("q", subscription_options(1)), clean=False,
                   properties=Properties(session_expiry_interval=300))
        s.send(Disconnect())
        p = client5(h)
        p.connect("p")
        p.send(Publish("q", b"x", 1, packet_id=1, properties=Properties(user_properties=list(USER))))
        await h.commit()
        s = client5(h)
        ack = s.connect("s", False, properties=Properties(session_expiry_interval=300))
        assert ack.session_present
        got = publishes(s)
        assert len(got) == 1 and got[0].properties is not None
        assert got[0].properties.user_properties == USER
    run(main())


def test_unacknowledged_delivery_is_resent_with_its_properties_after_reconnect(tmp_path: Path) -> None:
    """4.4 / MQTT-4.4.0-1: a QoS 1 delivery not acknowledged is re-sent (DUP) on reconnect with
    the properties it was first sent with (user properties, subscription identifier)."""
    async def main() -> None:
        h = Harness5(tmp_path)
        s = h.sub5("s", ("u", subscription_options(1)), clean=False,
                   props=Properties(subscription_identifiers=[5]),
                   properties=Properties(session_expiry_interval=300))
        p = client5(h)
        p.connect("p")
        p.send(Publish("u", b"m", 1, packet_id=1, properties=Properties(user_properties=list(USER))))
        await h.commit()
        (first,) = publishes(s)
        s.conn.connection_lost()
        s = client5(h)
        assert s.connect("s", False, properties=Properties(session_expiry_interval=300)).session_present
        (again,) = publishes(s)
        assert again.dup and again.packet_id == first.packet_id
        assert again.properties == first.properties
        assert again.properties is not None and again.properties.user_properties == USER
        assert again.properties.subscription_identifiers == [5]
    run(main())


def test_retained_message_keeps_its_properties(tmp_path: Path) -> None:
    """3.3.1.3: a retained message is sent to a new subscription with its properties."""
    async def main() -> None:
        h = Harness5(tmp_path)
        p = client5(h)
        p.connect("p")
        p.send(Publish("r", b"v", 1, retain=True, packet_id=1,
                       properties=Properties(content_type="a/b", user_properties=[("k", "v")])))
        await h.commit()
        s = h.sub5("s", ("r", subscription_options(1)))
        (m,) = publishes(s)
        assert m.retain and m.properties is not None and m.properties.content_type == "a/b"
        assert m.properties.user_properties == [("k", "v")]
    run(main())


# ---- 2. message expiry -----------------------------------------------------------------------


def test_message_expiry_rewrite_counts_whole_seconds() -> None:
    """3.3.2.3.3 / MQTT-3.3.2-6: the interval sent is the received one minus the whole seconds
    the message waited; None once it has passed (MQTT-3.3.2-5); headers without 0x02 untouched."""
    h = encode_message_headers(Properties(payload_format_indicator=1, message_expiry_interval=10,
                                          user_properties=[("k", "v")]))
    t0 = 1_000_000_000
    assert message_expiry(h, t0, t0 + 999_999) == h
    got = message_expiry(h, t0, t0 + 3_500_000)
    assert got == encode_message_headers(Properties(payload_format_indicator=1, message_expiry_interval=7,
                                                    user_properties=[("k", "v")]))
    assert message_expiry(h, t0, t0 + 10_000_000) is None
    plain = encode_message_headers(Properties(message_expiry_interval=4))
    assert message_expiry(plain, t0, t0 + 1_000_000) == encode_message_headers(
        Properties(message_expiry_interval=3))
    other = encode_message_headers(Properties(content_type="\x02"))
    assert message_expiry(other, t0, t0 + 100_000_000) == other


def test_expired_message_is_not_delivered_and_a_live_one_carries_the_remaining_interval(tmp_path: Path) -> None:
    """MQTT-3.3.2-5: an expired message is not delivered (MQTT 5 and 3.1.1 subscribers);
    MQTT-3.3.2-6: one delivered carries the interval minus its waiting time."""
    async def main() -> None:
        h = Harness5(tmp_path)
        s5 = h.sub5("s5", ("e/#", subscription_options(1)))
        s4 = h.connected("s4", subscribe=Subscribe(1, [("e/#", 1)]))
        append_old_record(h, "e/old", b"gone", 1, 5.2, 5)
        append_old_record(h, "e/young", b"kept", 1, 2.5, 60)
        await h.commit()
        (m5,) = publishes(s5)
        assert m5.payload == b"kept" and m5.properties is not None
        assert m5.properties.message_expiry_interval == 58
        assert [m.payload for m in publishes(s4)] == [b"kept"]
    run(main())


def test_expired_backlog_is_skipped_after_reconnect(tmp_path: Path) -> None:
    """MQTT-3.3.2-5: a queued message that expired while the session was offline is not sent."""
    async def main() -> None:
        h = Harness5(tmp_path)
        s = h.sub5("s", ("b", subscription_options(1)), clean=False,
                   properties=Properties(session_expiry_interval=300))
        s.send(Disconnect())
        append_old_record(h, "b", b"expired", 1, 3.0, 2)
        append_old_record(h, "b", b"fresh", 1, 0, 100)
        await h.commit()
        s = client5(h)
        s.connect("s", False, properties=Properties(session_expiry_interval=300))
        got = publishes(s)
        assert [m.payload for m in got] == [b"fresh"]
    run(main())


def test_expired_retained_message_is_not_sent(tmp_path: Path) -> None:
    """3.3.2.3.3: a retained message whose expiry passed is not sent to a new subscription."""
    async def main() -> None:
        h = Harness5(tmp_path)
        append_old_record(h, "ret/a", b"old", 0, 3.0, 2, retain=True)
        append_old_record(h, "ret/b", b"new", 0, 0, 50, retain=True)
        await h.commit()
        s = h.sub5("s", ("ret/#", subscription_options(0)))
        got = publishes(s)
        assert [m.payload for m in got] == [b"new"]
        assert got[0].properties is not None and got[0].properties.message_expiry_interval in (49, 50)
        s4 = h.connected("s4")
        s4.send(Subscribe(2, [("ret/#", 0)]))
        assert [m.payload for m in s4.received() if isinstance(m, Publish)] == [b"new"]
    run(main())


# ---- 3. payload format, response topic -------------------------------------------------------


def test_invalid_utf8_with_payload_format_1_gets_0x99(tmp_path: Path) -> None:
    """3.3.2.3.2 / MQTT-3.3.2-... : payload format indicator 1 and a payload that is not UTF-8:
    PUBACK/PUBREC 0x99 (QoS 1/2), not stored, the connection stays; QoS 0: DISCONNECT 0x99."""
    async def main() -> None:
        h = Harness5(tmp_path)
        p = client5(h)
        p.connect("p")
        bad = Properties(payload_format_indicator=1)
        p.send(Publish("t", b"\xff\xfe", 1, packet_id=1, properties=bad),
               Publish("t", b"\xc3", 2, packet_id=2, properties=bad))
        await h.commit()
        assert p.received() == [Puback(1, 0x99), Pubrec(2, 0x99)]
        assert h.queue.log.records == [] and not p.conn.closed
        p.send(Publish("t", b"\xff", 0, properties=bad))
        assert p.received() == [Disconnect(0x99)] and p.conn.closed
    run(main())


def test_response_topic_with_wildcard_is_a_protocol_error(tmp_path: Path) -> None:
    """MQTT-3.3.2-14: the response topic is a topic name (no wildcards): DISCONNECT 0x82."""
    async def main() -> None:
        h = Harness5(tmp_path)
        p = client5(h)
        p.connect("p")
        p.send(Publish("t", b"x", 1, packet_id=1, properties=Properties(response_topic="r/#")))
        assert p.received() == [Disconnect(0x82)] and p.conn.closed
        assert h.queue.log.records == []
    run(main())


# ---- 6. durability through reason codes ------------------------------------------------------


def test_full_disk_at_append_gets_0x97_and_the_connection_stays(tmp_path: Path) -> None:
    """Issue 13 item 6 / 3.4.2.1: the log refuses the append (below min_free_bytes): PUBACK or
    PUBREC 0x97 (quota exceeded), another I/O error 0x80; never success; still connected."""
    async def main() -> None:
        h = Harness5(tmp_path)
        p = client5(h)
        p.connect("p")
        h.queue.refuse_next = DiskFull("/data", "free space below min_free_bytes")
        p.send(Publish("t", b"1", 1, packet_id=1))
        h.queue.refuse_next = DiskFull("/data", "free space below min_free_bytes")
        p.send(Publish("t", b"2", 2, packet_id=2))
        h.queue.refuse_next = OSError(5, "I/O error")
        p.send(Publish("t", b"3", 1, packet_id=3))
        p.send(Publish("t", b"4", 1, packet_id=4))
        await h.commit()
        assert p.received() == [Puback(1, 0x97), Pubrec(2, 0x97), Puback(3, 0x80), Puback(4)]
        assert not p.conn.closed and [r.payload for r in h.queue.log.records] == [b"4"]
    run(main())


def _qos1(*pids: int) -> list[Publish]:
    return [Publish("t/run", f"m{pid}".encode(), 1, packet_id=pid) for pid in pids]


def test_a_read_of_qos1_publishes_without_properties_is_one_run(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """MQTT 5 takes 3.1.1's run path (issue 16): a read of QoS 1 PUBLISHes without
    properties is stored with one call, never one on_publish each, acknowledged in order
    after its commit with 4-byte PUBACKs (3.4.2.1: reason code 0 may be omitted), and each
    offset's publisher is noted for no local (MQTT-3.8.3-3): a no-local subscriber with
    the same client id gets none of its own messages."""
    async def main() -> None:
        h = Harness5(tmp_path)
        me = h.sub5("me", ("t/#", subscription_options(1, no_local=True)))
        other = h.sub5("other", ("t/#", 1))
        calls: list[object] = []
        real = h.core.ingest.on_publish
        # (append's None is discarded: the spy records the PUBLISH, then passes it on)
        monkeypatch.setattr(h.core.ingest, "on_publish", lambda conn, p: (calls.append(p), real(conn, p)))  # type: ignore[func-returns-value]
        monkeypatch.setattr(h.core, "on_publish", h.core.ingest.on_publish)  # (the connection's calls too)
        me.send(*_qos1(1, 2, 3, 4, 5))
        await h.commit()
        assert calls == []
        assert me.received() == [Puback(pid) for pid in (1, 2, 3, 4, 5)]
        assert [r.payload for r in h.queue.log.records] == [b"m1", b"m2", b"m3", b"m4", b"m5"]
        assert [m.payload for m in other.received() if isinstance(m, Publish)] == [b"m1", b"m2", b"m3", b"m4", b"m5"]
        assert not [m for m in me.received() if isinstance(m, Publish)]
    run(main())


def test_a_run_over_the_receive_maximum_gets_0x93_at_the_publish_over_it_mqtt_3_3_4_7(tmp_path: Path) -> None:
    """MQTT-3.3.4-7 with runs: a read of 5 QoS 1 PUBLISHes against Receive Maximum 3 is taken
    one by one: 3 stored, the 4th gets DISCONNECT 0x93. A run's PUBACKs waiting as one entry
    still count one each: 3 in a run, then a read of 2 against 4: 0x93 at the 5th."""
    async def main() -> None:
        h = Harness5(tmp_path, receive_maximum=3)
        c = client5(h)
        c.connect("p")
        c.send(*_qos1(1, 2, 3, 4, 5))
        assert c.received() == [Disconnect(0x93)] and c.conn.closed
        assert [r.payload for r in h.queue.log.records] == [b"m1", b"m2", b"m3"]
        (tmp_path / "2").mkdir()
        h2 = Harness5(tmp_path / "2", receive_maximum=4)
        d = client5(h2)
        d.connect("p")
        d.send(*_qos1(1, 2, 3))
        assert not d.conn.closed and d.received() == []
        d.send(*_qos1(4, 5))
        assert d.received() == [Disconnect(0x93)] and d.conn.closed
        assert [r.payload for r in h2.queue.log.records] == [b"m1", b"m2", b"m3", b"m4"]
    run(main())


def test_a_run_refused_midway_acks_the_stored_and_gives_the_rest_0x97(tmp_path: Path) -> None:
    """Issue 13 item 6 with runs: the log refuses the 3rd of a run of 5 (below
    min_free_bytes): PUBACK for the 2 stored once committed, 0x97 for the 3 others, in order,
    and the connection stays; a failed commit of a run gives each of its PUBLISHes 0x97."""
    async def main() -> None:
        h = Harness5(tmp_path)
        p = client5(h)
        p.connect("p")
        real = h.queue.publish_nowait
        count = {"n": 0}

        def third_refused(*a: Any, **kw: Any) -> Any:
            count["n"] += 1
            if count["n"] == 3:
                raise DiskFull("/data", "free space below min_free_bytes")
            return real(*a, **kw)

        h.queue.publish_nowait = third_refused  # type: ignore[method-assign]
        p.send(*_qos1(1, 2, 3, 4, 5))
        await h.commit()
        assert p.received() == [Puback(1), Puback(2), Puback(3, 0x97), Puback(4, 0x97), Puback(5, 0x97)]
        assert not p.conn.closed and [r.payload for r in h.queue.log.records] == [b"m1", b"m2"]
        h.queue.publish_nowait = real  # type: ignore[method-assign]
        p.send(*_qos1(6, 7, 8))
        h.queue.fail_next = True
        await h.commit()
        assert p.received() == [Puback(6, 0x97), Puback(7, 0x97), Puback(8, 0x97)]
        assert not p.conn.closed
    run(main())


def test_failed_commit_gets_a_reason_code_not_a_close(tmp_path: Path) -> None:
    """Item 6: a group commit that fails (ENOSPC at flush): each PUBLISH of that batch gets
    0x97 (0x80 for other errors) in order; later batches are acknowledged as usual."""
    async def main() -> None:
        h = Harness5(tmp_path)
        p = client5(h)
        p.connect("p")
        p.send(Publish("t", b"1", 1, packet_id=1), Publish("t", b"2", 2, packet_id=2))
        h.queue.fail_next = True
        await h.commit()
        assert p.received() == [Puback(1, 0x97), Pubrec(2, 0x97)]
        assert not p.conn.closed
        p.send(Publish("t", b"again", 2, packet_id=2))
        await h.commit()
        assert p.received() == [Pubrec(2)]
        assert [r.payload for r in h.queue.log.records] == [b"again"]
    run(main())


def test_failed_commit_still_closes_a_311_publisher(tmp_path: Path) -> None:
    """3.1.1 keeps today's behaviour: no negative ack exists, the connection is closed."""
    async def main() -> None:
        h = Harness5(tmp_path)
        p = h.connected("p4")
        p.send(Publish("t", b"1", 1, packet_id=1))
        h.queue.fail_next = True
        await h.commit()
        assert p.received() == [] and p.conn.closed
    run(main())


def test_acl_deny_and_dollar_topic_get_0x87(tmp_path: Path) -> None:
    """3.4.2.1: not authorized (0x87) for an ACL deny -- whatever acl_denied_publish says -- and
    for a PUBLISH to a $-topic; nothing stored; the connection stays."""
    async def main() -> None:
        for mode in ("ack", "disconnect"):
            (tmp_path / mode).mkdir()
            h = Harness5(tmp_path / mode, acl_denied_publish=mode)
            h.core.acl = _deny_topic("secret")
            p = client5(h)
            p.connect("p")
            p.send(Publish("secret", b"x", 1, packet_id=1), Publish("$SYS/x", b"y", 2, packet_id=2))
            await h.commit()
            assert p.received() == [Puback(1, 0x87), Pubrec(2, 0x87)]
            assert not p.conn.closed and h.queue.log.records == []
    run(main())


def _deny_topic(topic: str) -> Acl:
    """Anonymous clients may do anything but touch ``topic``."""
    return Acl.parse(f"topic readwrite #\ntopic deny {topic}\n")


def test_payload_over_message_size_limit_gets_0x97_or_disconnect_0x95(tmp_path: Path) -> None:
    """Item 6: a payload over message_size_limit is refused, never acknowledged as success:
    QoS 1/2 PUBACK/PUBREC 0x97 (0x95 is not a PUBACK reason code, 3.4.2.1; paho-mqtt rejects
    it), the connection stays; QoS 0: DISCONNECT 0x95 (packet too large, 3.14.2.1)."""
    async def main() -> None:
        h = Harness5(tmp_path, message_size_limit=4)
        p = client5(h)
        p.connect("p")
        p.send(Publish("t", b"12345", 1, packet_id=1), Publish("t", b"12345", 2, packet_id=2))
        assert p.received() == [Puback(1, 0x97), Pubrec(2, 0x97)]
        p.send(Publish("t", b"12345", 0))
        assert p.received() == [Disconnect(0x95)] and p.conn.closed
        assert h.queue.log.records == []
    run(main())


# ---- 4. SUBSCRIBE options ---------------------------------------------------------------------


def test_no_local_skips_the_publishers_own_messages(tmp_path: Path) -> None:
    """MQTT-3.8.3-3: with no local the server does not forward a client's own messages to it."""
    async def main() -> None:
        h = Harness5(tmp_path)
        me = h.sub5("me", ("n", subscription_options(1, no_local=True)))
        other = h.sub5("other", ("n", subscription_options(1)))
        me.send(Publish("n", b"mine", 1, packet_id=1))
        await h.commit()
        assert [m for m in me.received() if isinstance(m, Publish)] == []
        assert [m.payload for m in publishes(other)] == [b"mine"]
        other.send(Publish("n", b"theirs", 0))
        await h.commit()
        assert [m.payload for m in publishes(me)] == [b"theirs"]
    run(main())


def test_retain_as_published(tmp_path: Path) -> None:
    """MQTT-3.3.1-12: without retain as published the forwarded RETAIN flag is 0;
    MQTT-3.3.1-13: with it, the flag is the one the message was published with."""
    async def main() -> None:
        h = Harness5(tmp_path)
        keep = h.sub5("keep", ("ra", subscription_options(0, retain_as_published=True)))
        clear = h.sub5("clear", ("ra", subscription_options(0)))
        p = client5(h)
        p.connect("p")
        p.send(Publish("ra", b"x", 0, retain=True))
        await h.commit()
        assert [m.retain for m in publishes(keep)] == [True]
        assert [m.retain for m in publishes(clear)] == [False]
    run(main())


def test_retain_handling(tmp_path: Path) -> None:
    """MQTT-3.3.1-9: 0 sends retained messages at subscribe; MQTT-3.3.1-10: 1 only if the
    subscription did not exist; MQTT-3.3.1-11: 2 never."""
    async def main() -> None:
        h = Harness5(tmp_path)
        p = client5(h)
        p.connect("p")
        p.send(Publish("rh", b"r", 0, retain=True))
        await h.commit()
        c = client5(h)
        c.connect("c")
        for rh, expect in ((1, 1), (1, 0), (0, 1), (2, 0)):
            c.send(Subscribe(1, [("rh", subscription_options(0, retain_handling=rh))]))
            got = c.received()
            assert isinstance(got[0], Suback)
            assert len([m for m in got if isinstance(m, Publish)]) == expect, rh
    run(main())


def test_subscription_identifiers_on_deliveries(tmp_path: Path) -> None:
    """3.8.2.1.2 / 3.3.4, MQTT-3.3.4-3: every matching subscription's identifier on the one
    copy; a retained message at SUBSCRIBE carries that subscription's; CONNACK says available."""
    async def main() -> None:
        h = Harness5(tmp_path)
        s = client5(h)
        ack = s.connect("s")
        assert ack.properties is not None and ack.properties.subscription_identifier_available is None
        p = client5(h)
        p.connect("p")
        p.send(Publish("a/b", b"r", 0, retain=True))
        await h.commit()
        s.send(Subscribe(1, [("a/+", subscription_options(1))], Properties(subscription_identifiers=[7])))
        got = s.received()
        assert got[0] == Suback(1, [1])
        (ret,) = [m for m in got if isinstance(m, Publish)]
        assert ret.properties is not None and ret.properties.subscription_identifiers == [7]
        s.send(Subscribe(2, [("a/#", subscription_options(1))], Properties(subscription_identifiers=[300])))
        s.received()
        s.send(Subscribe(3, [("#", subscription_options(0))]))
        s.received()
        p.send(Publish("a/b", b"live", 1, packet_id=1))
        await h.commit()
        (m,) = publishes(s)
        assert m.qos == 1 and m.properties is not None
        assert sorted(m.properties.subscription_identifiers) == [7, 300]
    run(main())


def test_subscription_options_and_identifier_survive_in_the_session_file(tmp_path: Path) -> None:
    """The session file keeps options and identifier (a file without them loads with 0)."""
    stored = StoredSession("c", {"x": StoredSubscription(1, 5, 0x0C, 42), "y": StoredSubscription(0, 2)})
    data = stored.to_json()
    assert b'"y":{"qos":0,"start":2}' in data
    back = StoredSession.from_json(data, "p")
    assert back.subscriptions == stored.subscriptions

    async def main() -> None:
        h = Harness5(tmp_path)
        s = h.sub5("s", ("o", subscription_options(1, no_local=True)), clean=False,
                   props=Properties(subscription_identifiers=[9]),
                   properties=Properties(session_expiry_interval=600))
        s.send(Disconnect())
        h.core = h.make_core()  # a restart: sessions come from the files
        s = client5(h)
        assert s.connect("s", False, properties=Properties(session_expiry_interval=600)).session_present
        s.send(Publish("o", b"own", 0))
        p = client5(h)
        p.connect("p")
        p.send(Publish("o", b"other", 0))
        await h.commit()
        got = publishes(s)
        assert [m.payload for m in got] == [b"other"]
        assert got[0].properties is not None and got[0].properties.subscription_identifiers == [9]
    run(main())


def test_shared_subscription_gets_no_retained_messages_but_its_identifier(tmp_path: Path) -> None:
    """4.8.2: retained messages are not sent when a session subscribes to a shared subscription
    (3.3.1.3 / 4.8.2); deliveries through it carry its subscription identifier (3.3.4)."""
    async def main() -> None:
        h = Harness5(tmp_path)
        p = client5(h)
        p.connect("p")
        p.send(Publish("sh", b"old", 0, retain=True))
        await h.commit()
        s = client5(h)
        s.connect("s")
        s.send(Subscribe(1, [("$share/g/sh", subscription_options(1))], Properties(subscription_identifiers=[3])))
        assert s.received() == [Suback(1, [1])]
        p.send(Publish("sh", b"new", 1, packet_id=1))
        await h.commit()
        (m,) = publishes(s)
        assert m.payload == b"new" and not m.retain
        assert m.properties is not None and m.properties.subscription_identifiers == [3]
    run(main())


# ---- 5. SUBACK reason codes ---------------------------------------------------------------------


def test_suback_reason_codes_per_filter(tmp_path: Path) -> None:
    """3.9.3: granted QoS, 0x87 ACL deny, 0x8F invalid filter; 3.1.1 keeps 0x80."""
    async def main() -> None:
        h = Harness5(tmp_path)
        h.core.acl = _deny_topic("secret")
        c = client5(h)
        c.connect("c")
        c.send(Subscribe(1, [("ok", 2), ("secret", 1), ("a/#/b", 0)]))
        assert c.received() == [Suback(1, [2, 0x87, 0x8F])]
        c4 = h.connected("c4")
        c4.send(Subscribe(1, [("ok", 2), ("secret", 1), ("a/#/b", 0)]))
        assert c4.received() == [Suback(1, [2, 0x80, 0x80])]
    run(main())


# ---- 7. the client's maximum packet size -------------------------------------------------------


def test_publish_larger_than_client_maximum_packet_size_is_not_sent(tmp_path: Path) -> None:
    """MQTT-3.1.2-24/-25: a PUBLISH larger than the client's Maximum Packet Size is not sent; it
    is discarded as if delivered (its group moves on) and the next one is sent."""
    async def main() -> None:
        h = Harness5(tmp_path)
        s = h.sub5("s", ("m", subscription_options(1)), properties=Properties(maximum_packet_size=64))
        p = client5(h)
        p.connect("p")
        p.send(Publish("m", b"x" * 100, 1, packet_id=1), Publish("m", b"small", 1, packet_id=2))
        await h.commit()
        got = publishes(s)
        assert [m.payload for m in got] == [b"small"]
        assert s.conn.session is not None
        assert len(s.conn.session.qos.inflight) == 1
        assert h.core.delivery.dropped_too_large == 1
    run(main())


def test_sys_messages_larger_than_client_maximum_packet_size_are_not_sent_3_1_2_25(tmp_path: Path) -> None:
    """MQTT-3.1.2-25 holds for the broker's own $SYS messages too (not stored, but sent by
    the same planner, Delivery.deliver_sys): live and kept ones over the client's Maximum
    Packet Size are not sent and counted as any over-sized delivery; the ones that fit arrive."""
    async def main() -> None:
        h = Harness5(tmp_path)
        s = h.sub5("s", ("$SYS/#", subscription_options(0)), properties=Properties(maximum_packet_size=40))
        h.core.publish_sys([("$SYS/broker/uptime", b"5 seconds"), ("$SYS/broker/version", b"v" * 64)])
        assert [(m.topic, m.payload) for m in publishes(s)] == [("$SYS/broker/uptime", b"5 seconds")]
        assert h.core.delivery.dropped_too_large == 1
        late = h.sub5("late", ("$SYS/#", subscription_options(0)), properties=Properties(maximum_packet_size=40))
        assert [(m.topic, m.retain) for m in publishes(late)] == [("$SYS/broker/uptime", True)]
        assert h.core.delivery.dropped_too_large == 2
    run(main())


def test_sys_messages_carry_the_subscription_identifiers_mqtt_3_3_4_3(tmp_path: Path) -> None:
    """MQTT-3.3.4-3: a $SYS message, live or kept for a new subscription, carries the
    identifiers of the subscriptions it is sent for, as any delivery (the planner's): live,
    one copy with both overlapping subscriptions' identifiers (MQTT-3.3.4-5 lets the server
    send one); kept, the new subscription's own, RETAIN 1; a subscription without one gets
    none; topic aliases as any delivery."""
    from filemq.broker.delivery import SYS_OFFSET

    async def main() -> None:
        h = Harness5(tmp_path)
        s = h.sub5("s", ("$SYS/broker/#", subscription_options(0)), props=Properties(subscription_identifiers=[3]))
        s.send(Subscribe(2, [("$SYS/#", subscription_options(0))], Properties(subscription_identifiers=[9])))
        publishes(s)
        h.core.publish_sys([("$SYS/broker/uptime", b"5 seconds")])
        (m,) = publishes(s)
        assert (m.topic, m.retain, m.qos) == ("$SYS/broker/uptime", False, 0)
        assert m.properties is not None and sorted(m.properties.subscription_identifiers) == [3, 9]
        late = h.sub5("late", ("$SYS/#", subscription_options(0)), props=Properties(subscription_identifiers=[4]))
        (k,) = publishes(late)
        assert (k.topic, k.payload, k.retain) == ("$SYS/broker/uptime", b"5 seconds", True)
        assert k.properties is not None and k.properties.subscription_identifiers == [4]
        plain = h.sub5("plain", ("$SYS/#", subscription_options(0)))
        (n,) = publishes(plain)
        assert n.properties is None or not n.properties.subscription_identifiers
        a = client5(h)
        a.connect("a", properties=Properties(topic_alias_maximum=2))
        a.send(Subscribe(1, [("$SYS/#", subscription_options(0))]))
        got = publishes(a)  # the kept one assigns the alias, the live ones use it
        h.core.publish_sys([("$SYS/broker/uptime", b"6 seconds")])
        got += publishes(a)
        assert [(g.topic, g.payload, g.properties.topic_alias if g.properties else None) for g in got] == [
            ("$SYS/broker/uptime", b"5 seconds", 1), ("", b"6 seconds", 1)]
        assert h.core.log.next_offset < SYS_OFFSET  # (past every subscription's start)
    run(main())


def test_record_headers_are_opaque_to_311_only_stores(tmp_path: Path) -> None:
    """A record without headers (every 3.1.1 message) is stored as before (headers b'')."""
    async def main() -> None:
        h = Harness5(tmp_path)
        p = h.connected("p4")
        p.send(Publish("t", b"x", 1, packet_id=1))
        await h.commit()
        assert h.queue.log.records == [Record(0, h.queue.log.records[0].timestamp_us, "t", b"x", 1, False)]
        assert p.received() == [Puback(1)]
    run(main())


# ---- with paho-mqtt 2.x (an independent MQTT 5 client) against a real broker ------------------

paho = pytest.importorskip("paho.mqtt.client", reason="paho-mqtt is not installed")
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.subscribeoptions import SubscribeOptions  # noqa: E402

from tests.broker_process import start_threaded_broker  # noqa: E402
from tests.paho5 import Paho5, paho_props  # noqa: E402


def test_paho_user_properties_subscription_ids_no_local_and_retain_options(tmp_path: Path) -> None:
    """paho-mqtt 2.x end to end: user properties in order, content type, response topic and
    correlation data (3.3.2.3); subscription identifiers (3.3.4); no local (MQTT-3.8.3-3);
    retain handling 2 (MQTT-3.3.1-11) and retain as published (MQTT-3.3.1-13)."""
    b = start_threaded_broker(tmp_path)
    try:
        pub = Paho5(b.port, "pub")
        pub.publish("p/ret", b"retained", 1, retain=True)
        sub = Paho5(b.port, "sub")
        assert sub.subscribe("p/#", SubscribeOptions(qos=1, noLocal=True, retainAsPublished=True,
                                                    retainHandling=2), identifier=11) == [1]
        assert sub.subscribe("p/+", SubscribeOptions(qos=0), identifier=12) == [0]
        r = sub.get()  # retain handling 0 on the second one: its retained message
        assert r.topic == "p/ret" and r.retain and r.properties.SubscriptionIdentifier == [12]
        sub.publish("p/x", b"own")  # no local on p/#, but p/+ takes it
        m = sub.get()
        assert m.payload == b"own" and m.properties.SubscriptionIdentifier == [12]
        props = paho_props(PacketTypes.PUBLISH)
        props.UserProperty = [("z", "1"), ("a", "2"), ("z", "3")]
        props.ContentType = "text/plain"
        props.ResponseTopic = "reply/here"
        props.CorrelationData = b"\x01\x02"
        assert pub.publish("p/x", b"hello", 1, retain=True, props=props) == 0
        m = sub.get()
        assert m.payload == b"hello" and m.qos == 1 and m.retain  # retain as published (p/#)
        assert m.properties.UserProperty == [("z", "1"), ("a", "2"), ("z", "3")]
        assert m.properties.ContentType == "text/plain" and m.properties.ResponseTopic == "reply/here"
        assert m.properties.CorrelationData == b"\x01\x02"
        assert sorted(m.properties.SubscriptionIdentifier) == [11, 12]
        sub.close()
        pub.close()
    finally:
        b.stop()


def test_paho_message_expiry(tmp_path: Path) -> None:
    """3.3.2.3.3 with paho: a queued message whose interval passed while its session was
    offline is not delivered (MQTT-3.3.2-5); one still valid carries less than it was sent
    with (MQTT-3.3.2-6).  (The wait is the message's lifetime, not a synchronisation.)"""
    b = start_threaded_broker(tmp_path)
    try:
        sub = Paho5(b.port, "off", clean=False, expiry=600)
        assert sub.subscribe("x/#", SubscribeOptions(qos=1)) == [1]
        sub.close()
        pub = Paho5(b.port, "pub")
        short = paho_props(PacketTypes.PUBLISH)
        short.MessageExpiryInterval = 1
        long = paho_props(PacketTypes.PUBLISH)
        long.MessageExpiryInterval = 100
        assert pub.publish("x/short", b"s", 1, props=short) == 0
        assert pub.publish("x/long", b"l", 1, props=long) == 0
        time.sleep(2.1)
        sub = Paho5(b.port, "off", clean=False, expiry=600)
        m = sub.get()
        assert m.topic == "x/long" and 0 < m.properties.MessageExpiryInterval < 100
        assert sub.none_within(0.5)
        sub.close()
        pub.close()
    finally:
        b.stop()


def test_paho_full_disk_gets_puback_0x97_and_stays_connected(tmp_path: Path) -> None:
    """Issue 13 item 6 with paho: the file system is below log.min_free_bytes, so the log
    refuses every append: PUBACK 0x97 (quota exceeded), never success, connection kept."""
    b = start_threaded_broker(tmp_path, **{"log.min_free_bytes": 1 << 60})
    try:
        pub = Paho5(b.port, "pub")
        assert pub.publish("d/1", b"x", 1) == 0x97
        assert pub.publish("d/2", b"y", 1) == 0x97
        assert pub.c.is_connected()
        pub.close()
    finally:
        b.stop()


def test_no_local_forgets_the_publisher_of_an_offset_a_failed_commit_gave_back(tmp_path: Path) -> None:
    """MQTT-3.8.3-3 only for the client's own messages: after a failed commit the log reuses
    its offsets, and a message another (3.1.1) client then stores there reaches the no local
    subscriber."""
    async def main() -> None:
        h = Harness5(tmp_path)
        me = h.sub5("me", ("f", subscription_options(1, no_local=True)))
        me.send(Publish("f", b"lost", 1, packet_id=1))
        h.queue.fail_next = True
        await h.commit()
        assert me.received() == [Puback(1, 0x97)]
        other = h.connected("other4")
        other.send(Publish("f", b"theirs", 1, packet_id=1))
        await h.commit()
        assert [m.payload for m in publishes(me)] == [b"theirs"]
    run(main())


def test_paho_enospc_at_commit_gets_0x97_on_a_real_full_file_system(tmp_path: Path) -> None:
    """Item 6 on a real full file system (a small tmpfs, as tests/test_diskfull.py): with no
    free-space floor the group commit itself fails with ENOSPC; the paho publisher gets PUBACK
    0x97 for that message -- never 0x00 -- stays connected, and once space is freed the next
    PUBLISH is stored and acknowledged with success."""
    from tests.storage_faults import small_tmpfs

    with small_tmpfs(tmp_path / "fs", "4m") as fs:
        filler = fs / "filler"
        b = start_threaded_broker(fs, **{"log.min_free_bytes": 0})
        try:
            pub = Paho5(b.port, "pub")
            payload = b"p" * 32768
            codes = []
            for _ in range(400):  # bounded: the tmpfs holds far fewer
                codes.append(pub.publish("full/t", payload, 1))
                if codes[-1]:
                    break
                if not filler.exists():
                    # Take what is left but ~200 KB, so the log fills within a few messages.
                    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
                    filler.write_bytes(b"\0" * max(free - 200_000, 0))
            assert codes[-1] == 0x97 and set(codes[:-1]) <= {0}
            assert pub.c.is_connected()
            filler.unlink()
            assert pub.publish("full/t", b"after", 1) == 0
            pub.close()
        finally:
            b.stop()


_run_ops5 = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.lists(st.tuples(st.sampled_from(["a/1", "a/2", "b/1", "c/1"]),
                                                         st.integers(0, 2), st.booleans()),
                                               min_size=1, max_size=12)),
        st.tuples(st.just("ack"), st.integers(0, 12), st.booleans()),
        st.tuples(st.just("subscribe"), st.sampled_from(["b/#", "c/1", "#"]), st.integers(0, 2), st.booleans(),
                  st.sampled_from([0, 9])),
        st.just(("reconnect",)),
    ),
    max_size=12,
)


def _subscribe5(op: tuple[Any, ...]) -> Subscribe:
    return Subscribe(2, [(op[1], subscription_options(op[2], no_local=op[3]))],
                     Properties(subscription_identifiers=[op[4]]) if op[4] else None)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_run_ops5, first_pid=st.sampled_from([1, 0xFFF8]), max_packet=st.sampled_from([None, 16, 1000]),
       aliases=st.sampled_from([None, 4]))
def test_deliver_run_sends_what_the_planner_sends(tmp_path: Path, ops: list[tuple[Any, ...]], first_pid: int,
                                               max_packet: int | None, aliases: int | None) -> None:
    """MQTT 5: _deliver's run path gives the subscriber the packets the per-record planner gives (an empty
    property section; subscription identifiers 3.3.4 and no local MQTT-3.8.3-3 on, topic
    aliases 3.3.2.3.4 and the client's Maximum Packet Size MQTT-3.1.2-24 respected: then the
    per-record loop) and leaves the same messages in flight."""
    import tempfile

    from tests.broker_harness import deliveries

    props = Properties(maximum_packet_size=max_packet, topic_alias_maximum=aliases)
    results = [deliveries(ops, first_pid, Path(tempfile.mkdtemp(dir=tmp_path)), run_path, client5, _subscribe5,
                           protocol_level=5, properties=props)[0] for run_path in (False, True)]
    assert results[1] == results[0]


def test_deliver_run_takes_an_mqtt5_fanout_batch(tmp_path: Path) -> None:
    """An MQTT 5 subscriber without identifiers, no local or aliases gets a QoS 1 run through
    the run path, as the per-record planner would send it (MQTT 5 PUBLISH with an empty property section)."""
    from tests.broker_harness import deliveries

    ops: list[tuple[Any, ...]] = [("publish", [("a/1", 1, False), ("a/2", 1, False)] * 3), ("ack", 6, False)]
    (got, inflight, _), calls = deliveries(ops, 7, tmp_path, True, client5, protocol_level=5)
    assert calls == 1 and inflight == {}
    pubs = [m for m in got if isinstance(m, Publish)]
    assert [(m.packet_id, m.qos, m.payload, m.properties) for m in pubs] == [
        (7 + i, 1, b"%d" % (i + 1), None) for i in range(6)]
