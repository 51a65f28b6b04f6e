"""The sans-I/O connection (filemq/broker/session/connection.py) driven with bytes alone, as a
Hypothesis state machine against a model of the rules it owns (issue 31 item 1).

No broker core, no event loop, no socket, no clock: :class:`_Answers` plays the core with the
least a broker must answer (accept a CONNECT, put each QoS 1 PUBLISH's PUBACK behind a commit
the test resolves) and the test passes the time in.  The model says what the client must read
back and which messages the core must be handed, in which order:

* MQTT-3.1.0-1: the first packet must be CONNECT, anything else closes the connection;
  MQTT-3.1.0-2: a second CONNECT closes it (MQTT 5: DISCONNECT 0x82 first).
* MQTT-3.12.4-1: a PINGREQ is answered with a PINGRESP.
* 4.3.2 / MQTT-4.3.2-2 with the broker's durability rule: a QoS 1 PUBLISH's PUBACK leaves only
  once its commit resolved; MQTT-4.6.0-2: PUBACKs leave in the order the PUBLISHes arrived.
* 4.6 / MQTT-4.6.0-6 (ordered topics): the core is handed the messages in arrival order,
  however the reads cut and batch them.
* MQTT 5, 3.2.2.3.3 / 3.3.4: more unacknowledged QoS 1 PUBLISHes than the Receive Maximum
  closes with DISCONNECT 0x93, at the very PUBLISH over it.
* MQTT 5, 3.3.2.3.4 / MQTT-3.3.2-9/-10: a topic alias is set by a PUBLISH with topic and
  alias, used by one with an empty topic; above the Topic Alias Maximum is 0x94, an alias
  never set is a Protocol Error (0x82).  (Alias 0, MQTT-3.3.2-8, is refused by the decoder
  with the whole read it came in: tests/test_codec5.py.)
* 3.1.2.10 / MQTT-3.1.2-24 (3.1.1), MQTT-3.1.2-22 (5.0): the connection is due to close 1.5 x
  the keepalive after the last packet; before CONNECT, the connect timeout after the accept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from filemq.broker.session.connection import CONNECTED, Connection
from filemq.broker.session.events import Acks, Publishes
from filemq.broker.session_state import SessionState
from filemq.common.config import BrokerSection
from filemq.mqtt.codec import Decoder, ProtocolError, encode, encode5, encode_puback, publish_bytes5
from filemq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Pingreq,
    Pingresp,
    Puback,
    Publish,
    PublishRun,
)
from filemq.mqtt.packets import (
    Properties as Props,
)

RECEIVE_MAXIMUM = 4
ALIAS_MAXIMUM = 3
CONNECT_TIMEOUT = 10.0


class _Commit:
    """A commit future the test resolves (what Connection needs of one: filemq.broker.session.connection.Commit)."""

    def __init__(self) -> None:
        self._done = False

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return None


class _Answers:
    """The least a broker core answers: CONNACK to a CONNECT, a PUBACK behind the open commit
    for each QoS 1 message; records what it was handed."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.messages: list[tuple[str, bytes]] = []
        self.commit = _Commit()

    def handle(self, events: Any) -> None:
        conn = self.conn
        try:
            for event in events:
                if isinstance(event, Connect):
                    conn.state = CONNECTED
                    conn.keepalive = event.keepalive
                    conn.session = SessionState("m", False)  # (its qos2_in counts toward Receive Maximum)
                    if event.protocol_level == 5:
                        conn.protocol_level = 5
                        conn.encode_packet = encode5
                    conn.send_packet(Connack(False, 0))
                elif isinstance(event, Publish):
                    self._message(event.topic, event.payload, event.qos, event.packet_id)
                elif isinstance(event, Publishes):
                    for p in event.packets:
                        self._message(p.topic, p.payload, p.qos, p.packet_id)
                elif isinstance(event, PublishRun):
                    pids: Sequence[int | None] = event.packet_ids or [None] * len(event.payloads)  # (None at QoS 0)
                    for payload, pid in zip(event.payloads, pids, strict=True):
                        self._message(event.topic, payload, event.qos, pid)
                elif isinstance(event, Disconnect):
                    conn.close("client sent DISCONNECT", will=False)
                elif isinstance(event, (Acks, Puback)):
                    raise AssertionError("the test sends no PUBACK")
        except ProtocolError as exc:
            conn.protocol_error(exc)

    def _message(self, topic: str, payload: bytes, qos: int, pid: int | None) -> None:
        self.messages.append((topic, payload))
        if qos:
            assert pid is not None
            self.conn.queue_ack(self.commit, encode_puback(pid))

    def resolve(self) -> None:
        self.commit._done = True
        self.commit = _Commit()
        self.conn.ack_ready()


class ConnectionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        config = BrokerSection(receive_maximum=RECEIVE_MAXIMUM, topic_alias_maximum=ALIAS_MAXIMUM)
        self.conn = Connection(config, "10.0.0.1:1", now=self.now)
        self.core = _Answers(self.conn)
        self.client: Decoder | None = None
        self.sent = bytearray()  # what the client reads back, decoded once it knows the level
        # The model.
        self.level = 0  # 0 before CONNECT, else 4 or 5
        self.closed = False
        self.keepalive = 0
        self.last_rx = self.now
        self.expected: list[Any] = []  # packets the client must read, in order
        self.unacked: list[int] = []  # QoS 1 ids whose PUBACK waits for the commit
        self.messages: list[tuple[str, bytes]] = []
        self.aliases: dict[int, str] = {}
        self.next_pid = 1
        self.pending: list[Any] = []  # packets of the next read

    # ---- the wire ----------------------------------------------------------------------------

    def _encode(self, p: Any) -> bytes:
        if isinstance(p, Publish) and p.properties is not None:  # (by hand: the encoder refuses alias 0)
            alias = p.properties.topic_alias
            assert alias is not None  # (only aliased PUBLISHes carry properties here)
            return publish_bytes5(p.topic, p.payload, p.qos, False, p.packet_id, False,
                                  bytes((0x23, alias >> 8, alias & 0xFF)))
        return encode5(p) if self.level == 5 or (isinstance(p, Connect) and p.protocol_level == 5) else encode(p)

    def _send(self, packets: list[Any], cuts: list[int]) -> None:
        data = b"".join(self._encode(p) for p in packets)
        bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
        for a, b in zip(bounds, bounds[1:], strict=False):
            self.now += 0.001
            self.core.handle(self.conn.receive_data(data[a:b], self.now))
        self.last_rx = self.now

    def _close(self, code: int | None) -> None:
        if code is not None and self.level == 5:
            self.expected.append(Disconnect(code))
        self.closed = True

    # ---- rules -------------------------------------------------------------------------------

    @precondition(lambda self: not self.closed and self.level == 0)
    @rule(level=st.sampled_from([4, 5]), keepalive=st.sampled_from([0, 2, 30]), cuts=st.lists(st.integers(0, 200), max_size=3))
    def connect(self, level: int, keepalive: int, cuts: list[int]) -> None:
        self._send([Connect(client_id="m", keepalive=keepalive, protocol_level=level)], cuts)
        self.level, self.keepalive = level, keepalive
        self.expected.append(Connack(False, 0))

    @precondition(lambda self: not self.closed and self.level == 0)
    @rule(packet=st.sampled_from([Pingreq(), Publish("t", b"x"), Disconnect()]))
    def anything_before_connect_closes_3_1_0_1(self, packet: Any) -> None:
        self._send([packet], [])
        self._close(None)  # (no CONNACK: 3.1.1 has none for it; MQTT 5's is not asked here)

    @precondition(lambda self: not self.closed and self.level != 0)
    @rule(cuts=st.lists(st.integers(0, 100), max_size=2))
    def second_connect_closes_3_1_0_2(self, cuts: list[int]) -> None:
        self._send([Connect(client_id="m", protocol_level=self.level)], cuts)
        self._close(0x82)

    @precondition(lambda self: not self.closed and self.level != 0)
    @rule()
    def pingreq_is_answered_3_12_4_1(self) -> None:
        self._send([Pingreq()], [])
        self.expected.append(Pingresp())

    @precondition(lambda self: not self.closed and self.level != 0)
    @rule(messages=st.lists(st.tuples(st.sampled_from(["a", "b/c"]), st.sampled_from([0, 1]),
                                      st.sampled_from(["none", "set", "use", "over", "unset"])),
                            min_size=1, max_size=6),
          cuts=st.lists(st.integers(0, 400), max_size=3))
    def publishes_in_one_read(self, messages: list[tuple[str, int, str]], cuts: list[int]) -> None:
        packets: list[Any] = []
        for i, (topic, qos, alias_use) in enumerate(messages):
            payload = f"{self.next_pid}:{i}".encode()
            pid = None
            if qos:
                pid = self.next_pid
                self.next_pid = self.next_pid % 0xFFFF + 1
            props = None
            wire_topic = topic
            if self.level == 5 and alias_use != "none":
                alias = {"set": 1 + len(topic) % ALIAS_MAXIMUM, "use": 1 + len(topic) % ALIAS_MAXIMUM,
                         "zero": 0, "over": ALIAS_MAXIMUM + 1, "unset": ALIAS_MAXIMUM}[alias_use]
                props = Props(topic_alias=alias)
                if alias_use in ("use", "unset"):
                    wire_topic = ""
            packets.append(Publish(wire_topic, payload, qos, packet_id=pid, properties=props))
        self._send(packets, cuts)
        for p in packets:  # the model, message by message
            if self.closed:
                break
            topic = p.topic
            if p.properties is not None:
                alias = p.properties.topic_alias
                if not 0 < alias <= ALIAS_MAXIMUM:
                    self._close(0x94)  # MQTT-3.3.2-9/-10
                    break
                if topic:
                    self.aliases[alias] = topic
                elif alias in self.aliases:
                    topic = self.aliases[alias]
                else:
                    self._close(0x82)  # an alias never set on this connection
                    break
            if p.qos and self.level == 5 and len(self.unacked) >= RECEIVE_MAXIMUM:
                self._close(0x93)  # 3.2.2.3.3: over our Receive Maximum
                break
            self.messages.append((topic, p.payload))
            if p.qos:
                self.unacked.append(p.packet_id)

    @precondition(lambda self: not self.closed and self.level != 0)
    @rule()
    def commit_releases_pubacks_in_order_4_6_0_2(self) -> None:
        self.core.resolve()
        self.expected.extend(Puback(pid) for pid in self.unacked)
        self.unacked.clear()

    @precondition(lambda self: not self.closed)
    @rule(dt=st.sampled_from([0.5, 2.9, 3.1, 12.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        if self.level == 0:
            due = self.conn.connected_at + CONNECT_TIMEOUT
        else:
            due = self.last_rx + 1.5 * self.keepalive if self.keepalive else float("inf")
        assert self.conn.keepalive_expired(self.now, CONNECT_TIMEOUT) == (self.now > due)

    @precondition(lambda self: not self.closed and self.level != 0)
    @rule()
    def disconnect(self) -> None:
        self._send([Disconnect()], [])
        self._close(None)

    @precondition(lambda self: self.closed)
    @rule(packet=st.sampled_from([Pingreq(), Publish("t", b"late", 1, packet_id=9)]))
    def bytes_after_the_close_make_nothing(self, packet: Any) -> None:
        assert list(self.conn.receive_data(self._encode(packet), self.now)) == []

    # ---- what must hold after every step ------------------------------------------------------

    @invariant()
    def the_client_reads_what_the_model_says(self) -> None:
        self.sent += self.conn.data_to_send()
        level = self.level or 4
        got: list[Any] = []
        if self.sent:
            dec = Decoder(server=False, protocol_level=level)
            dec.feed(bytes(self.sent))
            got = dec.packets()
        expected = self.expected
        if level == 5:  # (MQTT 5 PUBACKs decode with reason code 0 and no properties)
            expected = [Puback(e.packet_id, 0) if isinstance(e, Puback) else e for e in expected]
        assert [type(p).__name__ for p in got] == [type(p).__name__ for p in expected]
        for g, e in zip(got, expected, strict=True):
            if isinstance(e, Puback):
                assert g.packet_id == e.packet_id
            elif isinstance(e, Disconnect):
                assert g.reason_code == e.reason_code
            elif isinstance(e, Connack):
                assert g.return_code == 0

    @invariant()
    def the_core_is_handed_the_messages_in_order(self) -> None:
        assert self.core.messages == self.messages

    @invariant()
    def closed_when_the_model_says(self) -> None:
        assert self.conn.closed == self.closed, self.conn.close_reason


ConnectionMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=30, deadline=None)
test_connection_state_machine = ConnectionMachine.TestCase
