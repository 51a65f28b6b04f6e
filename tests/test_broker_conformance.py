"""The protocol points an outside conformance run and Mosquitto's own broker tests found
(issue 33): packet-level tests through the sans-I/O connection and core, each citing the
OASIS rule it checks (MQTT 5.0 of 7 March 2019 unless it says 3.1.1)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from filemq.broker.core import HookResult
from filemq.mqtt.codec import Decoder, ProtocolError, encode, encode5
from filemq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Properties,
    Puback,
    Publish,
)
from filemq.mqtt.properties import encode_vbi, read_vbi
from tests.broker_harness import Harness, run
from tests.broker_harness5 import client5

MALFORMED = 0x81
PROTOCOL_ERROR = 0x82


# ---- a packet that parses but breaks a rule is a Protocol Error (0x82), not Malformed -------


def test_second_connect_gets_disconnect_0x82_mqtt_3_1_0_2(tmp_path: Path) -> None:
    """MQTT-3.1.0-2: a second CONNECT is a Protocol Error; the server closes with DISCONNECT
    0x82 (4.13.2), not 0x81 Malformed Packet: the packet itself is well formed."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        assert c.connect("twice").return_code == 0
        c.send(Connect(client_id="twice", protocol_level=5))
        assert c.received() == [Disconnect(PROTOCOL_ERROR)]
        assert c.conn.closed and c.transport.closed and "MQTT-3.1.0-2" in c.conn.close_reason
    run(main())


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param(b"\x32\x06\x00\x01t\x00\x00\x00", id="PUBLISH QoS 1"),
        pytest.param(b"\x34\x06\x00\x01t\x00\x00\x00", id="PUBLISH QoS 2"),
        pytest.param(b"\x40\x02\x00\x00", id="PUBACK"),
        pytest.param(b"\x82\x06\x00\x00\x00\x00\x01t\x00", id="SUBSCRIBE"),
        pytest.param(b"\xa2\x05\x00\x00\x00\x00\x01t", id="UNSUBSCRIBE"),
    ],
)
def test_packet_id_0_gets_disconnect_0x82_mqtt_2_2_1_3(tmp_path: Path, wire: bytes) -> None:
    """MQTT-2.2.1-3: PUBLISH (QoS > 0), SUBSCRIBE and UNSUBSCRIBE carry a non-zero packet id
    (and so does each ack, 2.2.1). Packet id 0 parses, so breaking the rule is a Protocol
    Error: DISCONNECT 0x82, not 0x81 -- also behind a PUBLISH that took the decoder's fast
    path with the same topic."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        assert c.connect("pid0").return_code == 0
        c.send(Publish("t", b"ok", 0))
        c.send_bytes(wire)
        assert c.received() == [Disconnect(PROTOCOL_ERROR)]
        assert c.conn.closed and "packet id 0" in c.conn.close_reason
    run(main())


# ---- MQTT-1.5.5-1: a variable byte integer takes the fewest bytes its value needs ----------


def _non_minimal(value: int, extra: int) -> bytes:
    """``value`` as a variable byte integer padded with ``extra`` needless bytes (a
    continuation bit on what would be the last byte, then ``80`` ... ``00``)."""
    out = bytearray(encode_vbi(value))
    out[-1] |= 0x80
    out += b"\x80" * (extra - 1) + b"\x00"
    return bytes(out)


def _with_length(packet: bytes, extra: int) -> bytes:
    """``packet`` (minimally encoded) with its remaining length padded by ``extra`` bytes."""
    remaining, at = read_vbi(packet, 1, len(packet), "remaining length", "test")
    return packet[:1] + _non_minimal(remaining, extra) + packet[at:]


@given(st.integers(0, 2_097_151), st.integers(1, 3), st.data())
def test_non_minimal_variable_byte_integers_are_malformed_mqtt_1_5_5_1(value: int, extra: int,
                                                                        data: st.DataObject) -> None:
    """MQTT-1.5.5-1: "The encoded value MUST use the minimum number of bytes necessary to
    represent the value"; any longer encoding (within the 4-byte cap) is a Malformed Packet,
    0x81, wherever a variable byte integer is read: remaining length, property length,
    subscription identifier."""
    padded = _non_minimal(value, extra)
    if len(padded) > 4:
        return  # over 4 bytes: already refused by the length cap
    with pytest.raises(ProtocolError, match="MQTT-1.5.5-1") as info:
        read_vbi(padded + b"rest", 0, len(padded) + 4, "length", "TEST")
    assert info.value.reason_code == MALFORMED
    # The minimal encoding of the same value reads back.
    assert read_vbi(encode_vbi(value) + b"rest", 0, len(encode_vbi(value)) + 4, "length", "TEST") == (value, len(encode_vbi(value)))
    # The fixed header: the decoder refuses it before any body byte is there.
    decoder = Decoder(1 << 22, protocol_level=data.draw(st.sampled_from([4, 5])))
    with pytest.raises(ProtocolError, match="MQTT-1.5.5-1") as info:
        decoder.feed(b"\x30" + padded)
        decoder.packets()
    assert info.value.reason_code == MALFORMED


def _publishes(level: int, n: int, qos: int = 1, props: bool = False) -> list[bytes]:
    enc = encode5 if level == 5 else encode
    properties = Properties(content_type="c") if props else None
    return [enc(Publish("t/x", b"p" * 10, qos, packet_id=i + 1, properties=properties)) for i in range(n)]


@pytest.mark.parametrize("level", [4, 5])
@pytest.mark.parametrize("shape", ["first of its topic", "topic cached", "a run of them", "QoS 0", "properties"])
def test_publish_with_a_non_minimal_remaining_length_is_refused_mqtt_1_5_5_1(tmp_path: Path, level: int,
                                                                             shape: str) -> None:
    """MQTT-1.5.5-1 on PUBLISH through every decoder path: the general one (the first PUBLISH
    of a topic, one with properties), the per-packet fast path (topic cached; a remaining
    length of 1 byte sent as 2, "9a 00") and the run path (a read of equal-shaped padded
    PUBLISHes).  Nothing of the padded packets is stored or acknowledged; what came before
    is; the MQTT 5 client gets DISCONNECT 0x81 Malformed Packet (4.13.2), the 3.1.1 one is
    closed."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h) if level == 5 else h.client()
        assert c.connect("nm").return_code == 0
        qos = 0 if shape == "QoS 0" else 1
        good = _publishes(level, 6, qos, shape == "properties")
        before = 0 if shape in ("first of its topic", "properties") else 1
        if before:
            c.send_bytes(good[0])
            await h.commit()
            assert c.received() == ([Puback(1)] if qos else [])
        bad = [_with_length(p, 1) for p in good[before:]]
        c.send_bytes(b"".join(bad) if shape == "a run of them" else bad[0])
        await h.commit()
        assert len(h.queue.log.records) == before
        assert c.received() == ([Disconnect(MALFORMED)] if level == 5 else [])
        assert c.conn.closed and "MQTT-1.5.5-1" in c.conn.close_reason
    run(main())


@pytest.mark.parametrize(
    ("props", "padded"),
    [
        pytest.param(b"", True, id="no properties"),
        pytest.param(b"\x03\x00\x01c", True, id="content type"),
        pytest.param(b"\x26\x00\x01k\x00\x01v", True, id="user property"),
        pytest.param(b"\x0b\x81\x00", False, id="subscription identifier 1 in two bytes"),
    ],
)
def test_publish_with_a_non_minimal_property_length_is_refused_mqtt_1_5_5_1(tmp_path: Path, props: bytes,
                                                                            padded: bool) -> None:
    """MQTT-1.5.5-1 inside an MQTT 5 PUBLISH: its property length padded by one byte (none,
    a content type, a user property), or a padded subscription identifier (not allowed from
    a client either way): DISCONNECT 0x81, nothing stored -- whichever decoder reads PUBLISH
    properties (the fast path takes only a property length of a single 00)."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        assert c.connect("nm").return_code == 0
        c.send(Publish("t/x", b"ok", 1, packet_id=1))  # the topic cached: the fast path is tried
        await h.commit()
        assert c.received() == [Puback(1)]
        plen = bytes((len(props) | 0x80, 0)) if padded else bytes((len(props),))
        body = b"\x00\x03t/x\x00\x02" + plen + props + b"payload"
        c.send_bytes(bytes((0x32, len(body))) + body)
        await h.commit()
        assert c.received() == [Disconnect(MALFORMED)]
        assert len(h.queue.log.records) == 1 and "MQTT-1.5.5-1" in c.conn.close_reason
    run(main())


@pytest.mark.parametrize("where", ["remaining length", "property length", "will property length"])
def test_connect_with_a_non_minimal_length_is_refused_mqtt_1_5_5_1(tmp_path: Path, where: str) -> None:
    """MQTT-1.5.5-1 on CONNECT: a padded remaining length or (will) property length is a
    Malformed Packet: closed without a session; CONNACK 0x81 first once the level byte said 5
    (4.13.1, MQTT-3.1.4-1), none when the fixed header is at fault (the level is unknown)."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        connect = Connect(client_id="nm", protocol_level=5, properties=Properties(session_expiry_interval=5),
                          will_topic="w", will_payload=b"x", will_properties=Properties(content_type="c"))
        wire = encode5(connect)
        if where == "remaining length":
            wire = _with_length(wire, 1)
        else:
            # The CONNECT's (or the will's) property section: property length 5 (or 4) ->
            # "85 00" (or "84 00"), one byte longer, with the remaining length one larger.
            mark = b"\x05\x11" if where == "property length" else b"\x04\x03"
            at = wire.index(mark)
            body = wire[2:at] + bytes((wire[at] | 0x80, 0)) + wire[at + 1:]
            wire = bytes((0x10, len(body))) + body
        c.send_bytes(wire)
        got = c.received()
        # (a padded property length: the level byte was read, so CONNACK 0x81 comes first)
        assert got == ([] if where == "remaining length" else [Connack(False, MALFORMED)])
        assert c.conn.closed and "MQTT-1.5.5-1" in c.conn.close_reason
        assert "nm" not in h.core.connections
    run(main())


# ---- MQTT-3.1.2-2: a protocol level filemq does not speak is answered, then closed ----------


def _at_level(wire: bytes, level: int) -> bytes:
    """A CONNECT's bytes with its protocol level byte replaced (after "00 04 MQTT")."""
    at = wire.index(b"\x00\x04MQTT") + 6
    return wire[:at] + bytes((level,)) + wire[at + 1:]


@pytest.mark.parametrize("level", [6, 7, 255, 0])
@pytest.mark.parametrize("shape", [4, 5])
def test_unknown_protocol_level_gets_connack_in_the_clients_shape_mqtt_3_1_2_2(tmp_path: Path, level: int,
                                                                              shape: int) -> None:
    """MQTT-3.1.2-2 (5.0): a CONNECT whose level the server does not speak MAY get CONNACK
    0x84 Unsupported Protocol Version, then MUST be closed; MQTT-3.1.2-2 (3.1.1): CONNACK 0x01.
    A level-6 CONNECT in the MQTT 5 shape (properties after the keep alive) gets the MQTT 5
    CONNACK ``20 03 00 84 00``; one in the 3.1.1 shape the 3.1.1 CONNACK ``20 02 00 01``
    (what a 3.1.1 client can read).  Before, both were closed without a word."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.client()
        props = Properties(session_expiry_interval=30, user_properties=[("k", "v")]) if shape == 5 else None
        connect = Connect(client_id="future", protocol_level=shape, properties=props, will_topic="w",
                          will_payload=b"bye", username="u", password=b"p",
                          will_properties=Properties(content_type="c") if shape == 5 else None)
        c.send_bytes(_at_level(encode5(connect), level))
        assert bytes(c.transport.data) == (b"\x20\x03\x00\x84\x00" if shape == 5 else b"\x20\x02\x00\x01")
        assert c.conn.closed and c.transport.closed and f"protocol level {level}" in c.conn.close_reason
        assert "future" not in h.core.connections
    run(main())


def test_connect_of_an_unknown_level_after_connack_is_disconnect_0x82_mqtt_3_1_0_2(tmp_path: Path) -> None:
    """A second CONNECT is a Protocol Error whatever its level (MQTT-3.1.0-2): DISCONNECT 0x82
    (0x84 is no DISCONNECT reason code, 3.14.2.1)."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        assert c.connect("twice").return_code == 0
        c.send_bytes(_at_level(encode5(Connect(client_id="twice", protocol_level=5)), 6))
        assert c.received() == [Disconnect(PROTOCOL_ERROR)]
        assert c.conn.closed
    run(main())


# ---- MQTT-3.1.4-1 / 4.13.1: an MQTT 5 CONNECT refused as malformed gets CONNACK 0x81 / 0x82 ---


def _connect5(props: bytes, will_props: bytes | None = None) -> bytes:
    """A level-5 CONNECT with hand-made property sections (client id "bad", Clean Start)."""
    body = b"\x00\x04MQTT\x05" + bytes((0x02 | (0x04 if will_props is not None else 0),)) + b"\x00\x3c"
    body += encode_vbi(len(props)) + props + b"\x00\x03bad"
    if will_props is not None:
        body += encode_vbi(len(will_props)) + will_props + b"\x00\x01w\x00\x03bye"
    return b"\x10" + encode_vbi(len(body)) + body


_EXPIRY = b"\x11\x00\x00\x00\x3c"  # session expiry interval 60


@pytest.mark.parametrize(
    ("wire", "code"),
    [
        pytest.param(_connect5(_EXPIRY + _EXPIRY), PROTOCOL_ERROR, id="session expiry twice (3.1.2.11.2)"),
        pytest.param(_connect5(b"\x7f\x00"), MALFORMED, id="unknown property 0x7F (2.2.2.2)"),
        pytest.param(_connect5(b"\x01\x00"), MALFORMED, id="payload format indicator on CONNECT (2.2.2.2)"),
        pytest.param(_connect5(b"\x21\x00\x00"), PROTOCOL_ERROR, id="receive maximum 0 (3.1.2.11.3)"),
        pytest.param(_connect5(b"\x27\x00\x00\x00\x00"), PROTOCOL_ERROR, id="maximum packet size 0 (3.1.2.11.4)"),
        pytest.param(_connect5(b"\x26\x00\x01\xff\x00\x01v"), MALFORMED,
                     id="ill-formed UTF-8 in a user property (MQTT-1.5.4-1)"),
        pytest.param(_connect5(b"\x16\x00\x01x"), PROTOCOL_ERROR, id="authentication data without method (3.1.2.11.10)"),
        pytest.param(_connect5(b"\x17\x02"), PROTOCOL_ERROR, id="request problem information 2 (3.1.2.11.7)"),
        pytest.param(_connect5(b"", _EXPIRY), MALFORMED, id="session expiry in the will properties (3.1.3.2)"),
        pytest.param(_connect5(b"", b"\x18\x00\x00\x00\x01" * 2), PROTOCOL_ERROR, id="will delay twice (3.1.3.2.2)"),
        pytest.param(_connect5(b"", b"\x01\x02"), PROTOCOL_ERROR, id="will payload format indicator 2 (3.1.3.2.3)"),
        pytest.param(_connect5(b"", b"\x03\x00\x02\xc0\x80"), MALFORMED, id="will content type not UTF-8 (MQTT-1.5.4-1)"),
        pytest.param(_connect5(b"\x05"), MALFORMED, id="property length past the packet (2.2.2.1)"),
    ],
)
def test_mqtt5_connect_property_errors_get_connack_0x81_or_0x82_mqtt_3_1_4_1(tmp_path: Path, wire: bytes,
                                                                              code: int) -> None:
    """MQTT-3.1.4-1: the server validates the CONNECT and closes the connection if it does not
    match 3.1; it MAY send a CONNACK with a reason code of 0x80 or greater first (4.13.1).
    filemq does, as docs/MQTT5.md says: 0x81 Malformed Packet for a packet that does not parse
    (an unknown or misplaced property, a value not of its type), 0x82 Protocol Error for one
    that parses but breaks a rule (a repeated property, a value out of its range).  Then it
    closes; no session, no will."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = client5(h)
        c.send_bytes(wire)
        assert c.received() == [Connack(False, code)]
        assert c.conn.closed and c.transport.closed
        assert "bad" not in h.core.connections and not h.queue.log.records
    run(main())


def test_3_1_1_connect_errors_are_still_closed_without_connack(tmp_path: Path) -> None:
    """3.1.1 has no CONNACK code for a malformed CONNECT (its 3.1.4: the server closes the
    connection): a CONNECT with a reserved flag set is closed without an answer."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.client()
        wire = bytearray(encode(Connect(client_id="old")))
        wire[9] |= 0x01  # the reserved flag (MQTT-3.1.2-3)
        c.send_bytes(bytes(wire))
        assert c.received() == [] and c.conn.closed
    run(main())


# ---- issue 33 item 5: MQTT 5 refusals carry a reason code; an MQTT 5 CONNECT may be large ----


def test_publish_hook_reject_sends_disconnect_0x83_to_an_mqtt5_client(tmp_path: Path) -> None:
    """A publish hook's ``HookResult.reject`` closes the connection unacknowledged; an MQTT 5
    client is told why first: DISCONNECT 0x83 Implementation specific error ("the packet
    received is valid but cannot be processed by this implementation", 3.14.2.1; MQTT-4.13.2-1:
    a server closing because of an error sends DISCONNECT with a reason code first).  A 3.1.1
    client is closed as before (it has no DISCONNECT from the server)."""
    async def main() -> None:
        h = Harness(tmp_path)
        h.hook = lambda _client, p: HookResult.reject("no") if p.topic == "bad" else HookResult.store()
        h.core = h.make_core()
        c = client5(h)
        assert c.connect("hooked").return_code == 0
        c.send(Publish("bad", b"x", 1, packet_id=1))
        await h.commit()
        assert c.received() == [Disconnect(0x83)]
        assert c.conn.closed and "rejected: no" in c.conn.close_reason and not h.queue.log.records
        old = h.client()
        assert old.connect("hooked311").return_code == 0
        old.send(Publish("bad", b"x", 1, packet_id=1))
        await h.commit()
        assert old.received() == [] and old.conn.closed
    run(main())


def _big_connect5(size: int) -> bytes:
    """An MQTT 5 CONNECT of about ``size`` bytes: user properties of 60,000-byte values."""
    n, rest = divmod(size, 60_010)
    pairs = [(f"k{i}", "v" * 60_000) for i in range(n)] + [("rest", "r" * max(0, rest - 20))]
    return encode5(Connect(client_id="big", protocol_level=5, properties=Properties(user_properties=pairs)))


def test_mqtt5_connect_larger_than_the_largest_311_connect_is_accepted(tmp_path: Path) -> None:
    """MQTT 5 has no largest CONNECT (its user properties are unbounded, 3.1.2.11.8); the
    server's Maximum Packet Size is the only limit (3.2.2.3.6).  A 500 KB level-5 CONNECT
    under max_packet_size 1 MiB is accepted, also sent in small reads (the pre-CONNECT cap of
    MAX_CONNECT_PACKET, 3.1.1's largest CONNECT, applies until its level byte says 5); one
    over max_packet_size gets CONNACK 0x95 Packet too large (4.13.1) and is closed; a 3.1.1
    CONNECT announcing as much is still closed as soon as its level byte is in."""
    from filemq.broker.session.connection import MAX_CONNECT5_PACKET, MAX_CONNECT_PACKET

    async def main() -> None:
        h = Harness(tmp_path, max_packet_size=1 << 20)
        wire = _big_connect5(500_000)
        assert MAX_CONNECT_PACKET < len(wire) < 1 << 20
        for step in (len(wire), 4, 1460):
            c = client5(h)
            for k in range(0, len(wire), step):
                c.feed(wire[k:k + step])
            h.core.flush()
            ack = c.received()
            assert [type(p) for p in ack] == [Connack] and ack[0].return_code == 0, step
            assert not c.conn.closed
            c.send(Disconnect())
        over = client5(h)
        over.send_bytes(_big_connect5((1 << 20) + 1000)[:200_000])
        assert over.received() == [Connack(False, 0x95)] and over.conn.closed
        old = h.client()
        size = len(wire) - 4
        old.send_bytes(bytes((0x10, 0x80 | (size & 0x7F), 0x80 | ((size >> 7) & 0x7F), size >> 14)))
        assert not old.conn.closed  # (its level byte is not in yet)
        old.send_bytes(b"\x00\x04MQTT\x04\x02\x00\x3c")
        assert old.received() == [] and old.conn.closed
        assert "exceeds max_packet_size" in old.conn.close_reason
        # Where max_packet_size is large (a collector's: 64 MiB for batches) a half-open
        # socket may still make the broker hold no more than MAX_CONNECT5_PACKET.
        (tmp_path / "big").mkdir()
        big = Harness(tmp_path / "big", max_packet_size=64 << 20)
        huge = client5(big)
        huge.send_bytes(_big_connect5(MAX_CONNECT5_PACKET + 70_000)[:100_000])
        assert huge.received() == [Connack(False, 0x95)] and huge.conn.closed
    run(main())


# ---- takeover and the will (Mosquitto's 07-will-takeover, MQTT-3.1.2-8 of 5.0) ---------------


def _wills(h: Harness) -> list[str]:
    return [r.topic for r in h.queue.log.records if r.topic.startswith("will/")]


@pytest.mark.parametrize(
    ("level", "expiry", "new_clean", "published"),
    [
        pytest.param(5, 60, False, False, id="5: the new connection resumes the session: no will"),
        pytest.param(5, 60, True, True, id="5: Clean Start 1 ends the session: will"),
        pytest.param(5, 0, False, True, id="5: session expiry 0 ended with the old connection: will"),
        pytest.param(4, None, False, True, id="3.1.1: a take-over publishes the will (3.1.2.5 of 3.1.1)"),
    ],
)
def test_takeover_publishes_the_will_only_when_the_session_ends_mqtt_3_1_2_8(
        tmp_path: Path, level: int, expiry: int | None, new_clean: bool, published: bool) -> None:
    """MQTT 5.0, MQTT-3.1.2-8: the will is published after the network connection closes and
    the will delay has elapsed or the session ended, *unless* a new network connection for
    the client id opened before the delay elapsed.  A take-over by a connection that resumes
    the session (Clean Start 0, the session outlives the old connection) is such a new
    connection, also with a will delay of 0: no will (as Mosquitto does, test
    07-will-takeover).  When the take-over ends the session (Clean Start 1, or the old
    connection's session expiry 0) the will is published.  MQTT 3.1.1 keeps its rule: the
    old connection did not send DISCONNECT, so its will is published."""
    async def main() -> None:
        h = Harness(tmp_path)
        old = client5(h) if level == 5 else h.client()
        new = client5(h) if level == 5 else h.client()
        props = None if expiry is None else Properties(session_expiry_interval=expiry)
        assert old.connect("dev", False, properties=props, will_topic="will/dev", will_payload=b"gone",
                           will_qos=1).return_code == 0
        assert new.connect("dev", new_clean, properties=props).return_code == 0
        await h.commit()
        assert old.conn.closed
        assert old.received() == ([Disconnect(0x8E)] if level == 5 else [])  # MQTT-3.1.4-3
        assert _wills(h) == (["will/dev"] if published else [])
        assert h.core.connections["dev"] is new.conn
    run(main())


# ---- security: empty passwords (as Mosquitto) ---------------------------------------------


@pytest.mark.parametrize("level", [4, 5])
def test_empty_password_is_refused_even_when_the_file_hashes_it(tmp_path: Path, level: int,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A password-file line that is the hash of the empty password does not let its user in
    with an empty password: CONNACK 0x04 (3.1.1) / 0x86 bad user name or password (MQTT 5,
    3.2.2.2), as Mosquitto refuses empty passwords.  The line is named in one WARNING, not one
    per attempt; the user's real logins and other users are untouched."""
    import asyncio

    from filemq.broker.auth import PasswordFile, PasswordHash

    pw_file = tmp_path / "pw"
    pw_file.write_text(f"empty:{PasswordHash.create(b'', 1000).encode()}\n"
                       f"alice:{PasswordHash.create(b'secret', 1000).encode()}\n")

    async def login(h: Harness, user: str, password: bytes) -> int:
        c = client5(h) if level == 5 else h.client()
        c.send(Connect(client_id=f"{user}-{len(c.h.core.connections)}", username=user, password=password,
                       protocol_level=level))
        for _ in range(300):
            if c.conn.closed or c.conn.state == "connected":
                break
            await asyncio.sleep(0.01)
        got = c.received()
        assert len(got) == 1 and type(got[0]) is Connack, got
        return got[0].return_code

    async def main() -> None:
        h = Harness(tmp_path)
        h.core.passwords = PasswordFile.load(pw_file)
        h.core.anonymous_allowed = False
        refused = 0x86 if level == 5 else 0x04
        with caplog.at_level(logging.WARNING, "filemq.broker.auth"):
            assert await login(h, "empty", b"") == refused
            assert await login(h, "empty", b"") == refused
            assert await login(h, "alice", b"") == refused
        assert await login(h, "alice", b"secret") == 0
        named = [r for r in caplog.records if r.name == "filemq.broker.auth" and "empty password" in r.message]
        assert len(named) == 1 and "'empty'" in named[0].message
    run(main())
