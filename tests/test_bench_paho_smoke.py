"""Tiny runs of `filemq bench broker --subscriber-client paho|single|nagle`, `--publisher-client
single|nagle` and `--max-inflight N`.

The fanout scenario with off-the-shelf paho-mqtt 2.x subscribers (one PUBACK per message,
like the held-out clients of issue 16) and one in-flight window for both brokers.  Checks
that every broker delivered every message and that the CPU figures are there; never a
timing threshold.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench.broker import summary_line
from bench.harness.brokers import BrokerBenchOptions, filemq_argv
from bench.harness.processes import mosquitto_available, start_mosquitto
from bench.loadgen import RawClient, flat_out, send_one_by_one
from bench.loadspec import PublisherResult, PublisherSpec
from bench.throughput import SUBSCRIBER_CLIENT_TEXT, scenario_fanout
from cli import main
from filemq.mqtt.codec import Decoder
from filemq.mqtt.packets import Publish

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

needs_mosquitto = pytest.mark.skipif(not mosquitto_available(),
                                     reason="Debian mosquitto (/usr/sbin/mosquitto) is not installed")

MESSAGES = 3000  # a few CPU clock ticks (10 ms) per broker


@needs_mosquitto
@pytest.mark.parametrize("client", ["paho", "single", "nagle"])
def test_fanout_with_ordinary_subscribers_delivers_every_message_through_the_cli(tmp_path: Path, client: str) -> None:
    args = ["bench", "broker", "--scenario", "fanout", "--subscriber-client", client, "--max-inflight", "20",
            "--messages", str(MESSAGES), "--publishers", "2", "--subscribers", "2", "--max-seconds", "10",
            "--repeat", "1", "--workdir", str(tmp_path), "--json"]
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0, run.output
    (out,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert out["scenario"] == "fanout"
    assert out["subscriber_client"] == client
    assert out["filemq_max_inflight"] == 20 and out["mosquitto_max_inflight"] == 20
    for name in ("filemq", "mosquitto"):
        assert out[f"{name}_published"] == MESSAGES, out
        assert out[f"{name}_delivered"] == MESSAGES * 2, out
        assert out[f"{name}_deliveries_per_s"] > 0
        assert out[f"{name}_cpu_us_per_msg"] > 0  # per delivery
        assert f"{name}_errors" not in out
    assert out["cpu_ratio_vs_mosquitto"] > 0
    assert SUBSCRIBER_CLIENT_TEXT[client] in run.stderr and "in-flight window filemq 20, mosquitto 20" in run.stderr
    assert "CPU" in summary_line(out)
    assert f"{client} subscribers, in-flight window filemq 20 / mosquitto 20" in summary_line(out)
    assert not list(tmp_path.iterdir()), "the bench left its data directories behind"


@needs_mosquitto
def test_default_windows_stay_each_brokers_own(tmp_path: Path) -> None:
    """Without --max-inflight: filemq's default window (32) and today's mosquitto config (100),
    reported in the JSON; mosquitto's configuration file says 100."""
    opts = BrokerBenchOptions(messages=MESSAGES, publishers=2, subscribers=2, max_seconds=10.0, repeat=1,
                              workdir=tmp_path)
    assert opts.subscriber_client == "loadgen" and opts.max_inflight is None
    out = scenario_fanout(opts, lambda _msg: None)
    assert out["subscriber_client"] == "loadgen"
    assert (out["filemq_max_inflight"], out["mosquitto_max_inflight"]) == (32, 100)
    assert out["filemq_delivered"] == out["mosquitto_delivered"] == MESSAGES * 2
    with start_mosquitto(tmp_path / "m") as broker:
        assert broker.alive()
    assert "max_inflight_messages 100\n" in (tmp_path / "m" / "mosquitto.conf").read_text()


def test_max_inflight_reaches_both_brokers(tmp_path: Path) -> None:
    argv = filemq_argv(tmp_path / "data", 1883, max_inflight=7)
    assert argv[argv.index("--max-inflight") + 1] == "7"
    assert "--max-inflight" not in filemq_argv(tmp_path / "data", 1883)
    if mosquitto_available():
        with start_mosquitto(tmp_path / "m", max_inflight=7) as broker:
            assert broker.alive()
        assert "max_inflight_messages 7\n" in (tmp_path / "m" / "mosquitto.conf").read_text()


def test_a_single_subscriber_sends_each_puback_on_its_own() -> None:
    """``--subscriber-client single``: the PUBACKs of one read leave in one send each."""
    sent: list[bytes] = []

    class Sock:
        def sendall(self, data: bytes) -> None:
            sent.append(bytes(data))

    acks = bytearray(b"\x40\x02\x00\x01\x40\x02\x00\x02\x40\x02\x01\x00")
    send_one_by_one(Sock(), acks)  # type: ignore[arg-type]
    assert sent == [b"\x40\x02\x00\x01", b"\x40\x02\x00\x02", b"\x40\x02\x01\x00"]


@pytest.mark.parametrize("nodelay", [True, False])
def test_a_nagle_client_leaves_nagles_algorithm_on(nodelay: bool) -> None:
    """``--subscriber-client nagle`` connects with ``nodelay=False``: its socket keeps Nagle's
    algorithm (TCP_NODELAY 0), every other raw client turns it off."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def accept_one() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)  # the CONNECT
            conn.sendall(b"\x20\x02\x00\x00")  # CONNACK, accepted
            conn.recv(1024)  # until the client closes

    thread = threading.Thread(target=accept_one, daemon=True)
    thread.start()
    try:
        client = RawClient.connect("127.0.0.1", port, "c", nodelay=nodelay)
        try:
            assert bool(client.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)) is nodelay
        finally:
            client.sock.close()
        thread.join(5)
    finally:
        server.close()


@needs_mosquitto
@pytest.mark.parametrize("client", ["single", "nagle"])
def test_ingest_with_naive_publishers_acks_every_message_through_the_cli(tmp_path: Path, client: str) -> None:
    args = ["bench", "broker", "--scenario", "ingest", "--publisher-client", client, "--messages", str(MESSAGES),
            "--publishers", "2", "--max-seconds", "10", "--repeat", "1", "--workdir", str(tmp_path), "--json"]
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0, run.output
    (out,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert out["scenario"] == "ingest" and out["publisher_client"] == client
    for name in ("filemq", "mosquitto"):
        assert out[f"{name}_acked"] == MESSAGES, out
        assert out[f"{name}_cpu_us_per_msg"] > 0
    assert "each PUBLISH in a send of its own" in run.stderr
    assert not list(tmp_path.iterdir()), "the bench left its data directories behind"


@pytest.mark.parametrize("client", ["loadgen", "single"])
def test_a_single_publisher_sends_each_publish_on_its_own(client: str) -> None:
    """``--publisher-client single``: one sendall per PUBLISH, the window's first ones included;
    ``loadgen``: the window in one sendall, then what each read of PUBACKs frees."""
    sent: list[bytes] = []

    class Sock:
        def __init__(self) -> None:
            self.unacked: list[int] = []

        def settimeout(self, _t: float) -> None:
            pass

        def sendall(self, data: bytes) -> None:
            sent.append(bytes(data))
            decoder = Decoder(server=True)
            decoder.feed(data)
            for p in decoder.packets():  # QoS 1 PUBLISHes only: the publisher sends nothing else
                assert isinstance(p, Publish) and p.packet_id is not None, p
                self.unacked.append(p.packet_id)

        def recv(self, _n: int) -> bytes:
            acks, self.unacked = self.unacked, []
            return b"".join(b"\x40\x02" + pid.to_bytes(2, "big") for pid in acks)

    spec = PublisherSpec("127.0.0.1", 1, "p", "t", messages=10, payload_size=16, inflight=4, client=client)
    result = PublisherResult("p")
    flat_out(RawClient(Sock(), "p", False, Decoder(server=False)), spec, result)()  # type: ignore[arg-type]
    assert result.acked == 10 and result.error is None
    if client == "single":
        assert len(sent) == 10  # one PUBLISH per send
    else:
        assert len(sent) == 3  # 4, then 4, then 2


def test_paho_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "paho", None)
    monkeypatch.setitem(sys.modules, "paho.mqtt", None)
    monkeypatch.setitem(sys.modules, "paho.mqtt.client", None)
    run = CliRunner().invoke(main, ["bench", "broker", "--scenario", "fanout", "--subscriber-client", "paho",
                                    "--messages", "10", "--workdir", str(tmp_path)])
    assert run.exit_code != 0
    assert "pip install paho-mqtt" in run.output
    assert not list(tmp_path.iterdir()), "no broker was started"
