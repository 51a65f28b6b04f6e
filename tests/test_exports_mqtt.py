"""MQTT exports: the device log shipped durably to an MQTT 3.1.1 broker (docs/FORWARDING.md).

Two kinds of tests. Packet level, against a scripted upstream (:class:`ScriptedBroker`):
the durability rules of an export -- the group's offset moves only over a gap-free
acknowledged prefix, the unacknowledged window is resent with DUP first (MQTT-4.4.0-1), after
a restart possibly-sent records carry DUP (MQTT-3.3.1-1), clean session is off. And end to end
with Debian mosquitto upstream started by the test and an oracle subscriber there: every
message a local publisher got a PUBACK for arrives, through kill -9 of the agent, a restart of
the upstream broker, the uplink cut at random bytes, wrong credentials, and a second export
that is down the whole time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from filemq.broker.server import free_port
from filemq.common.config import Config
from filemq.mqtt.client import MQTTClient
from filemq.mqtt.codec import Decoder, encode5
from filemq.mqtt.packets import (
    Connack,
    Connect,
    Packet,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
)
from tests import mosquitto
from tests.mosquitto import Mosquitto, Oracle
from tests.pipeline_harness import (
    DEVICE,
    REPO,
    Publishers,
    agent_config,
    publish_local,
    publish_through_cuts,
    run,
    until,
)
from tests.scripted_brokers import ScriptedBroker
from tests.tcpproxy import TcpProxy
from worker_agent.app import Agent
from worker_agent.mqtt_export import MqttExport

pytestmark = pytest.mark.timeout(120)

needs_mosquitto = pytest.mark.skipif(not mosquitto.available(), reason="Debian mosquitto is not installed")


# -- packet level, against a scripted upstream ---------------------------------------------------


def test_clean_session_off_and_client_id_default(tmp_path: Path) -> None:
    """The export connects with CleanSession=0 (MQTT-3.1.2-4: the broker keeps its QoS 1/2
    state) as ``filemq-<device_id>-<name>``, and templates topics."""

    async def scenario() -> None:
        up = ScriptedBroker()
        await up.start()
        agent = Agent(agent_config(tmp_path, f"""
[[export]]
name = "up"
url = "mqtt://127.0.0.1:{up.port}"
topic_template = "site/{{device_id}}/{{topic}}"
"""))
        await agent.start()
        try:
            await publish_local(agent.broker.port, 5)
            await up.wait_for(lambda: len(up.publishes()) >= 5)
            assert up.connects[0].clean_session is False
            assert up.connects[0].client_id == f"filemq-{DEVICE}-up"
            assert {p.topic for p in up.publishes()} == {f"site/{DEVICE}/sensors/t"}
            assert [p.payload for p in up.publishes()] == [f"m-{i}".encode() for i in range(5)]
            export = agent.exports.get("up")
            assert export is not None and export.group is not None
            await until(lambda: export.group.pending_offset == 5, what="all acked")  # type: ignore[union-attr]
        finally:
            await agent.stop()
            await up.stop()

    run(scenario())


def test_offset_moves_only_over_a_gap_free_acknowledged_prefix(tmp_path: Path) -> None:
    """PUBACKs for records 1..9 while record 0 is unacknowledged leave the group's Pending at 0;
    the PUBACK of record 0 moves it to 10 at once."""

    async def scenario() -> None:
        up = ScriptedBroker()
        up.ack = lambda conn, p: p.payload != b"m-0"
        await up.start()
        agent = Agent(agent_config(tmp_path, **{"agent.export": [f"up=mqtt://127.0.0.1:{up.port}"]}))
        await agent.start()
        try:
            await publish_local(agent.broker.port, 10)
            export = agent.exports.get("up")
            assert export is not None and export.group is not None
            group = export.group
            await up.wait_for(lambda: len(up.publishes()) >= 10)
            runner = export.runner
            await until(lambda: runner.stats.records_acked == 9, what="9 acks")  # type: ignore[union-attr]
            assert group.pending_offset == 0 and group.lag == 10
            up.release()
            await until(lambda: group.pending_offset == 10, what="prefix acked")
        finally:
            await agent.stop()
            await up.stop()

    run(scenario())


@pytest.mark.parametrize("qos", [1, 2])
def test_unacked_window_is_resent_with_dup_first_after_a_reconnect(tmp_path: Path, qos: int) -> None:
    """MQTT-4.4.0-1: on reconnect with CleanSession=0 the client re-sends unacknowledged
    PUBLISH packets (DUP=1, MQTT-3.3.1-1) with their original packet ids, before new ones."""

    async def scenario() -> None:
        up = ScriptedBroker()
        first_conn = 1 if qos == 2 else 0  # QoS 2 starts with one clean connection (mqtt_export doc)
        up.ack = lambda conn, p: conn > first_conn  # the first connection acknowledges nothing
        await up.start()
        agent = Agent(agent_config(tmp_path, f"""
[[export]]
name = "up"
url = "mqtt://127.0.0.1:{up.port}"
qos = {qos}
window = 4
"""))
        await agent.start()
        try:
            await publish_local(agent.broker.port, 10)
            await up.wait_for(lambda: len(up.publishes(first_conn)) >= 4)
            first = up.publishes(first_conn)
            assert [p.dup for p in first] == [False] * 4
            up.drop_connections()
            await up.wait_for(lambda: len(up.publishes(first_conn + 1)) >= 10)
            again = up.publishes(first_conn + 1)
            assert [(p.packet_id, p.payload, p.dup) for p in again[:4]] == [(p.packet_id, p.payload, True) for p in first]
            assert [p.payload for p in again[4:]] == [f"m-{i}".encode() for i in range(4, 10)]
            assert not any(p.dup for p in again[4:])
            export = agent.exports.get("up")
            assert export is not None and export.group is not None
            group = export.group
            await until(lambda: group.pending_offset == 10, what="all acked")
        finally:
            await agent.stop()
            await up.stop()

    run(scenario())


def test_after_a_restart_possibly_sent_records_go_first_with_dup(tmp_path: Path) -> None:
    """Records handed out before a restart and never acknowledged are published again first,
    with DUP=1 (MQTT-3.3.1-1: it might be a re-delivery); nothing is skipped."""

    async def scenario() -> None:
        up = ScriptedBroker()
        up.ack = lambda conn, p: False
        await up.start()
        cfg = agent_config(tmp_path, **{"agent.export": [f"up=mqtt://127.0.0.1:{up.port}"]})
        agent = Agent(cfg)
        await agent.start()
        await publish_local(agent.broker.port, 6)
        await up.wait_for(lambda: len(up.publishes()) >= 6)
        await agent.stop()
        up.ack = lambda conn, p: True
        seen = len(up.publishes())
        agent = Agent(cfg)
        await agent.start()
        try:
            await up.wait_for(lambda: len(up.publishes()) >= seen + 6)
            again = up.publishes()[seen:]
            assert [(p.payload, p.dup) for p in again] == [(f"m-{i}".encode(), True) for i in range(6)]
            export = agent.exports.get("up")
            assert export is not None and export.group is not None
            group = export.group
            await until(lambda: group.pending_offset == 6, what="all acked")
        finally:
            await agent.stop()
            await up.stop()

    run(scenario())


# -- end to end with Debian mosquitto upstream ---------------------------------------------------------


@needs_mosquitto
def test_upstream_broker_restarted_mid_drain_loses_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        mq = Mosquitto(tmp_path / "mosquitto")
        mq.start()
        oracle = Oracle(mq.port, "sensors/#")
        await oracle.start()
        agent = Agent(agent_config(tmp_path, f"""
[[export]]
name = "up"
url = "mqtt://127.0.0.1:{mq.port}"
window = 50
""", **{"uplink.rate_limit_bytes_per_s": 20_000}))
        await agent.start()
        try:
            pubs = Publishers(lambda: agent.broker.port, count=2)
            pubs.start(messages_each=3000)
            await pubs.wait()
            await oracle.wait_count(300, timeout=30)
            assert len(oracle.payloads) < len(pubs.acked), "drained before the restart: test proves nothing"
            await asyncio.to_thread(mq.stop)
            export = agent.exports.get("up")
            assert export is not None
            await until(lambda: export.state() == "backoff", what="export notices the broker is gone")
            await asyncio.to_thread(mq.start)
            await oracle.wait_for(pubs.acked, timeout=60)
            await until(lambda: export.group is not None and export.group.lag == 0, what="group drained")
        finally:
            await agent.stop()
            await oracle.stop()
            mq.stop()

    run(scenario())


@needs_mosquitto
def test_uplink_cut_at_random_bytes_loses_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        mq = Mosquitto(tmp_path / "mosquitto")
        mq.start()
        proxy = TcpProxy(mq.port)
        await proxy.start()
        oracle = Oracle(mq.port, "sensors/#")
        await oracle.start()
        agent = Agent(agent_config(tmp_path, **{"agent.export": [f"up=mqtt://127.0.0.1:{proxy.port}"]}))
        await agent.start()
        rng = random.Random(14)
        try:
            # Until five cuts and 6,000 messages (a fixed count once took 0.4 s here, too short
            # for three cuts).
            pubs = Publishers(lambda: agent.broker.port, count=3)
            pubs.start(messages_each=None, rate_pause=0.002)
            await publish_through_cuts(pubs, proxy, rng, cuts=5, messages=6000, cut_bytes=(200, 20_000))
            await oracle.wait_for(pubs.acked, timeout=60)
            assert proxy.cuts >= 3
            assert len(pubs.acked) >= 1000
        finally:
            await agent.stop()
            await proxy.stop()
            await oracle.stop()
            mq.stop()

    run(scenario())


@needs_mosquitto
def test_wrong_credentials_clear_error_backoff_nothing_skipped(tmp_path: Path) -> None:
    async def scenario() -> None:
        mq = Mosquitto(tmp_path / "mosquitto", password=("device", "right"))
        mq.add_user("oracle", "oracle-pw")  # subscribed before the export can deliver anything
        mq.start()
        oracle = Oracle(mq.port, "sensors/#")
        oracle_client = MQTTClient("oracle", port=mq.port, clean_session=False, username="oracle",
                                   password="oracle-pw", on_message=oracle._on_message)
        await oracle_client.connect()
        await oracle_client.subscribe([("sensors/#", 1)])
        pw = tmp_path / "pw"
        pw.write_text("wrong\n")
        agent = Agent(agent_config(tmp_path, f"""
[[export]]
name = "up"
url = "mqtt://127.0.0.1:{mq.port}"
username = "device"
password_file = "{pw}"
"""))
        await agent.start()
        try:
            await publish_local(agent.broker.port, 200)
            export = agent.exports.get("up")
            assert export is not None and export.group is not None
            runner = export.runner
            await until(lambda: runner.stats.connect_failures >= 3, what="retries")  # type: ignore[union-attr]
            assert export.state() == "backoff"
            error = export.last_error() or ""
            # (mosquitto answers MQTT 5 with 0x87 = 135, 3.1.1 with 5: both "not authorized")
            assert "refused" in error and "password_file" in error, error
            assert "not authorized (CONNACK 135)" in error or "not authorized (CONNACK 5)" in error, error
            assert export.group.pending_offset == 0 and export.group.lag == 200
            # The upstream now accepts that password (mosquitto re-reads its file on SIGHUP):
            # the export connects by itself and every record arrives (at the oracle, which
            # subscribed before anything could be delivered: none can pass it by).
            mq.add_user("device", "wrong")
            mq.reload()
            await until(lambda: export.group is not None and export.group.lag == 0, what="drained after the fix")
            await oracle.wait_for({f"m-{i}".encode() for i in range(200)}, timeout=30)
            await oracle_client.disconnect()
        finally:
            await agent.stop()
            mq.stop()

    run(scenario())


@needs_mosquitto
def test_two_exports_one_down_the_other_ships_everything(tmp_path: Path) -> None:
    """A collector export whose collector never answers does not hold back the mosquitto
    export, nor the local broker; its own backlog is kept whole."""

    async def scenario() -> None:
        mq = Mosquitto(tmp_path / "mosquitto")
        mq.start()
        oracle = Oracle(mq.port, "sensors/#")
        await oracle.start()
        dead = free_port()
        agent = Agent(agent_config(tmp_path, **{"agent.collector": f"127.0.0.1:{dead}",
                                                "agent.export": [f"cloud=mqtt://127.0.0.1:{mq.port}"]}))
        await agent.start()
        try:
            pubs = Publishers(lambda: agent.broker.port, count=2)
            pubs.start(messages_each=1500)
            await pubs.wait()
            assert len(pubs.acked) == 3000  # the local broker accepted everything
            await oracle.wait_for(pubs.acked, timeout=60)
            cloud, collector = agent.exports.get("cloud"), agent.exports.get("collector")
            assert cloud is not None and collector is not None
            assert cloud.group is not None and collector.group is not None
            await until(lambda: cloud.group is not None and cloud.group.lag == 0, what="cloud drained")
            assert collector.group.pending_offset == 0 and collector.group.lag == 3000
            assert collector.state() == "backoff" and "cannot connect" in (collector.last_error() or "")
        finally:
            await agent.stop()
            await oracle.stop()
            mq.stop()

    run(scenario())


@needs_mosquitto
def test_kill_9_of_the_agent_mid_drain_loses_nothing(tmp_path: Path) -> None:
    """The real ``filemq agent`` process with only an MQTT export, killed with SIGKILL while it
    drains a backlog to mosquitto; restarted, it finishes, and the oracle has every message."""

    mq = Mosquitto(tmp_path / "mosquitto")
    mq.start()
    port = free_port()
    args = [sys.executable, "-m", "cli", "agent", "--data-dir", str(tmp_path / "agent"), "--device-id", DEVICE,
            "--port", str(port), "--export", f"up=mqtt://127.0.0.1:{mq.port}", "--uplink-rate-limit", "30000",
            "--fsync", "interval", "--backoff-initial-ms", "20", "--backoff-max-ms", "200"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def start_agent() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        assert proc.stdout.readline(), "the agent did not start"
        return proc

    async def scenario() -> None:
        oracle = Oracle(mq.port, "sensors/#")
        await oracle.start()
        proc = start_agent()
        try:
            pubs = Publishers(lambda: port, count=2)
            pubs.start(messages_each=4000)
            await pubs.wait()
            await oracle.wait_count(500, timeout=30)
            assert len(oracle.payloads) < len(pubs.acked), "drained before the kill: test proves nothing"
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            proc = start_agent()
            await oracle.wait_for(pubs.acked, timeout=90)
        finally:
            with contextlib.suppress(Exception):
                proc.terminate()
                proc.wait(20)
            await oracle.stop()

    try:
        run(scenario(), timeout=110)
    finally:
        mq.stop()


@needs_mosquitto
def test_each_export_gets_exactly_what_its_filters_match(tmp_path: Path) -> None:
    """Two exports to one broker: `#` as `all/<topic>` (QoS 1) and `alarms/#` as `hi/<topic>`
    (QoS 2); every acknowledged local message arrives at each export whose filters match it,
    and only there."""

    async def scenario() -> None:
        mq = Mosquitto(tmp_path / "mosquitto")
        mq.start()
        oracle = Oracle(mq.port, "#")
        await oracle.start()
        agent = Agent(agent_config(tmp_path, f"""
[[export]]
name = "all"
url = "mqtt://127.0.0.1:{mq.port}"
topic_template = "all/{{topic}}"

[[export]]
name = "alarms"
url = "mqtt://127.0.0.1:{mq.port}"
topics = ["alarms/#"]
topic_template = "hi/{{topic}}"
qos = 2
"""))
        await agent.start()
        try:
            sensors = await publish_local(agent.broker.port, 50, topic="sensors/x", prefix="s")
            alarms = await publish_local(agent.broker.port, 20, topic="alarms/y", prefix="a")
            await oracle.wait_for(set(sensors) | set(alarms), timeout=30)
            # (the oracle counts payloads: an alarm's "all/" copy satisfies wait_for before its
            # "hi/" copy arrives, and an export's lag is 0 at the destination's ack, before the
            # destination forwards it to the oracle; so wait for the second copy too)
            await until(lambda: all(oracle.payloads[p] >= 2 for p in alarms), what="the alarms' second copies")
            await until(lambda: all(e.group is not None and e.group.lag == 0 for e in agent.exports.exports),
                        what="both drained")
            by_prefix: dict[str, set[bytes]] = {"all": set(), "hi": set()}
            for m in oracle.messages:
                by_prefix[m.topic.split("/", 1)[0]].add(m.payload)
            assert by_prefix["all"] == set(sensors) | set(alarms)
            assert by_prefix["hi"] == set(alarms)
            assert {m.topic for m in oracle.messages if m.topic.startswith("hi/")} == {"hi/alarms/y"}
        finally:
            await agent.stop()
            await oracle.stop()
            mq.stop()

    run(scenario())


@needs_mosquitto
def test_qos2_export_started_while_the_broker_is_down_backs_off_then_delivers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The clean first connection of a QoS 2 export fails like any other attempt (a warning
    and a backoff, not an unexpected error), then everything arrives."""

    async def scenario() -> None:
        mq = Mosquitto(tmp_path / "mosquitto")
        mq.start()
        oracle = Oracle(mq.port, "sensors/#")  # its persistent session outlives the restart
        await oracle.start()
        await asyncio.to_thread(mq.stop)
        agent = Agent(agent_config(tmp_path, f"""
[[export]]
name = "up"
url = "mqtt://127.0.0.1:{mq.port}"
qos = 2
"""))
        await agent.start()
        try:
            sent = await publish_local(agent.broker.port, 30)
            export = agent.exports.get("up")
            assert export is not None
            runner = export.runner
            await until(lambda: runner.stats.connect_failures >= 2, what="failed attempts")  # type: ignore[union-attr]
            assert "cannot connect" in (export.last_error() or "")
            await asyncio.to_thread(mq.start)
            await until(lambda: export.group is not None and export.group.lag == 0, what="drained")
            await oracle.wait_for(set(sent), timeout=30)
        finally:
            await agent.stop()
            await oracle.stop()
            mq.stop()
        assert not [r for r in caplog.records if "unexpected error" in r.getMessage()]

    run(scenario())


def test_a_record_over_max_packet_size_is_set_aside_not_resent_forever(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A broker closes the connection on a packet over its limit (AWS IoT Core: 128 KiB); an
    export with max_packet_size never sends such a record: it is acked unsent, counted and
    logged, and the records around it arrive."""

    async def scenario() -> None:
        up = ScriptedBroker()
        await up.start()
        agent = Agent(agent_config(tmp_path, f"""
[[export]]
name = "aws"
url = "mqtt://127.0.0.1:{up.port}"
max_packet_size = "2 KiB"
""", **{"broker.max_packet_size": "1 MiB"}))
        await agent.start()
        try:
            client = MQTTClient("pub", port=agent.broker.port)
            await client.connect()
            await client.publish("t/a", b"before", qos=1)
            await client.publish("t/big", b"x" * 4096, qos=1)
            await client.publish("t/a", b"after", qos=1)
            await client.disconnect()
            export = agent.exports.get("aws")
            assert export is not None and export.group is not None
            group = export.group
            await until(lambda: group.lag == 0, what="drained past the big record")
            assert [p.payload for p in up.publishes()] == [b"before", b"after"]
            (entry,) = agent.exports.status()
            assert entry["oversized_skipped"] == 1
            assert dict(agent.exports.sys_messages())["$SYS/broker/export/aws/oversized_skipped"] == b"1"
        finally:
            await agent.stop()
            await up.stop()
        assert any("exceeds the export's max_packet_size 2048" in r.getMessage() for r in caplog.records)

    run(scenario())


# -- a destination that stops acknowledging (issue 30 item 5) ---------------------------------


def _stalled_export_config(tmp_path: Path, port: int, qos: int = 1) -> Config:
    return agent_config(tmp_path, f"""
[[export]]
name = "up"
url = "mqtt://127.0.0.1:{port}"
qos = {qos}
ack_timeout_ms = 1000
""")


@pytest.mark.parametrize("qos", [1, 2])
def test_destination_that_stops_acknowledging_for_8_s_gets_everything_by_itself(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, qos: int) -> None:
    """The destination takes the connection and the PUBLISHes but acknowledges nothing for 8 s.
    The export does not wait forever: after ack_timeout_ms it closes the connection, logs it
    (once), reconnects and resends the window with the same ids and DUP set (MQTT-4.4.0-1);
    once the destination acknowledges again every locally acknowledged message is delivered
    and acknowledged there, with no restart of anything."""
    caplog.set_level(logging.INFO, logger="worker_agent.mqtt_export")

    async def scenario() -> None:
        up = ScriptedBroker()
        loop = asyncio.get_running_loop()
        resume_at = loop.time() + 8.0
        up.ack = lambda conn, p: loop.time() >= resume_at
        await up.start()
        agent = Agent(_stalled_export_config(tmp_path, up.port, qos))
        await agent.start()
        try:
            sent = await publish_local(agent.broker.port, 300)
            export = agent.exports.get("up")
            assert export is not None and export.group is not None
            runner = export.runner
            assert isinstance(runner, MqttExport)
            group = export.group
            await until(lambda: runner.stats.ack_timeouts >= 2, timeout=20, what="ack timeouts while stalled")
            assert group.lag == len(sent), "records were acked while the destination acknowledged nothing"
            await until(lambda: group.lag == 0, timeout=40, what="drained once the destination acknowledges")
            assert loop.time() >= resume_at
            delivered = {p.payload for c, p in up.packets if isinstance(p, Publish) and up.ack(c, p)}
            assert set(sent) <= delivered
            first = min(c for c, p in up.packets if isinstance(p, Publish))  # (QoS 2: after a clean one)
            first_ids = {p.packet_id: p.payload for p in up.publishes(first)}
            later = [p for c, p in up.packets if c > first and isinstance(p, Publish)]
            resent = [p for p in later if p.packet_id in first_ids and first_ids[p.packet_id] == p.payload]
            assert resent and all(p.dup for p in resent), "the window was not resent with its ids and DUP"
            assert export.counters()["ack_timeouts"] == runner.stats.ack_timeouts
        finally:
            await agent.stop()
            await up.stop()
        lines = [r for r in caplog.records if "has not acknowledged packet id" in r.getMessage()]
        assert len(lines) == 1, "the first ack timeout is logged once (later ones only counted)"
        assert any("acknowledges again" in r.getMessage() for r in caplog.records)

    run(scenario(), timeout=90)


def test_destination_that_answers_pubrec_to_qos1_is_left_and_retried(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A QoS 1 PUBLISH answered with PUBREC is not acknowledged (MQTT-4.3.2: only PUBACK
    completes it): the export keeps it in flight, times out, reconnects and resends with DUP;
    when the destination answers PUBACK (its third connection) everything is delivered."""

    async def scenario() -> None:
        up = ScriptedBroker()
        up.pubrec_for_qos1 = lambda conn, p: conn < 2
        await up.start()
        agent = Agent(_stalled_export_config(tmp_path, up.port))
        await agent.start()
        try:
            sent = await publish_local(agent.broker.port, 100)
            export = agent.exports.get("up")
            assert export is not None and export.group is not None
            runner = export.runner
            assert isinstance(runner, MqttExport)
            group = export.group
            await until(lambda: group.lag == 0, timeout=40, what="drained after the PUBRECs")
            assert runner.stats.ack_timeouts >= 2
            assert set(sent) <= {p.payload for p in up.publishes(2)} | {p.payload for c, p in up.packets
                                                                     if c > 2 and isinstance(p, Publish)}
            assert all(p.dup for p in up.publishes(2))
        finally:
            await agent.stop()
            await up.stop()
        assert sum("has not acknowledged packet id" in r.getMessage() for r in caplog.records) == 1

    run(scenario(), timeout=90)


def test_a_puback_of_packet_id_0_is_a_protocol_error_and_nothing_is_lost(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """MQTT-2.3.1-1: a PUBACK's packet id is non-zero.  A destination that answers with a PUBACK
    of id 0 (a read of nothing but that PUBACK, the PUBACK slicer's case) breaks the protocol:
    the link closes with a protocol error, as for the same PUBACK inside any other read, then
    reconnects and resends; everything is delivered."""

    async def scenario() -> None:
        up = ScriptedBroker()
        up.raw_reply = lambda conn, p: b"\x40\x02\x00\x00" if conn == 0 else None
        await up.start()
        agent = Agent(_stalled_export_config(tmp_path, up.port))
        await agent.start()
        try:
            sent = await publish_local(agent.broker.port, 20)
            export = agent.exports.get("up")
            assert export is not None and export.group is not None
            group = export.group
            await until(lambda: group.lag == 0, timeout=40, what="drained after the bad PUBACK")
            assert len(up.connects) >= 2
            assert set(sent) <= {p.payload for c, p in up.packets if c >= 1 and isinstance(p, Publish)}
        finally:
            await agent.stop()
            await up.stop()
        assert any("protocol error" in r.getMessage() and "packet id 0" in r.getMessage() for r in caplog.records)

    run(scenario(), timeout=90)


@needs_mosquitto
def test_mosquitto_silent_for_8_s_behind_a_proxy_loses_nothing(tmp_path: Path) -> None:
    """Real mosquitto upstream whose answers are held for 8 s by a proxy (the connection stays
    open, PUBLISHes reach it, no PUBACK comes back): the export times out, reconnects, resends
    with DUP into mosquitto's persistent session, and once the answers flow again every
    locally acknowledged message reaches the oracle subscriber, with nothing restarted."""

    async def scenario() -> None:
        mq = Mosquitto(tmp_path / "mosquitto")
        mq.start()
        oracle = Oracle(mq.port, "sensors/#")
        await oracle.start()
        proxy = TcpProxy(mq.port)
        await proxy.start()
        agent = Agent(_stalled_export_config(tmp_path, proxy.port))
        await agent.start()
        try:
            export = agent.exports.get("up")
            assert export is not None and export.group is not None
            runner = export.runner
            assert isinstance(runner, MqttExport)
            await until(lambda: runner.stats.state == "connected", what="export connected")
            proxy.hold_down = True
            sent = await publish_local(agent.broker.port, 400)
            await until(lambda: runner.stats.ack_timeouts >= 1, timeout=10, what="an ack timeout")
            await asyncio.sleep(8.0 - 1.5)
            assert export.group.lag == len(sent), "acked while mosquitto's answers were held"
            proxy.hold_down = False
            await until(lambda: export.group is not None and export.group.lag == 0, timeout=40,
                        what="drained once answers flow")
            await oracle.wait_for(set(sent), timeout=30)
        finally:
            await agent.stop()
            await proxy.stop()
            await oracle.stop()
            mq.stop()

    run(scenario(), timeout=100)


# -- MQTT 5 end to end (issue 33 item 4) -------------------------------------------------------


class Raw5:
    """A packet-level MQTT 5 client on loopback (bounded by ``timeout`` per read)."""

    def __init__(self) -> None:
        self.decoder = Decoder(server=False, protocol_level=5)
        self.received: list[Publish] = []
        self._queue: list[Packet] = []
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def connect(self, port: int, client_id: str) -> Connack:
        self._reader, self._writer = await asyncio.open_connection("127.0.0.1", port)
        self.send(Connect(client_id=client_id, protocol_level=5))
        ack = await self.next()
        assert isinstance(ack, Connack) and ack.return_code == 0, ack
        return ack

    def send(self, packet: Packet) -> None:
        assert self._writer is not None
        self._writer.write(encode5(packet))

    async def next(self, timeout: float = 10.0) -> Packet:
        assert self._reader is not None
        async with asyncio.timeout(timeout):
            while not self._queue:
                data = await self._reader.read(65536)
                assert data, "connection closed"
                self.decoder.feed(data)
                self._queue.extend(self.decoder.packets())
        return self._queue.pop(0)

    async def collect(self, n: int, timeout: float = 30.0) -> list[Publish]:
        """PUBLISHes until ``n`` arrived (each acknowledged)."""
        async with asyncio.timeout(timeout):
            while len(self.received) < n:
                p = await self.next(timeout)
                if isinstance(p, Publish):
                    self.received.append(p)
                    if p.qos and p.packet_id is not None:
                        self.send(Puback(p.packet_id) if p.qos == 1 else Pubrec(p.packet_id))
                elif isinstance(p, Pubrel):
                    self.send(Pubcomp(p.packet_id))
        return self.received

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _props(i: int, expiry: int | None = 3600) -> Properties:
    return Properties(payload_format_indicator=1, message_expiry_interval=expiry, content_type="application/json",
                      response_topic=f"reply/{i}", correlation_data=b"\x00corr-%d" % i,
                      user_properties=[("k", "v1"), ("k", "v2"), ("seq", str(i))])


async def _publish5(port: int, messages: Sequence[tuple[str, bytes, Properties | None]]) -> None:
    pub = Raw5()
    await pub.connect(port, "pub5")
    for i, (topic, payload, props) in enumerate(messages):
        pub.send(Publish(topic, payload, 1, packet_id=i + 1, properties=props))
        ack = await pub.next()
        assert isinstance(ack, Puback) and ack.packet_id == i + 1 and ack.reason_code == 0, ack
    pub.close()


@needs_mosquitto
@pytest.mark.parametrize("qos", [1, 2])
def test_mqtt5_properties_reach_a_v5_subscriber_at_mosquitto(tmp_path: Path, qos: int) -> None:
    """An MQTT 5 message published on the device goes through the export to Debian mosquitto
    (negotiated: MQTT 5) and reaches an MQTT 5 subscriber there with every message property:
    payload format indicator, content type, response topic, correlation data and the user
    properties in wire order with repeats (MQTT-3.3.2-17/-18: the server forwards them
    unaltered), the message expiry interval lowered, never raised (MQTT-3.3.2-6); a plain
    message arrives without properties; the status says MQTT 5."""

    async def scenario() -> None:
        mq = Mosquitto(tmp_path / "mosquitto")
        mq.start()
        sub = Raw5()
        await sub.connect(mq.port, "sub5")
        sub.send(Subscribe(1, [("up/#", 2)]))
        assert isinstance(await sub.next(), Suback)
        agent = Agent(agent_config(tmp_path, f"""
[[export]]
name = "up"
url = "mqtt://127.0.0.1:{mq.port}"
topic_template = "up/{{topic}}"
qos = {qos}
"""))
        await agent.start()
        try:
            sent: list[tuple[str, bytes, Properties | None]] = [(f"sensors/{i}", b"m-%d" % i, _props(i)) for i in range(20)]
            sent.append(("sensors/plain", b"plain", None))
            await _publish5(agent.broker.port, sent)
            got = await sub.collect(len(sent))
            by_payload = {p.payload: p for p in got}
            for i in range(20):
                p = by_payload[b"m-%d" % i]
                assert p.topic == f"up/sensors/{i}"
                props = p.properties
                assert props is not None
                assert props.payload_format_indicator == 1 and props.content_type == "application/json"
                assert props.response_topic == f"reply/{i}" and props.correlation_data == b"\x00corr-%d" % i
                assert props.user_properties == [("k", "v1"), ("k", "v2"), ("seq", str(i))]
                assert props.message_expiry_interval is not None and 3590 <= props.message_expiry_interval <= 3600
            plain = by_payload[b"plain"].properties
            assert plain is None or (plain.user_properties == [] and plain.content_type is None)
            (entry,) = agent.exports.status()
            assert entry["protocol"] == "5"
        finally:
            await agent.stop()
            sub.close()
            mq.stop()

    run(scenario())


def test_a_destination_that_refuses_mqtt5_gets_mqtt_3_1_1_and_the_status_says_so(tmp_path: Path) -> None:
    """protocol = "auto" (the default) to a 3.1.1-only broker: CONNACK 0x01 to the level-5
    CONNECT (MQTT-3.1.2-2), then a level-4 CONNECT that it accepts; everything is delivered,
    without properties, and the status shows the fallback with its reason."""

    async def scenario() -> None:
        up = ScriptedBroker()
        up.levels = (4,)
        await up.start()
        agent = Agent(agent_config(tmp_path, f"""
[[export]]
name = "up"
url = "mqtt://127.0.0.1:{up.port}"
"""))
        await agent.start()
        try:
            await _publish5(agent.broker.port, [("t/a", b"m-%d" % i, _props(i)) for i in range(5)])
            export = agent.exports.get("up")
            assert export is not None and export.group is not None
            group = export.group
            await until(lambda: group.lag == 0, what="drained over 3.1.1")
            assert [c.protocol_level for c in up.connects][:2] == [5, 4]
            assert {p.payload for p in up.publishes()} == {b"m-%d" % i for i in range(5)}
            (entry,) = agent.exports.status()
            assert entry["protocol"].startswith("3.1.1 (fallback: CONNACK 0x01"), entry["protocol"]
        finally:
            await agent.stop()
            await up.stop()

    run(scenario())


def test_protocol_is_configurable_and_mqtt5_limits_of_the_destination_are_kept(tmp_path: Path) -> None:
    """protocol = "5": the CONNECT is level 5 with a never-expiring session (clean start 0,
    Session Expiry Interval 0xFFFFFFFF: the persistent session of 3.1.1); the CONNACK's
    Receive Maximum 4 bounds the publishes in flight (MQTT-3.3.4-7: the client must not
    exceed it); a record whose message expiry passed while the destination was away is not
    sent (acked, counted); protocol = "3.1.1" sends a level-4 CONNECT."""

    async def scenario() -> None:
        up = ScriptedBroker()
        up.port = free_port()
        agent = Agent(agent_config(tmp_path, f"""
[[export]]
name = "v5"
url = "mqtt://127.0.0.1:{up.port}"
protocol = "5"
"""))
        await agent.start()
        try:
            # Published while the destination is down: one expires meanwhile.
            await _publish5(agent.broker.port, [("t/short", b"short", _props(0, expiry=1))]
                            + [("t/a", b"m-%d" % i, _props(i)) for i in range(12)])
            await asyncio.sleep(2.2)
            up.connack_properties = Properties(receive_maximum=4)
            held = {"on": True}
            up.ack = lambda conn, p: not held["on"]
            await up.start()
            export = agent.exports.get("v5")
            assert export is not None and export.group is not None and isinstance(export.runner, MqttExport)
            runner = export.runner
            await up.wait_for(lambda: len(up.publishes()) >= 4)
            await asyncio.sleep(0.5)
            assert len(up.publishes()) == 4, "more in flight than the destination's Receive Maximum"
            held["on"] = False
            up.release()
            group = export.group
            await until(lambda: group.lag == 0, what="drained")
            assert [c.protocol_level for c in up.connects] == [5]
            c = up.connects[0]
            assert not c.clean_session and c.properties is not None
            assert c.properties.session_expiry_interval == 0xFFFFFFFF
            payloads = [p.payload for p in up.publishes()]
            assert b"short" not in payloads and set(payloads) == {b"m-%d" % i for i in range(12)}
            assert runner.stats.expired_skipped == 1
        finally:
            await agent.stop()
            await up.stop()

        up = ScriptedBroker()
        await up.start()
        (tmp_path / "b").mkdir()
        agent = Agent(agent_config(tmp_path / "b", f"""
[[export]]
name = "old"
url = "mqtt://127.0.0.1:{up.port}"
protocol = "3.1.1"
"""))
        await agent.start()
        try:
            await _publish5(agent.broker.port, [("t/a", b"x", _props(1))])
            await up.wait_for(lambda: len(up.publishes()) >= 1)
            assert [c.protocol_level for c in up.connects] == [4]
            (entry,) = agent.exports.status()
            assert entry["protocol"] == "3.1.1"
        finally:
            await agent.stop()
            await up.stop()

    run(scenario())
