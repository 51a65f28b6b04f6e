"""The broker speaks MQTT 5.0 (OASIS Standard, 7 March 2019) beside 3.1.1: packet-level tests
of CONNECT/CONNACK, the reason codes the broker sends, server DISCONNECTs and AUTH, through
the sans-I/O connection and core (the harness of tests/broker_harness.py and
tests/broker_harness5.py)."""

from __future__ import annotations

from pathlib import Path

from filemq.mqtt.packets import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Properties,
    Puback,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
    subscription_options,
)
from tests.broker_harness import Harness, run
from tests.broker_harness5 import client5


def test_level_5_connect_is_accepted_with_mqtt5_connack(tmp_path: Path) -> None:
    """3.2.2.3: the CONNACK states the maximum packet size the broker takes; subscription
    identifiers are available (3.2.2.3.12: absent = available); 3.1.1 clients on the same core
    are unchanged."""
    async def main() -> None:
        h = Harness(tmp_path, max_packet_size=4096)
        c = client5(h)
        ack = c.connect("v5")
        assert ack.return_code == 0 and not ack.session_present
        assert ack.properties is not None and ack.properties.maximum_packet_size == 4096
        assert ack.properties.subscription_identifier_available is None
        assert ack.properties.assigned_client_identifier is None
        assert c.conn.protocol_level == 5
        old = h.client()
        assert old.connect("v311") == Connack(False, 0)
    run(main())


def test_empty_client_id_gets_an_assigned_one_even_without_clean_start(tmp_path: Path) -> None:
    """MQTT-3.1.3-6 / MQTT-3.1.3-7 / MQTT-3.2.2-16: a zero-length client id is given a unique one,
    returned as the Assigned Client Identifier."""
    async def main() -> None:
        h = Harness(tmp_path)
        ids = set()
        for clean in (True, False):
            c = client5(h)
            ack = c.connect("", clean)
            assert ack.return_code == 0
            assert ack.properties is not None and ack.properties.assigned_client_identifier
            assert ack.properties.assigned_client_identifier == c.conn.client_id
            ids.add(c.conn.client_id)
        assert len(ids) == 2
    run(main())


def test_authentication_method_is_refused_with_0x8c(tmp_path: Path) -> None:
    """3.1.2.11.9 / 4.12: filemq offers no extended authentication: CONNACK 0x8C, then close."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        c.send(Connect(client_id="x", protocol_level=5, properties=Properties(authentication_method="SCRAM-SHA-1")))
        assert c.received() == [Connack(False, 0x8C)]
        assert c.conn.closed
    run(main())


def test_auth_packet_after_connect_is_a_protocol_error(tmp_path: Path) -> None:
    """MQTT-4.12.0-... / 3.15: AUTH without an authentication method in CONNECT: DISCONNECT 0x82
    (4.13.2), then the connection is closed."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        c.connect("x")
        c.send(Auth(0x18))
        assert c.received() == [Disconnect(0x82)]
        assert c.conn.closed and c.transport.closed
    run(main())


def test_refused_logins_use_mqtt5_reason_codes(tmp_path: Path) -> None:
    """3.2.2.2: 0x86 bad user name or password, 0x87 not authorized (not the 3.1.1 codes 4/5)."""
    async def main() -> None:
        h = Harness(tmp_path)
        h.core.passwords = _Passwords({"alice": b"secret"})  # type: ignore[assignment]
        h.core.anonymous_allowed = False
        c = client5(h)
        c.send(Connect(client_id="a", protocol_level=5))
        assert c.received() == [Connack(False, 0x87)]
        c = client5(h)
        c.send(Connect(client_id="a", protocol_level=5, username="alice"))
        assert c.received() == [Connack(False, 0x86)]
        c = client5(h)
        assert c.connect("a", username="alice", password=b"secret").return_code == 0
    run(main())


class _Passwords:
    def __init__(self, users: dict[str, bytes]) -> None:
        self.users = users

    def cached(self, user: str, password: bytes) -> bool:
        return self.users.get(user) == password

    def check(self, user: str, password: bytes) -> bool:
        return self.users.get(user) == password


def test_keepalive_max_is_sent_as_server_keep_alive(tmp_path: Path) -> None:
    """MQTT-3.2.2-21 / 3.2.2.3.14: when the broker imposes its keep alive the CONNACK says so."""
    async def main() -> None:
        h = Harness(tmp_path, keepalive_max=30)
        c = client5(h)
        ack = c.connect("k", keepalive=0)
        assert ack.properties is not None and ack.properties.server_keep_alive == 30
        assert c.conn.keepalive == 30
        c = client5(h)
        ack = c.connect("k2", keepalive=20)
        assert ack.properties is not None and ack.properties.server_keep_alive is None
    run(main())


def test_malformed_packet_gets_disconnect_0x81(tmp_path: Path) -> None:
    """4.13.2 / MQTT-4.13.2-1: after CONNACK a malformed packet closes with DISCONNECT 0x81."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        c.connect("m")
        c.send_bytes(b"\x30\x03\x00\x05a")  # topic length runs past the packet
        assert c.received() == [Disconnect(0x81)]
        assert c.conn.closed
    run(main())


def test_packet_over_maximum_size_gets_disconnect_0x95(tmp_path: Path) -> None:
    """3.1.2.11.4 / 4.13: a packet larger than the Maximum Packet Size the broker stated: 0x95."""
    async def main() -> None:
        h = Harness(tmp_path, max_packet_size=1024)
        c = client5(h)
        c.connect("big")
        c.send(Publish("t", b"x" * 2000, 0))
        assert c.received() == [Disconnect(0x95)]
        assert c.conn.closed
    run(main())


def test_unsuback_has_a_reason_code_per_filter(tmp_path: Path) -> None:
    """3.11.3: 0x00 success, 0x11 no subscription existed (MQTT-3.11.3-1)."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        c.connect("u")
        c.send(Subscribe(1, [("a/#", subscription_options(1))]))
        assert c.received() == [Suback(1, [1])]
        c.send(Unsubscribe(2, ["a/#", "b"]))
        assert c.received() == [Unsuback(2, [0x00, 0x11])]
    run(main())


def test_disconnect_0x04_publishes_the_will_and_a_normal_one_does_not(tmp_path: Path) -> None:
    """3.14.2.1: reason 0x04 "Disconnect with Will Message"; 0x00 discards the will (MQTT-3.1.2-10)."""
    async def main() -> None:
        h = Harness(tmp_path)
        watcher = client5(h)
        watcher.connect("w")
        watcher.send(Subscribe(1, [("will/#", subscription_options(0))]))
        watcher.received()
        for cid, code in (("quiet", 0x00), ("loud", 0x04)):
            c = client5(h)
            c.connect(cid, will_topic=f"will/{cid}", will_payload=b"bye")
            c.send(Disconnect(code))
            assert c.conn.closed
        await h.commit()
        got = [p.topic for p in watcher.received() if isinstance(p, Publish)]
        assert got == ["will/loud"]
    run(main())


def test_session_expiry_zero_ends_the_session_with_the_connection(tmp_path: Path) -> None:
    """3.1.2.11.2: no Session Expiry Interval (= 0) means the session ends when the network
    connection closes, even with Clean Start 0; a non-zero one keeps it (session present)."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        c.connect("e", False)
        c.send(Subscribe(1, [("a", subscription_options(1))]), Disconnect())
        c = client5(h)
        assert not c.connect("e", False).session_present
        c.send(Disconnect())
        c = client5(h)
        c.connect("e", False, properties=Properties(session_expiry_interval=3600))
        c.send(Subscribe(1, [("a", subscription_options(1))]), Disconnect())
        c = client5(h)
        assert c.connect("e", False, properties=Properties(session_expiry_interval=3600)).session_present
        # DISCONNECT may lower it to 0: the session ends then (3.14.2.2.2).
        c.send(Disconnect(0, Properties(session_expiry_interval=0)))
        c = client5(h)
        assert not c.connect("e", False).session_present
    run(main())


def test_disconnect_cannot_raise_session_expiry_from_zero(tmp_path: Path) -> None:
    """3.14.2.2.2 (MQTT-3.14.2-... ): a non-zero Session Expiry Interval on DISCONNECT after 0 on
    CONNECT is a Protocol Error: DISCONNECT 0x82 from the server."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        c.connect("z")
        c.send(Disconnect(0, Properties(session_expiry_interval=10)))
        assert c.received() == [Disconnect(0x82)]
        assert c.conn.closed
    run(main())


def test_takeover_sends_disconnect_0x8e_to_the_old_connection(tmp_path: Path) -> None:
    """MQTT-3.1.4-3: the existing connection gets DISCONNECT 0x8E (Session taken over)."""
    async def main() -> None:
        h = Harness(tmp_path)
        a = client5(h)
        a.connect("same")
        b = client5(h)
        b.connect("same")
        assert a.received() == [Disconnect(0x8E)]
        assert a.conn.closed and not b.conn.closed
    run(main())


def test_pubrec_with_failure_reason_ends_the_qos2_delivery(tmp_path: Path) -> None:
    """4.3.3 / 3.5.2.1: a PUBREC with a reason code >= 0x80 ends the exchange: no PUBREL; the
    packet id is free again and the message is not re-sent."""
    async def main() -> None:
        h = Harness(tmp_path)
        sub = client5(h)
        sub.connect("s")
        sub.send(Subscribe(1, [("q", subscription_options(2))]))
        sub.received()
        pub = client5(h)
        pub.connect("p")
        pub.send(Publish("q", b"m", 2, packet_id=5))
        await h.commit()
        assert pub.received() == [Pubrec(5)]
        got = [p for p in sub.received() if isinstance(p, Publish)]
        assert len(got) == 1 and got[0].qos == 2
        sub.send(Pubrec(got[0].packet_id or 0, 0x80))
        assert not [p for p in sub.received() if isinstance(p, Pubrel)]
        assert sub.conn.session is not None and sub.conn.session.qos.inflight == {}
    run(main())


def test_qos1_publish_and_delivery_at_level_5(tmp_path: Path) -> None:
    """3.3 / 3.4: an MQTT 5 PUBLISH is stored and acknowledged after the commit; subscribers at
    either level get it in their own level's PUBLISH."""
    async def main() -> None:
        h = Harness(tmp_path)
        s5 = client5(h)
        s5.connect("s5")
        s5.send(Subscribe(1, [("t/#", subscription_options(1))]))
        s5.received()
        s4 = h.connected("s4", subscribe=Subscribe(1, [("t/#", 1)]))
        p = client5(h)
        p.connect("p")
        p.send(Publish("t/1", b"hello", 1, packet_id=9))
        assert p.received() == []  # not before the commit
        await h.commit()
        assert p.received() == [Puback(9)]
        (m5,) = s5.received()
        (m4,) = s4.received()
        assert (m5.topic, m5.payload, m5.qos) == (m4.topic, m4.payload, m4.qos) == ("t/1", b"hello", 1)
    run(main())


def test_client_receive_maximum_caps_the_inflight_window(tmp_path: Path) -> None:
    """3.1.2.11.3 / MQTT-3.3.4-9: the broker never has more unacknowledged QoS 1/2 PUBLISHes
    out to a client than its Receive Maximum."""
    async def main() -> None:
        h = Harness(tmp_path, max_inflight=20)
        s = client5(h)
        s.connect("s", properties=Properties(receive_maximum=2))
        s.send(Subscribe(1, [("r", subscription_options(1))]))
        s.received()
        p = client5(h)
        p.connect("p")
        p.send(*[Publish("r", b"%d" % i, 1, packet_id=i + 1) for i in range(5)])
        await h.commit()
        got = [m for m in s.received() if isinstance(m, Publish)]
        assert [m.payload for m in got] == [b"0", b"1"]
        s.send(Puback(got[0].packet_id or 0))
        more = [m for m in s.received() if isinstance(m, Publish)]
        assert [m.payload for m in more] == [b"2"]
    run(main())


def test_broker_sends_topic_aliases_to_a_client_that_takes_them(tmp_path: Path) -> None:
    """3.3.2.3.4 / MQTT-3.3.2-11: with a client Topic Alias Maximum the broker may alias topics
    it sends: the first PUBLISH of a topic carries topic and alias, later ones the alias and an
    empty topic; never more aliases than the client allows (MQTT-3.3.2-7... 3.1.2.11.5), and
    none at all to a client with no maximum (the default, MQTT-3.1.2-26)."""
    async def main() -> None:
        h = Harness(tmp_path)
        s = client5(h)
        s.connect("s", properties=Properties(topic_alias_maximum=1))
        s.send(Subscribe(1, [("t/#", subscription_options(2))]))
        s.received()
        plain = client5(h)
        plain.connect("plain")
        plain.send(Subscribe(1, [("t/#", subscription_options(2))]))
        plain.received()
        p = client5(h)
        p.connect("p")
        p.send(Publish("t/a", b"0", 0), Publish("t/a", b"1", 1, packet_id=1), Publish("t/a", b"2", 2, packet_id=2),
               Publish("t/b", b"3", 1, packet_id=3))
        await h.commit()
        got = [m for m in s.received() if isinstance(m, Publish)]
        assert [(m.topic, m.properties.topic_alias if m.properties else None) for m in got] == [
            ("t/a", 1), ("", 1), ("", 1), ("t/b", None)]
        assert [m.payload for m in got] == [b"0", b"1", b"2", b"3"]
        others = [m for m in plain.received() if isinstance(m, Publish)]
        assert [(m.topic, m.properties) for m in others] == [("t/a", None)] * 3 + [("t/b", None)]
    run(main())
