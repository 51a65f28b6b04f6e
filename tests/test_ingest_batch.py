"""The ingest batch path (issue 16 item 3): a read's run of MQTT 3.1.1 PUBLISHes is appended
with one call (``Log.append_many`` / ``GroupCommitter.append_many_nowait`` /
``Queue.publish_many_nowait``) and its PUBACKs wait for the commit as one entry. Same records,
same bytes on disk, same acks in the same order as one ``on_publish`` per message; PUBACK only
after the commit (MQTT-4.3.2 / ARCHITECTURE.md: acknowledged = fdatasynced)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from filemq.broker.tailcache import _OVERHEAD, TailCache
from filemq.mqtt.codec import Decoder, encode, publish_bytes
from filemq.mqtt.packets import Puback, Publish, PublishRun, Pubrec
from segments import DiskFull, GroupCommitter, Log, LogConfig, Record
from tests.broker_harness import Harness, run
from tests.storage_faults import InjectingFileIO

SMALL = LogConfig(segment_bytes=2048, index_interval_bytes=200)

_msg = st.tuples(st.sampled_from(["a", "dev/t", "é/ü"]), st.binary(max_size=300), st.booleans())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=st.lists(_msg, min_size=1, max_size=40), qos=st.integers(0, 2), cut=st.integers(0, 40))
def test_append_many_writes_the_same_bytes_as_append_one_by_one(
        tmp_path_factory: pytest.TempPathFactory, msgs: list[tuple[str, bytes, bool]], qos: int, cut: int) -> None:
    """Byte for byte the segment files (and their rolls, indexes) of ``append`` per record."""
    one, many = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("many")
    a, b = Log.open(one, SMALL), Log.open(many, SMALL)
    a.append("x", b"first", timestamp_us=1)  # not at offset 0 / position 0
    b.append("x", b"first", timestamp_us=1)
    for t, p, r in msgs:
        a.append(t, p, qos=qos, retain=r, timestamp_us=1234)
    first = b.append_many([t for t, _, _ in msgs[:cut]], [p for _, p, _ in msgs[:cut]],
                          [r for _, _, r in msgs[:cut]], qos, 1234) if cut else 1
    second = b.append_many([t for t, _, _ in msgs[cut:]], [p for _, p, _ in msgs[cut:]],
                           [r for _, _, r in msgs[cut:]], qos, 1234) if msgs[cut:] else None
    assert first == 1 and second in (None, 1 + min(cut, len(msgs)))
    a.close()
    b.close()
    files_a = sorted(p.name for p in one.iterdir())
    assert files_a == sorted(p.name for p in many.iterdir())
    for name in files_a:
        assert (one / name).read_bytes() == (many / name).read_bytes(), name


def test_append_many_keeps_the_records_before_a_failing_one(tmp_path: Path) -> None:
    """A record too large for a segment raises ValueError as ``append`` does; the ones before
    it stay buffered with their offsets, it and the ones after it get none."""
    log = Log.open(tmp_path, SMALL)
    with pytest.raises(ValueError, match="does not fit"):
        log.append_many(["t", "t", "t"], [b"1", b"x" * 4096, b"3"], [False] * 3, 1, 5)
    assert log.next_offset == 1
    log.flush()
    assert [(r.offset, r.payload, r.qos) for r in log.read(0, 10)] == [(0, b"1", 1)]
    with pytest.raises(ValueError, match="qos"):
        log.append_many(["t"], [b"1"], [False], 3, 5)
    log.close()


def test_append_many_below_the_free_space_floor_stops_where_append_would(tmp_path: Path) -> None:
    """``min_free_bytes``: DiskFull at the same record as ``append`` one by one; the records
    before it stay, and the log takes more once there is room again."""
    ref_io, io = InjectingFileIO(), InjectingFileIO()
    ref_io.free = io.free = 10_000
    ref = Log.open(tmp_path / "ref", LogConfig(min_free_bytes=9_000), fileio=ref_io)
    log = Log.open(tmp_path / "many", LogConfig(min_free_bytes=9_000), fileio=io)
    with pytest.raises(DiskFull):
        for _ in range(100):
            ref.append("t", b"x" * 50, qos=1)
    with pytest.raises(DiskFull):
        log.append_many(["t"] * 100, [b"x" * 50] * 100, [False] * 100, 1, 5)
    assert 0 < log.next_offset == ref.next_offset < 100
    log.flush()
    assert [r.offset for r in log.read(0, 1000)] == list(range(log.next_offset))
    io.free = 10**9
    assert log.append_many(["t"], [b"again"], [False], 1, 5) == ref.next_offset
    ref.close()
    log.close()


def test_group_commit_of_a_run_resolves_one_future_after_the_sync(tmp_path: Path) -> None:
    async def main() -> None:
        log = Log.open(tmp_path, LogConfig(fsync="always"))
        gc = GroupCommitter(log)
        await gc.start()
        first, fut = gc.append_many_nowait(["a", "b"], [b"1", b"2"], [False, True], 1, 7)
        offset, fut2 = gc.append_nowait("c", b"3", qos=1)
        assert (first, offset) == (0, 2) and fut2 is fut and not fut.done()
        await fut
        assert log.committed_offset == 3 and log.stats.fsyncs >= 1
        assert [(r.topic, r.payload, r.retain, r.timestamp_us) for r in log.read(0, 2)] == \
            [("a", b"1", False, 7), ("b", b"2", True, 7)]
        await gc.close()
        log.close()
    run(main())


def test_a_read_of_mixed_publishes_is_stored_and_acked_in_order(tmp_path: Path) -> None:
    """MQTT-4.6.0-2 (PUBACKs in the order the PUBLISHes were received) with the run split by a
    QoS 0, a ``$`` topic (acked, dropped), a QoS 2 and a retained message: records stored in
    order, nothing acknowledged before the commit except what is not stored."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("p")
        c.send(Publish("t/1", b"1", qos=1, packet_id=1), Publish("t/1", b"2", qos=1, packet_id=2),
               Publish("t/0", b"q0"), Publish("$x", b"d", qos=1, packet_id=3),
               Publish("t/2", b"3", qos=2, packet_id=4), Publish("t/1", b"4", qos=1, packet_id=5, retain=True),
               Publish("t/3", b"5", qos=1, packet_id=6))
        await asyncio.sleep(0)
        assert c.received() == []  # the $ PUBACK waits behind the acks queued before it
        await h.commit()
        assert c.received() == [Puback(1), Puback(2), Puback(3), Pubrec(4), Puback(5), Puback(6)]
        assert [(r.topic, r.payload, r.qos, r.retain) for r in h.queue.log.records] == [
            ("t/1", b"1", 1, False), ("t/1", b"2", 1, False), ("t/0", b"q0", 0, False),
            ("t/2", b"3", 2, False), ("t/1", b"4", 1, True), ("t/3", b"5", 1, False)]
        assert h.stats.messages_received == 7
        rates = dict(h.stats.hot_topics.top(10, 0.0))
        assert rates["t/1"] == pytest.approx(3 / 60, rel=1e-3)
        assert rates["t/3"] == pytest.approx(1 / 60, rel=1e-3)
        assert h.core.retained.store.get("t/1") is not None  # routed like any committed record
    run(main())


def test_a_failed_commit_of_a_run_acks_nothing_and_closes(tmp_path: Path) -> None:
    """3.1.1 has no negative PUBACK: a run whose commit fails is not acknowledged."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("p")
        c.send(*[Publish("t", b"%d" % i, qos=1, packet_id=i + 1) for i in range(5)])
        h.queue.fail_next = True
        await h.commit()
        assert c.received() == []
        assert c.conn.closed and "storing a PUBLISH failed" in c.conn.close_reason
    run(main())


_QOS = (1, 2, 0, 1)


class _FakeLog:
    first_offset = 0
    next_offset = 10_000
    committed_offset = 10_000

    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> list[Record]:
        return []


@settings(max_examples=60, deadline=None)
@given(runs=st.lists(st.integers(1, 30), min_size=1, max_size=12),
       sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=50),
       gaps=st.lists(st.integers(-3, 3), min_size=12, max_size=12), limit=st.integers(2_000, 40_000),
       mixed=st.booleans())
def test_tail_cache_put_many_keeps_what_put_per_record_keeps(runs: list[int], sizes: list[int], gaps: list[int],
                                                              limit: int, mixed: bool) -> None:
    """Runs that follow the tail, overlap it or leave a gap: the same records readable, the
    same bytes counted, memory bounded as with :meth:`TailCache.put` one by one."""
    one = TailCache(_FakeLog(), max_bytes=limit)
    many = TailCache(_FakeLog(), max_bytes=limit)
    offset = 0
    for count, gap in zip(runs, gaps, strict=False):
        offset = max(0, offset + gap)
        # A record is the same whenever its offset is put again (committed records never change).
        # Plain QoS 1 records, or (mixed) some QoS 0 / 2, retained or with MQTT 5 headers.
        records = [Record(o, 0, "t", b"x" * sizes[o % len(sizes)], _QOS[o % 4] if mixed else 1,
                          mixed and o % 7 == 3, b"\x03\x00\x01a" if mixed and o % 11 == 5 else b"")
                   for o in range(offset, offset + count)]
        offset += count
        for r in records:
            one.put(r)
        many.put_many(records)
        # Both keep a gap-free suffix of what was put (eviction may cut at another record).
        a, b = sorted((one._tail, many._tail), key=len)
        assert a == b[len(b) - len(a):]
        assert [r.offset for r in many._tail] == list(range(many._base, many._base + len(many._tail)))
        # (headers counted as eviction counts them: the bytes stay those of what is held)
        assert many._tail_bytes == sum(len(r.payload) + len(r.topic) + len(r.headers) + _OVERHEAD for r in many._tail)
        assert many._tail_bytes <= many._tail_limit
        assert many._largest >= max((len(r.payload) + 1 for r in many._tail), default=0)
        for cache in (one, many):  # each record's PUBLISH prefix beside it (the run path's)
            assert len(cache._prefix) == len(cache._odd) <= len(cache._tail)  # (made when asked)
            if len(cache._tail) > 2 and mixed:
                cache.plain_prefixes(cache._base + 1, 1)  # some made now, the rest below
            assert cache.plain_prefixes(cache._base - 1, 1) is None
            assert cache.plain_prefixes(cache._base, len(cache._tail) + 1) is None
            plain = [not r.headers and not r.retain and r.qos >= 1 for r in cache._tail]
            whole = cache.plain_prefixes(cache._base, len(cache._tail))
            assert (whole is not None) == all(plain)
            for k, r in enumerate(cache._tail):
                got = cache.plain_prefixes(r.offset, 1)
                assert (got is not None) == plain[k], r
                if got is not None:
                    pid = 1 + k % 0xFFFF
                    assert got[0] + pid.to_bytes(2, "big") + r.payload == publish_bytes(r.topic, r.payload, 1, False, pid)


def test_a_run_with_a_payload_over_message_size_limit_stops_at_it(tmp_path: Path) -> None:
    """As one on_publish per message: the PUBLISHes before the oversized one are stored, it and
    those after it are not, the connection closes and nothing is acknowledged (3.1.1 has no
    negative PUBACK; docs/CONFIG.md message_size_limit)."""
    async def main() -> None:
        h = Harness(tmp_path, message_size_limit=10)
        c = h.connected("p")
        c.send(Publish("t", b"ok", qos=1, packet_id=1), Publish("t", b"x" * 11, qos=1, packet_id=2),
               Publish("t", b"later", qos=1, packet_id=3))
        await h.commit()
        assert c.received() == []
        assert c.conn.closed and "message_size_limit" in c.conn.close_reason
        assert [r.payload for r in h.queue.log.records] == [b"ok"]
    run(main())


def test_a_sync_companion_with_nothing_to_sync_wakes_no_thread(tmp_path: Path) -> None:
    """The progress journal's sync rides on synced commits only when it has records to sync
    (``needed``): an ingest without acks starts no companion thread per commit."""
    log = Log.open(tmp_path, LogConfig(fsync="always"))
    calls: list[int] = []
    dirty = [False]

    ran = threading.Event()

    def companion() -> None:
        calls.append(log.committed_offset)
        dirty[0] = False
        ran.set()

    async def main() -> None:
        gc = GroupCommitter(log)
        gc.add_sync_companion(companion, lambda: dirty[0])
        await gc.start()
        for i in range(3):
            await gc.append("t", b"%d" % i)
        assert calls == []
        dirty[0] = True
        await gc.append("t", b"dirty")
        assert await asyncio.get_running_loop().run_in_executor(None, ran.wait, 10)
        assert calls == [4] and not dirty[0]
        await gc.close()

    run(main())
    log.close()


def test_runs_of_equal_shaped_publishes_are_stored_and_acked_like_single_ones(tmp_path: Path) -> None:
    """MQTT-4.6.0-2 (acks in order) across runs the decoder hands over as one PublishRun each
    (QoS 1 stored at once; QoS 0, QoS 2 and a ``$`` topic through on_publish per message)."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("p")
        first = [Publish("run/1", b"a%d" % i, qos=1, packet_id=1 + i) for i in range(6)]
        dollar = [Publish("$run", b"b%d" % i, qos=1, packet_id=10 + i) for i in range(5)]
        qos0 = [Publish("run/0", b"c%d" % i) for i in range(5)]
        qos2 = [Publish("run/2", b"d%d" % i, qos=2, packet_id=20 + i) for i in range(5)]
        last = [Publish("run/1", b"e%d" % i, qos=1, packet_id=30 + i, retain=True) for i in range(5)]
        for p in (first[0], dollar[0], qos0[0], qos2[0]):  # topics seen once: the cache holds them
            c.send(p)
        await h.commit()
        c.received()
        records_before = len(h.queue.log.records)
        decoder = Decoder(server=True, runs=True)
        decoder.feed(b"".join(encode(p) for p in first[:1] + first))
        assert [type(p) for p in decoder.packets()] == [Publish, PublishRun]
        c.send(*first[1:], *dollar[1:], *qos0[1:], *qos2[1:], *last)
        await h.commit()
        acks: list[object] = [Puback(p.packet_id or 0) for p in first[1:] + dollar[1:]]
        acks += [Pubrec(p.packet_id or 0) for p in qos2[1:]] + [Puback(p.packet_id or 0) for p in last]
        assert c.received() == acks
        assert [(r.topic, r.payload, r.qos, r.retain) for r in h.queue.log.records[records_before:]] == [
            (p.topic, p.payload, p.qos, p.retain) for p in first[1:] + qos0[1:] + qos2[1:] + last]
    run(main())


def test_a_run_of_empty_payloads_loses_no_message(tmp_path: Path) -> None:
    """Regression (823cdbc): a run of equal-shaped PUBLISHes with empty payloads is stored and
    acknowledged whole, QoS 0 and QoS 1 alike."""
    async def main() -> None:
        h = Harness(tmp_path)
        c = h.connected("p")
        c.send(Publish("e", b"", qos=1, packet_id=100), Publish("z", b""))  # topics cached
        await h.commit()
        c.received()
        before = len(h.queue.log.records)
        c.send(*[Publish("e", b"", qos=1, packet_id=1 + i) for i in range(6)], *[Publish("z", b"") for _ in range(6)])
        await h.commit()
        assert c.received() == [Puback(1 + i) for i in range(6)]
        assert [(r.topic, r.qos) for r in h.queue.log.records[before:]] == [("e", 1)] * 6 + [("z", 0)] * 6
    run(main())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=st.lists(st.tuples(_msg, st.sampled_from([b"", b"\x03\x00\x01x", b"\x26\x00\x01k\x00\x01v" * 3])),
                     min_size=1, max_size=40),
       qos=st.integers(0, 2), cut=st.integers(0, 40))
def test_append_many_with_headers_writes_the_same_bytes_as_append_one_by_one(
        tmp_path_factory: pytest.TempPathFactory, msgs: list[tuple[tuple[str, bytes, bool], bytes]], qos: int,
        cut: int) -> None:
    """Issue 33 item 6: records with MQTT 5 headers (format 2; a run where every record has
    some is encoded in one call, a mixed one record by record) are byte for byte those of
    ``append`` per record, rolls and indexes included."""
    one, many = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("many")
    a, b = Log.open(one, SMALL), Log.open(many, SMALL)
    a.append("x", b"first", timestamp_us=1)  # not at offset 0 / position 0
    b.append("x", b"first", timestamp_us=1)
    for (t, p, r), h in msgs:
        a.append(t, p, qos=qos, retain=r, timestamp_us=1234, headers=h)
    for part in (msgs[:cut], msgs[cut:]):
        if part:
            b.append_many([t for (t, _, _), _ in part], [p for (_, p, _), _ in part], [r for (_, _, r), _ in part],
                          qos, 1234, [h for _, h in part])
    a.close()
    b.close()
    files_a = sorted(p.name for p in one.iterdir())
    assert files_a == sorted(p.name for p in many.iterdir())
    for name in files_a:
        assert (one / name).read_bytes() == (many / name).read_bytes(), name
