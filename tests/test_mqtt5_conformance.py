"""MQTT 5 conformance: the scenarios of the Eclipse Paho interoperability suite
(paho.mqtt.testing, ``interoperability/client_test5.py``) that Debian's mosquitto 2.0 passes,
written here from scratch against a filemq broker.

Issue 13's "done" is that external suite run against ``filemq broker`` passing at least what
mosquitto passes (``/work/tools/run_paho5.sh HOST PORT`` runs it; its code is EPL and stays
out of this repository). Each test below is one scenario of that suite, checked with
paho-mqtt 2.x as an independent MQTT 5 client, or at packet level (``Raw``: bytes built here
by hand, not with filemq's codec) where the scenario is about packets paho hides (a second
CONNECT, a silent client, an unacknowledged delivery, a server DISCONNECT's reason code).
Every docstring cites the rules of MQTT Version 5.0 (OASIS Standard, 7 March 2019) it checks.

The broker runs as the suite expects it configured: ``keepalive_max = 60`` (the suite wants a
Server Keep Alive of 60 for a client asking 120). Every wait is bounded; the only sleeps are
in scenarios about time (session expiry, message expiry, will delay) or where the check is
that something does NOT arrive and no later event can stand for it (flow control).
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.broker_process import ThreadedBroker, make_config

paho = pytest.importorskip("paho.mqtt.client", reason="paho-mqtt is not installed")
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402
from paho.mqtt.subscribeoptions import SubscribeOptions  # noqa: E402

WAIT = 10.0  # seconds: upper bound of every wait for something that must happen
KEEPALIVE_MAX = 60  # the suite's test_server_keep_alive expects exactly this
USER_PROPS = [("a", "2"), ("c", "3")]


# MQTT5_CONFORMANCE_PORT=N runs the module against a broker already listening on
# 127.0.0.1:N instead of a fresh filemq broker per test (to check the tests themselves
# against mosquitto, configured as /work/tools/mosquitto_paho5.conf: max_keepalive 60).
EXTERNAL_PORT = int(os.environ.get("MQTT5_CONFORMANCE_PORT", "0"))


@dataclass
class ExternalBroker:
    port: int


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[ThreadedBroker | ExternalBroker]:
    if EXTERNAL_PORT:
        yield ExternalBroker(EXTERNAL_PORT)
        return
    b = ThreadedBroker(make_config(tmp_path, keepalive_max=KEEPALIVE_MAX))
    b.start()
    try:
        yield b
    finally:
        b.stop()


Broker5 = ThreadedBroker | ExternalBroker


# ---------------------------------------------------------------------------------------------
# paho-mqtt 2.x, MQTT 5


@dataclass
class Connack:
    reason: int
    session_present: bool
    properties: Any


class Client5:
    """A paho-mqtt 2.x MQTT 5 client in its own network thread; events go into queues."""

    def __init__(self, port: int, client_id: str = "", *, clean_start: bool = True,
                 properties: Properties | None = None, keepalive: int = 60,
                 will: tuple[str, bytes, int, Properties | None] | None = None,
                 manual_ack: bool = False) -> None:
        self.port = port
        self.messages: queue.Queue[Any] = queue.Queue()
        self.connacks: queue.Queue[Connack] = queue.Queue()
        self.subacks: queue.Queue[list[int]] = queue.Queue()
        self.unsubacks: queue.Queue[int] = queue.Queue()
        self.disconnects: queue.Queue[int] = queue.Queue()
        c = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id,
                        protocol=paho.MQTTv5, manual_ack=manual_ack)
        c.reconnect_delay_set(60, 120)  # a test that is disconnected stays disconnected
        if will is not None:
            c.will_set(will[0], will[1], qos=will[2], properties=will[3])
        c.on_message = lambda _c, _u, m: self.messages.put(m)
        c.on_connect = lambda _c, _u, flags, rc, props: self.connacks.put(
            Connack(rc.value, bool(flags.session_present), props))
        c.on_subscribe = lambda _c, _u, _mid, rcs, _p: self.subacks.put([r.value for r in rcs])
        c.on_unsubscribe = lambda _c, _u, mid, _rcs, _p: self.unsubacks.put(mid)
        c.on_disconnect = lambda _c, _u, _f, rc, _p: self.disconnects.put(rc.value)
        self.c = c
        self.connack = self.connect(clean_start=clean_start, properties=properties,
                                    keepalive=keepalive)

    def connect(self, *, clean_start: bool, properties: Properties | None = None,
                keepalive: int = 60) -> Connack:
        self.c.connect("127.0.0.1", self.port, keepalive=keepalive, clean_start=clean_start,
                       properties=properties)
        self.c.loop_start()
        connack = self.connacks.get(timeout=WAIT)
        self.connack = connack
        if connack.reason != 0:
            self.c.loop_stop()
            raise AssertionError(f"CONNACK reason 0x{connack.reason:02x}")
        return connack

    def subscribe(self, *filters: tuple[str, SubscribeOptions],
                  properties: Properties | None = None) -> list[int]:
        self.c.subscribe(list(filters), properties=properties)
        return self.subacks.get(timeout=WAIT)

    def unsubscribe(self, *filters: str) -> None:
        self.c.unsubscribe(list(filters))
        self.unsubacks.get(timeout=WAIT)

    def publish(self, topic: str, payload: bytes, qos: int = 0, *, retain: bool = False,
                properties: Properties | None = None) -> None:
        """Publish and wait until the broker acknowledged it (QoS 1/2) or it was written (QoS 0)."""
        info = self.c.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        info.wait_for_publish(WAIT)
        assert info.is_published(), f"{topic} qos {qos} not acknowledged"

    def get(self, timeout: float = WAIT) -> Any:
        return self.messages.get(timeout=timeout)

    def get_until(self, payload: bytes, limit: int = 50) -> list[Any]:
        """Every message up to and including the first whose payload is ``payload``."""
        got = []
        for _ in range(limit):
            m = self.get()
            got.append(m)
            if m.payload == payload:
                return got
        raise AssertionError(f"no {payload!r} among {limit} messages")

    def no_message(self) -> None:
        assert self.messages.empty(), [(m.topic, m.payload) for m in list(self.messages.queue)]

    def disconnect(self, properties: Properties | None = None) -> None:
        self.c.disconnect(properties=properties)
        self.disconnects.get(timeout=WAIT)
        self.c.loop_stop()


def props(packet_type: int, **values: Any) -> Properties:
    p = Properties(packet_type)
    for name, value in values.items():
        if name == "UserProperty":
            for pair in value:
                p.UserProperty = pair
        else:
            setattr(p, name, value)
    return p


def sub(qos: int = 2, **options: Any) -> SubscribeOptions:
    return SubscribeOptions(qos=qos, **options)


# ---------------------------------------------------------------------------------------------
# Raw MQTT 5 packets, built by hand (independent of filemq's codec)

# property identifier -> type (spec 2.2.2.2, table 2-4)
PROP_TYPES = {1: "byte", 2: "u32", 3: "str", 8: "str", 9: "bin", 11: "vbi", 17: "u32",
              18: "str", 19: "u16", 21: "str", 22: "bin", 23: "byte", 24: "u32", 25: "byte",
              26: "str", 28: "str", 31: "str", 33: "u16", 34: "u16", 35: "u16", 36: "byte",
              37: "byte", 38: "pair", 39: "u32", 40: "byte", 41: "byte", 42: "byte"}
SESSION_EXPIRY, RECEIVE_MAXIMUM, TOPIC_ALIAS_MAXIMUM, TOPIC_ALIAS = 17, 33, 34, 35
USER_PROPERTY = 38
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP, SUBSCRIBE, SUBACK = range(1, 10)
DISCONNECT = 14


def vbi(n: int) -> bytes:
    out = bytearray()
    while True:
        digit, n = n % 128, n // 128
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def read_vbi(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def mqtt_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return len(b).to_bytes(2, "big") + b


def encode_props(items: Sequence[tuple[int, Any]] = ()) -> bytes:
    body = bytearray()
    for ident, value in items:
        kind = PROP_TYPES[ident]
        body += vbi(ident)
        if kind == "byte":
            body.append(value)
        elif kind in ("u16", "u32"):
            body += value.to_bytes(2 if kind == "u16" else 4, "big")
        elif kind == "vbi":
            body += vbi(value)
        elif kind in ("str", "bin"):
            body += mqtt_str(value)
        else:
            body += mqtt_str(value[0]) + mqtt_str(value[1])
    return vbi(len(body)) + bytes(body)


def decode_props(buf: bytes, pos: int) -> tuple[dict[int, list[Any]], int]:
    out: dict[int, list[Any]]
    length, pos = read_vbi(buf, pos)
    end, out = pos + length, {}
    while pos < end:
        ident, pos = read_vbi(buf, pos)
        kind = PROP_TYPES[ident]
        value: Any
        if kind == "byte":
            value, pos = buf[pos], pos + 1
        elif kind in ("u16", "u32"):
            n = 2 if kind == "u16" else 4
            value, pos = int.from_bytes(buf[pos:pos + n], "big"), pos + n
        elif kind == "vbi":
            value, pos = read_vbi(buf, pos)
        else:
            parts = []
            for _ in range(2 if kind == "pair" else 1):
                n = int.from_bytes(buf[pos:pos + 2], "big")
                raw = buf[pos + 2:pos + 2 + n]
                parts.append(raw if kind == "bin" else raw.decode())
                pos += 2 + n
            value = tuple(parts) if kind == "pair" else parts[0]
        out.setdefault(ident, []).append(value)
    return out, end


def packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + vbi(len(body)) + body


def connect5(client_id: str = "", *, clean_start: bool = True, keepalive: int = 0,
             properties: Sequence[tuple[int, Any]] = (),
             will: tuple[str, bytes, int, Sequence[tuple[int, Any]]] | None = None,
             protocol_name: str = "MQTT") -> bytes:
    flags = 0x02 if clean_start else 0
    payload = mqtt_str(client_id)
    if will is not None:
        topic, message, qos, will_props = will
        flags |= 0x04 | (qos << 3)
        payload += encode_props(will_props) + mqtt_str(topic) + mqtt_str(message)
    body = (mqtt_str(protocol_name) + bytes([5, flags]) + keepalive.to_bytes(2, "big")
            + encode_props(properties) + payload)
    return packet(CONNECT << 4, body)


def publish5(topic: str, payload: bytes, qos: int = 0, pid: int = 0,
             properties: Sequence[tuple[int, Any]] = ()) -> bytes:
    body = mqtt_str(topic) + (pid.to_bytes(2, "big") if qos else b"") + encode_props(properties)
    return packet((PUBLISH << 4) | (qos << 1), body + payload)


def subscribe5(pid: int, *filters: tuple[str, int]) -> bytes:
    body = pid.to_bytes(2, "big") + encode_props()
    for topic, options in filters:
        body += mqtt_str(topic) + bytes([options])
    return packet((SUBSCRIBE << 4) | 0x02, body)


def ack5(ptype: int, pid: int) -> bytes:
    return packet((ptype << 4) | (0x02 if ptype == PUBREL else 0), pid.to_bytes(2, "big"))


def disconnect5(reason: int = 0, properties: Sequence[tuple[int, Any]] = ()) -> bytes:
    return packet(DISCONNECT << 4, bytes([reason]) + encode_props(properties))


@dataclass
class Packet:
    type: int
    flags: int
    body: bytes
    properties: dict[int, list[Any]] = field(default_factory=dict)
    # PUBLISH only
    topic: str = ""
    pid: int = 0
    payload: bytes = b""

    @property
    def qos(self) -> int:
        return (self.flags >> 1) & 3

    @property
    def dup(self) -> bool:
        return bool(self.flags & 0x08)

    @property
    def reason(self) -> int:
        """CONNACK/DISCONNECT/PUBACK...: the reason code (0 when the packet leaves it out)."""
        if self.type == CONNACK:
            return self.body[1]
        if self.type == DISCONNECT:
            return self.body[0] if self.body else 0
        return self.body[2] if len(self.body) > 2 else 0


def parse(first: int, body: bytes) -> Packet:
    p = Packet(first >> 4, first & 0x0F, body)
    if p.type == CONNACK and len(body) > 2:
        p.properties, _ = decode_props(body, 2)
    elif p.type == DISCONNECT and len(body) > 1:
        p.properties, _ = decode_props(body, 1)
    elif p.type == PUBLISH:
        n = int.from_bytes(body[:2], "big")
        p.topic, pos = body[2:2 + n].decode(), 2 + n
        if p.qos:
            p.pid, pos = int.from_bytes(body[pos:pos + 2], "big"), pos + 2
        p.properties, pos = decode_props(body, pos)
        p.payload = body[pos:]
    elif p.type in (PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK):
        p.pid = int.from_bytes(body[:2], "big")
    return p


class Raw:
    """One TCP connection speaking hand-built MQTT 5 packets."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self, n: int) -> bool:
        while len(self.buf) < n:
            try:
                chunk = self.sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                chunk = b""
            if not chunk:
                return False
            self.buf += chunk
        return True

    def read(self, timeout: float = WAIT) -> Packet | None:
        """The next packet, or None once the server closed the connection."""
        self.sock.settimeout(timeout)
        if not self._fill(2):
            return None
        length, pos = 0, 1
        for shift in range(0, 28, 7):
            if not self._fill(pos + 1):
                return None
            b = self.buf[pos]
            pos += 1
            length |= (b & 0x7F) << shift
            if not b & 0x80:
                break
        if not self._fill(pos + length):
            return None
        first, body = self.buf[0], self.buf[pos:pos + length]
        self.buf = self.buf[pos + length:]
        return parse(first, body)

    def expect(self, ptype: int, timeout: float = WAIT) -> Packet:
        p = self.read(timeout)
        assert p is not None, f"connection closed while waiting for packet type {ptype}"
        assert p.type == ptype, f"expected packet type {ptype}, got {p}"
        return p

    def connect(self, client_id: str = "", **kwargs: Any) -> Packet:
        self.send(connect5(client_id, **kwargs))
        connack = self.expect(CONNACK)
        assert connack.reason == 0, connack
        return connack

    def closed_by_server(self, timeout: float = WAIT) -> list[Packet]:
        """Read until the server closes the connection; return what it sent before."""
        got: list[Packet] = []
        for _ in range(100_000):
            p = self.read(timeout)
            if p is None:
                return got
            got.append(p)
        raise AssertionError("server kept sending and never closed the connection")

    def close(self) -> None:
        """Drop the TCP connection without DISCONNECT (a network failure, for the broker)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def silent_will_client(port: int, client_id: str, topic: str, message: bytes, *,
                       keepalive: int = 0, session_expiry: int = 0,
                       will_props: Sequence[tuple[int, Any]] = ()) -> Raw:
    raw = Raw(port)
    connect_props = [(SESSION_EXPIRY, session_expiry)] if session_expiry else []
    raw.connect(client_id, keepalive=keepalive, properties=connect_props,
                will=(topic, message, 1, will_props))
    return raw


# ---------------------------------------------------------------------------------------------
# The scenarios of client_test5.py that mosquitto 2.0 passes


def test_basic(broker: Broker5) -> None:
    """test_basic: CONNECT/CONNACK 0x00 twice; SUBSCRIBE QoS 2, PUBLISH QoS 0/1/2 come back at
    their own QoS (3.8.4: the minimum of published and granted QoS; 4.3 QoS flows); a second
    CONNECT on the same connection is a Protocol Error that closes it (MQTT-3.1.0-2, 4.13); a
    wrong protocol name is not accepted as MQTT 5 (MQTT-3.1.2-1)."""
    a = Client5(broker.port, "basic")
    assert a.connack.reason == 0
    a.disconnect()
    assert a.connect(clean_start=False).reason == 0
    assert a.subscribe(("b/TopicA", sub(2))) == [2]
    for q in (0, 1, 2):
        a.publish("b/TopicA", b"qos %d" % q, q)
    got = sorted((m.payload, m.qos) for m in (a.get(), a.get(), a.get()))
    assert got == [(b"qos 0", 0), (b"qos 1", 1), (b"qos 2", 2)]
    a.disconnect()

    raw = Raw(broker.port)
    raw.connect("basic")
    raw.send(connect5("basic"))
    after = raw.closed_by_server()
    assert all(p.type == DISCONNECT and p.reason >= 0x80 for p in after), after

    raw = Raw(broker.port)
    raw.send(connect5("basic", protocol_name="hj"))
    after = raw.closed_by_server()
    assert all(p.type in (CONNACK, DISCONNECT) and p.reason >= 0x80 for p in after), after


def test_retained_message(broker: Broker5) -> None:
    """test_retained_message: retained PUBLISHes at QoS 0/1/2 with user properties are sent to
    a later wildcard subscription (3.3.1.3; MQTT-3.3.1-9 retain handling 0), each with its user
    properties, in order (MQTT-3.3.2-17, MQTT-3.3.2-18), at QoS 0, 1 and 2."""
    a = Client5(broker.port, "retainer")
    pp = props(PacketTypes.PUBLISH, UserProperty=USER_PROPS)
    for q, topic in enumerate(("r/TopicA/B", "r/Topic/C", "r/TopicA/C")):
        a.publish(topic, b"qos %d" % q, q, retain=True, properties=pp)
    assert a.subscribe(("r/+/+", sub(2))) == [2]
    got = [a.get() for _ in range(3)]
    for m in got:
        assert m.retain
        assert m.properties.UserProperty == USER_PROPS
    assert sorted(m.qos for m in got) == [0, 1, 2]
    a.disconnect()


def test_will_message(broker: Broker5) -> None:
    """test_will_message: a client that goes silent past 1.5 x its keep alive is closed
    (MQTT-3.1.2-22) and its will, with its user properties in order, is published
    (MQTT-3.1.2-8; will properties 3.1.3.2, MQTT-3.1.3-10)."""
    b = Client5(broker.port, "will-watcher")
    assert b.subscribe(("w/Topic/C", sub(2))) == [2]
    silent = silent_will_client(broker.port, "will-sender", "w/Topic/C", b"will message",
                                keepalive=1, will_props=[(USER_PROPERTY, p) for p in USER_PROPS])
    m = b.get()
    assert (m.topic, m.payload) == ("w/Topic/C", b"will message")
    assert m.properties.UserProperty == USER_PROPS
    silent.close()
    b.disconnect()


def test_zero_length_clientid(broker: Broker5) -> None:
    """test_zero_length_clientid: a zero-length ClientID is accepted, with Clean Start 0 as with
    1, and gets a unique ClientID returned as Assigned Client Identifier (MQTT-3.1.3-6,
    MQTT-3.1.3-7, MQTT-3.2.2-16)."""
    ids = []
    for clean_start in (False, True):
        c = Client5(broker.port, "", clean_start=clean_start)
        assert c.connack.reason == 0
        ids.append(c.connack.properties.AssignedClientIdentifier)
        c.disconnect()
    assert all(ids) and ids[0] != ids[1], ids


def test_offline_message_queueing(broker: Broker5) -> None:
    """test_offline_message_queueing: a session with Session Expiry Interval > 0 outlives its
    connection (MQTT-3.1.2-23); QoS 1 and 2 messages published meanwhile are delivered when it
    resumes with Clean Start 0 (MQTT-3.1.2-5, session state 4.1; QoS 0 ones may be too)."""
    a = Client5(broker.port, "offline", properties=props(PacketTypes.CONNECT,
                                                          SessionExpiryInterval=99999))
    assert a.subscribe(("o/+/+", sub(2))) == [2]
    a.disconnect()
    b = Client5(broker.port, "offline-pub")
    for q, topic in enumerate(("o/TopicA/B", "o/Topic/C", "o/TopicA/C")):
        b.publish(topic, b"qos %d" % q, q)
    assert a.connect(clean_start=False).session_present
    got: set[tuple[bytes, int]] = set()
    for _ in range(3):
        if {(b"qos 1", 1), (b"qos 2", 2)} <= got:
            break
        m = a.get()
        got.add((m.payload, m.qos))
    assert {(b"qos 1", 1), (b"qos 2", 2)} <= got <= {(b"qos 0", 0), (b"qos 1", 1), (b"qos 2", 2)}
    a.disconnect()
    b.disconnect()


def test_overlapping_subscriptions(broker: Broker5) -> None:
    """test_overlapping_subscriptions: a message matching two of a client's subscriptions
    (QoS 2 and QoS 1) arrives once at QoS 2 or once per subscription at QoS 2 and 1
    (3.3.4 overlapping subscriptions, MQTT-3.3.4-2)."""
    a = Client5(broker.port, "overlap")
    assert a.subscribe(("v/TopicA/#", sub(2)), ("v/TopicA/+", sub(1))) == [2, 1]
    a.publish("v/TopicA/C", b"overlapping topic filters", 2)
    first = a.get()
    try:  # the optional second copy: there is no later event to wait for instead
        got = [first, a.get(timeout=1.0)]
    except queue.Empty:
        got = [first]
    assert sorted(m.qos for m in got) in ([2], [1, 2]), [(m.topic, m.qos) for m in got]
    a.disconnect()


def test_keepalive(broker: Broker5) -> None:
    """test_keepalive: with a non-zero Keep Alive and no packet for 1.5 x that period the
    server closes the connection as if the network failed (MQTT-3.1.2-22; it may send
    DISCONNECT 0x8D first) and publishes the will (MQTT-3.1.2-8)."""
    b = Client5(broker.port, "ka-watcher")
    assert b.subscribe(("k/TopicA", sub(2))) == [2]
    started = time.monotonic()
    silent = silent_will_client(broker.port, "ka-silent", "k/TopicA", b"keepalive expiry",
                                keepalive=1)
    m = b.get()
    assert m.payload == b"keepalive expiry"
    assert time.monotonic() - started >= 1.0
    before_close = silent.closed_by_server()
    assert all(p.type == DISCONNECT and p.reason == 0x8D for p in before_close), before_close
    b.disconnect()


def test_redelivery_on_reconnect(broker: Broker5) -> None:
    """test_redelivery_on_reconnect: QoS 1 and 2 PUBLISHes the client never acknowledged are
    re-sent when the session resumes with Clean Start 0, with their original Packet
    Identifiers (MQTT-4.4.0-1) and DUP set (MQTT-3.3.1-1)."""
    raw = Raw(broker.port)
    raw.connect("redeliver", properties=[(SESSION_EXPIRY, 99999)])
    raw.send(subscribe5(1, ("d/TopicA/#", 2)))
    assert raw.expect(SUBACK).body[-1] == 2
    raw.send(publish5("d/TopicA/B", b"q1", 1, pid=10) + publish5("d/TopicA/C", b"q2", 2, pid=11))
    first: dict[bytes, Packet] = {}
    for _ in range(20):
        if len(first) == 2:
            break
        p = raw.read()
        assert p is not None
        if p.type == PUBREC:
            raw.send(ack5(PUBREL, p.pid))
        elif p.type == PUBLISH:
            first[p.payload] = p  # deliberately never acknowledged
    assert set(first) == {b"q1", b"q2"}
    raw.send(disconnect5())
    raw.close()

    raw = Raw(broker.port)
    connack = raw.connect("redeliver", clean_start=False, properties=[(SESSION_EXPIRY, 99999)])
    assert connack.body[0] & 1, "session not present"
    again: dict[bytes, Packet] = {}
    for _ in range(20):
        if len(again) == 2:
            break
        p = raw.read()
        assert p is not None
        if p.type == PUBLISH:
            again[p.payload] = p
    assert {k: (p.pid, p.qos) for k, p in again.items()} == {
        k: (p.pid, p.qos) for k, p in first.items()}
    assert all(p.dup for p in again.values())
    raw.close()


def test_dollar_topics(broker: Broker5) -> None:
    """test_dollar_topics: filters starting with a wildcard do not match topic names starting
    with $ (MQTT-4.7.2-1)."""
    b = Client5(broker.port, "dollar")
    no_retained = sub(2, retainHandling=2)  # only what is published from now on
    assert b.subscribe(("+/+", no_retained), ("#", no_retained)) == [2, 2]
    b.publish("$TopicA/B", b"", 1)
    b.publish("TopicA/B", b"marker", 1)
    got = b.get_until(b"marker")
    assert [m.topic for m in got] == ["TopicA/B"]
    b.disconnect()


def test_unsubscribe(broker: Broker5) -> None:
    """test_unsubscribe: after UNSUBSCRIBE of one of three filters the server stops sending
    messages for it and keeps the others (MQTT-3.10.4-1, MQTT-3.10.4-2)."""
    b = Client5(broker.port, "unsub")
    for topic in ("u/TopicA", "u/TopicA/B", "u/Topic/C"):
        assert b.subscribe((topic, sub(2))) == [2]
    b.unsubscribe("u/TopicA")
    a = Client5(broker.port, "unsub-pub")
    a.publish("u/TopicA", b"topic 0 - unsubscribed", 1)
    a.publish("u/TopicA/B", b"topic 1", 1)
    a.publish("u/Topic/C", b"topic 2", 1)
    got = b.get_until(b"topic 2")
    assert sorted(m.payload for m in got) == [b"topic 1", b"topic 2"]
    a.disconnect()
    b.disconnect()


def test_session_expiry(broker: Broker5) -> None:
    """test_session_expiry: Session Expiry Interval 0 ends the session with the connection; a
    positive one keeps it that long after the close, then it is gone (3.1.2.11.2,
    MQTT-3.1.2-23; CONNACK Session Present 3.2.2.1.1, MQTT-3.1.2-5/-6); a DISCONNECT's Session
    Expiry Interval replaces the CONNECT's (3.14.2.2.2), 0 ending the session at once."""
    def connect(clean_start: bool, expiry: int) -> tuple[Client5, bool]:
        c = Client5(broker.port, "expiring", clean_start=clean_start,
                    properties=props(PacketTypes.CONNECT, SessionExpiryInterval=expiry))
        assert c.connack.reason == 0
        return c, c.connack.session_present

    a, present = connect(True, 0)
    assert not present
    a.subscribe(("e/TopicA", sub(2)))
    a.disconnect()
    a, present = connect(False, 0)
    assert not present, "expiry 0: the session must end with the connection"
    a.disconnect()

    a, present = connect(True, 1)
    a.subscribe(("e/TopicA", sub(2)))
    a.disconnect()
    a, present = connect(False, 1)
    assert present, "expiry 1 s: the session must still be there at once"
    a.disconnect()
    time.sleep(2.5)  # the interval plus the broker's 1 s timer granularity
    a, present = connect(False, 1)
    assert not present, "expiry 1 s: the session must be gone 2.5 s after the close"
    a.disconnect()

    a, present = connect(True, 1)
    a.subscribe(("e/TopicA", sub(2)))
    a.disconnect(props(PacketTypes.DISCONNECT, SessionExpiryInterval=5))
    time.sleep(1.5)  # longer than the CONNECT's 1 s, shorter than the DISCONNECT's 5 s
    a, present = connect(False, 1)
    assert present, "the DISCONNECT's 5 s must replace the CONNECT's 1 s"
    a.disconnect(props(PacketTypes.DISCONNECT, SessionExpiryInterval=0))
    a, present = connect(False, 1)
    assert not present, "a DISCONNECT with expiry 0 must end the session at once"
    a.disconnect()


def test_user_properties(broker: Broker5) -> None:
    """test_user_properties: user properties of a PUBLISH reach the subscriber at QoS 0/1/2
    (MQTT-3.3.2-17), in their order (MQTT-3.3.2-18)."""
    a = Client5(broker.port, "userprops")
    a.subscribe(("p/TopicA", sub(2)))
    pp = props(PacketTypes.PUBLISH, UserProperty=USER_PROPS)
    for q in (0, 1, 2):
        a.publish("p/TopicA", b"", q, properties=pp)
    got = [a.get() for _ in range(3)]
    assert [m.properties.UserProperty for m in got] == [USER_PROPS] * 3
    assert sorted(m.qos for m in got) == [0, 1, 2]
    a.disconnect()


def test_payload_format(broker: Broker5) -> None:
    """test_payload_format: Payload Format Indicator and Content Type reach the subscriber
    unaltered at QoS 0/1/2 (MQTT-3.3.2-4, MQTT-3.3.2-20)."""
    a = Client5(broker.port, "format")
    a.subscribe(("f/TopicA", sub(2)))
    pp = props(PacketTypes.PUBLISH, PayloadFormatIndicator=1, ContentType="My name")
    for q in (0, 1, 2):
        a.publish("f/TopicA", b"", q, properties=pp)
    got = [a.get() for _ in range(3)]
    for m in got:
        assert (m.properties.PayloadFormatIndicator, m.properties.ContentType) == (1, "My name")
    assert sorted(m.qos for m in got) == [0, 1, 2]
    a.disconnect()


def test_publication_expiry(broker: Broker5) -> None:
    """test_publication_expiry: a message whose Message Expiry Interval passed before delivery
    started is never delivered (MQTT-3.3.2-5); one still alive is delivered with the interval
    minus the time it waited (MQTT-3.3.2-6)."""
    b = Client5(broker.port, "expiry-sub", properties=props(PacketTypes.CONNECT,
                                                           SessionExpiryInterval=99999))
    b.subscribe(("x/TopicA", sub(2)))
    b.disconnect(props(PacketTypes.DISCONNECT, SessionExpiryInterval=999999999))
    a = Client5(broker.port, "expiry-pub")
    for expiry, label in ((1, b"expire"), (10, b"don't expire")):
        pp = props(PacketTypes.PUBLISH, MessageExpiryInterval=expiry)
        a.publish("x/TopicA", b"qos 1 - " + label, 1, properties=pp)
        a.publish("x/TopicA", b"qos 2 - " + label, 2, properties=pp)
    time.sleep(2.0)  # the 1 s messages expire while the subscriber is away
    assert b.connect(clean_start=False).session_present
    a.publish("x/TopicA", b"marker", 2)  # QoS 2 like the last message: paho hands QoS 2 over at PUBREL
    got = b.get_until(b"marker")[:-1]
    assert sorted(m.payload for m in got) == [b"qos 1 - don't expire", b"qos 2 - don't expire"]
    for m in got:
        assert m.properties.MessageExpiryInterval < 10, m.properties
    a.disconnect()
    b.disconnect()


def test_subscribe_options_no_local(broker: Broker5) -> None:
    """test_subscribe_options (noLocal): with No Local set the server does not send a client
    its own publications (MQTT-3.8.3-3); other subscribers get them."""
    a = Client5(broker.port, "nolocal-a")
    b = Client5(broker.port, "nolocal-b")
    a.subscribe(("n/TopicA", sub(2, noLocal=True)))
    b.subscribe(("n/TopicA", sub(2, noLocal=True)))
    a.publish("n/TopicA", b"noLocal test", 1)
    assert b.get().payload == b"noLocal test"
    b.publish("n/TopicA", b"marker", 1)
    assert [m.payload for m in a.get_until(b"marker")] == [b"marker"]
    b.no_message()
    a.disconnect()
    b.disconnect()


def test_subscribe_options_retain_as_published(broker: Broker5) -> None:
    """test_subscribe_options (retainAsPublished): with Retain As Published set, a forwarded
    PUBLISH keeps the RETAIN flag it was published with (MQTT-3.3.1-13)."""
    a = Client5(broker.port, "rap")
    a.subscribe(("t/TopicA", sub(2, retainAsPublished=True, retainHandling=2)))
    a.publish("t/TopicA", b"retain as published false", 1, retain=False)
    a.publish("t/TopicA", b"retain as published true", 1, retain=True)
    got = [a.get(), a.get()]
    assert [(m.payload, m.retain) for m in got] == [
        (b"retain as published false", False), (b"retain as published true", True)]
    a.disconnect()


def test_subscribe_options_retain_handling(broker: Broker5) -> None:
    """test_subscribe_options (retainHandling): 0 sends retained messages at every SUBSCRIBE
    (MQTT-3.3.1-9), 1 only when the subscription did not exist (MQTT-3.3.1-10), 2 never
    (MQTT-3.3.1-11)."""
    a = Client5(broker.port, "rh")
    for q, topic in enumerate(("h/TopicA/B", "h/Topic/C", "h/TopicA/C")):
        a.publish(topic, b"qos %d" % q, q, retain=True)

    def subscribe_and_collect(client: Client5, handling: int, expected: int) -> list[int]:
        client.subscribe(("h/+/+", sub(2, retainHandling=handling)))
        got = [client.get() for _ in range(expected)]
        # Not retained, QoS 2 like the last retained one (paho hands QoS 2 over at PUBREL):
        # nothing more may come before it.
        client.publish("h/x/marker", b"marker", 2)
        assert [m.payload for m in client.get_until(b"marker")] == [b"marker"]
        assert all(m.retain for m in got)
        return sorted(m.qos for m in got)

    assert subscribe_and_collect(a, 1, 3) == [0, 1, 2]
    assert subscribe_and_collect(a, 1, 0) == []
    a.disconnect()
    a.connect(clean_start=True)
    assert subscribe_and_collect(a, 2, 0) == []
    assert subscribe_and_collect(a, 2, 0) == []
    a.disconnect()
    a.connect(clean_start=True)
    assert subscribe_and_collect(a, 0, 3) == [0, 1, 2]
    assert subscribe_and_collect(a, 0, 3) == [0, 1, 2]
    a.disconnect()


def test_assigned_clientid(broker: Broker5) -> None:
    """test_assigned_clientid: a CONNECT with a zero-length ClientID gets a CONNACK with a
    non-empty Assigned Client Identifier (3.2.2.3.7, MQTT-3.2.2-16)."""
    c = Client5(broker.port, "")
    assert c.connack.properties.AssignedClientIdentifier
    c.disconnect()


def test_request_response(broker: Broker5) -> None:
    """test_request_response: Response Topic and Correlation Data reach the responder
    unaltered (MQTT-3.3.2-15, MQTT-3.3.2-16; request/response 4.10), whose reply to the
    Response Topic reaches the requester."""
    a = Client5(broker.port, "requester")
    b = Client5(broker.port, "responder")
    a.subscribe(("q/TopicA", sub(2, noLocal=True)))
    b.subscribe(("q/TopicA", sub(2, noLocal=True)))
    a.publish("q/TopicA", b"request", 1, properties=props(
        PacketTypes.PUBLISH, ResponseTopic="q/TopicA", CorrelationData=b"334"))
    req = b.get()
    assert (req.properties.ResponseTopic, req.properties.CorrelationData) == ("q/TopicA", b"334")
    b.publish(req.properties.ResponseTopic, b"response", 1, properties=props(
        PacketTypes.PUBLISH, CorrelationData=req.properties.CorrelationData))
    resp = a.get()
    assert (resp.payload, resp.properties.CorrelationData) == (b"response", b"334")
    a.disconnect()
    b.disconnect()


def test_client_topic_alias(broker: Broker5) -> None:
    """test_client_topic_alias: a Topic Alias of 0 is not permitted (MQTT-3.3.2-8,
    3.3.2.3.4): the server closes the connection with a DISCONNECT carrying an error reason
    (0x94 Topic Alias invalid; mosquitto sends 0x81); within the advertised Topic Alias Maximum
    (3.2.2.3.8) a client sets an alias with a topic and then uses it with an empty topic name;
    aliases do not carry over to a new connection (MQTT-3.3.2-7): using one there without a
    topic is a Protocol Error (DISCONNECT 0x82, or 0x94)."""
    raw = Raw(broker.port)
    raw.connect("alias")
    raw.send(publish5("a/TopicA", b"topic alias 0", 1, pid=1, properties=[(TOPIC_ALIAS, 0)]))
    after = raw.closed_by_server()
    assert [p.type for p in after] == [DISCONNECT] and after[0].reason >= 0x80, after

    b = Client5(broker.port, "alias-watcher")
    b.subscribe(("a/TopicA", sub(2)))
    raw = Raw(broker.port)
    connack = raw.connect("alias", properties=[(TOPIC_ALIAS_MAXIMUM, 0), (SESSION_EXPIRY, 99999)])
    assert connack.properties.get(TOPIC_ALIAS_MAXIMUM, [0])[0] >= 1, connack.properties
    raw.send(publish5("a/TopicA", b"topic alias 1", 1, pid=1, properties=[(TOPIC_ALIAS, 1)]))
    raw.send(publish5("", b"topic alias 2", 1, pid=2, properties=[(TOPIC_ALIAS, 1)]))
    assert {raw.expect(PUBACK).pid, raw.expect(PUBACK).pid} == {1, 2}
    got = [b.get(), b.get()]
    assert [(m.topic, m.payload) for m in got] == [
        ("a/TopicA", b"topic alias 1"), ("a/TopicA", b"topic alias 2")]
    raw.send(disconnect5())
    raw.close()

    raw = Raw(broker.port)
    raw.connect("alias", clean_start=False)
    raw.send(publish5("", b"topic alias 4", 1, pid=3, properties=[(TOPIC_ALIAS, 1)]))
    after = raw.closed_by_server()
    assert [p.type for p in after] == [DISCONNECT] and after[0].reason in (0x82, 0x94), after
    b.no_message()
    b.disconnect()


def test_maximum_packet_size(broker: Broker5) -> None:
    """test_maximum_packet_size: the server never sends a client a packet larger than the
    client's Maximum Packet Size (MQTT-3.1.2-24); such a message is discarded for that client
    as if sent (MQTT-3.1.2-25) and later small ones still arrive."""
    a = Client5(broker.port, "maxpacket", properties=props(PacketTypes.CONNECT,
                                                          MaximumPacketSize=64))
    a.subscribe(("m/TopicA", sub(2)))
    a.publish("m/TopicA", b"." * 32, 0)
    assert a.get().payload == b"." * 32
    a.publish("m/TopicA", b"." * 64, 1)
    a.publish("m/TopicA", b"marker", 1)
    assert [m.payload for m in a.get_until(b"marker")] == [b"marker"]
    a.disconnect()


def test_server_keep_alive(broker: Broker5) -> None:
    """test_server_keep_alive: a client asking for a Keep Alive above the server's maximum gets
    the value it must use as Server Keep Alive in CONNACK (3.2.2.3.14, MQTT-3.1.2-21); the
    suite expects 60 (here broker.keepalive_max = 60)."""
    c = Client5(broker.port, "serverka", keepalive=120)
    assert c.connack.properties.ServerKeepAlive == KEEPALIVE_MAX
    c.disconnect()


def test_flow_control1(broker: Broker5) -> None:
    """test_flow_control1: the server sends no more unacknowledged QoS 1/2 PUBLISHes than the
    client's Receive Maximum (MQTT-3.3.4-9, 3.1.2.11.3, 4.9); an acknowledgement lets the next
    one go."""
    a = Client5(broker.port, "flow", manual_ack=True,
                properties=props(PacketTypes.CONNECT, ReceiveMaximum=2, SessionExpiryInterval=0))
    a.subscribe(("c/TopicA", sub(2)))
    p = Client5(broker.port, "flow-pub")
    for i in (1, 2, 3):
        p.publish("c/TopicA", b"message %d" % i, 1)
    first, second = a.get(), a.get()
    assert first.qos == second.qos == 1
    with pytest.raises(queue.Empty):  # a third before any PUBACK would exceed Receive Maximum
        a.get(timeout=1.0)
    a.c.ack(first.mid, 1)
    third = a.get()
    assert sorted(m.payload for m in (first, second, third)) == [
        b"message 1", b"message 2", b"message 3"]
    a.c.ack(second.mid, 1)
    a.c.ack(third.mid, 1)
    a.disconnect()
    p.disconnect()


def test_shared_subscriptions(broker: Broker5) -> None:
    """test_shared_subscriptions: a message to a topic both clients subscribe to normally
    reaches both; one matching their shared subscription $share/sharename/... reaches exactly
    one of them (4.8.2)."""
    a = Client5(broker.port, "share-a")
    b = Client5(broker.port, "share-b")
    for c in (a, b):
        assert c.subscribe(("$share/sharename/s/x", sub(2)), ("s/TopicA", sub(2))) == [2, 2]
    b.publish("s/TopicA", b"message 0", 0)
    assert a.get().payload == b.get().payload == b"message 0"
    b.publish("s/x", b"shared", 0)
    b.publish("s/TopicA", b"marker", 1)
    got = [m.payload for m in a.get_until(b"marker") + b.get_until(b"marker")]
    # The shared copy comes through the share's consumer group and may trail the marker on the
    # ordinary subscription (seen with the suite's files run side by side on a loaded machine):
    # wait for it, bounded, before counting.
    deadline = time.monotonic() + 10.0
    while b"shared" not in got and time.monotonic() < deadline:
        for c in (a, b):
            with contextlib.suppress(queue.Empty):
                got.append(c.messages.get(timeout=0.1).payload)
    assert got.count(b"shared") == 1, got
    a.disconnect()
    b.disconnect()
