"""Retained messages: apply/clear, snapshot + log replay across restarts, damage and retention."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from filemq.queue.retained import (
    SNAPSHOT_NAME,
    CorruptSnapshot,
    RetainedMessage,
    RetainedStore,
    decode_snapshot,
    encode_snapshot,
)
from segments.log import Log, LogConfig
from segments.record import Record


def publish(
    log: Log, store: RetainedStore | None, topic: str, payload: bytes, *,
    retain: bool = True, qos: int = 1,
) -> int:
    """What the broker does: append, commit, then apply the durable record."""
    offset = log.append(topic, payload, qos=qos, retain=retain)
    log.sync()
    if store is not None:
        (record,) = log.read(offset, 1)
        store.apply(record)
    return offset


def model_after(ops: list[tuple[str, bytes]]) -> dict[str, bytes]:
    state: dict[str, bytes] = {}
    for topic, payload in ops:
        if payload:
            state[topic] = payload
        else:
            state.pop(topic, None)
    return state


def contents(store: RetainedStore) -> dict[str, bytes]:
    return {m.topic: m.payload for m in store.match("#")}


def test_apply_sets_clears_and_ignores_non_retained(tmp_path: Path) -> None:
    store = RetainedStore(tmp_path)
    store.apply(Record(0, 10, "a/b", b"one", 1, True))
    store.apply(Record(1, 11, "a/c", b"two", 0, True))
    store.apply(Record(2, 12, "a/b", b"not retained", 1, False))
    assert store.get("a/b") == RetainedMessage("a/b", b"one", 1, 0, 10)
    store.apply(Record(3, 13, "a/b", b"", 1, True))  # empty retained payload clears
    assert store.get("a/b") is None and len(store) == 1
    assert store.payload_bytes == 3
    store.apply(Record(4, 14, "a/c", b"newer", 2, True))
    store.apply(Record(1, 11, "a/c", b"two", 0, True))  # replayed older record: no effect
    assert store.get("a/c") == RetainedMessage("a/c", b"newer", 2, 4, 14)
    assert store.payload_bytes == 5


def test_match_uses_filters_and_the_dollar_rule(tmp_path: Path) -> None:
    store = RetainedStore(tmp_path)
    for i, topic in enumerate(["s/1/temp", "s/2/temp", "s/2/hum", "$SYS/x", "s"]):
        store.apply(Record(i, 0, topic, topic.encode(), 0, True))
    assert [m.topic for m in store.match("s/+/temp")] == ["s/1/temp", "s/2/temp"]
    assert [m.topic for m in store.match("s/#")] == ["s", "s/1/temp", "s/2/hum", "s/2/temp"]
    assert "$SYS/x" not in [m.topic for m in store.match("#")]
    assert [m.topic for m in store.match("$SYS/#")] == ["$SYS/x"]
    assert [m.topic for m in store.match("s/2/hum")] == ["s/2/hum"]
    assert store.match("nothing/here") == []
    assert [m.topic for m in store.match("$share/g/s/1/+")] == ["s/1/temp"]


def test_snapshot_round_trip_and_crc(tmp_path: Path) -> None:
    msgs = [RetainedMessage("a", b"x" * 300, 1, 5, 123), RetainedMessage("ü/b", b"", 2, 9, -1)]
    data = encode_snapshot(msgs, 10)
    assert decode_snapshot(data) == (msgs, 10)
    for cut in (0, 5, len(data) // 2, len(data) - 1):
        with pytest.raises(CorruptSnapshot):
            decode_snapshot(data[:cut])
    for pos in (3, 20, len(data) - 2):
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        with pytest.raises(CorruptSnapshot):
            decode_snapshot(bytes(flipped))


HEADERS = b"\x03\x00\x0atext/plain&\x00\x01k\x00\x01v"  # content type, a user property


def test_apply_keeps_a_retained_messages_headers(tmp_path: Path) -> None:
    """Issue 13: a retained message keeps its MQTT 5 properties (Record.headers)."""
    store = RetainedStore(tmp_path)
    store.apply(Record(0, 10, "a/b", b"one", 1, True, HEADERS))
    assert store.get("a/b") == RetainedMessage("a/b", b"one", 1, 0, 10, HEADERS)
    store.apply(Record(1, 11, "a/b", b"two", 1, True))  # a newer one without properties
    assert store.get("a/b") == RetainedMessage("a/b", b"two", 1, 1, 11)


def test_snapshot_format_2_with_headers_and_format_1_without(tmp_path: Path) -> None:
    """A snapshot without any headers is written in format 1 (``FMQRSNP1``), byte for byte
    as before (what an older release reads); with headers in format 2 (``FMQRSNP2``: a u32
    headers length per entry).  Both round-trip and detect damage."""
    plain = [RetainedMessage("a", b"x" * 300, 1, 5, 123), RetainedMessage("ü/b", b"", 2, 9, -1)]
    v1 = encode_snapshot(plain, 10)
    assert v1[:8] == b"FMQRSNP1" and decode_snapshot(v1) == (plain, 10)
    golden = (Path(__file__).parent / "golden" / "retained_v1.snap").read_bytes()
    assert encode_snapshot(GOLDEN_SNAPSHOT, 12) == golden
    mixed = [RetainedMessage("a", b"x", 1, 5, 123, HEADERS), RetainedMessage("b", b"y", 0, 6, 1)]
    v2 = encode_snapshot(mixed, 10)
    assert v2[:8] == b"FMQRSNP2" and decode_snapshot(v2) == (mixed, 10)
    for cut in range(len(v2)):
        with pytest.raises(CorruptSnapshot):
            decode_snapshot(v2[:cut])
    for pos in range(len(v2)):
        flipped = bytearray(v2)
        flipped[pos] ^= 0x10
        with pytest.raises(CorruptSnapshot):
            decode_snapshot(bytes(flipped))


GOLDEN_SNAPSHOT = [
    RetainedMessage("a/b", b"one", 1, 3, 1_700_000_000_000_000),
    RetainedMessage("cafés/🌡", b"", 0, 7, -1),
    RetainedMessage("x", bytes(range(20)), 2, 9, 5),
]


def test_a_format_1_snapshot_written_before_headers_still_loads(tmp_path: Path) -> None:
    """tests/golden/retained_v1.snap was written by main's code at 95ea32c (before format 2)."""
    golden = (Path(__file__).parent / "golden" / "retained_v1.snap").read_bytes()
    assert decode_snapshot(golden) == (GOLDEN_SNAPSHOT, 12)
    log = Log.open(tmp_path / "log")
    for _ in range(12):
        log.append("other", b"p")
    log.append("m5", b"new", qos=1, retain=True, headers=HEADERS)
    log.sync()
    (tmp_path / SNAPSHOT_NAME).write_bytes(golden)
    store = RetainedStore(tmp_path)
    report = store.recover(log)
    assert report.snapshot_loaded and report.snapshot_entries == 3 and report.replay_from == 12
    assert store.get("a/b") == GOLDEN_SNAPSHOT[0]
    assert store.get("m5") == RetainedMessage("m5", b"new", 1, 12, store.get("m5").timestamp_us, HEADERS)  # type: ignore[union-attr]
    log.close()


@pytest.mark.parametrize("via", ["snapshot", "log"])
def test_retained_headers_survive_a_restart(tmp_path: Path, via: str) -> None:
    """From the snapshot (format 2) or replayed from the log (record format 2)."""
    log = Log.open(tmp_path / "log")
    store = RetainedStore(tmp_path)
    offset = log.append("m5/t", b"v", qos=1, retain=True, headers=HEADERS)
    log.append("m3/t", b"w", qos=0, retain=True)
    log.sync()
    for record in log.read(0):
        store.apply(record)
    if via == "snapshot":
        store.advance(log.committed_offset)
        store.snapshot()
        assert (tmp_path / SNAPSHOT_NAME).read_bytes()[:8] == b"FMQRSNP2"
    log.close()
    log = Log.open(tmp_path / "log")
    again = RetainedStore(tmp_path)
    report = again.recover(log)
    assert report.replayed_records == (0 if via == "snapshot" else 2)
    assert again.get("m5/t") == store.get("m5/t") == RetainedMessage(
        "m5/t", b"v", 1, offset, again.get("m5/t").timestamp_us, HEADERS)  # type: ignore[union-attr]
    assert again.get("m3/t") is not None and again.get("m3/t").headers == b""  # type: ignore[union-attr]
    log.close()


def test_restart_with_snapshot_replays_only_the_tail(tmp_path: Path) -> None:
    ops: list[tuple[str, bytes]] = []
    log = Log.open(tmp_path / "log")
    store = RetainedStore(tmp_path)
    for i in range(50):
        topic, payload = f"t/{i % 7}", (b"" if i % 5 == 4 else f"v{i}".encode())
        publish(log, store, topic, payload)
        publish(log, store, "plain", b"p", retain=False)
        ops.append((topic, payload))
    store.advance(log.committed_offset)
    store.snapshot()
    covered = store.covered_offset
    for i in range(10):  # after the snapshot: must come back from the log
        topic, payload = f"t/{i % 3}", (b"" if i == 4 else f"late{i}".encode())
        publish(log, store, topic, payload)
        ops.append((topic, payload))
    expected = model_after(ops)
    assert contents(store) == expected
    log.close()

    log = Log.open(tmp_path / "log")
    again = RetainedStore(tmp_path)
    report = again.recover(log)
    assert contents(again) == expected
    assert report.snapshot_loaded and report.replay_from == covered
    assert report.replayed_records == 10 and report.applied == 10
    assert again.covered_offset == log.committed_offset
    assert again.get("t/1") == store.get("t/1")
    log.close()


def test_no_snapshot_rebuilds_from_the_whole_log(tmp_path: Path) -> None:
    log = Log.open(tmp_path / "log")
    ops = []
    for i in range(30):
        topic, payload = f"t/{i % 4}", (b"" if i % 6 == 5 else bytes([i]))
        publish(log, None, topic, payload)
        ops.append((topic, payload))
    store = RetainedStore(tmp_path)
    report = store.recover(log)
    assert not report.snapshot_loaded and not report.snapshot_corrupt
    assert report.replayed_records == 30 and contents(store) == model_after(ops)
    log.close()


@pytest.mark.parametrize("damage", ["torn", "flipped", "garbage"])
def test_corrupt_snapshot_warns_and_replays_from_first_offset(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    log = Log.open(tmp_path / "log")
    store = RetainedStore(tmp_path)
    ops = []
    for i in range(20):
        topic, payload = f"t/{i % 3}", f"v{i}".encode()
        publish(log, store, topic, payload)
        ops.append((topic, payload))
    store.advance(log.committed_offset)
    store.snapshot()
    snap = tmp_path / SNAPSHOT_NAME
    data = snap.read_bytes()
    if damage == "torn":
        snap.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":
        snap.write_bytes(data[:30] + bytes([data[30] ^ 1]) + data[31:])
    else:
        snap.write_bytes(b"\x00" * 7)
    fresh = RetainedStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="filemq.queue.retained"):
        report = fresh.recover(log)
    assert report.snapshot_corrupt and not report.snapshot_loaded
    assert report.replay_from == log.first_offset and report.replayed_records == 20
    assert contents(fresh) == model_after(ops)
    assert any("corrupt retained snapshot" in r.getMessage() for r in caplog.records)
    log.close()


def test_snapshot_is_the_source_for_segments_deleted_by_retention(tmp_path: Path) -> None:
    config = LogConfig(segment_bytes=1024, retention_bytes=2048)
    log = Log.open(tmp_path / "log", config)
    store = RetainedStore(tmp_path)
    publish(log, store, "old/retained", b"from long ago")
    for _ in range(100):
        publish(log, store, "bulk", b"x" * 100, retain=False)
    store.advance(log.committed_offset)
    store.snapshot()
    publish(log, store, "new/retained", b"fresh")
    log.enforce_retention()
    assert log.first_offset > 0  # the old retained record's segment is gone
    log.close()

    log = Log.open(tmp_path / "log", config)
    again = RetainedStore(tmp_path)
    report = again.recover(log)
    assert report.lost_range is None
    assert contents(again) == {"old/retained": b"from long ago", "new/retained": b"fresh"}
    log.close()


def test_retention_past_the_snapshot_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = LogConfig(segment_bytes=1024, retention_bytes=2048)
    log = Log.open(tmp_path / "log", config)
    store = RetainedStore(tmp_path)
    store.snapshot()  # covers nothing
    publish(log, store, "lost/retained", b"deleted before any snapshot")
    for _ in range(100):
        publish(log, store, "bulk", b"x" * 100, retain=False)
    log.enforce_retention()
    first = log.first_offset
    with caplog.at_level(logging.WARNING, logger="filemq.queue.retained"):
        report = RetainedStore(tmp_path).recover(log)
    assert report.lost_range == (0, first)
    assert any("retention deleted" in r.getMessage() for r in caplog.records)
    log.close()


class ShortLog:
    """A log that lost its unsynced tail: it ends before the snapshot's covered offset."""

    first_offset = 0
    next_offset = 3  # (LogView's; recovery reads only first_offset and committed_offset)
    committed_offset = 3

    def __init__(self, records: list[Record]) -> None:
        self.records = records

    def read(self, offset: int, max_records: int = 1000, max_bytes: int = 1 << 20) -> list[Record]:
        return [r for r in self.records if offset <= r.offset < self.committed_offset][:max_records]


def test_snapshot_ahead_of_the_log_drops_what_the_log_lost(tmp_path: Path) -> None:
    store = RetainedStore(tmp_path)
    store.apply(Record(1, 0, "kept", b"k", 1, True))
    store.apply(Record(4, 0, "lost", b"l", 1, True))
    store.advance(5)
    store.snapshot()
    fresh = RetainedStore(tmp_path)
    report = fresh.recover(ShortLog([Record(2, 0, "x", b"", 0, False)]))
    assert report.dropped_ahead == 1 and contents(fresh) == {"kept": b"k"}
    assert fresh.covered_offset == 3


def test_without_advance_the_snapshot_covers_what_recovery_saw(tmp_path: Path) -> None:
    # apply() never moves covered_offset (out-of-order applies would be unsafe), so a
    # snapshot taken without advance() still replays everything after the last recovery.
    log = Log.open(tmp_path / "log")
    store = RetainedStore(tmp_path)
    store.recover(log)
    publish(log, store, "a", b"1")
    store.snapshot()
    assert store.covered_offset == 0
    log.close()
    log = Log.open(tmp_path / "log")
    again = RetainedStore(tmp_path)
    report = again.recover(log)
    assert report.replayed_records == 1 and contents(again) == {"a": b"1"}
    log.close()


# -- model check: random publishes, snapshots and restarts against a dict -----------------

OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("pub"), st.integers(0, 4), st.sampled_from([b"", b"a", b"bb"]), st.booleans(),
            st.sampled_from([b"", b"\x01\x01", b"&\x00\x01k\x00\x01v"]),  # headers (issue 13)
        ),
        st.tuples(st.just("snap"), st.booleans()),
        st.tuples(st.just("restart")),
    ),
    max_size=40,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_model_random_publishes_snapshots_restarts(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[object, ...]]
) -> None:
    root = tmp_path_factory.mktemp("model")
    log = Log.open(root / "log")
    store = RetainedStore(root)
    store.recover(log)
    model: dict[str, tuple[bytes, bytes]] = {}
    for op in ops:
        if op[0] == "pub":
            _, idx, payload, retain, headers = op
            assert isinstance(payload, bytes) and isinstance(retain, bool) and isinstance(headers, bytes)
            topic = f"t/{idx}"
            offset = log.append(topic, payload, qos=1, retain=retain, headers=headers)
            log.flush()  # readable; durability itself is the log's concern, tested there
            (record,) = log.read(offset, 1)
            store.apply(record)
            if retain:
                if payload:
                    model[topic] = (payload, headers)
                else:
                    model.pop(topic, None)
        elif op[0] == "snap":
            if op[1]:
                store.advance(log.committed_offset)
            store.snapshot()
        else:
            log.close()
            log = Log.open(root / "log")
            store = RetainedStore(root)
            store.recover(log)
        assert {m.topic: (m.payload, m.headers) for m in store.match("#")} == model
    log.close()
