"""MQTT 5 ingest through the decoder's PublishRun (issue 16 item 5): a read's run of
equal-shaped QoS 1 PUBLISHes without properties reaches the core as one
:class:`~filemq.mqtt.packets.PublishRun` (``on_publish_run``, as 3.1.1's do) when our Receive
Maximum has room for all of it (3.2.2.3.3), and the client sees exactly what it sees when the
same packets arrive one per read: the same PUBACK/PUBREC reason codes in the same order, the
same DISCONNECT 0x93 at the PUBLISH over the Receive Maximum (MQTT-3.3.4-7..9), the same stored
records and no-local publisher map."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from filemq.mqtt.codec import encode5
from filemq.mqtt.packets import Disconnect, Properties, Puback, Publish, PublishRun, Pubrec
from segments.fileio import DiskFull
from tests.broker_harness import run
from tests.broker_harness5 import FakeQueue5, Harness5, client5


class RefusingQueue(FakeQueue5):
    """:class:`FakeQueue5` whose log refuses every append from the ``refuse_from``-th on (a
    disk that filled up and stays full: DiskFull, below ``min_free_bytes``)."""

    def __init__(self, groups_dir: Path) -> None:
        super().__init__(groups_dir)
        self.refuse_from: int | None = None
        self.appends = 0

    def publish_nowait(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                       timestamp_us: int | None = None, *, validated: bool = False,
                       headers: bytes = b"") -> tuple[int, asyncio.Future[None]]:
        self.appends += 1
        if self.refuse_from is not None and self.appends >= self.refuse_from:
            raise DiskFull("/data", "free space below min_free_bytes")
        return super().publish_nowait(topic, payload, qos, retain, timestamp_us, validated=validated,
                                      headers=headers)


class RunHarness(Harness5):
    queue: RefusingQueue

    def __init__(self, tmp: Path, **broker: Any) -> None:
        super().__init__(tmp, **broker)
        self.queue = RefusingQueue(tmp / "groups")
        self.core = self.make_core()


def _qos1(*pids: int, topic: str = "t/run") -> list[Publish]:
    return [Publish(topic, f"m{pid:03}".encode(), 1, packet_id=pid) for pid in pids]


def _records(h: RunHarness) -> list[tuple[Any, ...]]:
    return [(r.offset, r.topic, r.payload, r.qos, r.retain, r.headers) for r in h.queue.log.records]


async def _ingest(tmp: Path, reads: list[bytes], refuse_from: int | None, fail_commit: bool,
                  **broker: Any) -> tuple[list[Any], list[tuple[Any, ...]], list[tuple[int, str]], bool, int]:
    """Feed ``reads`` to one MQTT 5 publisher, commit: what it received, the records, the
    no-local publisher map, whether it was closed, and how many PublishRuns the core took."""
    h = RunHarness(tmp, **broker)
    c = client5(h)
    c.connect("p")
    h.queue.refuse_from = refuse_from
    runs = 0
    real = h.core.on_publish_run

    def counting(conn: Any, r: PublishRun) -> None:
        nonlocal runs
        runs += 1
        real(conn, r)

    setattr(h.core, "on_publish_run", counting)  # noqa: B010 (a method of the instance only)
    for data in reads:
        c.feed(data)
        h.core.flush()
    h.queue.fail_next = fail_commit
    await h.commit()
    return c.received(), _records(h), list(h.core.publishers().items()), c.conn.closed, runs


_TOPICS = ["t/a", "t/b", "$x/y"]  # "$x/y": refused with 0x87 (clients may not publish to $-topics)


@st.composite
def _streams(draw: st.DrawFn) -> list[Publish]:
    """Runs of equal-shaped PUBLISHes (any QoS and RETAIN; QoS 1 ones form PublishRuns) mixed
    with PUBLISHes that carry properties (user properties, a topic alias set or used)."""
    packets: list[Publish] = []
    pid = 0
    aliased = False
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.integers(0, 3)) != 3:  # (Hypothesis' simplest choices: a QoS 1 run of 8)
            topic = draw(st.sampled_from(_TOPICS))
            size = draw(st.sampled_from([10, 60]))
            qos = draw(st.sampled_from([1, 1, 1, 0, 2]))
            retain = draw(st.booleans())
            for _ in range(draw(st.sampled_from([8, 1, 2, 5, 20]))):
                pid += 1
                packets.append(Publish(topic, bytes([pid % 256]) * size, qos, retain, False,
                                       pid if qos else None))
        else:
            pid += 1
            kind = draw(st.sampled_from(["user", "alias set", "alias used"]))
            if kind == "alias used" and not aliased and draw(st.integers(0, 9)):
                kind = "alias set"  # (mostly: an alias used before it is set closes the connection)
            aliased = aliased or kind == "alias set"
            props = Properties(user_properties=[("k", "v")]) if kind == "user" else Properties(topic_alias=1)
            topic = "" if kind == "alias used" else draw(st.sampled_from(_TOPICS[:2]))
            packets.append(Publish(topic, b"props", 1, False, False, pid, props))
    return packets


@given(_streams(), st.data(), st.sampled_from([65535, 2, 5, 20, 65535]), st.sampled_from([None, None, 30]),
       st.none() | st.none() | st.integers(1, 60), st.booleans())
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_read_of_v5_publishes_gets_what_one_per_read_gets(
        packets: list[Publish], data: st.DataObject, receive_maximum: int, size_limit: int | None,
        refuse_from: int | None, fail_commit: bool) -> None:
    """Whatever the reads (runs taken as PublishRuns, a lone PublishRun, runs over the Receive
    Maximum, 3.3.4 / MQTT-3.3.4-9: DISCONNECT 0x93 at the PUBLISH over it), the properties (a
    PUBLISH with properties or a topic alias never joins a run, 3.3.2.3.4), the refusals
    (0x87 for a $-topic, 0x97 over ``message_size_limit``, 0x97 from the append that found the
    disk full on, 0x97 for a failed commit, issue 13 item 6): the PUBACKs, PUBRECs and
    DISCONNECT, the stored records and the no-local publisher map are those of the same
    packets sent one per read."""
    wires = [encode5(p) for p in packets]
    stream = b"".join(wires)
    bounds = [sum(map(len, wires[:k])) for k in range(1, len(wires))]  # between packets
    anywhere = st.integers(1, len(stream) - 1) if len(stream) > 1 else st.nothing()
    cuts = sorted(set(data.draw(st.lists(st.sampled_from(bounds) | anywhere if bounds else anywhere, max_size=8))))
    reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    config = {"receive_maximum": receive_maximum, "message_size_limit": size_limit, "topic_alias_maximum": 4}
    with tempfile.TemporaryDirectory(prefix="v5runs-") as d:
        (Path(d) / "a").mkdir()
        (Path(d) / "b").mkdir()
        together = run(_ingest(Path(d) / "a", reads, refuse_from, fail_commit, **config))
        one_by_one = run(_ingest(Path(d) / "b", wires, refuse_from, fail_commit, **config))
    assert together[:4] == one_by_one[:4]
    assert one_by_one[4] == 0
    event(f"PublishRuns taken by the core: {min(together[4], 2)}{'+' if together[4] > 1 else ''}")


def test_a_read_of_v5_qos1_publishes_is_stored_as_one_publish_run(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The run path is taken: after the first PUBLISH of a topic (not yet in the decoder's
    topic cache), a read of 10 QoS 1 PUBLISHes without properties is one on_publish_run call,
    no on_publish / on_publishes; its PUBACKs leave in order after the commit (MQTT-4.3.2-2,
    4.6.0-2) and each offset's publisher is noted for no local (MQTT-3.8.3-3)."""
    async def main() -> None:
        h = RunHarness(tmp_path)
        c = client5(h)
        c.connect("p")
        c.send(*_qos1(1))
        await h.commit()
        assert c.received() == [Puback(1)]
        calls: list[str] = []
        def spy(name: str) -> Any:
            real = getattr(h.core.ingest, name)

            def called(conn: Any, p: Any) -> None:
                calls.append(name)
                real(conn, p)
            return called

        for name in ("on_publish", "on_publishes", "on_publish_run"):
            called = spy(name)  # (the core's entry and the ingest part's own calls)
            monkeypatch.setattr(h.core.ingest, name, called)
            monkeypatch.setattr(h.core, name, called)
        c.send(*_qos1(*range(2, 12)))
        assert calls == ["on_publish_run"]
        assert c.received() == []  # durable first
        await h.commit()
        assert c.received() == [Puback(pid) for pid in range(2, 12)]
        assert [r.payload for r in h.queue.log.records] == [f"m{pid:03}".encode() for pid in range(1, 12)]
        assert list(h.core.publishers().values()) == ["p"] * 11
    run(main())


def test_a_lone_publish_run_over_the_receive_maximum_gets_0x93_at_the_publish_over_it(tmp_path: Path) -> None:
    """MQTT-3.3.4-9 with a read the decoder gives as one PublishRun (its topic cached):
    Receive Maximum 5, 1 PUBACK waiting, a read of 8: taken one by one, 4 stored, the 5th of
    the read gets DISCONNECT 0x93 (3.3.4: 0x93 Receive Maximum exceeded)."""
    async def main() -> None:
        h = RunHarness(tmp_path, receive_maximum=5)
        c = client5(h)
        c.connect("p")
        c.send(*_qos1(1))
        c.send(*_qos1(*range(2, 10)))
        assert c.received() == [Disconnect(0x93)] and c.conn.closed
        assert [r.payload for r in h.queue.log.records] == [f"m{pid:03}".encode() for pid in range(1, 6)]
    run(main())


def test_a_publish_run_with_room_refused_midway_acks_the_stored_and_gives_the_rest_0x97(tmp_path: Path) -> None:
    """Issue 13 item 6 through on_publish_run: the log refuses the 3rd message of a
    PublishRun of 6 (below min_free_bytes) and every append after it: PUBACK for the 2 stored
    once committed, 0x97 for the 4 others, in order; the connection stays; once appends work
    again, the next run is stored and acknowledged."""
    async def main() -> None:
        h = RunHarness(tmp_path)
        c = client5(h)
        c.connect("p")
        c.send(*_qos1(1))
        await h.commit()
        assert c.received() == [Puback(1)]
        h.queue.refuse_from = h.queue.appends + 3
        c.send(*_qos1(*range(2, 8)))
        await h.commit()
        assert c.received() == [Puback(2), Puback(3), *(Puback(pid, 0x97) for pid in range(4, 8))]
        assert not c.conn.closed
        h.queue.refuse_from = None
        c.send(*_qos1(*range(8, 12)))
        h.queue.fail_next = True
        await h.commit()
        assert c.received() == [Puback(pid, 0x97) for pid in range(8, 12)]  # a failed commit: each 0x97
        c.send(*_qos1(*range(12, 16)))
        await h.commit()
        assert c.received() == [Puback(pid) for pid in range(12, 16)] and not c.conn.closed
        assert [r.payload for r in h.queue.log.records] == [b"m001", b"m002", b"m003", b"m012", b"m013",
                                                             b"m014", b"m015"]
    run(main())


def test_a_publish_run_to_a_refused_topic_gets_each_its_reason_code(tmp_path: Path) -> None:
    """A run the core's one check refuses (a $-topic: 0x87, 3.3.2.1 / 4.7.2) is taken one
    message at a time, each with its PUBACK reason code, nothing stored; QoS 2 runs (never a
    PublishRun at level 5) get their PUBRECs one by one."""
    async def main() -> None:
        h = RunHarness(tmp_path)
        c = client5(h)
        c.connect("p")
        c.send(*_qos1(1, topic="$x/y"))
        c.send(*_qos1(*range(2, 8), topic="$x/y"))
        assert c.received() == [Puback(pid, 0x87) for pid in range(1, 8)]
        c.send(*[Publish("t", b"q2", 2, packet_id=pid) for pid in range(8, 14)])
        await h.commit()
        assert c.received() == [Pubrec(pid) for pid in range(8, 14)]
        assert len(h.queue.log.records) == 6
    run(main())



def test_the_no_local_publisher_map_keeps_the_latest_offsets_in_order(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """MQTT-3.8.3-3 bookkeeping: runs and single PUBLISHes note their offsets' publisher; the
    map keeps the latest PUBLISHERS_KEPT offsets, oldest first (a run that overflows it drops
    as many of the oldest as it adds)."""
    from filemq.broker import publish

    monkeypatch.setattr(publish, "PUBLISHERS_KEPT", 10)

    async def main() -> None:
        h = RunHarness(tmp_path)
        c = client5(h)
        c.connect("p")
        d = client5(h)
        d.connect("q")
        c.send(*_qos1(*range(1, 9)))  # offsets 0-7: one Publish, then a PublishRun of 7
        d.send(*_qos1(1))  # offset 8
        assert list(h.core.publishers().items()) == [(o, "p") for o in range(8)] + [(8, "q")]
        c.send(*_qos1(*range(9, 17)))  # offsets 9-16: a PublishRun of 8
        assert list(h.core.publishers().items()) == [(7, "p"), (8, "q")] + [(o, "p") for o in range(9, 17)]
        d.send(*_qos1(2))
        assert list(h.core.publishers().items()) == [(8, "q")] + [(o, "p") for o in range(9, 17)] + [(17, "q")]
        await h.commit()
        assert [len(c.received()), len(d.received())] == [16, 2]
    run(main())


def test_paho_burst_of_qos1_publishes_is_acknowledged_delivered_in_order_and_not_echoed(tmp_path: Path) -> None:
    """paho-mqtt 2.x, real sockets: 400 equal-shaped QoS 1 PUBLISHes sent without waiting
    (paho's 20 in flight, so a read may carry several) all get PUBACK 0 (3.4.2.1); a subscriber gets
    them in order (4.6), and the publisher's own no-local subscription none (MQTT-3.8.3-3)."""
    from paho.mqtt.subscribeoptions import SubscribeOptions

    from tests.broker_process import start_threaded_broker
    from tests.paho5 import Paho5

    b = start_threaded_broker(tmp_path)
    try:
        sub = Paho5(b.port, "sub")
        assert sub.subscribe("burst/#", SubscribeOptions(qos=1)) == [1]
        pub = Paho5(b.port, "pub")
        assert pub.subscribe("burst/#", SubscribeOptions(qos=1, noLocal=True)) == [1]
        mids = [pub.c.publish("burst/t", f"{i:06}".encode(), 1).mid for i in range(400)]
        acks = [pub.acks.get(timeout=30) for _ in mids]
        assert sorted(acks) == sorted((mid, 0) for mid in mids)
        assert [sub.get(30).payload for _ in mids] == [f"{i:06}".encode() for i in range(400)]
        assert pub.none_within(0.3)
        sub.close()
        pub.close()
    finally:
        b.stop()
