"""The forwarder against a fake upstream: batching, window, in-order acks, resends, backoff."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from filemq.queue.groups import ConsumerGroup
from filemq.upstream.batch import decode_batch
from segments import GroupCommitter, Log, LogConfig, Record
from worker_agent.forwarder import (
    Forwarder,
    ForwarderConfig,
    TokenBucket,
    backoff_delay,
)

pytestmark = pytest.mark.timeout(60)


class FakeCollector:
    """Shared state behind every FakeUpstream: what arrived, and how to behave."""

    def __init__(self) -> None:
        self.down = False
        self.auto_ack = True
        self.received: list[bytes] = []  # every batch payload, in arrival order
        self.unacked: list[asyncio.Future[None]] = []
        self.max_unacked = 0
        self.connections: list[FakeUpstream] = []
        self.on_publish: Callable[[FakeUpstream, bytes], None] | None = None
        self.max_packet_size: int | None = None  # like the collector: a larger PUBLISH closes
        self.too_large = 0

    def offsets(self) -> list[int]:
        return [o for payload in self.received for o in decode_batch(payload).offsets()]

    def acked_offsets(self) -> list[int]:
        return [o for payload, ok in self.acked for o in decode_batch(payload).offsets() if ok]

    @property
    def acked(self) -> list[tuple[bytes, bool]]:
        return [(p, f.done() and not f.cancelled() and f.exception() is None) for p, f in self._pairs]

    _pairs: list[tuple[bytes, asyncio.Future[None]]]

    def ack_all(self) -> None:
        for future in self.unacked:
            if not future.done():
                future.set_result(None)
        self.unacked.clear()


class FakeUpstream:
    def __init__(self, collector: FakeCollector) -> None:
        self.collector = collector
        self.closed = asyncio.Event()
        self.closed.set()
        collector.connections.append(self)

    async def connect(self, timeout: float = 10.0) -> object:
        if self.collector.down:
            raise ConnectionRefusedError("collector down")
        self.closed.clear()
        return None

    def publish_nowait(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> asyncio.Future[None]:
        assert not self.closed.is_set(), "publish on a closed connection"
        assert topic == "filemq/v1/dev-1/main"
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        c = self.collector
        size = len(payload) + len(topic) + 9  # fixed header (<= 5), topic length, packet id
        if c.max_packet_size is not None and size > c.max_packet_size:
            c.too_large += 1  # MQTT 3.1.1 has no refusal: the receiver closes the connection
            self.closed.set()
            return future
        c.received.append(payload)
        c._pairs.append((payload, future))
        if c.auto_ack:
            future.set_result(None)
        else:
            c.unacked.append(future)
            c.max_unacked = max(c.max_unacked, sum(1 for f in c.unacked if not f.done()))
        if c.on_publish is not None:
            c.on_publish(self, payload)
        return future

    def drop(self) -> None:
        self.closed.set()

    async def disconnect(self, timeout: float = 5.0) -> None:
        self.closed.set()


class Device:
    def __init__(self, path: Path) -> None:
        self.log = Log.open(path / "log", LogConfig(fsync="never"))
        self.committer = GroupCommitter(self.log)
        self.group = ConsumerGroup.create("forwarder", self.log, path / "groups", start="earliest")

    async def publish(self, n: int, size: int = 50, topic: str = "sensors/t") -> None:
        future = None
        for i in range(n):
            _, future = self.committer.append_nowait(topic, bytes([i % 256]) * size, qos=1)
        if future is not None:
            await future


Scenario = Callable[[Device, FakeCollector], Awaitable[None]]


def device_test(scenario: Scenario) -> Callable[[Path], None]:
    """Run ``scenario(device, collector)`` on a fresh event loop with a real log and group."""

    def test(tmp_path: Path) -> None:
        async def main() -> None:
            device = Device(tmp_path)
            await device.committer.start()
            collector = FakeCollector()
            collector._pairs = []
            try:
                await asyncio.wait_for(scenario(device, collector), 30)
            finally:
                await device.committer.close()
                device.log.close()

        asyncio.run(main())

    test.__name__ = scenario.__name__
    test.__doc__ = scenario.__doc__
    return test


def make_forwarder(device: Device, collector: FakeCollector, **overrides: object) -> Forwarder:
    settings: dict[str, object] = {
        "device_id": "dev-1",
        "batch_records": 100,
        "batch_bytes": 1 << 20,
        "linger_s": 0.02,
        "window": 4,
        "backoff_initial_s": 0.01,
        "backoff_max_s": 0.05,
        "ack_timeout_s": 5.0,
    }
    settings.update(overrides)
    return Forwarder(
        device.group,
        device.committer.wait_committed,
        lambda: FakeUpstream(collector),
        ForwarderConfig(**settings),  # type: ignore[arg-type]
        rng=random.Random(7),
    )


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


@device_test
async def test_forwards_everything_in_bounded_batches(device: Device, collector: FakeCollector) -> None:
    await device.publish(1050, size=50)
    fwd = make_forwarder(device, collector, batch_records=100, batch_bytes=3000)
    fwd.start()
    await until(lambda: device.group.pending_offset == 1050)
    await fwd.stop()
    assert collector.offsets() == list(range(1050))
    for payload in collector.received:
        batch = decode_batch(payload)
        assert len(batch) <= 100
        # bytes bound: records are 50 + 9 + 21 = 80 "batch bytes" each -> at most 37 per batch
        assert len(batch) <= 3000 // 80
    assert fwd.stats.records_acked == 1050
    assert device.group.lag == 0


@device_test
async def test_linger_sends_a_partial_batch(device: Device, collector: FakeCollector) -> None:
    fwd = make_forwarder(device, collector, batch_records=1000, linger_s=0.05)
    fwd.start()
    await device.publish(3)
    await until(lambda: len(collector.received) == 1)
    await asyncio.sleep(0.1)
    await device.publish(2)
    await until(lambda: device.group.pending_offset == 5)
    await fwd.stop()
    assert [len(decode_batch(p)) for p in collector.received] == [3, 2]


@device_test
async def test_window_bounds_batches_in_flight_and_acks_apply_in_order(device: Device, collector: FakeCollector) -> None:
    collector.auto_ack = False
    await device.publish(1000)
    fwd = make_forwarder(device, collector, batch_records=100, window=3)
    fwd.start()
    await until(lambda: len(collector.unacked) == 3)
    await asyncio.sleep(0.05)
    assert len(collector.received) == 3  # the window is full: nothing more is sent
    assert collector.max_unacked == 3
    # The PUBACK of the third batch comes first: held, Pending does not move.
    collector.unacked[2].set_result(None)
    await asyncio.sleep(0.05)
    assert device.group.pending_offset == 0
    collector.unacked[0].set_result(None)
    await until(lambda: device.group.pending_offset == 100)
    await asyncio.sleep(0.05)
    assert device.group.pending_offset == 100  # batch 1 still unacked holds batch 2
    collector.unacked[1].set_result(None)
    await until(lambda: device.group.pending_offset == 300)
    collector.auto_ack = True
    collector.ack_all()
    await until(lambda: device.group.pending_offset == 1000)
    await fwd.stop()
    assert collector.max_unacked <= 3


@device_test
async def test_lost_connection_resends_what_was_in_flight(device: Device, collector: FakeCollector) -> None:
    collector.auto_ack = False
    await device.publish(500)
    fwd = make_forwarder(device, collector, batch_records=50, window=4)
    fwd.start()
    await until(lambda: len(collector.unacked) == 4)
    collector.unacked[0].set_result(None)  # batch 0 acked; 1..3 in flight
    await until(lambda: device.group.pending_offset == 50)
    collector.connections[-1].drop()
    collector.unacked.clear()
    collector.auto_ack = True
    await until(lambda: device.group.pending_offset == 500)
    await fwd.stop()
    offsets = collector.offsets()
    assert sorted(set(offsets)) == list(range(500))
    duplicates = len(offsets) - len(set(offsets))
    # Only what was in flight at the drop (at most the window after the acked batch).
    assert 0 < duplicates <= 4 * 50
    assert fwd.stats.disconnects == 1 and fwd.stats.resent_records >= duplicates


@device_test
async def test_ack_timeout_reconnects_and_resends(device: Device, collector: FakeCollector) -> None:
    collector.auto_ack = False
    await device.publish(120)
    fwd = make_forwarder(device, collector, batch_records=100, ack_timeout_s=0.2)
    fwd.start()
    await until(lambda: fwd.stats.ack_timeouts >= 1)
    assert device.group.pending_offset == 0
    collector.auto_ack = True
    await until(lambda: device.group.pending_offset == 120)
    await fwd.stop()
    assert len(collector.connections) >= 2
    assert set(collector.acked_offsets()) == set(range(120))


@device_test
async def test_collector_down_then_up_drains_backlog(device: Device, collector: FakeCollector) -> None:
    collector.down = True
    fwd = make_forwarder(device, collector, batch_records=200)
    fwd.start()
    await device.publish(2000)
    await until(lambda: fwd.stats.connect_failures >= 3)
    assert collector.received == []
    assert fwd.backlog == 2000
    collector.down = False
    await until(lambda: device.group.pending_offset == 2000)
    await fwd.stop()
    assert collector.offsets() == list(range(2000))


@device_test
async def test_gaps_in_the_log_keep_exact_offsets(device: Device, collector: FakeCollector) -> None:
    """Records the group skips (filtered out) leave gaps; offsets in batches stay exact."""
    device.group.set_filters(["keep/#"])
    for i in range(30):
        device.committer.append_nowait("keep/a" if i % 3 else "drop/b", b"x")
    await device.committer.wait_committed(29)
    fwd = make_forwarder(device, collector, batch_records=100)
    fwd.start()
    await until(lambda: device.group.pending_offset == 30)
    await fwd.stop()
    assert collector.offsets() == [i for i in range(30) if i % 3]


@device_test
async def test_rate_limit_paces_batches(device: Device, collector: FakeCollector) -> None:
    await device.publish(40, size=1000)  # ~41 kB of batches
    loop = asyncio.get_running_loop()
    start = loop.time()
    fwd = make_forwarder(device, collector, batch_records=10, rate_limit_bytes_per_s=20_000)
    fwd.start()
    await until(lambda: device.group.pending_offset == 40)
    elapsed = loop.time() - start
    await fwd.stop()
    # The bucket starts with one second (20 kB); the other ~21 kB must wait ~1 s.
    assert fwd.stats.bytes_sent > 40_000
    assert elapsed >= (fwd.stats.bytes_sent - 20_000) / 20_000 - 0.15


def test_token_bucket_delays() -> None:
    now = [0.0]
    bucket = TokenBucket(1000, clock=lambda: now[0])
    assert bucket.delay_for(1000) == 0.0  # starts with one second of tokens
    assert bucket.delay_for(500) == pytest.approx(0.5)
    now[0] = 0.5
    assert bucket.delay_for(100) == pytest.approx(0.1)
    now[0] = 10.0  # idle refills at most one second's worth
    assert bucket.delay_for(1000) == 0.0
    assert bucket.delay_for(1) > 0


def test_backoff_full_jitter_bounds() -> None:
    rng = random.Random(1)
    for attempt in range(12):
        cap = min(60.0, 0.5 * 2**attempt)
        delays = [backoff_delay(attempt, 0.5, 60.0, rng) for _ in range(200)]
        assert all(0.0 <= d <= cap for d in delays)
        assert max(delays) > cap * 0.8  # jitter spans the range, not a constant
    assert backoff_delay(10_000, 0.5, 60.0, rng) <= 60.0


def test_config_rejects_bad_names() -> None:
    with pytest.raises(ValueError, match="must not contain"):
        ForwarderConfig(device_id="a/b")
    with pytest.raises(ValueError, match="backoff"):
        ForwarderConfig(device_id="a", backoff_initial_s=5, backoff_max_s=1)


@device_test
async def test_a_record_bigger_than_batch_bytes_goes_alone(device: Device, collector: FakeCollector) -> None:
    await device.publish(3, size=50)
    await device.publish(1, size=5000)
    await device.publish(3, size=50)
    fwd = make_forwarder(device, collector, batch_records=100, batch_bytes=1000)
    fwd.start()
    await until(lambda: device.group.pending_offset == 7)
    await fwd.stop()
    assert [decode_batch(p).offsets() for p in collector.received] == [[0, 1, 2], [3], [4, 5, 6]]
    topics = dict(fwd.sys_messages())
    assert topics["$SYS/broker/forwarder/records/acked"] == b"7"
    assert topics["$SYS/broker/forwarder/backlog"] == b"0"
    assert topics["$SYS/broker/forwarder/batches/acked"] == b"3"


@device_test
async def test_a_record_too_large_for_the_collector_is_set_aside_not_retried_forever(
    device: Device, collector: FakeCollector
) -> None:
    """Issue 10 item 11: a record accepted locally (raised max_packet_size) that no batch can
    carry within the collector's packet limit must not wedge the stream: the forwarder sets
    it aside (it stays in the device log, skipped upstream), counts and logs the loss, and
    everything after it is forwarded. A multi-record batch over the limit is split."""
    collector.max_packet_size = 2000
    await device.publish(3, size=50)
    await device.publish(1, size=5000)  # offset 3: bigger than the collector's packet limit
    await device.publish(30, size=100)  # 4..33: together 4 KB, split to fit
    fwd = make_forwarder(device, collector, batch_records=100, batch_bytes=1 << 20, upstream_max_packet_size=2000)
    fwd.start()
    await until(lambda: device.group.pending_offset == 34)
    await fwd.stop()
    assert collector.too_large == 0
    assert collector.acked_offsets() == [0, 1, 2, *range(4, 34)]
    assert all(len(p) + 29 <= 2000 for p in collector.received)
    assert fwd.stats.oversized_records == 1 and fwd.stats.oversized_bytes >= 5000
    topics = dict(fwd.sys_messages())
    assert topics["$SYS/broker/forwarder/records/oversized_skipped"] == b"1"
    assert topics["$SYS/broker/forwarder/backlog"] == b"0"


@device_test
async def test_a_batch_of_only_oversized_records_does_not_leak_the_window(device: Device, collector: FakeCollector) -> None:
    """With window 1, a batch made only of set-aside records must give its window slot back,
    or nothing after it would ever be sent."""
    collector.max_packet_size = 2000
    await device.publish(1, size=5000)
    fwd = make_forwarder(device, collector, window=1, upstream_max_packet_size=2000)
    fwd.start()
    await until(lambda: device.group.pending_offset == 1)
    await device.publish(2, size=50)
    await until(lambda: device.group.pending_offset == 3)
    await fwd.stop()
    assert collector.acked_offsets() == [1, 2] and collector.too_large == 0
    assert fwd.stats.oversized_records == 1


class HeadersGroup:
    """The device's real group, but every odd offset's record carries MQTT 5 headers (as the
    log will once it stores them; until then its reads give b"")."""

    def __init__(self, group: ConsumerGroup) -> None:
        self._group = group

    def __getattr__(self, name: str) -> object:
        return getattr(self._group, name)

    def fetch(self, max_records: int = 100, consumer: str = "") -> list[Record]:
        return [r._replace(headers=b"\x03\x00\x04json" + b"\x26\x00\x01k\x00\x01" + bytes([48 + r.offset % 10]))
                if r.offset % 2 else r
                for r in self._group.fetch(max_records, consumer)]


@device_test
async def test_record_headers_travel_upstream_and_count_toward_batch_bytes(
    device: Device, collector: FakeCollector
) -> None:
    """Issue 13 item 7: each record's headers (its MQTT 5 message properties) go upstream in a
    version 2 batch, record by record; their bytes count toward ``batch_bytes``."""
    await device.publish(200, size=50)
    fwd = Forwarder(
        HeadersGroup(device.group),  # type: ignore[arg-type]
        device.committer.wait_committed,
        lambda: FakeUpstream(collector),
        ForwarderConfig(device_id="dev-1", batch_records=100, batch_bytes=3000, linger_s=0.02),
        rng=random.Random(7),
    )
    fwd.start()
    await until(lambda: device.group.pending_offset == 200)
    await fwd.stop()
    assert collector.offsets() == list(range(200))
    headers: dict[int, bytes] = {}
    for payload in collector.received:
        batch = decode_batch(payload)
        assert batch.header.version == 2
        # 50 + 9 + 21 bytes a record, plus 14 of headers on every other one: <= 34 a batch
        assert len(batch) <= 3000 // 87
        headers.update((r.offset, r.headers) for r in batch.records())
    assert all(headers[o] == b"" for o in range(0, 200, 2))
    assert all(headers[o].endswith(b"\x00\x01" + bytes([48 + o % 10])) for o in range(1, 200, 2))
