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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from filemq.broker.server import free_port
from filemq.common.config import Config, load_config
from filemq.mqtt.client import MQTTClient
from filemq.mqtt.codec import Decoder, encode
from filemq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
)
from tests import mosquitto
from tests.mosquitto import Mosquitto, Oracle
from tests.tcpproxy import TcpProxy
from tests.test_e2e_forward import Publishers, run, until
from worker_agent.app import Agent
from worker_agent.mqtt_export import MqttExport

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent
DEVICE = "dev-1"
needs_mosquitto = pytest.mark.skipif(not mosquitto.available(), reason="Debian mosquitto is not installed")


def agent_config(tmp: Path, toml: str = "", /, **extra: Any) -> Config:
    values: dict[str, Any] = {
        "data_dir": str(tmp / "agent"),
        "broker.port": 0,
        "broker.sys_interval_s": 1,
        "agent.device_id": DEVICE,
        "agent.backoff_initial_ms": 20,
        "agent.backoff_max_ms": 200,
        "log.fsync": "never",
        "log.min_free_bytes": 0,
    }
    values.update(extra)
    path = None
    if toml:
        path = tmp / "agent.toml"
        path.write_text(toml)
    return load_config(path, values)


class ScriptedBroker:
    """A minimal MQTT server on loopback that records every packet and acks as told.

    ``ack`` decides per PUBLISH whether to acknowledge it now (default: yes); ``held`` keeps
    the ones not acknowledged so a test can release them later with :meth:`release`.
    """

    def __init__(self) -> None:
        self.port = 0
        self.connects: list[Connect] = []
        self.packets: list[tuple[int, Packet]] = []  # (connection number, packet)
        self.ack: Callable[[int, Publish], bool] = lambda conn, p: True
        # True: answer this QoS 1 PUBLISH with PUBREC, as a broken destination does (never PUBACK)
        self.pubrec_for_qos1: Callable[[int, Publish], bool] = lambda conn, p: False
        self.session_present = True
        self.held: list[tuple[asyncio.StreamWriter, Publish]] = []
        self.changed = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop_connections()

    def drop_connections(self) -> None:
        for w in self._writers:
            w.close()
        self._writers.clear()

    def publishes(self, conn: int | None = None) -> list[Publish]:
        return [p for c, p in self.packets if isinstance(p, Publish) and (conn is None or c == conn)]

    def release(self) -> None:
        held, self.held = self.held, []
        for writer, p in held:
            assert p.packet_id is not None
            writer.write(encode(Puback(p.packet_id) if p.qos == 1 else Pubrec(p.packet_id)))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = len(self.connects)
        self._writers.append(writer)
        decoder = Decoder(1 << 20, server=True)
        try:
            while data := await reader.read(1 << 16):
                decoder.feed(data)
                for packet in decoder.packets():
                    self.packets.append((conn, packet))
                    self.changed.set()
                    if isinstance(packet, Connect):
                        self.connects.append(packet)
                        writer.write(encode(Connack(self.session_present and not packet.clean_session, 0)))
                    elif isinstance(packet, Publish):
                        assert packet.packet_id is not None
                        if packet.qos == 1 and self.pubrec_for_qos1(conn, packet):
                            writer.write(encode(Pubrec(packet.packet_id)))
                        elif self.ack(conn, packet):
                            writer.write(encode(Puback(packet.packet_id) if packet.qos == 1 else Pubrec(packet.packet_id)))
                        else:
                            self.held.append((writer, packet))
                    elif isinstance(packet, Pubrel):
                        writer.write(encode(Pubcomp(packet.packet_id)))
                    elif isinstance(packet, Pingreq):
                        writer.write(encode(Pingresp()))
                    elif isinstance(packet, Disconnect):
                        return
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 20) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


async def publish_local(port: int, n: int, topic: str = "sensors/t", prefix: str = "m", qos: int = 1) -> list[bytes]:
    """Publish ``n`` messages to the agent's broker; the payloads it PUBACKed, in order."""
    client = MQTTClient(f"pub-{prefix}", port=port, max_inflight=100)
    await client.connect()
    payloads = [f"{prefix}-{i}".encode() for i in range(n)]
    futures = [client.publish_nowait(topic, p, qos=qos) for p in payloads]
    await asyncio.gather(*futures)
    await client.disconnect()
    return payloads


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
            pubs = Publishers(lambda: agent.broker.port, count=3)
            pubs.start(messages_each=2000, rate_pause=0.002)
            while not all(t.done() for t in pubs._tasks):
                proxy.cut_after(rng.randrange(200, 20_000))
                await asyncio.sleep(0.2)
            await pubs.wait()
            await oracle.wait_for(pubs.acked, timeout=60)
            assert proxy.cuts >= 3
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
            assert "refused" in error and "not authorized (CONNACK 5)" in error and "password_file" in error, error
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
