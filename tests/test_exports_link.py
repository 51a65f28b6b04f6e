"""``worker_agent.mqtt_link.ExportLink``, the MQTT export's lean publisher, at packet level.

A raw loopback server decodes what the link sends with the codec and answers with bytes the
test chooses, so the batch framing, the bulk PUBACK path (several acknowledgements in one read,
duplicates, unknown ids), QoS 2's PUBREC -> PUBREL -> PUBCOMP and the resend after a reconnect
are checked on the wire. The end-to-end durability of exports is in tests/test_exports_mqtt.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.mqtt.codec import Decoder, encode
from filemq.mqtt.packets import Connack, Connect, Packet, Pingreq, Publish, Pubrel
from filemq.queue import Queue, QueueConfig
from segments import LogConfig, Record
from worker_agent import mqtt_export
from worker_agent.mqtt_export import MqttExport, MqttExportSettings
from worker_agent.mqtt_link import ExportLink, Message, remaining_length

pytestmark = pytest.mark.timeout(30)


class RawBroker:
    """Accepts connections, answers CONNECT with CONNACK, records every packet; the test writes
    whatever bytes it wants through :attr:`writer`."""

    def __init__(self) -> None:
        self.packets: list[tuple[int, Packet]] = []  # (connection number, packet)
        self.writer: asyncio.StreamWriter | None = None
        self.connections = 0
        self.changed = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        self.writer = writer
        decoder = Decoder(1 << 20, server=True)
        try:
            while data := await reader.read(1 << 16):
                decoder.feed(data)
                for packet in decoder.packets():
                    self.packets.append((conn, packet))
                    if isinstance(packet, Connect):
                        writer.write(encode(Connack(session_present=conn > 1)))
                self.changed.set()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def publishes(self, conn: int | None = None) -> list[Publish]:
        return [p for c, p in self.packets if isinstance(p, Publish) and (conn is None or c == conn)]

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(10):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.server is not None:
            self.server.close()


def records(n: int, start: int = 0, size: int = 10, retain: bool = False) -> list[Record]:
    return [Record(start + i, 0, f"t/{i % 3}", bytes([i % 256]) * size, 1, retain) for i in range(n)]


def ack_bytes(kind: int, pid: int) -> bytes:
    return bytes((kind, 2)) + pid.to_bytes(2, "big")


def run(scenario: Callable[[RawBroker], Awaitable[None]]) -> None:
    async def main() -> None:
        broker = RawBroker()
        await broker.start()
        try:
            await scenario(broker)
        finally:
            await broker.close()

    asyncio.run(main())


def never(_offset: int) -> bool:
    return False


def test_a_batch_is_one_write_of_valid_publishes_with_the_records_fields() -> None:
    """Each record becomes a QoS 1 PUBLISH (spec 3.3) with its topic (through topic_of), payload,
    the retained flag passed through when asked, DUP when redelivered (MQTT-3.3.1-1), and a
    distinct non-zero packet id (MQTT-2.3.1-1); a payload over 127 bytes takes a 2-byte
    remaining length (spec 2.2.3)."""

    async def scenario(broker: RawBroker) -> None:
        link = ExportLink("exp", "127.0.0.1", broker.port, qos=1)
        link.topic_of = lambda topic: f"site/{topic}"
        await link.connect()
        batch = records(4, retain=True) + [Record(4, 0, "big", b"x" * 300, 1, False)]
        sent = link.publish(batch, True, lambda offset: offset == 1)
        assert sent == 4 * 10 + 300
        await broker.wait_for(lambda: len(broker.publishes()) == 5)
        got = broker.publishes()
        assert [(p.topic, p.payload, p.qos, p.retain, p.dup) for p in got] == [
            ("site/t/0", batch[0].payload, 1, True, False),
            ("site/t/1", batch[1].payload, 1, True, True),
            ("site/t/2", batch[2].payload, 1, True, False),
            ("site/t/0", batch[3].payload, 1, True, False),
            ("site/big", b"x" * 300, 1, False, False),
        ]
        ids = [p.packet_id for p in got]
        assert len(set(ids)) == 5 and 0 not in ids
        assert list(link.inflight) == ids
        link.publish(records(1, start=5), False, never)  # retain not passed through
        await broker.wait_for(lambda: len(broker.publishes()) == 6)
        assert broker.publishes()[5].retain is False
        await link.disconnect()

    run(scenario)


def test_a_connect_whose_connect_packet_cannot_be_written_leaves_the_link_closed() -> None:
    """If the CONNECT cannot be written (the transport went away between the TCP connect and
    the write, or the protocol's connection_made failed), connect() raises and the link is
    closed, so the next connect() works instead of refusing with "already connected" forever
    (what an export link did on uvloop before its transports were accepted)."""

    async def scenario(broker: RawBroker) -> None:
        link = ExportLink("exp", "127.0.0.1", broker.port, qos=1)
        real_write = link._write
        calls = 0

        def failing_write(data: bytes) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise ConnectionError("transport gone")
            real_write(data)

        link._write = failing_write  # type: ignore[method-assign]
        with pytest.raises(ConnectionError, match="transport gone"):
            await link.connect()
        assert not link.connected
        await link.connect()
        assert link.connected
        link.publish(records(1), False, never)
        await broker.wait_for(lambda: len(broker.publishes()) == 1)
        await link.disconnect()

    run(scenario)


def test_pubacks_in_one_read_complete_each_message_once() -> None:
    """Many PUBACKs in one read (spec 4.3.2: PUBACK completes a QoS 1 publish) each complete
    their message once: a duplicate PUBACK or one for an unknown id completes nothing more."""

    async def scenario(broker: RawBroker) -> None:
        link = ExportLink("exp", "127.0.0.1", broker.port, qos=1)
        done: list[Message] = []
        link.on_complete = done.extend
        await link.connect()
        batch = records(50)
        link.publish(batch, False, never)
        await broker.wait_for(lambda: len(broker.publishes()) == 50)
        ids = [p.packet_id or 0 for p in broker.publishes()]
        assert broker.writer is not None
        broker.writer.write(b"".join(ack_bytes(0x40, pid) for pid in ids[:30]))  # the bulk path
        async with asyncio.timeout(5):
            while len(done) < 30:
                await asyncio.sleep(0.01)
        assert done == batch[:30]
        # A duplicate, an unknown id, then the rest: each message still completes exactly once.
        rest = [ids[30], ids[30], 9999] + ids[31:]
        broker.writer.write(b"".join(ack_bytes(0x40, pid) for pid in rest))
        async with asyncio.timeout(5):
            while len(done) < 50:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert done == batch and not link.inflight
        # A read of known ids with one of them twice: completed once.
        more = records(2, start=100)
        link.publish(more, False, never)
        await broker.wait_for(lambda: len(broker.publishes()) == 52)
        x, y = (p.packet_id or 0 for p in broker.publishes()[50:])
        broker.writer.write(ack_bytes(0x40, x) + ack_bytes(0x40, y) + ack_bytes(0x40, x))
        async with asyncio.timeout(5):
            while len(done) < 52:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert done == batch + more and not link.inflight
        done.clear()
        # A PUBACK split across two reads goes through the decoder and still completes.
        link.publish(records(1, start=50), False, never)
        await broker.wait_for(lambda: len(broker.publishes()) == 53)
        last = ack_bytes(0x40, broker.publishes()[52].packet_id or 0)
        broker.writer.write(last[:1])
        await asyncio.sleep(0.05)
        broker.writer.write(last[1:])
        async with asyncio.timeout(5):
            while not done:
                await asyncio.sleep(0.01)
        assert [m.offset for m in done] == [50] and not link.inflight
        await link.disconnect()

    run(scenario)


def test_qos2_pubrec_is_answered_with_pubrel_and_pubcomp_completes() -> None:
    """QoS 2 (spec 4.3.3): PUBREC is answered with PUBREL (MQTT-4.3.3-1), even for an unknown
    id; only PUBCOMP completes the message; a PUBACK does not."""

    async def scenario(broker: RawBroker) -> None:
        link = ExportLink("exp", "127.0.0.1", broker.port, qos=2)
        done: list[Message] = []
        link.on_complete = done.extend
        await link.connect()
        batch = records(2)
        link.publish(batch, False, never)
        await broker.wait_for(lambda: len(broker.publishes()) == 2)
        a, b = (p.packet_id or 0 for p in broker.publishes())
        assert all(p.qos == 2 for p in broker.publishes())
        assert broker.writer is not None
        broker.writer.write(ack_bytes(0x40, a) + ack_bytes(0x50, a) + ack_bytes(0x50, 777))
        await broker.wait_for(lambda: sum(isinstance(p, Pubrel) for _, p in broker.packets) == 2)
        assert [p.packet_id for _, p in broker.packets if isinstance(p, Pubrel)] == [a, 777]
        assert done == []
        broker.writer.write(ack_bytes(0x70, a) + ack_bytes(0x70, b))  # b was never PUBREC'd
        async with asyncio.timeout(5):
            while not done:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert done == [batch[0]] and list(link.inflight) == [b]
        await link.disconnect()

    run(scenario)


def test_reconnect_resends_the_window_first_same_ids_dup_and_pubrel() -> None:
    """After a lost connection the in-flight window goes first on the next one, in original
    order with the same packet ids (MQTT-4.4.0-1): PUBLISH with DUP set (MQTT-3.3.1-1) when
    not yet acknowledged, PUBREL when PUBREC'd."""

    async def scenario(broker: RawBroker) -> None:
        link = ExportLink("exp", "127.0.0.1", broker.port, qos=2)
        await link.connect()
        batch = records(3)
        link.publish(batch, False, never)
        await broker.wait_for(lambda: len(broker.publishes(1)) == 3)
        ids = [p.packet_id or 0 for p in broker.publishes(1)]
        assert broker.writer is not None
        broker.writer.write(ack_bytes(0x50, ids[1]))
        await broker.wait_for(lambda: any(isinstance(p, Pubrel) for _, p in broker.packets))
        broker.writer.transport.abort()
        async with asyncio.timeout(5):
            await link.closed.wait()
        await link.connect()
        await broker.wait_for(lambda: len([p for c, p in broker.packets if c == 2]) >= 4)
        second = [p for c, p in broker.packets if c == 2]
        assert isinstance(second[0], Connect) and second[0].clean_session is False
        resent = second[1:4]
        assert [(type(p).__name__, getattr(p, "packet_id", None), getattr(p, "dup", None)) for p in resent] == [
            ("Publish", ids[0], True), ("Pubrel", ids[1], None), ("Publish", ids[2], True)]
        await link.disconnect()

    run(scenario)


def test_packet_ids_wrap_and_skip_ids_still_in_flight() -> None:
    """Packet ids run 1..65535 and wrap; an id still in flight is never reused (MQTT-2.3.1-2)."""

    async def scenario(broker: RawBroker) -> None:
        link = ExportLink("exp", "127.0.0.1", broker.port, qos=1)
        link.publish(records(1), False, never)  # not connected: only in flight, id 2
        held = next(iter(link.inflight))
        link._next_id = 65533
        link.publish(records(4, start=1), False, never)
        assert list(link.inflight) == [held, 65534, 65535, 1, 3]
        await link.connect()  # the whole window goes out, oldest first
        await broker.wait_for(lambda: len(broker.publishes()) == 5)
        assert [p.packet_id for p in broker.publishes()] == [held, 65534, 65535, 1, 3]
        await link.disconnect()

    run(scenario)


def test_remaining_length_encoding() -> None:
    """Spec 2.2.3: the variable byte integer at each length boundary."""
    assert [remaining_length(n) for n in (0, 127, 128, 16383, 16384, 268_435_455)] == [
        b"\x00", b"\x7f", b"\x80\x01", b"\xff\x7f", b"\x80\x80\x01", b"\xff\xff\xff\x7f"]


def test_export_in_flight_is_bounded_by_records_and_by_payload_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An MQTT export never has more than ``window`` publishes in flight, nor (after the chunk
    that crosses it) more than MAX_INFLIGHT_BYTES of payload: a big window of big records
    cannot fill the agent's memory while the destination does not acknowledge."""
    monkeypatch.setattr(mqtt_export, "MAX_INFLIGHT_BYTES", 20_000)

    async def scenario(broker: RawBroker) -> None:
        queue = Queue.open(tmp_path, QueueConfig(log=LogConfig(fsync="never")))
        for i in range(3000):
            queue.log.append("t/x", bytes([i % 256]) * 100, qos=1)
        queue.log.flush()
        async def sent_until_blocked(name: str, window: int) -> int:
            group = queue.group(f"export.{name}", filters=("#",), start="earliest")
            before = len(broker.publishes())
            export = MqttExport(group, queue.wait_for_records,
                                lambda: ExportLink("exp", "127.0.0.1", broker.port),
                                MqttExportSettings(name, "dev", window=window))
            export.start()

            def arrived() -> bool:
                return len(broker.publishes()) - before == export.stats.records_sent

            await broker.wait_for(lambda: export.stats.records_sent > 0 and arrived())
            for _ in range(100):  # let the pump run on until it blocks (bounded)
                await asyncio.sleep(0)
            await broker.wait_for(arrived)
            await export.stop()
            return export.stats.records_sent

        results = [await sent_until_blocked("small", 300), await sent_until_blocked("big", 5000)]
        # window 300: the records bound it; window 5000: one 512-record chunk crosses 20,000 bytes.
        assert results == [300, mqtt_export.FETCH_MAX]
        await queue.close()

    run(scenario)


def test_idle_link_sends_pingreq_and_closes_without_pingresp() -> None:
    """Keep Alive (spec 3.1.2.10): an idle link sends PINGREQ; with no PINGRESP within the
    keepalive it closes the connection (the export then reconnects and resends its window)."""

    async def scenario(broker: RawBroker) -> None:
        link = ExportLink("exp", "127.0.0.1", broker.port, keepalive=1)
        await link.connect()
        await broker.wait_for(lambda: any(isinstance(p, Pingreq) for _, p in broker.packets))
        async with asyncio.timeout(5):
            await link.closed.wait()
        assert "PINGRESP" in str(link.close_reason)

    run(scenario)


class _Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data


def _sink_link(next_id: int, busy: set[int], topic_of: Callable[[str], str]) -> tuple[ExportLink, _Sink]:
    """A link 'connected' to an in-memory sink, with ``busy`` packet ids already in flight."""
    link = ExportLink("eq", "127.0.0.1", 1)
    sink = _Sink()

    class _Conn:
        transport = sink

    link._conn = _Conn()  # type: ignore[assignment]
    link.closed.clear()
    link._next_id = next_id
    link.topic_of = topic_of
    for pid in busy:
        link.inflight[pid] = Record(-pid, 0, "busy", b"", 1, False)
    return link, sink


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["a", "s/1", "ü/x"]), st.integers(0, 300), st.booleans()), max_size=60),
    st.integers(1, 65535),
    st.sets(st.integers(1, 65535), max_size=5),
    st.booleans(),
    st.integers(1, 3),
)
def test_a_run_built_by_maps_is_byte_for_byte_the_loop(
    shapes: list[tuple[str, int, bool]], next_id: int, busy: set[int], retain: bool, calls: int
) -> None:
    """The C-level run builder (no DUP, no RETAIN to set, a free block of packet ids) sends the
    same bytes, with the same packet ids in flight (MQTT-2.3.1-2: ids unique among unacknowledged
    publishes), as the per-record loop; it falls back to the loop whenever one of those does not
    hold (ids about to wrap, an id still in flight, a retained record passed through)."""
    records = [Record(i, 0, t, bytes([i % 256]) * size, 1, r) for i, (t, size, r) in enumerate(shapes)]
    fast, fast_out = _sink_link(next_id, busy, "site/{}".format)
    loop, loop_out = _sink_link(next_id, busy, "site/{}".format)
    for _ in range(calls):
        sent_fast = fast.publish(records, retain, None)
        sent_loop = loop.publish(records, retain, lambda offset: False)  # forces the loop
        assert sent_fast == sent_loop == sum(len(r.payload) for r in records)
    assert bytes(fast_out.data) == bytes(loop_out.data)
    assert list(fast.inflight.items()) == list(loop.inflight.items())
    assert fast._next_id == loop._next_id
