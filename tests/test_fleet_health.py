"""The health report (filemq.upstream.health, docs/FORMAT.md "Health report") and the agent side:
the bytes, the CRC, the checks, and the forwarder sending one at each connect and every interval
as QoS 0, never taking a data batch's place."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filemq.queue.groups import ConsumerGroup
from filemq.upstream.batch import decode_batch, parse_batch_topic
from filemq.upstream.health import (
    MAX_REPORT_BYTES,
    RESERVED_FIELDS,
    HealthCrcError,
    MalformedHealth,
    decode_health,
    encode_health,
    health_topic,
    parse_health_topic,
)
from segments import GroupCommitter, Log, LogConfig
from worker_agent.forwarder import Forwarder, ForwarderConfig

pytestmark = pytest.mark.timeout(60)

BODY = {"agent_version": "0.1.0", "build": "pure", "uptime_s": 12.5, "interval_s": 30, "log_bytes": 4096,
        "disk_free_bytes": 10**9, "clients_connected": 3, "messages_received": 10, "messages_dropped": 0,
        "oversized_skipped": 0, "recovery_corrupt_records": 0, "recovery_truncated_bytes": 0,
        "exports": [{"name": "collector", "kind": "filemq", "state": "connected", "lag_records": 5,
                     "lag_bytes": 500, "oldest_unacked_age_s": 1.25, "records_acked": 5, "lost_records": 0,
                     "oversized_skipped": 0}]}

names = st.text(st.characters(blacklist_characters="/+#\x00", blacklist_categories=["Cs"]), min_size=1,
                max_size=40)
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=12)


def test_golden_layout() -> None:
    """The header fields sit where FORMAT.md says (offsets and widths)."""
    data = encode_health("dev-1", 1_700_000_000_000_000, 7, {"uptime_s": 1.0})
    assert data[:4] == b"FMQH"
    assert data[8] == 1 and data[9:12] == b"\0\0\0"
    sent, seq = struct.unpack_from("<qQ", data, 12)
    assert (sent, seq) == (1_700_000_000_000_000, 7)
    (n,) = struct.unpack_from("<H", data, 28)
    assert data[30:30 + n] == b"dev-1"
    (body_len,) = struct.unpack_from("<I", data, 30 + n)
    assert data[34 + n:] == b'{"uptime_s":1.0}' and body_len == len(data) - 34 - n


@settings(max_examples=200, deadline=None)
@given(device=names, sent=st.integers(-2**63, 2**63 - 1), seq=st.integers(0, 2**64 - 1),
       extra=st.dictionaries(st.text(min_size=1, max_size=10).filter(lambda k: k not in BODY and k not in RESERVED_FIELDS),
                             json_values,
                             max_size=5))
def test_roundtrip(device: str, sent: int, seq: int, extra: dict[str, Any]) -> None:
    body = {**BODY, **extra}
    report = decode_health(encode_health(device, sent, seq, body))
    assert (report.device_id, report.sent_at_us, report.sequence, report.body) == (device, sent, seq, body)
    assert report.exports == BODY["exports"]
    assert json.loads(report.body_json) == body


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_flipped_bit_is_a_crc_error(data: st.DataObject) -> None:
    raw = bytearray(encode_health("dev-1", 1, 1, BODY))
    bit = data.draw(st.integers(0, len(raw) * 8 - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    # A flip in the CRC field itself is a mismatch too; every byte is covered.
    with pytest.raises(HealthCrcError):
        decode_health(bytes(raw))


def _with_crc(rest: bytes, magic: bytes = b"FMQH") -> bytes:
    from crc32c import crc32c
    return magic + struct.pack("<I", crc32c(rest, crc32c(magic))) + rest


@pytest.mark.parametrize("rest,why", [
    (bytes((2, 0, 0, 0)) + bytes(40), "version"),
    (bytes((1, 1, 0, 0)) + struct.pack("<qQ", 0, 0) + struct.pack("<H", 1) + b"d" + struct.pack("<I", 2) + b"{}",
     "reserved"),
    (bytes((1, 0, 0, 0)) + struct.pack("<qQ", 0, 0) + struct.pack("<H", 3) + b"a/b" + struct.pack("<I", 2) + b"{}",
     "device id"),
    (bytes((1, 0, 0, 0)) + struct.pack("<qQ", 0, 0) + struct.pack("<H", 1) + b"d" + struct.pack("<I", 9) + b"{}",
     "body length"),
    (bytes((1, 0, 0, 0)) + struct.pack("<qQ", 0, 0) + struct.pack("<H", 1) + b"d" + struct.pack("<I", 2) + b"[]",
     "JSON object"),
    (bytes((1, 0, 0, 0)) + struct.pack("<qQ", 0, 0) + struct.pack("<H", 1) + b"d" + struct.pack("<I", 16)
     + b'{"log_bytes":-1}', "non-negative"),
    (bytes((1, 0, 0, 0)) + struct.pack("<qQ", 0, 0) + struct.pack("<H", 1) + b"d" + struct.pack("<I", 15)
     + b'{"exports":[1]}', "exports"),
    # Numbers the table cannot hold: an int past int64, a number past a double (as an int,
    # which once escaped as OverflowError instead of MalformedHealth).
    (bytes((1, 0, 0, 0)) + struct.pack("<qQ", 0, 0) + struct.pack("<H", 1) + b"d" + struct.pack("<I", 34)
     + b'{"log_bytes":18446744073709551616}', "64-bit integer"),
    (bytes((1, 0, 0, 0)) + struct.pack("<qQ", 0, 0) + struct.pack("<H", 1) + b"d" + struct.pack("<I", 414)
     + b'{"uptime_s":1' + b"0" * 400 + b"}", "finite non-negative number"),
])
def test_malformed_reports_are_refused_with_the_reason(rest: bytes, why: str) -> None:
    with pytest.raises(MalformedHealth, match=why):
        decode_health(_with_crc(rest))


def test_a_batch_is_not_a_health_report_and_sizes_are_bounded() -> None:
    with pytest.raises(MalformedHealth, match="magic"):
        decode_health(_with_crc(bytes((1, 0, 0, 0)) + bytes(40), magic=b"FMQB"))
    with pytest.raises(ValueError, match="exceeds"):
        encode_health("d", 0, 1, {"notes": "x" * MAX_REPORT_BYTES})
    with pytest.raises(ValueError, match="integer"):
        encode_health("d", 0, 1, {"clients_connected": 1.5})
    with pytest.raises(ValueError, match="reserved"):
        encode_health("d", 0, 1, {"sequence": 3})


@given(device=names)
def test_the_topic_is_never_a_batch_topic(device: str) -> None:
    topic = health_topic(device)
    assert parse_health_topic(topic) == device
    assert parse_batch_topic(topic) is None
    assert parse_health_topic(f"filemq/v1/{device}/main") is None


# -- the forwarder sends reports ------------------------------------------------------------------


class Upstream:
    """A fake collector connection recording (topic, qos) of every publish, acking batches at once."""

    def __init__(self, sent: list[tuple[str, int, bytes]]) -> None:
        self.closed = asyncio.Event()
        self.sent = sent

    async def connect(self, timeout: float = 10.0) -> object:
        return None

    def publish_nowait(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> asyncio.Future[None]:
        self.sent.append((topic, qos, payload))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def disconnect(self, timeout: float = 5.0) -> None:
        self.closed.set()


def test_forwarder_reports_at_each_connect_and_every_interval_as_qos0(tmp_path: Path) -> None:
    async def main() -> None:
        wal = Log.open(tmp_path / "log", LogConfig(fsync="never"))
        committer = GroupCommitter(wal)
        await committer.start()
        group = ConsumerGroup.create("export.collector", wal, tmp_path / "groups", start="earliest")
        for i in range(30):
            _, fut = committer.append_nowait("t", bytes([i]), qos=1)
        await fut
        sent: list[tuple[str, int, bytes]] = []
        conns: list[Upstream] = []

        def connect() -> Upstream:
            conns.append(Upstream(sent))
            return conns[-1]

        reports = iter(range(1, 1000))
        fwd = Forwarder(group, committer.wait_committed, connect,
                        ForwarderConfig("dev-1", batch_records=10, linger_s=0.01, backoff_initial_s=0.01,
                                        backoff_max_s=0.02),
                        health=lambda: encode_health("dev-1", 0, next(reports), {}), health_interval_s=0.2)
        fwd.start()
        async with asyncio.timeout(10):
            while sum(1 for t, _, _ in sent if t.endswith("/health")) < 3:
                await asyncio.sleep(0.01)
        conns[-1].closed.set()  # the connection drops: the next one starts with a report again
        async with asyncio.timeout(10):
            while len(conns) < 2 or not any(t.endswith("/health") for t, _, _ in sent[-3:]):
                await asyncio.sleep(0.01)
        await fwd.stop()
        await committer.close()
        wal.close()
        health = [(q, decode_health(p).sequence) for t, q, p in sent if t == health_topic("dev-1")]
        batches = [decode_batch(p) for t, q, p in sent if t == "filemq/v1/dev-1/main"]
        assert all(q == 0 for q, _ in health)  # QoS 0: no in-flight slot, no PUBACK
        assert [s for _, s in health] == list(range(1, len(health) + 1))
        assert all(q == 1 for t, q, _ in sent if t == "filemq/v1/dev-1/main")
        offsets = [o for b in batches for o in b.offsets()]
        assert sorted(set(offsets)) == list(range(30)) and offsets[:30] == list(range(30))
        assert fwd.stats.health_reports_sent == len(health)

    asyncio.run(main())


def test_forwarder_survives_a_report_that_cannot_be_built(tmp_path: Path) -> None:
    async def main() -> None:
        wal = Log.open(tmp_path / "log", LogConfig(fsync="never"))
        committer = GroupCommitter(wal)
        await committer.start()
        group = ConsumerGroup.create("export.collector", wal, tmp_path / "groups", start="earliest")
        _, fut = committer.append_nowait("t", b"x", qos=1)
        await fut
        sent: list[tuple[str, int, bytes]] = []

        def broken() -> bytes:
            raise ValueError("figure unreadable")

        fwd = Forwarder(group, committer.wait_committed, lambda: Upstream(sent), ForwarderConfig("dev-1"),
                        health=broken, health_interval_s=0.05)
        fwd.start()
        async with asyncio.timeout(10):
            while fwd.stats.records_acked < 1:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert fwd.stats.connects == 1 and fwd.stats.disconnects == 0
        await fwd.stop()
        await committer.close()
        wal.close()

    asyncio.run(main())


def test_zero_interval_with_a_reporter_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="health_interval_s"):
        Forwarder(None, None, None, ForwarderConfig("dev-1"), health=lambda: b"", health_interval_s=0)  # type: ignore[arg-type]
