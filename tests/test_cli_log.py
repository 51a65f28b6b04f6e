"""`filemq inspect`, `filemq verify` and `filemq status` through click's CliRunner."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from filemq.ops.status import DryRunFileIO
from filemq.queue import Queue, QueueConfig
from filemq.queue.groups import escape_group_name
from filemq.queue.offsets import OffsetFile, encode_offset
from segments import Log, LogConfig

SEGMENT_BYTES = 2048
RECORDS = 60


def build(data: Path, acked: int = 20) -> None:
    """A data dir with two segments (first sealed) and one group that acked ``acked`` records."""

    async def body() -> None:
        q = Queue.open(data, QueueConfig(log=LogConfig(segment_bytes=SEGMENT_BYTES)))
        await q.start()
        g = q.group("dev/1", ["s/#"], start="earliest")
        for i in range(RECORDS):
            await q.publish(f"s/{i % 3}", b"payload %d" % i, qos=i % 3, retain=i == 5)
        for r in g.fetch(acked):
            g.ack(r.offset)
        await q.close()

    asyncio.run(body())


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file()
    }


def segment_files(data: Path) -> list[Path]:
    return sorted((data / "log").glob("*.log"))


def group_dir(data: Path) -> Path:
    return data / "groups" / escape_group_name("dev/1")


@pytest.fixture
def data(tmp_path: Path) -> Path:
    build(tmp_path / "data")
    return tmp_path / "data"


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


# ---- inspect -------------------------------------------------------------------------------


def test_inspect_json_lists_every_record_with_positions(data: Path) -> None:
    code, out = invoke("inspect", str(data), "--json", "--payload")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["offset"] for r in rows] == list(range(RECORDS))
    assert all(r["crc_ok"] for r in rows)
    assert len(segment_files(data)) == len({r["segment"] for r in rows}) == 2
    # position + length of a record is where the next one in the same segment starts
    for a, b in zip(rows, rows[1:], strict=False):
        if a["segment"] == b["segment"]:
            assert a["position"] + a["length"] == b["position"]
    assert base64.b64decode(rows[7]["payload"]) == b"payload 7"
    assert rows[7]["payload_len"] == len(b"payload 7")
    assert rows[7]["topic"] == "s/1" and rows[7]["qos"] == 1
    assert rows[5]["retain"] is True and rows[4]["retain"] is False
    assert rows[0]["timestamp"].endswith("Z")
    # The framed lengths add up to the segment files' sizes.
    assert sum(r["length"] for r in rows) == sum(p.stat().st_size for p in segment_files(data))


def test_inspect_from_limit_and_log_dir(data: Path) -> None:
    code, out = invoke("inspect", str(data / "log"), "--from", "50", "--limit", "3", "--json")
    assert code == 0
    assert [json.loads(line)["offset"] for line in out.splitlines()] == [50, 51, 52]
    assert "payload" not in json.loads(out.splitlines()[0])
    code, out = invoke("inspect", str(data), "--from", "58")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("offset=58 ") and "topic='s/1'" in lines[0]


def test_inspect_shows_corrupt_records(data: Path) -> None:
    first = segment_files(data)[0]
    raw = bytearray(first.read_bytes())
    raw[60] ^= 0x01  # inside the second record
    first.write_bytes(bytes(raw))
    code, out = invoke("inspect", str(data), "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    bad = [r for r in rows if not r["crc_ok"]]
    assert len(bad) == 1 and bad[0]["offset"] is None and bad[0]["position"] <= 60
    assert 1 not in [r["offset"] for r in rows]
    assert [r["offset"] for r in rows if r["crc_ok"]] == [0, *range(2, RECORDS)]


def build_v2(data: Path) -> bytes:
    """A data dir whose log mixes records with MQTT 5 properties (format 2) and without."""
    from filemq.mqtt.packets import Properties
    from filemq.mqtt.properties import encode_message_headers

    headers = encode_message_headers(Properties(
        payload_format_indicator=1, message_expiry_interval=60, content_type="x",
        response_topic="re/t", correlation_data=b"\x00id", user_properties=[("k", "v"), ("k", "w")]))

    async def body() -> None:
        q = Queue.open(data, QueueConfig(log=LogConfig(segment_bytes=SEGMENT_BYTES)))
        await q.start()
        await q.publish("plain", b"3.1.1", qos=1)
        await q.publish("m5", b"five", qos=1, headers=headers)
        await q.publish("m5", b"junk", headers=b"\xff\x00")  # not a property section
        await q.close()

    asyncio.run(body())
    return headers


def test_inspect_shows_the_mqtt5_properties_of_format_2_records(tmp_path: Path) -> None:
    """Issue 13: inspect decodes a record's headers (its MQTT 5 message properties)."""
    build_v2(tmp_path / "data")
    code, out = invoke("inspect", str(tmp_path / "data"))
    assert code == 0
    plain, five, junk = out.splitlines()
    assert "headers" not in plain
    assert five.endswith(
        "headers: payload_format_indicator=1 message_expiry_interval=60 content_type='x' "
        "response_topic='re/t' correlation_data=b'\\x00id' user_properties=[('k', 'v'), ('k', 'w')]")
    assert "headers: undecodable (2 bytes:" in junk
    code, out = invoke("inspect", str(tmp_path / "data"), "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["headers_len"] for r in rows] == [0, rows[1]["headers_len"], 2] and rows[1]["headers_len"] > 20
    assert rows[0]["properties"] is None
    assert rows[1]["properties"] == {
        "payload_format_indicator": 1, "message_expiry_interval": 60, "content_type": "x",
        "response_topic": "re/t", "correlation_data": base64.b64encode(b"\x00id").decode(),
        "user_properties": [["k", "v"], ["k", "w"]]}
    assert rows[2]["properties"] is None and "headers_error" in rows[2]


def test_verify_accepts_format_2_records(tmp_path: Path) -> None:
    build_v2(tmp_path / "data")
    code, out = invoke("verify", str(tmp_path / "data"), "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["records"] == 3 and report["problems"] == []


def test_inspect_refuses_a_non_filemq_directory(tmp_path: Path) -> None:
    code, out = invoke("inspect", str(tmp_path))
    assert code != 0 and "no 'log/' directory" in out


# ---- status ----------------------------------------------------------------------------


def test_status_json(data: Path) -> None:
    code, out = invoke("status", str(data), "--json")
    assert code == 0
    status = json.loads(out)
    lg = status["log"]
    assert lg["first_offset"] == 0 and lg["next_offset"] == RECORDS and lg["segments"] == 2
    assert lg["size_bytes"] == sum(p.stat().st_size for p in segment_files(data))
    [g] = status["groups"]
    assert (g["name"], g["doing"], g["pending"], g["lag"]) == ("dev/1", 20, 20, RECORDS - 20)
    assert g["filters"] == ["s/#"] and g["problems"] == []


def test_status_text_and_damaged_pending(data: Path) -> None:
    (group_dir(data) / "pending").write_bytes(b"torn")
    code, out = invoke("status", str(data))
    assert code == 0
    assert "group 'dev/1'" in out and "pending=None" in out and f"lag={RECORDS}" in out
    assert "PROBLEM" in out and "torn" in out


# ---- verify ----------------------------------------------------------------------------


def test_verify_clean(data: Path) -> None:
    code, out = invoke("verify", str(data))
    assert code == 0, out
    assert "clean" in out
    code, out = invoke("verify", str(data), "--json")
    report = json.loads(out)
    assert report["ok"] and report["records"] == RECORDS and report["problems"] == []


@pytest.mark.parametrize("target", ["missing", "file"])
def test_verify_unusable_exits_2(tmp_path: Path, target: str) -> None:
    path = tmp_path / "nothing-here"
    if target == "file":
        path.write_text("x")
    code, out = invoke("verify", str(path))
    assert code == 2 and "UNUSABLE" in out


def damage(data: Path) -> None:
    sealed, tail = segment_files(data)
    raw = bytearray(sealed.read_bytes())
    raw[100] ^= 0xFF  # a corrupt record inside the sealed segment
    sealed.write_bytes(bytes(raw))
    with tail.open("ab") as f:
        f.write(b"\x00\x00\x00\x40torn")  # a torn tail
    (group_dir(data) / "pending").write_bytes(encode_offset(20)[:9])
    (group_dir(data) / "doing").write_bytes(b"garbage-garbage-!")


def test_verify_reports_without_changing_anything(data: Path) -> None:
    damage(data)
    before = snapshot(data)
    code, out = invoke("verify", str(data), "--json")
    assert code == 1
    report = json.loads(out)
    assert snapshot(data) == before  # read-only
    assert report["torn_tail_bytes"] == 8
    assert report["corrupt_records"] == 1
    problems = "\n".join(report["problems"])
    assert "truncate" in problems and "cut 8 bytes" in problems
    assert "corrupt record in 00000000000000000000.log" in problems and "after offset 1" in problems
    assert "Pending" in problems and "torn" in problems
    assert "Doing" in problems
    assert report["repaired"] == []


def test_verify_repair_then_clean_except_sealed_corruption(data: Path) -> None:
    tail_size = segment_files(data)[1].stat().st_size
    damage(data)
    code, out = invoke("verify", str(data), "--repair", "--json")
    assert code == 1
    report = json.loads(out)
    repaired = "\n".join(report["repaired"])
    assert "cut 8 bytes" in repaired
    assert "Pending rewritten as 0" in repaired  # the safe value: re-deliver from the start
    assert "Doing rewritten as 0" in repaired
    assert OffsetFile(group_dir(data) / "pending").read() == 0
    assert segment_files(data)[1].stat().st_size == tail_size  # torn bytes cut, records kept
    # Only the corrupt record in the sealed segment is left, and reported again.
    code, out = invoke("verify", str(data), "--json")
    report = json.loads(out)
    assert code == 1
    assert report["torn_tail_bytes"] == 0 and report["corrupt_records"] == 1
    assert len(report["problems"]) == 1 and "corrupt record" in report["problems"][0]
    # The repaired data dir opens and the group re-delivers everything still readable.
    lg = Log.open(data / "log", LogConfig(segment_bytes=SEGMENT_BYTES))
    assert lg.recovery.tail_bytes_truncated == 0
    lg.close()


def test_verify_repairs_a_damaged_group_file(data: Path) -> None:
    (group_dir(data) / "group.json").write_text("{")
    code, out = invoke("verify", str(data))
    assert code == 1 and "group.json" in out and "recoverable" in out
    code, out = invoke("verify", str(data), "--repair")
    assert code == 1 and "REPAIRED" in out
    code, out = invoke("verify", str(data))
    assert code == 0, out


def test_verify_doing_below_pending_is_a_problem(data: Path) -> None:
    OffsetFile(group_dir(data) / "doing").write(3)
    code, out = invoke("verify", str(data))
    assert code == 1 and "Doing 3 is below Pending 20" in out


def test_verify_reports_a_missing_session_group_and_a_stray_group_directory(tmp_path: Path) -> None:
    """issue 10 item 13: a stored session whose group directory is gone (its queued messages
    would be lost) and a group directory no session owns (it pins retention) are problems."""
    from filemq.broker.session_store import SessionStore, StoredSession, StoredSubscription

    data = tmp_path / "data"

    async def body() -> None:
        q = Queue.open(data, QueueConfig(log=LogConfig(segment_bytes=SEGMENT_BYTES)))
        await q.start()
        q.group("mqtt-session:owned", ["t"], start="earliest")
        q.group("mqtt-session:gone", ["t"], start="earliest")
        for i in range(10):
            await q.publish("t", b"%d" % i, qos=1)
        await q.close()

    asyncio.run(body())
    store = SessionStore(data)
    store.save(StoredSession("owned", {"t": StoredSubscription(1, 0)}))
    store.save(StoredSession("lost", {"t": StoredSubscription(1, 0)}))
    store.save(StoredSession("idle"))  # no subscriptions: needs no group
    code, out = invoke("verify", str(data), "--json")
    report = json.loads(out)
    problems = "\n".join(report["problems"])
    assert code == 1, out
    assert "session 'lost'" in problems and "missing" in problems
    assert "stray group directory" in problems and "mqtt-session:gone" in problems and "Pending 0" in problems
    assert len(report["problems"]) == 2, problems


def test_status_counts_acks_the_progress_journal_holds(data: Path) -> None:
    """After a crash the journal may be ahead of the offset files: status shows the lag
    the broker will resume with (Pending 20 in the file, 45 journaled)."""
    from filemq.queue.offsets import ProgressJournal

    journal = ProgressJournal(data / "groups" / "progress.journal")
    journal.record([(group_dir(data).name, 45, 50)])
    journal.close()
    code, out = invoke("status", str(data), "--json")
    assert code == 0, out
    [g] = json.loads(out)["groups"]
    assert (g["pending"], g["journaled_pending"], g["lag"]) == (20, 45, RECORDS - 45)
    code, out = invoke("status", str(data))
    assert "journaled pending=45" in out


# ---- the dry-run file layer ------------------------------------------------------------


def test_dry_run_file_io_records_instead_of_writing(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    io = DryRunFileIO()
    h = io.open(path)
    h.truncate(4)
    assert h.size() == 4 and h.pread(100, 0) == b"0123"
    h.pwrite(b"zz", 4)
    h.close()
    new = io.open(tmp_path / "new", create=True)
    new.pwrite(b"abc", 0)
    assert new.pread(3, 0) == b"abc"
    io.rename(tmp_path / "new", tmp_path / "renamed")
    io.unlink(path)
    with pytest.raises(FileNotFoundError):
        io.open(path)
    assert io.open(tmp_path / "renamed").pread(3, 0) == b"abc"
    assert path.read_bytes() == b"0123456789"  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    assert [c.kind for c in io.changes] == ["truncate", "write", "create", "write", "unlink"]
