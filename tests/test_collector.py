"""The collector: the door (CRC, quarantine, duplicates, overlaps), the lander, the marks."""

from __future__ import annotations

import asyncio
import os
import urllib.request
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from collector.dedup import HighWaterMarks, batch_ranges, offset_runs
from collector.headers import check_headers, property_columns
from collector.lander import Lander
from collector.landing import LANDING_SCHEMA, PROPERTY_COLUMNS, SCHEMA_VERSION, LandingWriter
from collector.ops import start_metrics_server
from collector.server import Collector
from filemq.broker import ClientInfo
from filemq.mqtt.client import MQTTClient
from filemq.mqtt.packets import Properties, Publish
from filemq.mqtt.properties import encode_message_headers
from filemq.queue import Queue, QueueConfig
from filemq.upstream.batch import BatchRecord, decode_batch, encode_batch, peek_header
from segments import LogConfig
from segments.log import FREE_RECHECK_S
from tests.collector_harness import collector_config, collector_run, collector_until
from tests.mqtt_strategies import properties

pytestmark = pytest.mark.timeout(60)

CLIENT = ClientInfo("dev-1", "dev-1", "127.0.0.1:1")
TOPIC = "filemq/v1/dev-1/main"


def records(first: int, n: int, *, ts: int = 1_700_000_000_000_000, payload: bytes = b"p") -> list[BatchRecord]:
    return [BatchRecord(first + i, ts + i, f"sensors/{i % 3}", payload + str(first + i).encode(), 1) for i in range(n)]


def batch(first: int, n: int, device: str = "dev-1", **kw: Any) -> bytes:
    return encode_batch(device, "main", records(first, n, **kw))


def landed_rows(landing: Path) -> list[dict[str, Any]]:
    files = sorted((landing / "incoming").rglob("*.parquet"))
    rows: list[dict[str, Any]] = []
    for f in files:
        table = pq.read_table(f, partitioning=None)
        assert table.schema.equals(LANDING_SCHEMA)
        rows.extend(table.to_pylist())
    return rows


# -- the door ---------------------------------------------------------------------------------


def test_door_decisions(tmp_path: Path) -> None:
    collector = Collector(collector_config(tmp_path))
    check = collector.check_publish

    assert check(CLIENT, Publish(TOPIC, batch(0, 10), 1, False, False, 1)).action == "store"
    collector.marks.add("dev-1", "main", 0, 9)  # as the lander would after reading it

    # A resend of the same batch: acknowledged and dropped.
    result = check(CLIENT, Publish(TOPIC, batch(0, 10), 1, False, False, 2))
    assert result.action == "ack_drop"
    assert collector.stats.duplicate_batches == 1 and collector.stats.duplicate_records == 10

    # Overlap 5..14: stored with 5..9 trimmed off.
    result = check(CLIENT, Publish(TOPIC, batch(5, 10), 1, False, False, 3))
    assert result.action == "store" and result.payload is not None
    assert decode_batch(result.payload).offsets() == list(range(10, 15))
    assert collector.stats.trimmed_records == 5

    # Damaged in transit: not acknowledged (reject closes the connection; the agent resends).
    damaged = bytearray(batch(20, 5))
    damaged[-1] ^= 0xFF
    assert check(CLIENT, Publish(TOPIC, bytes(damaged), 1, False, False, 4)).action == "reject"
    assert collector.stats.crc_rejected == 1
    assert collector.stats.quarantined == 0


def test_door_quarantines_malformed_and_foreign(tmp_path: Path) -> None:
    collector = Collector(collector_config(tmp_path))
    check = collector.check_publish
    # Not a batch at all (valid CRC impossible): garbage on a batch topic is a CRC error...
    assert check(CLIENT, Publish(TOPIC, b"hello world", 1, False, False, 2)).action == "reject"
    # ...but a batch topic with bad structure is malformed, and a foreign topic too.
    assert check(CLIENT, Publish("sensors/t", b"x", 1, False, False, 3)).action == "ack_drop"
    assert check(CLIENT, Publish("sensors/t", b"hello world", 1, False, False, 5)).action == "ack_drop"
    assert check(CLIENT, Publish(TOPIC, b"FMQ", 1, False, False, 4)).action == "ack_drop"
    assert collector.stats.quarantined == 3
    qdir = tmp_path / "data" / "quarantine"
    reasons = sorted(qdir.glob("*.reason"))
    payloads = sorted(qdir.glob("*.batch"))
    assert len(reasons) == 3 and len(payloads) == 3
    texts = [r.read_text() for r in reasons]
    assert sum("not filemq/v1/" in t for t in texts) == 2
    assert {p.read_bytes() for p in payloads} == {b"x", b"hello world", b"FMQ"}


@pytest.mark.parametrize(
    "topic",
    [
        "filemq/v1/dev-2/main",  # another device's id
        "filemq/v1/Dev-1/main",  # one bit flipped in the device id
        "filemq/v1/dev-1/maiN",  # in the stream
        "filemq/v1/dev-1\x0fmain",  # the '/' damaged: no batch topic at all
        "filemq/v1/dev-1/main/x",
    ],
)
def test_door_rejects_unacknowledged_a_batch_whose_topic_disagrees_with_its_header(
    tmp_path: Path, topic: str
) -> None:
    """Issue 10 item 2: the topic is not covered by the batch CRC, the header (device, stream,
    offsets) is. A valid batch on any other topic than its header's is refused without a
    PUBACK (the agent resends), never quarantined and acknowledged."""
    collector = Collector(collector_config(tmp_path))
    result = collector.check_publish(CLIENT, Publish(topic, batch(0, 10), 1, False, False, 1))
    assert result.action == "reject" and "does not match the batch header" in result.reason
    assert collector.stats.topic_rejected == 1
    assert collector.stats.quarantined == 0 and collector.stats.batches_received == 0
    assert not (tmp_path / "data" / "quarantine").exists()
    # The same bytes on the right topic (the agent's resend) are stored.
    assert collector.check_publish(CLIENT, Publish(TOPIC, batch(0, 10), 1, False, False, 2)).action == "store"


# -- the lander on a queue (no network) -------------------------------------------------------


class LanderRig:
    def __init__(self, tmp_path: Path, roll_bytes: int = 1 << 30, roll_seconds: float = 60) -> None:
        self.tmp = tmp_path
        self.queue = Queue.open(tmp_path / "wal", QueueConfig(log=LogConfig(fsync="never")))
        self.writer = LandingWriter(tmp_path / "landing", "c1")
        self.marks = HighWaterMarks(tmp_path / "wal" / "dedup.snap")
        self.lander = Lander(self.queue, self.writer, self.marks, roll_bytes=roll_bytes, roll_seconds=roll_seconds)

    async def start(self) -> None:
        await self.queue.start()
        self.lander.recover()
        self.lander.start()

    async def store(self, payload: bytes, received_at: int = 1_800_000_000_000_000) -> None:
        await self.queue.publish(TOPIC, payload, qos=1, timestamp_us=received_at)

    async def stop(self) -> None:
        await self.lander.stop()
        await self.queue.close()


def test_lander_lands_rows_with_both_clocks(tmp_path: Path) -> None:
    async def scenario() -> None:
        rig = LanderRig(tmp_path, roll_bytes=500)
        await rig.start()
        # A device whose clock is far in the past (1970): publish_ts kept as sent.
        await rig.store(batch(0, 20, ts=5_000_000), received_at=1_800_000_000_000_000)
        await rig.store(batch(20, 20), received_at=1_800_000_000_000_123)
        await collector_until(lambda: rig.lander.stats.rows_landed == 40)
        await rig.stop()

    collector_run(scenario())
    rows = landed_rows(tmp_path / "landing")
    assert [r["offset"] for r in rows] == list(range(40))
    first = rows[0]
    assert first["publish_ts"].year == 1970 and int(first["publish_ts"].timestamp() * 1e6) == 5_000_000
    assert int(first["received_at"].timestamp() * 1e6) == 1_800_000_000_000_000
    assert int(rows[25]["received_at"].timestamp() * 1e6) == 1_800_000_000_000_123
    assert first["device_id"] == "dev-1" and first["stream"] == "main" and first["collector_id"] == "c1"
    assert first["topic"] == "sensors/0" and first["qos"] == 1 and first["payload"] == b"p0"
    assert first["schema_version"] == SCHEMA_VERSION == 2
    assert all(first[c] is None for c in PROPERTY_COLUMNS)  # a version 1 batch: no properties
    # received_at decides the dt partition (the collector's clock), not the device's.
    assert all("dt=2027-01-15" in str(p) for p in (tmp_path / "landing" / "incoming").rglob("*.parquet"))


def test_lander_drops_duplicates_stored_twice(tmp_path: Path) -> None:
    """A batch re-sent while its first copy was being committed is in the WAL twice."""

    async def scenario() -> None:
        rig = LanderRig(tmp_path, roll_bytes=1 << 30, roll_seconds=0.3)
        await rig.start()
        await rig.store(batch(0, 10))
        await rig.store(batch(0, 10))  # the same batch again
        await rig.store(batch(5, 10))  # overlapping
        await collector_until(lambda: rig.lander.stats.rows_landed == 15)
        await rig.stop()
        assert rig.lander.stats.duplicate_rows_dropped == 15

    collector_run(scenario())
    assert [r["offset"] for r in landed_rows(tmp_path / "landing")] == list(range(15))


def test_lander_rolls_by_time(tmp_path: Path) -> None:
    async def scenario() -> None:
        rig = LanderRig(tmp_path, roll_seconds=0.2)
        await rig.start()
        await rig.store(batch(0, 3))
        await collector_until(lambda: rig.lander.stats.files_landed == 1, timeout=5)
        await rig.store(batch(3, 3))
        await collector_until(lambda: rig.lander.stats.files_landed == 2, timeout=5)
        await rig.stop()

    collector_run(scenario())
    assert len(list((tmp_path / "landing" / "incoming").rglob("*.parquet"))) == 2


def test_marks_survive_restart_and_snapshot_loss_is_safe(tmp_path: Path) -> None:
    async def first_run() -> None:
        rig = LanderRig(tmp_path, roll_seconds=0.1)
        await rig.start()
        await rig.store(batch(0, 10))
        await collector_until(lambda: rig.lander.stats.rows_landed == 10)
        await rig.stop()
        assert rig.marks.covered == 1  # the snapshot covers WAL offset 0

    async def second_run(expect_mark: int, expect_dropped: int) -> None:
        rig = LanderRig(tmp_path, roll_seconds=0.1)
        await rig.start()
        assert rig.marks.get("dev-1", "main") == expect_mark
        await rig.store(batch(0, 10))  # a resend after the restart
        await rig.store(batch(10, 5))
        await collector_until(lambda: rig.lander.stats.batches_read == 2)
        await collector_until(lambda: rig.lander.stats.buffered_rows == 0)
        await rig.stop()
        assert rig.lander.stats.duplicate_rows_dropped == expect_dropped

    collector_run(first_run())
    collector_run(second_run(expect_mark=9, expect_dropped=10))
    assert [r["offset"] for r in landed_rows(tmp_path / "landing")] == list(range(15))
    # Without the snapshot the marks are rebuilt from the WAL's batch headers (all of the
    # WAL that retention left): still no duplicate here.
    (tmp_path / "wal" / "dedup.snap").unlink()
    collector_run(second_run(expect_mark=14, expect_dropped=15))
    assert [r["offset"] for r in landed_rows(tmp_path / "landing")] == list(range(15))


def test_marks_replayed_when_snapshot_lags_the_offset(tmp_path: Path) -> None:
    """Crash after the offset was persisted but before the snapshot: replay the WAL."""

    async def first_run() -> None:
        rig = LanderRig(tmp_path, roll_seconds=0.1)
        await rig.start()
        await rig.store(batch(0, 10))
        await collector_until(lambda: rig.lander.stats.rows_landed == 10 and rig.marks.covered == 1)
        old = (tmp_path / "wal" / "dedup.snap").read_bytes()
        await rig.store(batch(10, 10))
        await collector_until(lambda: rig.lander.stats.rows_landed == 20)
        await rig.stop()
        (tmp_path / "wal" / "dedup.snap").write_bytes(old)  # as if the last save never happened

    async def second_run() -> None:
        rig = LanderRig(tmp_path, roll_seconds=0.1)
        await rig.start()
        assert rig.marks.get("dev-1", "main") == 19  # rebuilt from the WAL's batch headers
        await rig.store(batch(10, 10))
        await collector_until(lambda: rig.lander.stats.duplicate_rows_dropped == 10)
        await rig.stop()

    collector_run(first_run())
    collector_run(second_run())
    assert [r["offset"] for r in landed_rows(tmp_path / "landing")] == list(range(20))


def test_crash_between_rename_and_offset_lands_rows_again(tmp_path: Path) -> None:
    """The documented duplicate window: the file is in incoming/, the offset is not persisted.

    Simulated by putting the lander's offset files and the marks snapshot back to what they
    were before the roll, which is what a power cut right after the rename leaves behind.
    """
    saved: dict[Path, bytes] = {}

    async def first_run() -> None:
        rig = LanderRig(tmp_path, roll_seconds=0.1)
        await rig.start()
        await rig.store(batch(0, 5))
        await collector_until(lambda: rig.lander.stats.rows_landed == 5 and rig.marks.covered == 1)
        await asyncio.sleep(0.1)  # let the queue's housekeeping settle too
        state = [p for p in (tmp_path / "wal").rglob("*") if p.is_file() and p.parent.name == "lander"]
        state.append(tmp_path / "wal" / "dedup.snap")
        saved.update({p: p.read_bytes() for p in state})
        await rig.store(batch(5, 10))
        await collector_until(lambda: rig.lander.stats.rows_landed == 15)
        await rig.stop()
        for path, data in saved.items():
            path.write_bytes(data)

    async def restart() -> None:
        rig = LanderRig(tmp_path, roll_seconds=0.1)
        await rig.start()
        await collector_until(lambda: rig.lander.stats.rows_landed == 10)
        await rig.stop()

    collector_run(first_run())
    assert len(saved) >= 2
    collector_run(restart())
    offsets = [r["offset"] for r in landed_rows(tmp_path / "landing")]
    # Every row is there; the second roll's rows are there twice (removed downstream by key).
    assert sorted(offsets) == sorted(list(range(15)) + list(range(5, 15)))


def test_marks_snapshot_round_trip_and_damage(tmp_path: Path) -> None:
    marks = HighWaterMarks(tmp_path / "m.snap")
    marks.add("dév", "main", 0, 41)
    marks.add("dév", "main", 3, 7)  # inside: nothing changes
    marks.add("dév", "main", 50, 60)  # after a gap
    marks.add("b", "s2", 2**63, 2**63 + 5)
    marks.save(123)
    again = HighWaterMarks(tmp_path / "m.snap")
    assert again.load() and again.covered == 123
    assert again.ranges("dév", "main") == [(0, 41), (50, 60)]
    assert again.get("dév", "main") == 60 and again.get("b", "s2") == 2**63 + 5 and again.get("x", "y") == -1
    data = bytearray((tmp_path / "m.snap").read_bytes())
    for i in range(0, len(data), 7):
        broken = bytearray(data)
        broken[i] ^= 0x01
        (tmp_path / "m.snap").write_bytes(bytes(broken))
        assert not HighWaterMarks(tmp_path / "m.snap").load()
    (tmp_path / "m.snap").write_bytes(bytes(data[:-3]))
    assert not HighWaterMarks(tmp_path / "m.snap").load()


def test_held_ranges_merge_and_keep_holes() -> None:
    marks = HighWaterMarks(None)
    marks.add("d", "s", 0, 9)
    marks.add("d", "s", 20, 29)  # batch 10..19 failed to commit, 20..29 made it
    assert marks.ranges("d", "s") == [(0, 9), (20, 29)]
    assert marks.get("d", "s") == 29
    assert marks.holds("d", "s", 0, 9) and marks.holds("d", "s", 22, 25)
    assert not marks.holds("d", "s", 10, 19)  # the hole is not held: a resend is stored
    assert not marks.holds("d", "s", 5, 25)
    assert marks.overlaps("d", "s", 5, 25) == [(5, 9), (20, 25)]
    assert marks.overlaps("d", "s", 10, 19) == []
    marks.add("d", "s", 10, 19)  # the resend fills the hole: one range again
    assert marks.ranges("d", "s") == [(0, 29)]
    marks.add("d", "s", 31, 40)  # a device-side skip of offset 30: a permanent hole
    marks.add("d", "s", 41, 50)
    assert marks.ranges("d", "s") == [(0, 29), (31, 50)]
    marks.add("d", "s", 100, 110)
    marks.add("d", "s", 60, 70)
    marks.add("d", "s", 25, 105)  # swallows everything it touches
    assert marks.ranges("d", "s") == [(0, 110)]
    with pytest.raises(ValueError):
        marks.add("d", "s", 5, 4)


def test_held_ranges_are_bounded_by_forgetting_never_by_merging(caplog: pytest.LogCaptureFixture) -> None:
    from collector.dedup import MAX_RANGES

    marks = HighWaterMarks(None)
    for i in range(MAX_RANGES + 5):
        marks.add("d", "s", 10 * i, 10 * i + 5)  # every batch after a gap
    ranges = marks.ranges("d", "s")
    assert len(ranges) == MAX_RANGES
    assert ranges[0] == (50, 55)  # the five lowest were forgotten, no hole was closed
    assert ranges[-1] == (10 * (MAX_RANGES + 4), 10 * (MAX_RANGES + 4) + 5)
    assert not marks.holds("d", "s", 6, 9) and not marks.overlaps("d", "s", 0, 49)
    assert "forgetting the lowest" in caplog.text and marks.forgotten_ranges == 5


def test_a_batch_holds_exactly_the_offsets_it_carries() -> None:
    """Issue 10 item 3: a batch with offsets {0, 10**9} holds those two, not 0..10**9."""
    forged = encode_batch("d", "s", [BatchRecord(0, 1, "t", b"a", 1), BatchRecord(10**9, 1, "t", b"b", 1)])
    header = peek_header(forged)
    assert batch_ranges(header, forged) == [(0, 0), (10**9, 10**9)]
    marks = HighWaterMarks(None)
    marks.add_ranges("d", "s", batch_ranges(header, forged))
    assert not marks.holds("d", "s", 1, 500) and marks.overlaps("d", "s", 1, 500) == []
    gapped = encode_batch("d", "s", [BatchRecord(o, 1, "t", b"x", 1) for o in (5, 6, 7, 9, 12, 13)])
    assert batch_ranges(peek_header(gapped), gapped) == [(5, 7), (9, 9), (12, 13)]
    contiguous = batch(3, 4)
    assert batch_ranges(peek_header(contiguous), contiguous) == [(3, 6)]
    assert offset_runs(0, []) == [] and offset_runs(7, [0]) == [(7, 7)]


def _runs(offsets: set[int]) -> list[tuple[int, int]]:
    return offset_runs(0, sorted(offsets))


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 200), st.integers(0, 12)), min_size=1, max_size=40
    ),
    probes=st.lists(st.tuples(st.integers(0, 220), st.integers(0, 30)), max_size=20),
    max_ranges=st.sampled_from([2, 3, 5, 1024]),
)
@example(ops=[(0, 0), (2, 0), (4, 0), (1, 0)], probes=[], max_ranges=2)  # 0 forgotten, then 1 joins 2
def test_held_ranges_against_a_set_model(
    ops: list[tuple[int, int]], probes: list[tuple[int, int]], max_ranges: int
) -> None:
    """HighWaterMarks against a reference set of the offsets added: while the range bound is not
    hit it is exactly that set; once hit it holds a subset of it (ranges are forgotten, holes
    never closed), so nothing that was not added is ever held."""
    marks = HighWaterMarks(None, max_ranges=max_ranges)
    model: set[int] = set()
    overflowed = False  # the bound was hit once: a forgotten range may stay a hole for good
    for first, length in ops:
        marks.add("d", "s", first, first + length)
        model.update(range(first, first + length + 1))
        overflowed = overflowed or len(_runs(model)) > max_ranges
        ranges = marks.ranges("d", "s")
        held = {o for lo, hi in ranges for o in range(lo, hi + 1)}
        assert held <= model
        assert len(ranges) <= max_ranges
        assert all(hi + 1 < lo2 for (_, hi), (lo2, _) in zip(ranges, ranges[1:], strict=False))
        if not overflowed:
            assert ranges == _runs(model)
    exact = len(_runs(model)) <= max_ranges and marks.ranges("d", "s") == _runs(model)
    if max_ranges == 1024:
        assert exact  # never overflowed: exactly the model
    held = {o for lo, hi in marks.ranges("d", "s") for o in range(lo, hi + 1)}
    for first, length in probes:
        span = set(range(first, first + length + 1))
        assert marks.holds("d", "s", first, first + length) == (span <= held)
        clipped = marks.overlaps("d", "s", first, first + length)
        assert clipped == _runs(span & held)
        assert marks.get("d", "s") == (max(held) if held else -1)


def test_door_stores_a_late_fill_in_of_a_gap(tmp_path: Path) -> None:
    """If batch k failed to commit but k+1 made it, the resent k must be stored, not dropped."""
    collector = Collector(collector_config(tmp_path))
    check = collector.check_publish
    collector.door_marks.add("dev-1", "main", 0, 9)
    collector.door_marks.add("dev-1", "main", 20, 29)
    assert check(CLIENT, Publish(TOPIC, batch(10, 10), 1, False, False, 1)).action == "store"
    assert check(CLIENT, Publish(TOPIC, batch(20, 10), 1, False, False, 2)).action == "ack_drop"
    result = check(CLIENT, Publish(TOPIC, batch(5, 30), 1, False, False, 3))  # 5..34
    assert result.action == "store" and result.payload is not None
    assert decode_batch(result.payload).offsets() == [*range(10, 20), *range(30, 35)]


def test_lander_keeps_a_late_fill_in(tmp_path: Path) -> None:
    async def scenario() -> None:
        rig = LanderRig(tmp_path, roll_seconds=0.2)
        await rig.start()
        await rig.store(batch(0, 10))
        await rig.store(batch(20, 10))  # 10..19 missing (its commit failed)
        await rig.store(batch(10, 15))  # the resend of 10..24: 20..24 are held already
        await collector_until(lambda: rig.lander.stats.rows_landed == 30)
        await rig.stop()
        assert rig.lander.stats.duplicate_rows_dropped == 5
        assert rig.marks.ranges("dev-1", "main") == [(0, 29)]

    collector_run(scenario())
    assert sorted(r["offset"] for r in landed_rows(tmp_path / "landing")) == list(range(30))


# -- the whole collector over MQTT ------------------------------------------------------------


class FakeFull:
    """Wraps the WAL's FileIO: reports no free space while ``full`` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.full = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def free_bytes(self, path: Any) -> int:
        return 0 if self.full else int(self.inner.free_bytes(path))


def test_full_disk_stops_acks_until_space_returns(tmp_path: Path) -> None:
    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path, **{"log.min_free_bytes": 1, "collector.roll_seconds": 1}))
        await collector.start()
        assert collector.broker.queue is not None
        wal = collector.broker.queue.log
        fake = FakeFull(wal.fileio)
        wal.fileio = fake
        client = MQTTClient("dev-1", port=collector.port)
        await client.connect()
        await client.publish(TOPIC, batch(0, 10), qos=1, timeout=5)

        fake.full = True
        # Free space is read again at most FREE_RECHECK_S apart (no statfs per commit, issue 29;
        # near the floor at every commit): the disk that filled up behind the log's back shows
        # from then on. (A write that meets a truly full disk fails with ENOSPC at once.)
        await asyncio.sleep(FREE_RECHECK_S)
        future = client.publish_nowait(TOPIC, batch(10, 10), qos=1)
        await asyncio.sleep(0.5)
        assert not future.done()  # no PUBACK while the disk is full
        await client.wait_closed()  # the broker closed the connection: the batch was not stored
        assert collector.stats.batches_received == 2

        fake.full = False
        client2 = MQTTClient("dev-1", port=collector.port)
        await client2.connect()
        await client2.publish(TOPIC, batch(10, 10), qos=1, timeout=5)  # the agent's resend
        await collector_until(lambda: collector.lander is not None and collector.lander.stats.rows_landed == 20)
        await client2.disconnect()
        await client.disconnect()
        await collector.stop()

    collector_run(scenario())
    assert [r["offset"] for r in landed_rows(tmp_path / "landing")] == list(range(20))


def test_metrics_endpoint(tmp_path: Path) -> None:
    async def scenario() -> str:
        collector = Collector(collector_config(tmp_path, **{"collector.roll_seconds": 1}))
        await collector.start()
        server = start_metrics_server(collector, 0)
        try:
            client = MQTTClient("dev-1", port=collector.port)
            await client.connect()
            await client.publish(TOPIC, batch(0, 7), qos=1, timeout=5)
            await client.publish(TOPIC, batch(0, 7), qos=1, timeout=5)
            await collector_until(lambda: collector.lander is not None and collector.lander.stats.rows_landed == 7)
            await client.disconnect()
            url = f"http://127.0.0.1:{server.port}/metrics"
            return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        finally:
            server.shutdown()
            await collector.stop()

    result: list[str] = []

    async def wrapper() -> None:
        result.append(await scenario())

    collector_run(wrapper())
    text = result[0]
    assert "filemq_collector_records_received_total 7.0" in text
    assert "filemq_collector_rows_landed_total 7.0" in text
    assert "filemq_collector_duplicate_records_dropped_total" in text
    # admission and the ingest budget (issue 30), the broker's figures under the collector's names
    assert "\nfilemq_collector_connections_half_open " in text
    assert "\nfilemq_collector_admission_accept_paused_total " in text
    from prometheus_client.parser import text_string_to_metric_families
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert values["filemq_collector_ingest_uncommitted_limit_bytes"] == 256 << 20  # the collector's default
    assert os.path.isdir(tmp_path / "landing" / "incoming")


def test_door_drops_resends_of_acked_batches_while_the_lander_is_behind(tmp_path: Path) -> None:
    """The door's marks follow the WAL, not the lander: a resend of anything acked is dropped
    even when nothing has been landed yet, also after a restart (replayed from the WAL)."""

    async def first() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        assert collector.lander is not None
        await collector.lander.stop(land=False)  # stalled lander: nothing lands
        client = MQTTClient("dev-1", port=collector.port)
        await client.connect()
        await client.publish(TOPIC, batch(0, 10), qos=1, timeout=5)
        await collector_until(lambda: collector.door_marks.get("dev-1", "main") == 9)
        await client.publish(TOPIC, batch(0, 10), qos=1, timeout=5)  # resend: dropped
        await client.publish(TOPIC, batch(5, 10), qos=1, timeout=5)  # overlap: trimmed
        await client.disconnect()
        assert collector.stats.duplicate_batches == 1 and collector.stats.trimmed_records == 5
        assert collector.lander.stats.rows_landed == 0
        collector.lander = None  # already stopped
        await collector.stop()

    async def second() -> None:
        collector = Collector(collector_config(tmp_path, **{"collector.roll_seconds": 1}))
        await collector.start()
        # Replayed from the WAL before anything is landed.
        await collector_until(lambda: collector.door_marks.get("dev-1", "main") == 14)
        client = MQTTClient("dev-1", port=collector.port)
        await client.connect()
        await client.publish(TOPIC, batch(10, 5), qos=1, timeout=5)
        await client.disconnect()
        assert collector.stats.duplicate_batches == 1
        await collector_until(lambda: collector.lander is not None and collector.lander.stats.rows_landed == 15)
        await collector.stop()

    collector_run(first())
    collector_run(second())
    assert [r["offset"] for r in landed_rows(tmp_path / "landing")] == list(range(15))


def test_a_failed_offset_write_is_retried_without_landing_twice(tmp_path: Path) -> None:
    async def scenario() -> None:
        rig = LanderRig(tmp_path, roll_seconds=0.1)
        rig.lander.retry_seconds = 0.05
        real_save = rig.marks.save_encoded
        calls = {"n": 0}

        def flaky_save(data: bytes, covered: int) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise OSError(28, "No space left on device")
            real_save(data, covered)

        rig.marks.save_encoded = flaky_save  # type: ignore[method-assign]
        await rig.start()
        await rig.store(batch(0, 10))
        await collector_until(lambda: rig.marks.covered == 1)
        await rig.stop()
        assert rig.lander.stats.land_failures == 1 and calls["n"] == 2
        assert rig.lander.stats.files_landed == 1 and rig.lander.stats.rows_landed == 10

    collector_run(scenario())
    assert [r["offset"] for r in landed_rows(tmp_path / "landing")] == list(range(10))


# -- MQTT 5.0 message properties (issue 13 item 7): batch version 2 -> landing columns --------

ALL_PROPS = Properties(
    payload_format_indicator=1,
    message_expiry_interval=3600,
    content_type="application/json",
    response_topic="replies/dev-1",
    correlation_data=b"\x00\x01req-7",
    user_properties=[("site", "north"), ("line", "3"), ("site", "south")],  # order and repeats kept
)


def with_headers(first: int, n: int, headers: list[bytes]) -> list[BatchRecord]:
    return [BatchRecord(r.offset, r.timestamp_us, r.topic, r.payload, r.qos, h)
            for r, h in zip(records(first, n), headers, strict=True)]


def test_door_quarantines_a_batch_with_malformed_headers_and_keeps_serving(tmp_path: Path) -> None:
    """Headers that are not MQTT 5.0 message properties (spec 2.2.2.2: an identifier not valid
    for a PUBLISH, a repeated property, a truncated value) in a batch whose CRC matches: the
    sender really sent them, so the batch is quarantined like any malformed batch, never
    stored; damage to the headers in transit fails the CRC and is not acknowledged."""
    collector = Collector(collector_config(tmp_path))
    check = collector.check_publish
    good = encode_message_headers(ALL_PROPS)
    bad_headers = [
        b"\x23\x00\x01",  # topic alias: a PUBLISH property, not a message property
        b"\x02\x00\x00\x00\x01\x02\x00\x00\x00\x02",  # message expiry interval twice
        b"\x03\x00\x09abc",  # content type shorter than its length
        b"\x01\x02",  # payload format indicator 2
        b"\xff",  # unknown identifier
    ]
    payload: bytes | bytearray  # (a bytes batch here, a damaged copy below)
    for i, bad in enumerate(bad_headers):
        payload = encode_batch("dev-1", "main", with_headers(100 * i, 3, [good, bad, b""]))
        result = check(CLIENT, Publish(TOPIC, payload, 1, False, False, i + 1))
        assert result.action == "ack_drop" and "malformed headers" in result.reason, result
    assert collector.stats.quarantined == len(bad_headers) and collector.stats.batches_received == 0
    reasons = [r.read_text() for r in sorted((tmp_path / "data" / "quarantine").glob("*.reason"))]
    assert len(reasons) == len(bad_headers) and all("offset" in r and "malformed headers" in r for r in reasons)

    payload = bytearray(encode_batch("dev-1", "main", with_headers(0, 2, [good, good])))
    payload[-3] ^= 0x01  # inside the last record's headers
    assert check(CLIENT, Publish(TOPIC, bytes(payload), 1, False, False, 9)).action == "reject"
    assert collector.stats.crc_rejected == 1
    # The door still stores good batches of both versions.
    assert check(CLIENT, Publish(TOPIC, encode_batch("dev-1", "main", with_headers(0, 2, [good, b""])),
                                 1, False, False, 10)).action == "store"
    assert check(CLIENT, Publish(TOPIC, batch(2, 2), 1, False, False, 11)).action == "store"


def test_collector_lands_message_properties_from_version_1_and_2_batches(tmp_path: Path) -> None:
    """End to end over MQTT: an old agent's version 1 batch and a version 2 batch, one of
    whose records is trimmed off at the door as a duplicate, land in one schema version 2
    file; each property is its own column, null when the message did not carry it."""
    only_user = encode_message_headers(Properties(user_properties=[("k", "v"), ("k", "v")]))
    pfi_zero = encode_message_headers(Properties(payload_format_indicator=0, correlation_data=b""))

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        client = MQTTClient("dev-1", port=collector.port)
        await client.connect()
        await client.publish(TOPIC, batch(0, 3), qos=1, timeout=5)  # version 1: an older agent
        await collector_until(lambda: collector.door_marks.get("dev-1", "main") == 2)
        v2 = encode_batch("dev-1", "main", with_headers(2, 4, [b"", encode_message_headers(ALL_PROPS),
                                                                only_user, pfi_zero]))
        assert peek_header(v2).version == 2
        await client.publish(TOPIC, v2, qos=1, timeout=5)  # offset 2 held already: trimmed
        await client.disconnect()
        assert collector.stats.trimmed_records == 1
        assert collector.lander is not None
        await collector_until(lambda: collector.lander is not None and collector.lander.stats.buffered_rows == 6)
        collector.lander.request_roll()
        await collector_until(lambda: collector.lander is not None and collector.lander.stats.rows_landed == 6)
        await collector.stop()

    collector_run(scenario())
    rows = {r["offset"]: r for r in landed_rows(tmp_path / "landing")}
    assert sorted(rows) == list(range(6)) and {r["schema_version"] for r in rows.values()} == {2}
    for offset in (0, 1, 2):
        assert [rows[offset][c] for c in PROPERTY_COLUMNS] == [None] * 6
    full = rows[3]
    assert full["payload"] == b"p3" and full["topic"] == "sensors/1"
    assert full["payload_format_indicator"] == 1 and full["message_expiry_s"] == 3600
    assert full["content_type"] == "application/json" and full["response_topic"] == "replies/dev-1"
    assert full["correlation_data"] == b"\x00\x01req-7"
    assert full["user_properties"] == [{"key": "site", "value": "north"}, {"key": "line", "value": "3"},
                                       {"key": "site", "value": "south"}]
    assert [rows[4][c] for c in PROPERTY_COLUMNS[:5]] == [None] * 5
    assert rows[4]["user_properties"] == [{"key": "k", "value": "v"}] * 2
    assert rows[5]["payload_format_indicator"] == 0 and rows[5]["correlation_data"] == b""
    assert rows[5]["user_properties"] is None and rows[5]["message_expiry_s"] is None


@settings(max_examples=100, deadline=None)
@given(props=st.lists(st.none() | properties("PUBLISH"), min_size=1, max_size=6))
def test_property_columns_hold_exactly_the_published_properties(props: list[Properties | None]) -> None:
    """Arbitrary message properties (any subset, any values, user properties repeated):
    encode_message_headers -> batch -> columns gives back each property, null when absent."""
    headers = [encode_message_headers(p) for p in props]
    decoded = decode_batch(encode_batch("d", "s", with_headers(0, len(props), headers)), check_headers=check_headers)
    columns = {f: c.to_pylist() for f, c in zip(PROPERTY_COLUMNS, property_columns(decoded), strict=True)}
    for i, p in enumerate(props):
        p = p or Properties()
        assert columns["payload_format_indicator"][i] == p.payload_format_indicator
        assert columns["message_expiry_s"][i] == p.message_expiry_interval
        assert columns["content_type"][i] == p.content_type
        assert columns["response_topic"][i] == p.response_topic
        assert columns["correlation_data"][i] == p.correlation_data
        assert columns["user_properties"][i] == ([{"key": k, "value": v} for k, v in p.user_properties] or None)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=60))
def test_check_headers_refuses_garbage_with_a_value_error_only(headers: bytes) -> None:
    """Whatever the bytes, check_headers passes or raises ValueError (so decode_batch makes it
    MalformedBatch), and what it passes lands without an error."""
    try:
        check_headers(headers)
    except ValueError:
        return
    decoded = decode_batch(encode_batch("d", "s", with_headers(0, 1, [headers])))
    assert len(property_columns(decoded)) == len(PROPERTY_COLUMNS)


# -- connection capacity (issue 11 item 7) -----------------------------------------------------


def test_collector_sizes_max_connections_from_the_fd_limit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A collector serves a fleet: unless collector.max_connections is set, its limit comes from
    RLIMIT_NOFILE (soft raised to hard where allowed) minus a reserve for its own files and for
    sockets still in their CONNECT (broker.max_connecting), not the device broker's 1,000; the
    capacity is logged at start."""
    import resource

    from filemq.ops.fdlimit import FD_RESERVE

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    collector = Collector(collector_config(tmp_path))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY:
        assert soft == hard  # raised (allowed: an unprivileged process may raise soft to hard)
    connecting = collector.broker.config.broker.max_connecting
    capacity = soft - FD_RESERVE - connecting
    assert collector.broker.config.broker.max_connections == capacity > 1000
    explicit = Collector(collector_config(tmp_path / "x", **{"collector.max_connections": 20_000}))
    assert explicit.broker.config.broker.max_connections == 20_000

    async def start_stop() -> None:
        await collector.start()
        await collector.stop()

    caplog.set_level("INFO")
    collector_run(start_stop())
    assert f"up to {capacity} device connections" in caplog.text


def test_fd_limit_raise_and_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    from filemq.ops import fdlimit

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))

    def refuse(_: int, limits: tuple[int, int]) -> None:
        calls.append(limits)
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    assert fdlimit.raise_nofile_limit() == (1024, 4096)  # refused: the soft limit stays
    assert calls == [(4096, 4096)]
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: calls.append(limits))
    assert fdlimit.raise_nofile_limit() == (4096, 4096)
    assert fdlimit.connection_capacity(4096) == 4096 - fdlimit.FD_RESERVE
    assert fdlimit.connection_capacity(300) == 150  # a tiny limit: half for connections
    assert fdlimit.connection_capacity(1) == 1
