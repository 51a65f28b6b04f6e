"""Outbound packet ids across a restart (issue 33 item 1; docs/DURABILITY.md, docs/BROKER.md).

A subscriber that PUBREC'd a QoS 2 PUBLISH holds its packet id until PUBREL (MQTT 4.3.3,
method B) and takes any PUBLISH with that id for a duplicate.  So after a kill -9 the broker
must re-send the unfinished QoS 2 delivery with the *same* id and DUP set (MQTT-4.4.0-1),
never give that id to a new message while the client may hold it (MQTT-2.2.1-3), and not
deliver the record a second time under another id.  Real process, real SIGKILL.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from filemq.broker.session_store import CorruptSession, StoredSession
from filemq.mqtt.packets import Connect, Puback, Pubcomp, Publish, Pubrec, Pubrel, Suback, Subscribe
from tests.broker_process import BlockingClient, start_broker_process

pytestmark = pytest.mark.timeout(60)


def _publishes(client: BlockingClient, n: int) -> list[Publish]:
    out: list[Publish] = []
    while len(out) < n:
        p = client.next()
        assert isinstance(p, Publish), p
        out.append(p)
    return out


def _quiet(client: BlockingClient, seconds: float = 0.5) -> list[object]:
    """What arrives within ``seconds`` (nothing expected)."""
    client.sock.settimeout(seconds)
    try:
        return [client.next()]
    except TimeoutError:
        return []
    finally:
        client.sock.settimeout(5)


def test_unfinished_qos2_delivery_keeps_its_id_across_kill9_and_the_id_is_not_reused(tmp_path: Path) -> None:
    """Three QoS 1 deliveries complete (ids 1-3), then a QoS 2 one goes out with id 4 and the
    subscriber's PUBREC is lost; SIGKILL.  After the restart the QoS 2 message comes again
    as the first PUBLISH, with id 4 and DUP (MQTT-4.4.0-1); while id 4 is unfinished, ten new
    messages never use it (MQTT-2.2.1-3); the QoS 2 message is never sent under another id.
    Before the fix the ids restarted at 1: the message came back as id 1 and the fourth new
    message took id 4, which a method-B subscriber drops as a duplicate."""
    proc, port = start_broker_process(tmp_path)
    try:
        sub = BlockingClient(port, Connect(client_id="sub", clean_session=False))
        sub.send(Subscribe(1, [("t/#", 2)]))
        assert sub.next() == Suback(1, [2])
        pub = BlockingClient(port, Connect(client_id="pub"))
        for i in range(3):
            pub.send(Publish("t/1", b"q1-%d" % i, 1, packet_id=i + 1))
            assert pub.next() == Puback(i + 1)
        for m in _publishes(sub, 3):
            assert m.packet_id is not None
            sub.send(Puback(m.packet_id))
        pub.send(Publish("t/2", b"exactly-once", 2, packet_id=9))
        assert pub.next() == Pubrec(9)
        pub.send(Pubrel(9))
        assert pub.next() == Pubcomp(9)
        (held,) = _publishes(sub, 1)
        assert held.qos == 2 and held.payload == b"exactly-once" and held.packet_id not in (None, 1)
        held_id = held.packet_id
        # The subscriber PUBRECs (method B: it now holds the id), but the broker dies first.
        proc.kill()
        proc.wait(timeout=10)
        sub.close()
        pub.close()

        proc, port = start_broker_process(tmp_path)
        sub = BlockingClient(port, Connect(client_id="sub", clean_session=False))
        again = sub.next()
        assert isinstance(again, Publish) and again.payload == b"exactly-once"
        assert again.packet_id == held_id and again.dup and again.qos == 2
        pub = BlockingClient(port, Connect(client_id="pub"))
        for i in range(10):
            pub.send(Publish("t/1", b"new-%d" % i, 1, packet_id=i + 1))
            assert pub.next() == Puback(i + 1)
        fresh = _publishes(sub, 10)
        assert [m.payload for m in fresh] == [b"new-%d" % i for i in range(10)]
        assert held_id not in {m.packet_id for m in fresh}, "a new message took the id the client holds"
        for m in fresh:
            assert m.packet_id is not None
            sub.send(Puback(m.packet_id))
        # The held flow completes under its own id.
        sub.send(Pubrec(held_id))
        assert sub.next() == Pubrel(held_id)
        sub.send(Pubcomp(held_id))
        assert not [p for p in _quiet(sub) if isinstance(p, Publish) and p.payload == b"exactly-once"]
        sub.close()
        pub.close()

        # Completed: after another kill -9 nothing of it comes back.
        proc.kill()
        proc.wait(timeout=10)
        proc, port = start_broker_process(tmp_path)
        sub = BlockingClient(port, Connect(client_id="sub", clean_session=False))
        left = _quiet(sub, 1.0)
        assert not [p for p in left if isinstance(p, Publish) and p.payload == b"exactly-once"]
        sub.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_qos2_sent_round_trips_and_bad_entries_are_refused() -> None:
    s = StoredSession("c", qos2_sent={4: 17, 65535: 0})
    back = StoredSession.from_json(s.to_json(), "f")
    assert back.qos2_sent == {4: 17, 65535: 0}
    assert b"qos2_sent" not in StoredSession("c").to_json()  # absent when empty (older files unchanged)
    assert StoredSession.from_json(StoredSession("c", qos2_sent={4: -1}).to_json(), "f").qos2_sent == {4: -1}
    for bad in (b'{"0": 1}', b'{"65536": 1}', b'{"4": -2}', b'{"4": true}', b'[4]'):
        body = s.to_json().replace(b'"qos2_sent":{"4":17,"65535":0}', b'"qos2_sent":' + bad)
        with pytest.raises(CorruptSession):
            StoredSession.from_json(body, "f")


def test_retained_qos2_delivery_id_is_released_after_kill9_not_reused(tmp_path: Path) -> None:
    """A retained QoS 2 message sent at SUBSCRIBE (not a group record: never re-sent) whose
    PUBREC is lost to a SIGKILL: after the restart the broker sends PUBREL for its id, so a
    client holding it (method B) frees it, and no new message gets the id before the PUBCOMP
    (MQTT-2.2.1-3).  Before, the first new delivery took the same id 1."""
    proc, port = start_broker_process(tmp_path)
    try:
        pub = BlockingClient(port, Connect(client_id="pub"))
        pub.send(Publish("r/1", b"retained", 2, retain=True, packet_id=1))
        assert pub.next() == Pubrec(1)
        pub.send(Pubrel(1))
        assert pub.next() == Pubcomp(1)
        sub = BlockingClient(port, Connect(client_id="sub", clean_session=False))
        sub.send(Subscribe(1, [("r/#", 2)]))
        assert sub.next() == Suback(1, [2])
        (ret,) = _publishes(sub, 1)
        assert ret.retain and ret.qos == 2 and ret.packet_id is not None
        held_id = ret.packet_id
        proc.kill()
        proc.wait(timeout=10)
        sub.close()
        pub.close()

        proc, port = start_broker_process(tmp_path)
        sub = BlockingClient(port, Connect(client_id="sub", clean_session=False))
        assert sub.next() == Pubrel(held_id)
        pub = BlockingClient(port, Connect(client_id="pub"))
        pub.send(Publish("r/1", b"new", 2, packet_id=2))
        assert pub.next() == Pubrec(2)
        pub.send(Pubrel(2))
        assert pub.next() == Pubcomp(2)
        (new,) = _publishes(sub, 1)
        assert new.payload == b"new" and new.packet_id != held_id
        sub.send(Pubcomp(held_id))
        sub.close()
        pub.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_shared_subscription_qos2_id_is_released_after_kill9_and_the_message_comes_again(tmp_path: Path) -> None:
    """A QoS 2 delivery of a shared subscription ($share/g/...) whose PUBREC is lost to a
    SIGKILL: after the restart the member gets PUBREL for the old id (freeing it at the
    client) and the message again from the share group under another id; the old id is not
    reused before its PUBCOMP (MQTT-2.2.1-3)."""
    proc, port = start_broker_process(tmp_path)
    try:
        sub = BlockingClient(port, Connect(client_id="member", clean_session=False))
        sub.send(Subscribe(1, [("$share/g/s/#", 2)]))
        assert sub.next() == Suback(1, [2])
        pub = BlockingClient(port, Connect(client_id="pub"))
        pub.send(Publish("s/1", b"shared", 2, packet_id=1))
        assert pub.next() == Pubrec(1)
        pub.send(Pubrel(1))
        assert pub.next() == Pubcomp(1)
        (first,) = _publishes(sub, 1)
        assert first.qos == 2 and first.packet_id is not None
        held_id = first.packet_id
        proc.kill()
        proc.wait(timeout=10)
        sub.close()
        pub.close()

        proc, port = start_broker_process(tmp_path)
        sub = BlockingClient(port, Connect(client_id="member", clean_session=False))
        assert sub.next() == Pubrel(held_id)
        (again,) = _publishes(sub, 1)
        assert again.payload == b"shared" and again.packet_id != held_id
        sub.send(Pubcomp(held_id))
        sub.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)
