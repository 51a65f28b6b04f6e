"""Interop with MQTT clients nobody here wrote: paho-mqtt 2.x, amqtt, mosquitto_pub/_sub.

The broker runs in a background thread with its own event loop (paho and the mosquitto
tools are blocking), or in the test's loop for amqtt.  Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from filemq.broker import Broker
from filemq.common.config import load_config
from tests.broker_process import ThreadedBroker, make_config

paho = pytest.importorskip("paho.mqtt.client", reason="paho-mqtt is not installed")
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MOSQUITTO_PUB = shutil.which("mosquitto_pub")
MOSQUITTO_SUB = shutil.which("mosquitto_sub")
needs_mosquitto_clients = pytest.mark.skipif(
    MOSQUITTO_PUB is None or MOSQUITTO_SUB is None,
    reason="mosquitto_pub/mosquitto_sub not installed (Debian package mosquitto-clients; `make system-deps`)",
)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[ThreadedBroker]:
    b = ThreadedBroker(make_config(tmp_path))
    b.start()
    try:
        yield b
    finally:
        b.stop()


class Paho:
    """A paho client in its own network thread, messages into a queue."""

    def __init__(self, port: int, client_id: str, *, clean: bool = True, keepalive: int = 30,
                 will: tuple[str, bytes, int] | None = None) -> None:
        self.messages: queue.Queue[Any] = queue.Queue()
        self.disconnected = threading.Event()
        self.connected = threading.Event()
        self.subscribed = threading.Event()
        c = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id,
                        clean_session=clean)
        if will:
            c.will_set(will[0], will[1], qos=will[2])
        c.on_message = lambda _c, _u, m: self.messages.put(m)
        c.on_connect = lambda *a: self.connected.set()
        c.on_subscribe = lambda *a: self.subscribed.set()
        c.on_disconnect = lambda *a: self.disconnected.set()
        c.connect("127.0.0.1", port, keepalive=keepalive)
        c.loop_start()
        assert self.connected.wait(10), "paho did not connect"
        self.c = c

    def subscribe(self, topic: str, qos: int) -> None:
        self.subscribed.clear()
        self.c.subscribe(topic, qos)
        assert self.subscribed.wait(10)

    def get(self, timeout: float = 10) -> Any:
        return self.messages.get(timeout=timeout)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def test_paho_qos_both_ways_and_retained(broker: ThreadedBroker) -> None:
    sub = Paho(broker.port, "paho-sub")
    pub = Paho(broker.port, "paho-pub")
    try:
        sub.subscribe("p/#", 2)
        for q in (0, 1, 2):
            info = pub.c.publish(f"p/{q}", b"paho%d" % q, qos=q)
            info.wait_for_publish(10)
            assert info.is_published()
        got = sorted((m.topic, m.payload, m.qos) for m in (sub.get(), sub.get(), sub.get()))
        assert got == [("p/0", b"paho0", 0), ("p/1", b"paho1", 1), ("p/2", b"paho2", 2)]
        pub.c.publish("r/state", b"on", qos=1, retain=True).wait_for_publish(10)
        late = Paho(broker.port, "paho-late")
        late.subscribe("r/+", 1)
        m = late.get()
        assert (m.topic, m.payload, m.retain) == ("r/state", b"on", True)
        late.close()
    finally:
        sub.close()
        pub.close()


def test_paho_will_keepalive_expiry_and_takeover(broker: ThreadedBroker) -> None:
    watcher = Paho(broker.port, "watcher")
    watcher.subscribe("will/#", 1)
    try:
        # Keepalive 1 s, then the client goes silent: closed after 1.5 s, will published.
        silent = Paho(broker.port, "silent", keepalive=1, will=("will/silent", b"lost", 1))
        silent.c.loop_stop()  # no more PINGREQs, socket left open
        started = time.monotonic()
        m = watcher.get(timeout=10)
        assert (m.topic, m.payload) == ("will/silent", b"lost")
        assert time.monotonic() - started >= 1.0
        # Take-over: a second CONNECT with the same id disconnects the first.
        first = Paho(broker.port, "twin", will=("will/twin", b"first-gone", 1))
        first.c.reconnect_delay_set(60, 120)  # keep it from reconnecting and taking over back
        second = Paho(broker.port, "twin")
        assert first.disconnected.wait(10)
        m = watcher.get(timeout=10)
        assert (m.topic, m.payload) == ("will/twin", b"first-gone")
        first.c.loop_stop()
        second.close()
    finally:
        watcher.close()


def test_amqtt_client_persistent_session_across_restart(tmp_path: Path) -> None:
    from amqtt.client import MQTTClient as AmqttClient

    cfg = make_config(tmp_path)

    async def main() -> None:
        b = Broker(cfg)
        await b.start()
        port = b.port
        conf = {"auto_reconnect": False, "keep_alive": 30}
        sub = AmqttClient("amqtt-sub", config=conf)
        await sub.connect(f"mqtt://127.0.0.1:{port}/", cleansession=False)
        assert await sub.subscribe([("a/#", 1), ("a2/#", 2)]) == [1, 2]
        pub = AmqttClient("amqtt-pub", config=conf)
        await pub.connect(f"mqtt://127.0.0.1:{port}/")
        for q in (0, 1, 2):
            await pub.publish("a/live", b"q%d" % q, qos=q)
        live = [await sub.deliver_message(timeout_duration=10) for _ in range(3)]
        assert sorted(m.data for m in live if m is not None) == [b"q0", b"q1", b"q2"]
        await sub.disconnect()
        for i in range(20):
            await pub.publish("a/offline", b"%d" % i, qos=1)
        await pub.disconnect()
        await b.stop()
        b2 = Broker(load_config(None, {"data_dir": str(tmp_path), "broker.port": port}))
        await b2.start()
        try:
            sub2 = AmqttClient("amqtt-sub", config=conf)
            await sub2.connect(f"mqtt://127.0.0.1:{port}/", cleansession=False)
            got = []
            for _ in range(20):
                m = await sub2.deliver_message(timeout_duration=10)
                assert m is not None
                got.append(m.data)
            assert got == [b"%d" % i for i in range(20)]
            await sub2.disconnect()
        finally:
            await b2.stop()

    asyncio.run(main())


def test_amqtt_shared_subscription(tmp_path: Path) -> None:
    from amqtt.client import MQTTClient as AmqttClient

    async def main() -> None:
        b = Broker(make_config(tmp_path))
        await b.start()
        try:
            conf = {"auto_reconnect": False}
            url = f"mqtt://127.0.0.1:{b.port}/"
            members = [AmqttClient(f"worker{i}", config=conf) for i in range(2)]
            for m in members:
                await m.connect(url)
                await m.subscribe([("$share/workers/jobs/#", 1)])
            solo = AmqttClient("solo", config=conf)
            await solo.connect(url)
            await solo.subscribe([("jobs/#", 1)])
            pub = AmqttClient("jobs-pub", config=conf)
            await pub.connect(url)
            n = 20
            for i in range(n):
                await pub.publish("jobs/new", b"%d" % i, qos=1)
            seen: list[list[bytes]] = [[], []]
            async with asyncio.timeout(15):
                while len(seen[0]) + len(seen[1]) < n:
                    for i, m in enumerate(members):
                        with contextlib.suppress(TimeoutError):
                            msg = await m.deliver_message(timeout_duration=0.05)
                            if msg is not None:
                                seen[i].append(msg.data)
            assert not set(seen[0]) & set(seen[1])
            assert sorted(seen[0] + seen[1], key=int) == [b"%d" % i for i in range(n)]
            solo_got = [await solo.deliver_message(timeout_duration=10) for _ in range(n)]
            assert [m.data for m in solo_got if m is not None] == [b"%d" % i for i in range(n)]
            for c in (*members, solo, pub):
                await c.disconnect()
        finally:
            await b.stop()

    asyncio.run(main())


@needs_mosquitto_clients
def test_mosquitto_clients_qos_and_retained(broker: ThreadedBroker) -> None:
    port = str(broker.port)
    assert MOSQUITTO_PUB is not None and MOSQUITTO_SUB is not None
    sub = subprocess.Popen([MOSQUITTO_SUB, "-h", "127.0.0.1", "-p", port, "-t", "m/#", "-q", "2", "-C", "3",
                            "-W", "20", "-v"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # let the subscription land
        for q in ("0", "1", "2"):
            subprocess.run([MOSQUITTO_PUB, "-h", "127.0.0.1", "-p", port, "-t", f"m/{q}", "-q", q, "-m", f"hi{q}"],
                           check=True, timeout=20)
        out, err = sub.communicate(timeout=25)
    finally:
        if sub.poll() is None:
            sub.kill()
    assert sorted(out.split("\n")[:3]) == ["m/0 hi0", "m/1 hi1", "m/2 hi2"], err
    subprocess.run([MOSQUITTO_PUB, "-h", "127.0.0.1", "-p", port, "-t", "ret/x", "-q", "1", "-r", "-m", "kept"],
                   check=True, timeout=20)
    got = subprocess.run([MOSQUITTO_SUB, "-h", "127.0.0.1", "-p", port, "-t", "ret/#", "-C", "1", "-W", "10"],
                         capture_output=True, text=True, timeout=20)
    assert got.stdout.strip() == "kept"


@needs_mosquitto_clients
def test_mosquitto_sub_persistent_across_cli_broker_restart(tmp_path: Path) -> None:
    """The `filemq broker` process is stopped and restarted; mosquitto_sub -c gets the backlog."""
    assert MOSQUITTO_PUB is not None and MOSQUITTO_SUB is not None
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def start(port: int) -> tuple[subprocess.Popen[str], int]:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "broker", "--data-dir", str(tmp_path), "--port",
                                 str(port)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, proc.stderr.read() if proc.stderr else line
        return proc, int(line.split("127.0.0.1:")[1].split(",")[0])

    proc, port = start(0)
    try:
        # Register the persistent session and its subscription, then leave.
        subprocess.run([MOSQUITTO_SUB, "-h", "127.0.0.1", "-p", str(port), "-c", "-i", "mq-durable", "-q", "1",
                        "-t", "d/#", "-W", "1"], capture_output=True, timeout=20)
        for i in range(5):
            subprocess.run([MOSQUITTO_PUB, "-h", "127.0.0.1", "-p", str(port), "-t", "d/x", "-q", "1", "-m",
                            f"msg{i}"], check=True, timeout=20)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        proc, port = start(port)
        got = subprocess.run([MOSQUITTO_SUB, "-h", "127.0.0.1", "-p", str(port), "-c", "-i", "mq-durable", "-q",
                              "1", "-t", "d/#", "-C", "5", "-W", "15"], capture_output=True, text=True, timeout=30)
        assert got.stdout.split() == [f"msg{i}" for i in range(5)], got.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
