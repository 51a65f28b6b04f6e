"""End to end on loopback: publishers -> agent (broker + forwarder) -> collector -> Parquet.

The oracle: every publisher records each message the agent PUBACKed; after the run each of
them is in the landed Parquet files. Faults: the uplink cut at random bytes many times, the
collector down and coming back, its disk full, a device clock far in the past, and
``kill -9`` of the real ``filemq agent`` and ``filemq collector`` processes.
"""

from __future__ import annotations

import asyncio
import os
import random
import ssl
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from collector.landing import PROPERTY_COLUMNS
from collector.server import Collector
from filemq.broker.server import free_port
from filemq.common.config import Config, load_config
from filemq.mqtt.client import MQTTClient
from filemq.mqtt.packets import Properties
from filemq.mqtt.properties import encode_message_headers
from filemq.queue.groups import ConsumerGroup
from filemq.upstream.batch import BatchRecord, encode_batch
from segments import GroupCommitter, Log, LogConfig
from segments.log import FREE_RECHECK_S
from tests.pipeline_harness import (
    DEVICE,
    Publishers,
    kill9,
    kill_leftovers,
    publish_through_cuts,
    run,
    start_process,
    terminate,
    until,
)
from tests.tcpproxy import TcpProxy
from worker_agent.app import Agent
from worker_agent.forwarder import Forwarder, ForwarderConfig

pytestmark = pytest.mark.timeout(120)


def collector_config(tmp: Path, port: int = 0, **extra: Any) -> Config:
    values = {
        "data_dir": str(tmp / "collector"),
        "collector.landing": str(tmp / "landing"),
        "collector.port": port,
        "collector.collector_id": "c1",
        "collector.roll_seconds": 1,
        "log.fsync": "never",
        "log.min_free_bytes": 0,
    }
    values.update(extra)
    return load_config(None, values)


def agent_config(tmp: Path, collector_port: int, **extra: Any) -> Config:
    values = {
        "data_dir": str(tmp / "agent"),
        "broker.port": 0,
        "broker.sys_interval_s": 1,
        "agent.device_id": DEVICE,
        "agent.collector": f"127.0.0.1:{collector_port}",
        "agent.batch_records": 200,
        "agent.linger_ms": 20,
        "agent.backoff_initial_ms": 20,
        "agent.backoff_max_ms": 300,
        "agent.ack_timeout_ms": 2000,
        "log.fsync": "never",
        "log.min_free_bytes": 0,
    }
    values.update(extra)
    return load_config(None, values)


def landed(landing: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for f in sorted((landing / "incoming").rglob("*.parquet")):
        rows.extend(pq.read_table(f, partitioning=None).to_pylist())
    return rows


def landed_payloads(landing: Path) -> set[bytes]:
    payloads: set[bytes] = set()
    for f in sorted((landing / "incoming").rglob("*.parquet")):
        payloads.update(pq.read_table(f, columns=["payload"], partitioning=None).column(0).to_pylist())
    return payloads


def check_oracle(tmp: Path, acked: set[bytes], *, max_duplicates: int = 0) -> list[dict[str, Any]]:
    rows = landed(tmp / "landing")
    payloads = {r["payload"] for r in rows}
    missing = acked - payloads
    assert not missing, f"{len(missing)} acknowledged messages missing from landing, e.g. {sorted(missing)[:5]}"
    keys = Counter((r["device_id"], r["stream"], r["offset"]) for r in rows)
    duplicates = sum(n - 1 for n in keys.values())
    assert duplicates <= max_duplicates, f"{duplicates} duplicate rows (allowed {max_duplicates})"
    offsets = sorted(k[2] for k in keys)
    assert offsets == list(range(len(offsets))), "landed offsets are not the device log's offsets"
    return rows


class FullDisk:
    """The WAL's FileIO, reporting no free space while ``state["on"]``."""

    def __init__(self, inner: Any, state: dict[str, bool]) -> None:
        self.inner = inner
        self.state = state

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def free_bytes(self, path: Any) -> int:
        return 0 if self.state["on"] else int(self.inner.free_bytes(path))


# -- in-process scenarios ----------------------------------------------------------------------


def test_uplink_cut_at_random_bytes_many_times(tmp_path: Path) -> None:
    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        proxy = TcpProxy(collector.port)
        await proxy.start()
        agent = Agent(agent_config(tmp_path, proxy.port))
        await agent.start()
        pubs = Publishers(lambda: agent.broker.port)
        # Until 15 cuts and 4,500 messages (with a fixed 4,500 the 15th cut came at 3,000-3,600
        # here); batches are ~8 kB, so the cuts fall mostly mid-batch.
        pubs.start(messages_each=None, rate_pause=0.02)
        await publish_through_cuts(pubs, proxy, random.Random(42), cuts=15, messages=4500, cut_bytes=(1, 12_000))
        fwd = agent.forwarder
        assert fwd is not None
        await until(lambda: fwd.backlog == 0, what="agent backlog drained")
        total = agent.broker.queue.log.next_offset  # type: ignore[union-attr]
        lander = collector.lander
        assert lander is not None
        await until(lambda: lander.stats.rows_landed >= total, what="all rows landed")
        assert proxy.cuts >= 15, f"only {proxy.cuts} cuts happened"
        assert fwd.stats.resent_records > 0
        await agent.stop()
        await collector.stop()
        await proxy.stop()
        assert len(pubs.acked) == pubs.sent >= 4500  # every PUBLISH acknowledged, cuts or not
        check_oracle(tmp_path, pubs.acked, max_duplicates=0)

    run(scenario())


def test_collector_down_then_up_drains_backlog(tmp_path: Path) -> None:
    port = free_port()

    async def scenario() -> None:
        agent = Agent(agent_config(tmp_path, port))
        await agent.start()
        pubs = Publishers(lambda: agent.broker.port)
        pubs.start(messages_each=1000)
        await pubs.wait()
        fwd = agent.forwarder
        assert fwd is not None
        await until(lambda: fwd.stats.connect_failures >= 2, what="failed connects")
        assert fwd.backlog == 3000 and fwd.stats.batches_acked == 0
        collector = Collector(collector_config(tmp_path, port=port))
        await collector.start()
        await until(lambda: fwd.backlog == 0, what="backlog drained")
        lander = collector.lander
        assert lander is not None
        await until(lambda: lander.stats.rows_landed >= 3000, what="rows landed")
        await agent.stop()
        await collector.stop()
        check_oracle(tmp_path, pubs.acked)

    run(scenario())


def test_full_disk_at_collector_and_old_device_clock(tmp_path: Path) -> None:
    """The collector stops acking while its disk is full; the agent backs off and resumes.
    Records stamped by a device clock in 1970 keep that publish_ts; received_at is now."""

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path, **{"log.min_free_bytes": 1}))
        await collector.start()
        queue = collector.broker.queue
        assert queue is not None
        wal = queue.log
        full = {"on": True}
        wal.fileio = FullDisk(wal.fileio, full)
        # The log reads free space again at most FREE_RECHECK_S apart (no statfs per commit):
        # from then on the full disk shows at every commit.
        await asyncio.sleep(FREE_RECHECK_S)
        agent = Agent(agent_config(tmp_path, collector.port))
        await agent.start()
        device_queue = agent.broker.queue
        assert device_queue is not None
        old_ts = 86_400_000_000  # 1970-01-02, a device whose clock was never set
        for i in range(300):
            device_queue.publish_nowait("sensors/old", f"old-{i}".encode(), qos=1, timestamp_us=old_ts + i)
        pubs = Publishers(lambda: agent.broker.port, count=2)
        pubs.start(messages_each=500)
        await pubs.wait()
        fwd = agent.forwarder
        assert fwd is not None
        await until(lambda: fwd.stats.disconnects >= 2, what="refused batches")
        assert fwd.stats.batches_acked == 0
        full["on"] = False
        await until(lambda: fwd.backlog == 0, what="drained after space returned")
        lander = collector.lander
        assert lander is not None
        await until(lambda: lander.stats.rows_landed >= 1300, what="rows landed")
        await agent.stop()
        await collector.stop()
        rows = check_oracle(tmp_path, pubs.acked)
        old = [r for r in rows if r["topic"] == "sensors/old"]
        assert len(old) == 300
        assert all(r["publish_ts"].year == 1970 for r in old)
        assert all(r["received_at"].year >= 2024 for r in old)

    run(scenario())


# -- real processes, kill -9 --------------------------------------------------------------------


def write_agent_toml(tmp: Path) -> Path:
    path = tmp / "agent.toml"
    path.write_text(
        "[agent]\nbatch_records = 200\nlinger_ms = 20\nbackoff_initial_ms = 20\n"
        "backoff_max_ms = 300\nack_timeout_ms = 2000\n"
    )
    return path


@pytest.mark.slow
def test_kill9_agent_while_forwarding(tmp_path: Path) -> None:
    agent_port = free_port()
    toml = write_agent_toml(tmp_path)

    started: list[asyncio.subprocess.Process] = []

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        args = ["agent", "--config", str(toml), "--data-dir", str(tmp_path / "agent"), "--device-id", DEVICE,
                "--collector", f"127.0.0.1:{collector.port}", "--port", str(agent_port)]
        proc = await start_process(args, "filemq agent", started)
        pubs = Publishers(lambda: agent_port, count=3)
        pubs.start(messages_each=None, rate_pause=0.005)
        rng = random.Random(3)
        try:
            for _ in range(3):
                await asyncio.sleep(rng.uniform(0.7, 1.5))
                await kill9(proc)
                proc = await start_process(args, "filemq agent", started)
            await asyncio.sleep(1.0)
        finally:
            await pubs.stop()
        assert len(pubs.acked) > 500
        landing = tmp_path / "landing"
        await until(lambda: pubs.acked <= landed_payloads(landing), timeout=40, what="acked messages landed")
        assert await terminate(proc) == 0
        await collector.stop()
        # The restarted agent resumed from its last persisted Pending and re-sent batches...
        assert collector.stats.duplicate_records + collector.stats.trimmed_records > 0
        # ...which the collector's marks dropped: no duplicate rows.
        check_oracle(tmp_path, pubs.acked, max_duplicates=0)

    async def guarded() -> None:
        try:
            await scenario()
        finally:
            await kill_leftovers(started)

    run(guarded(), timeout=110)


@pytest.mark.slow
def test_kill9_collector_while_landing(tmp_path: Path) -> None:
    collector_port = free_port()

    started: list[asyncio.subprocess.Process] = []

    async def scenario() -> None:
        args = ["collector", "--data-dir", str(tmp_path / "collector"), "--landing", str(tmp_path / "landing"),
                "--port", str(collector_port), "--collector-id", "c1", "--roll-seconds", "1"]
        proc = await start_process(args, "filemq collector", started)
        agent = Agent(agent_config(tmp_path, collector_port))
        await agent.start()
        pubs = Publishers(lambda: agent.broker.port, count=3)
        pubs.start(messages_each=None, rate_pause=0.005)
        kills = 3
        rng = random.Random(5)
        try:
            for _ in range(kills):
                await asyncio.sleep(rng.uniform(1.0, 2.0))
                await kill9(proc)
                proc = await start_process(args, "filemq collector", started)
            await asyncio.sleep(1.0)
        finally:
            await pubs.stop()
        fwd = agent.forwarder
        assert fwd is not None
        await until(lambda: fwd.backlog == 0, timeout=40, what="agent drained")
        landing = tmp_path / "landing"
        await until(lambda: pubs.acked <= landed_payloads(landing), timeout=40, what="acked messages landed")
        await agent.stop()
        assert await terminate(proc) == 0
        files = sorted((landing / "incoming").rglob("*.parquet"))
        biggest_roll = max(pq.ParquetFile(f).metadata.num_rows for f in files)
        # Duplicates only from a roll whose offset was not yet persisted at a kill.
        check_oracle(tmp_path, pubs.acked, max_duplicates=kills * biggest_roll)

    async def guarded() -> None:
        try:
            await scenario()
        finally:
            await kill_leftovers(started)

    run(guarded(), timeout=110)


def test_status_shows_forwarder_group(tmp_path: Path) -> None:
    """`filemq status DIR --json` lists the collector export's group (`export.collector`) with its lag."""
    port = free_port()

    async def scenario() -> None:
        agent = Agent(agent_config(tmp_path, port))
        await agent.start()
        queue = agent.broker.queue
        assert queue is not None
        for i in range(10):
            await queue.publish("sensors/x", str(i).encode(), qos=1)
        await agent.stop()

    run(scenario())
    from click.testing import CliRunner

    import cli

    result = CliRunner().invoke(cli.main, ["status", str(tmp_path / "agent"), "--json"])
    assert result.exit_code == 0, result.output
    import json

    status = json.loads(result.output.strip().splitlines()[-1])
    groups = {g["name"]: g for g in status["groups"]}
    assert groups["export.collector"]["pending"] == 0 and groups["export.collector"]["lag"] == 10
    assert os.path.isdir(tmp_path / "agent")


def test_tls_and_device_logins(tmp_path: Path) -> None:
    """The agent logs in with its own user over TLS; the ACL keeps it under its own id."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    from filemq.broker.auth import add_or_update

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    passwords = tmp_path / "devices"
    add_or_update(passwords, DEVICE, "s3cret", iterations=1000)
    add_or_update(passwords, "dev-2", "other", iterations=1000)
    acl = tmp_path / "acl"
    acl.write_text("pattern write filemq/v1/%u/#\n")
    upstream_pw = tmp_path / "upstream-password"
    upstream_pw.write_text("s3cret\n")

    async def scenario() -> None:
        overrides: dict[str, Any] = {  # (Any: a dict of str and int values could hold `port`)
            "collector.password_file": str(passwords), "collector.acl_file": str(acl),
            "broker.tls_cert": str(cert), "broker.tls_key": str(key), "broker.tls_port": 0}
        collector = Collector(collector_config(tmp_path, **overrides))
        await collector.start()
        tls_port = collector.broker.tls_port
        assert tls_port is not None
        agent = Agent(agent_config(
            tmp_path, 0, **{"agent.collector": f"localhost:{tls_port}", "agent.tls_ca": str(cert),
                            "agent.username": DEVICE, "agent.password_file": str(upstream_pw)}))
        await agent.start()
        pubs = Publishers(lambda: agent.broker.port, count=2)
        pubs.start(messages_each=300)
        await pubs.wait()
        fwd = agent.forwarder
        assert fwd is not None
        await until(lambda: fwd.backlog == 0, what="drained over TLS")
        # Another device may not write under dev-1's id: denied by the ACL, and at the collector
        # never acknowledged (a misconfigured device keeps its batch): the connection is closed.
        intruder = MQTTClient("dev-2", "localhost", tls_port, username="dev-2", password="other",
                              ssl=ssl.create_default_context(cafile=str(cert)))
        await intruder.connect()
        forged = encode_batch(DEVICE, "main", [BatchRecord(10_000, 1, "x", b"forged", 1)])
        with pytest.raises(TimeoutError):  # no PUBACK: our client keeps it pending for a resend
            await intruder.publish(f"filemq/v1/{DEVICE}/main", forged, qos=1, timeout=2)
        assert intruder.closed.is_set()
        assert collector.broker.core is not None and collector.broker.core.stats.publish_dropped >= 1
        # A wrong password is refused.
        refused = MQTTClient("dev-2", "localhost", tls_port, username="dev-2", password="wrong",
                             ssl=ssl.create_default_context(cafile=str(cert)))
        with pytest.raises(Exception, match="refused|not authori|bad user"):
            await refused.connect()
        lander = collector.lander
        assert lander is not None
        await until(lambda: lander.stats.rows_landed >= 600, what="rows landed")
        await agent.stop()
        await collector.stop()
        rows = check_oracle(tmp_path, pubs.acked)
        assert b"forged" not in {r["payload"] for r in rows}
        assert fwd.stats.batches_acked > 0

    run(scenario())


def test_agent_progress_in_sys_topics_and_metrics(tmp_path: Path) -> None:
    import urllib.request

    from worker_agent.metrics import start_metrics_server

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        agent = Agent(agent_config(tmp_path, collector.port))
        await agent.start()
        server = start_metrics_server(agent, 0)
        try:
            pubs = Publishers(lambda: agent.broker.port, count=1)
            pubs.start(messages_each=250)
            await pubs.wait()
            fwd = agent.forwarder
            assert fwd is not None
            await until(lambda: fwd.backlog == 0, what="drained")
            watcher = MQTTClient("watcher", port=agent.broker.port)
            await watcher.connect()
            await watcher.subscribe([("$SYS/broker/forwarder/#", 0)])
            seen: dict[str, bytes] = {}
            async with asyncio.timeout(10):
                async for message in watcher.messages():
                    seen[message.topic] = message.payload
                    if "$SYS/broker/forwarder/records/acked" in seen and "$SYS/broker/forwarder/backlog" in seen:
                        break
            await watcher.disconnect()
            assert seen["$SYS/broker/forwarder/records/acked"] == b"250"
            assert seen["$SYS/broker/forwarder/backlog"] == b"0"
            url = f"http://127.0.0.1:{server.port}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
            assert "filemq_agent_records_acked_total 250.0" in text
            assert "filemq_agent_lag_records 0.0" in text
            assert 'filemq_agent_batch_latency_seconds_bucket{le="+Inf"}' in text
        finally:
            server.shutdown()
            await agent.stop()
            await collector.stop()

    run(scenario())


@pytest.mark.parametrize(
    ("index", "what"),
    [(10, "device id 'dev-1' becomes 'Dev-1'"), (15, "the '/' before the stream becomes 0x0f")],
)
def test_topic_byte_flipped_in_transit_is_resent_not_quarantined(tmp_path: Path, index: int, what: str) -> None:
    """Issue 10 item 2: the batch topic is outside the batch CRC, so a flipped topic byte must
    not be acknowledged as quarantined: the collector rejects it unacknowledged (the topic
    disagrees with the CRC-covered header) and the agent resends the batch."""

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        proxy = TcpProxy(collector.port)
        await proxy.start()
        proxy.flip_in(f"filemq/v1/{DEVICE}/main".encode(), index)
        agent = Agent(agent_config(tmp_path, proxy.port))
        await agent.start()
        pubs = Publishers(lambda: agent.broker.port, count=2)
        pubs.start(messages_each=300)
        await pubs.wait()
        fwd = agent.forwarder
        assert fwd is not None
        await until(lambda: fwd.backlog == 0, what="agent backlog drained")
        lander = collector.lander
        assert lander is not None
        lander.request_roll()
        await until(lambda: lander.stats.rows_landed >= 600, what="all rows landed")
        await agent.stop()
        await collector.stop()
        await proxy.stop()
        assert proxy.flips == 1, what
        assert collector.stats.quarantined == 0
        assert collector.stats.topic_rejected == 1
        assert len(pubs.acked) == 600
        check_oracle(tmp_path, pubs.acked)

    run(scenario())


def test_forged_batch_with_a_huge_gap_does_not_drop_real_records(tmp_path: Path) -> None:
    """Issue 10 item 3: one batch for dev-1 holding offsets {0, 10^9} (valid CRC, published
    by someone with write rights on the topic) must hold exactly those two offsets, not the
    span 0..10^9: the device's real records 1..499 that follow all land. Offset 0 is claimed
    by the forged record (the key (device, stream, offset) is what it forged)."""

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        forger = MQTTClient("forger", port=collector.port)
        await forger.connect(timeout=5)
        forged = encode_batch(DEVICE, "main", [BatchRecord(0, 1, "x", b"forged-0", 1),
                                                BatchRecord(10**9, 1, "x", b"forged-1e9", 1)])
        await forger.publish(f"filemq/v1/{DEVICE}/main", forged, qos=1)
        await forger.disconnect()
        lander = collector.lander
        assert lander is not None
        await until(lambda: collector.door_marks.get(DEVICE, "main") == 10**9, what="forged batch committed")
        agent = Agent(agent_config(tmp_path, collector.port))
        await agent.start()
        pubs = Publishers(lambda: agent.broker.port, count=1)
        pubs.start(messages_each=500)
        await pubs.wait()
        fwd = agent.forwarder
        assert fwd is not None
        await until(lambda: fwd.backlog == 0, what="agent backlog drained")
        lander.request_roll()
        await until(lambda: lander.stats.rows_landed >= 2 + 499, what="real rows landed")
        await agent.stop()
        await collector.stop()
        rows = landed(tmp_path / "landing")
        by_offset = {r["offset"]: r["payload"] for r in rows}
        assert len(by_offset) == len(rows) == 501
        assert by_offset[0] == b"forged-0" and by_offset[10**9] == b"forged-1e9"
        real = {by_offset[o] for o in range(1, 500)}
        assert len(pubs.acked) == 500 and real <= pubs.acked and len(real) == 499

    run(scenario())


def test_oversized_local_message_is_set_aside_and_the_stream_keeps_flowing(tmp_path: Path) -> None:
    """Issue 10 item 11 end to end: the agent's broker accepts a 1.5 MiB message (raised
    broker.max_packet_size) while the collector's limit is given as 1 MiB: that one record is
    skipped upstream and counted; the messages before and after it land."""

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        agent = Agent(agent_config(tmp_path, collector.port, **{
            "broker.max_packet_size": "4MiB", "agent.upstream_max_packet_size": "1MiB"}))
        await agent.start()
        client = MQTTClient("big", port=agent.broker.port, max_packet_size=8 << 20)
        await client.connect(timeout=5)
        await client.publish("sensors/a", b"before", qos=1)
        await client.publish("sensors/big", b"B" * (3 << 19), qos=1)
        await client.publish("sensors/a", b"after", qos=1)
        await client.disconnect()
        fwd = agent.forwarder
        assert fwd is not None
        await until(lambda: fwd.backlog == 0, what="agent backlog drained past the big record")
        lander = collector.lander
        assert lander is not None
        lander.request_roll()
        await until(lambda: lander.stats.rows_landed >= 2, what="rows landed")
        await agent.stop()
        await collector.stop()
        assert fwd.stats.oversized_records == 1
        rows = landed(tmp_path / "landing")
        assert [(r["offset"], r["payload"]) for r in rows] == [(0, b"before"), (2, b"after")]

    run(scenario())


# -- MQTT 5 message properties through the real device log (issue 13 item 7) ---------------------


def test_message_properties_in_the_device_log_land_as_columns(tmp_path: Path) -> None:
    """Records with headers appended to a real device log (record format 2), read back from
    disk by the forwarder, sent in version 2 batches over MQTT to a real collector, land with
    their MQTT 5 properties in the columns; records without headers land with nulls."""
    full = Properties(payload_format_indicator=1, message_expiry_interval=86_400, content_type="text/csv",
                      response_topic="replies/x", correlation_data=b"\x00\xffid",
                      user_properties=[("unit", "C"), ("unit", "F"), ("a", "")])
    headers = [encode_message_headers(full), b"", encode_message_headers(Properties(content_type="a/b"))]

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        device = tmp_path / "device"
        log = Log.open(device / "log", LogConfig(fsync="never"))
        committer = GroupCommitter(log)
        await committer.start()
        for i in range(30):
            await committer.append(f"sensors/{i % 3}", b"v%d" % i, qos=1, headers=headers[i % 3])
        await committer.close()
        log.close()
        log = Log.open(device / "log", LogConfig(fsync="never"))  # read back from disk
        committer = GroupCommitter(log)
        await committer.start()
        group = ConsumerGroup.create("export.collector", log, device / "groups", start="earliest")
        forwarder = Forwarder(group, committer.wait_committed, lambda: MQTTClient(DEVICE, port=collector.port),
                              ForwarderConfig(device_id=DEVICE, batch_records=7, linger_s=0.02))
        forwarder.start()
        await until(lambda: group.pending_offset == 30, what="every record acknowledged upstream")
        await forwarder.stop()
        await until(lambda: collector.lander is not None and collector.lander.stats.rows_landed == 30,
                    what="every row landed")
        await collector.stop()
        await committer.close()
        log.close()

    run(scenario())
    rows = {r["offset"]: r for r in landed(tmp_path / "landing")}
    assert sorted(rows) == list(range(30))
    for offset, row in rows.items():
        assert row["payload"] == b"v%d" % offset and row["schema_version"] == 2
        kind = offset % 3
        if kind == 0:
            assert (row["payload_format_indicator"], row["message_expiry_s"], row["content_type"],
                    row["response_topic"], row["correlation_data"]) == (1, 86_400, "text/csv", "replies/x",
                                                                         b"\x00\xffid")
            assert row["user_properties"] == [{"key": "unit", "value": "C"}, {"key": "unit", "value": "F"},
                                              {"key": "a", "value": ""}]
        elif kind == 1:
            assert all(row[c] is None for c in PROPERTY_COLUMNS)
        else:
            assert row["content_type"] == "a/b" and row["user_properties"] is None
            assert row["payload_format_indicator"] is None and row["message_expiry_s"] is None


def test_paho_mqtt5_properties_reach_the_landing_columns(tmp_path: Path) -> None:
    """Issue 13 item 7 with paho-mqtt 2.x as the MQTT 5 publisher: the properties of a PUBLISH
    (3.3.2.3.2 payload format indicator, 3.3.2.3.3 message expiry interval as published,
    3.3.2.3.9 content type, 3.3.2.3.5 response topic, 3.3.2.3.6 correlation data, 3.3.2.3.7
    user properties in order with repeats) go agent log -> batch -> collector -> landing
    columns; a PUBLISH without properties, and a 3.1.1 one, land with nulls."""
    paho5 = pytest.importorskip("tests.paho5")
    from paho.mqtt.packettypes import PacketTypes

    def publish_with_paho(port: int) -> None:
        pub = paho5.Paho5(port, "paho-pub")
        try:
            props = paho5.paho_props(PacketTypes.PUBLISH)
            props.PayloadFormatIndicator = 1
            props.MessageExpiryInterval = 3600
            props.ContentType = "application/json"
            props.ResponseTopic = "replies/paho"
            props.CorrelationData = b"\x00req-1"
            props.UserProperty = [("z", "1"), ("a", "2"), ("z", "3")]
            assert pub.publish("sensors/full", b'{"t": 1}', 1, props=props) == 0
            assert pub.publish("sensors/none", b"plain", 1) == 0
            only = paho5.paho_props(PacketTypes.PUBLISH)
            only.UserProperty = [("k", "v")]
            assert pub.publish("sensors/user", b"u", 1, props=only) == 0
        finally:
            pub.close()

    async def scenario() -> None:
        collector = Collector(collector_config(tmp_path))
        await collector.start()
        agent = Agent(agent_config(tmp_path, collector.port))
        await agent.start()
        await asyncio.to_thread(publish_with_paho, agent.broker.port)  # paho blocks on its acks
        client = MQTTClient("pub-311", port=agent.broker.port)
        await client.connect()
        await client.publish("sensors/v311", b"old client", qos=1, timeout=5)
        await client.disconnect()
        lander = collector.lander
        assert lander is not None
        await until(lambda: lander.stats.rows_landed == 4, what="four rows landed")
        await agent.stop()
        await collector.stop()

    run(scenario())
    rows = {r["topic"]: r for r in landed(tmp_path / "landing")}
    assert sorted(rows) == ["sensors/full", "sensors/none", "sensors/user", "sensors/v311"]
    full = rows["sensors/full"]
    assert (full["payload_format_indicator"], full["message_expiry_s"], full["content_type"], full["response_topic"],
            full["correlation_data"]) == (1, 3600, "application/json", "replies/paho", b"\x00req-1")
    assert full["user_properties"] == [{"key": "z", "value": "1"}, {"key": "a", "value": "2"},
                                       {"key": "z", "value": "3"}]
    assert rows["sensors/user"]["user_properties"] == [{"key": "k", "value": "v"}]
    assert rows["sensors/user"]["content_type"] is None
    for topic in ("sensors/none", "sensors/v311"):
        assert all(rows[topic][c] is None for c in PROPERTY_COLUMNS), topic
    assert {r["schema_version"] for r in rows.values()} == {2}
