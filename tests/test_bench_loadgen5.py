"""The load generator's MQTT 5 packets (issue 13 item 9), checked without a broker.

What `filemq bench broker --protocol 5` sends must be MQTT 5.0 as the spec has it, so the
packets are decoded by our v5 Decoder and by paho-mqtt 2.x's packet decoders as an independent
oracle; the bulk PUBACK counting and acking must agree with packet-by-packet decoding for any
split of the stream.
"""

from __future__ import annotations

import random
import socket
import threading

import pytest

from bench.harness.loads import V5_PROPERTIES
from bench.harness.summary import refusal
from bench.loadgen import (
    SESSION_EXPIRY_S,
    LoadError,
    PubackCounter,
    PublishAcker,
    RawClient,
    connect_packet,
    publish_template,
)
from bench.loadspec import LoadResult, PublisherResult, SubscriberResult
from filemq.mqtt.codec import Decoder, encode, encode5
from filemq.mqtt.packets import (
    PROTOCOL_LEVEL_5,
    Connack,
    Connect,
    Properties,
    Puback,
    Publish,
    Suback,
    Subscribe,
    subscription_options,
)

paho_packet = pytest.importorskip("paho.mqtt._packet")
from paho.mqtt.enums import MQTTProtocolVersion  # noqa: E402

V5 = MQTTProtocolVersion.MQTTv5


def _split(wire: bytes) -> tuple[int, bytes]:
    """(first byte, body) of one packet."""
    i, length, shift = 1, 0, 0
    while True:
        byte = wire[i]
        length |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            break
        shift += 7
    assert len(wire) == i + length
    return wire[0], wire[i:]


@pytest.mark.parametrize("props", [None, V5_PROPERTIES], ids=["no-properties", "v5-properties"])
def test_v5_publish_bytes_decode_with_our_v5_decoder_and_paho(props: Properties | None) -> None:
    """3.3.2: topic, packet id, then the property section (3.3.2.3: property length 0 when
    there are none), then the payload; built the way the publisher builds them."""
    prefix, middle = publish_template("bench/fanout/3", 100, 1, PROTOCOL_LEVEL_5, props)
    payload = bytes(100)
    pids = [1, 2, 300, 65535]
    wires = [prefix + pid.to_bytes(2, "big") + middle + payload for pid in pids]
    assert wires[0] == encode5(Publish("bench/fanout/3", payload, 1, packet_id=1, properties=props))
    if props is None:
        assert middle == b"\x00"
    decoder = Decoder(server=True, protocol_level=PROTOCOL_LEVEL_5)
    decoder.feed(b"".join(wires))
    got = decoder.packets()
    assert got == [Publish("bench/fanout/3", payload, 1, packet_id=pid, properties=props) for pid in pids]
    for pid, wire in zip(pids, wires, strict=True):
        pub = paho_packet.decode_publish(*_split(wire), V5)
        assert (pub.topic, pub.mid, pub.qos, pub.payload) == (b"bench/fanout/3", pid, 1, payload)
        if props is not None:
            assert pub.properties.ContentType == props.content_type
            assert pub.properties.UserProperty == props.user_properties


def test_v311_publish_template_is_unchanged() -> None:
    prefix, middle = publish_template("bench/ingest", 100, 1)
    assert middle == b""
    assert prefix + b"\x00\x07" + bytes(100) == encode(Publish("bench/ingest", bytes(100), 1, packet_id=7))


def test_v5_connect_is_level_5_with_session_expiry_when_persistent() -> None:
    """3.1.2.2 protocol level 5; 3.1.2.11.2: a persistent session (clean start 0) states its
    session expiry interval, else it would end with the connection."""
    decoder = Decoder(server=True)
    decoder.feed(connect_packet("sub-1", False, 600, PROTOCOL_LEVEL_5))
    decoder.feed(connect_packet("pub-1", True, 600, PROTOCOL_LEVEL_5))
    persistent, clean = decoder.packets()
    assert isinstance(persistent, Connect) and isinstance(clean, Connect)
    assert (persistent.protocol_level, persistent.clean_session, persistent.client_id) == (5, False, "sub-1")
    assert persistent.properties == Properties(session_expiry_interval=SESSION_EXPIRY_S)
    assert (clean.protocol_level, clean.clean_session, clean.properties) == (5, True, None)


class _OneShotServer:
    """Accepts one connection, answers its first read with ``reply``, keeps what it read."""

    def __init__(self, reply: bytes, replies_after_connect: bytes = b"") -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = bytearray()
        self._reply = reply
        self._second = replies_after_connect
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(10)
            self.received += conn.recv(4096)
            conn.sendall(self._reply)
            if self._second:
                self.received += conn.recv(4096)
                conn.sendall(self._second)
            self.done.set()
            while conn.recv(4096):
                pass
        self.listener.close()


def test_v5_subscribe_sends_the_options_byte_and_reads_the_v5_suback() -> None:
    """3.8.3.1: the options byte (QoS 1, no local 0, retain as published 0, retain handling 0);
    3.9.3: SUBACK reason codes."""
    server = _OneShotServer(encode5(Connack(properties=Properties(receive_maximum=50))),
                            encode5(Suback(1, [1])))
    client = RawClient.connect("127.0.0.1", server.port, "sub", clean_session=False, protocol=PROTOCOL_LEVEL_5)
    assert client.receive_maximum == 50  # 3.2.2.3.3: the publisher's window is capped by it
    codes, early = client.subscribe([("bench/fanout/#", 1)])
    assert (codes, early) == ([1], [])
    client.close()
    assert server.done.wait(10)
    decoder = Decoder(server=True)
    decoder.feed(bytes(server.received))
    connect, subscribe, *_ = decoder.packets()
    assert isinstance(connect, Connect) and connect.protocol_level == 5
    assert subscribe == Subscribe(1, [("bench/fanout/#", subscription_options(1))])


def test_refused_v5_connect_carries_the_connack_code() -> None:
    """A 3.1.1 server refuses a level-5 CONNECT with its 2-byte CONNACK 0x01 (3.1.4 lets it
    answer in its own level): the client says so and keeps the code for the report."""
    server = _OneShotServer(b"\x20\x02\x00\x01")
    with pytest.raises(LoadError, match=r"unacceptable protocol version \(CONNACK 0x01\)") as info:
        RawClient.connect("127.0.0.1", server.port, "pub", protocol=PROTOCOL_LEVEL_5)
    assert info.value.connack_code == 1
    result = LoadResult([PublisherResult("pub", connack_code=1)], [SubscriberResult("sub")])
    assert refusal(result) == "CONNACK 0x01"
    assert refusal(LoadResult([PublisherResult("pub")], [])) is None


def _count_in_pieces(protocol: int, stream: bytes, rng: random.Random) -> tuple[int, PubackCounter]:
    counter = PubackCounter(protocol)
    total = pos = 0
    while pos < len(stream):
        step = rng.randrange(1, 700)
        total += counter.count(stream[pos : pos + step])
        pos += step
    return total, counter


@pytest.mark.parametrize("form", ["short", "no-subscribers-0x10", "success-0x00-3-bytes"])
def test_v5_pubacks_are_counted_in_bulk_in_either_form(form: str) -> None:
    """3.4.2.1: a PUBACK may omit the reason code (0x00, remaining length 2); mosquitto sends
    40 03 id 0x10 ("no matching subscribers") to every PUBLISH nobody subscribed to."""
    code = {"short": None, "no-subscribers-0x10": 0x10, "success-0x00-3-bytes": 0x00}[form]
    acks = [bytes([0x40, 2]) + pid.to_bytes(2, "big") if code is None
            else bytes([0x40, 3]) + pid.to_bytes(2, "big") + bytes([code]) for pid in range(1, 3001)]
    for seed in range(5):
        total, counter = _count_in_pieces(PROTOCOL_LEVEL_5, b"".join(acks), random.Random(seed))
        assert (total, counter.refused) == (3000, 0)
        assert not counter.decoding  # stayed on the bulk path


def test_v5_refused_pubacks_count_as_refused_not_acked() -> None:
    """A PUBACK reason code >= 0x80 is a failure (2.4): 0x97 quota exceeded, 0x80, ..."""
    stream = b"".join(encode5(Puback(pid, 0x10 if pid % 7 else 0x97)) for pid in range(1, 701))
    stream += b"".join(encode5(Puback(pid)) for pid in range(701, 801))
    for seed in range(5):
        total, counter = _count_in_pieces(PROTOCOL_LEVEL_5, stream, random.Random(seed))
        assert total == 800  # every one frees its window slot
        assert counter.refused == 100
        assert counter.refused_codes == {0x97}


def test_v5_deliveries_with_properties_are_acked_in_bulk_and_paho_reads_the_acks() -> None:
    """Deliveries carrying a property section (3.3.2.3) are acked by packet id; the PUBACKs
    sent are the short form (3.4.2.1), valid MQTT 5 as paho decodes them."""
    deliveries = [encode5(Publish("bench/fanout/1", bytes(100), 1, packet_id=i % 65535 + 1,
                                  properties=V5_PROPERTIES)) for i in range(600)]
    odd = encode5(Publish("bench/fanout/2", b"x" * 30, 1, dup=True, packet_id=9))
    stream = encode5(Suback(1, [1])) + b"".join(deliveries[:300]) + odd + b"".join(deliveries[300:])
    expected = [i % 65535 + 1 for i in range(300)] + [9] + [i % 65535 + 1 for i in range(300, 600)]
    rng = random.Random(11)
    for _ in range(5):
        acker = PublishAcker(server=False, protocol=PROTOCOL_LEVEL_5)
        acks = bytearray()
        others = []
        pos = 0
        while pos < len(stream):
            step = rng.randrange(1, 2000)
            others += acker.feed(stream[pos : pos + step], acks)
            pos += step
        assert acker.publishes == 601
        assert [type(p).__name__ for p in others] == ["Suback"]
        wires = [bytes(acks[i : i + 4]) for i in range(0, len(acks), 4)]
        assert [paho_packet.decode_puback(*_split(w), V5).mid for w in wires] == expected
        assert {paho_packet.decode_puback(*_split(w), V5).reason.value for w in wires} == {0}


def test_null_sink_acker_switches_to_v5_on_a_level_5_connect() -> None:
    """The null sink's acker reads the PUBLISHes behind a level-5 CONNECT as MQTT 5 (the
    property length byte is not payload) and acks each."""
    prefix, middle = publish_template("bench/sink", 100, 1, PROTOCOL_LEVEL_5, V5_PROPERTIES)
    stream = connect_packet("p", True, 60, PROTOCOL_LEVEL_5) + b"".join(
        prefix + pid.to_bytes(2, "big") + middle + bytes(100) for pid in range(1, 51))
    acker = PublishAcker(server=True)
    acks = bytearray()
    others = acker.feed(stream, acks)
    assert [type(p).__name__ for p in others] == ["Connect"]
    assert acker.publishes == 50
    assert [int.from_bytes(acks[i + 2 : i + 4], "big") for i in range(0, len(acks), 4)] == list(range(1, 51))
