"""A real broker for the tests: in the test's process (:func:`running`, :class:`ThreadedBroker`)
or as a ``filemq broker`` process (:func:`start_broker_process`), its configs, and
socket-level clients of it.

Every broker listens on loopback, port 0 (the port it took is ``broker.port``), and every wait
is bounded. :func:`running` skips a test whose config would start a TLS listener on uvloop
(tests/loops.py). :class:`BlockingClient` is a packet-level client on a blocking socket;
:func:`ack_one_by_one` answers each QoS 1 PUBLISH with a PUBACK in a send of its own (the
subscriber of the ack pacing and batching tests), :func:`backlog` leaves messages waiting for a
persistent subscription. TLS certificates: tests/tls_material.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from filemq.broker import Broker
from filemq.common.config import Config, load_config
from filemq.mqtt.client import MQTTClient
from filemq.mqtt.codec import Decoder, encode, encode_puback
from filemq.mqtt.packets import Connack, Connect, Publish
from tests.loops import skip_tls_on_uvloop

REPO = Path(__file__).resolve().parents[1]
SLOW_RECV_S = 0.03  # a delayed ACK waits 40 ms; a recv that blocks this long waited for one

# ---- configs ----------------------------------------------------------------------------------


def make_config(data_dir: Path, **broker: Any) -> Config:
    """A config with its data in ``data_dir`` and a broker on port 0; ``broker`` are [broker] keys."""
    overrides: dict[str, Any] = {"data_dir": str(data_dir), "broker.port": 0}
    overrides.update({f"broker.{k}": v for k, v in broker.items()})
    return load_config(None, overrides)


def load_toml(tmp: Path, text: str, **overrides: Any) -> Config:
    """The config of the TOML ``text`` (written to ``tmp/filemq.toml``), its data in ``tmp/data``."""
    conf = tmp / "filemq.toml"
    conf.write_text(text)
    return load_config(conf, {"data_dir": str(tmp / "data"), **overrides})


# ---- a broker in the test's process -----------------------------------------------------------


@contextlib.asynccontextmanager
async def running(config: Config, **kw: Any) -> AsyncIterator[Broker]:
    skip_tls_on_uvloop(config)
    broker = Broker(config, **kw)
    await broker.start()
    try:
        yield broker
    finally:
        await broker.stop()


async def collect(client_msgs: list[Publish], n: int, timeout: float = 5.0) -> None:
    """Wait until ``client_msgs`` holds ``n`` messages (TimeoutError after ``timeout`` s)."""
    async with asyncio.timeout(timeout):
        while len(client_msgs) < n:
            await asyncio.sleep(0.01)


async def closed_by_peer(reader: asyncio.StreamReader, timeout: float) -> bool:
    """True when the broker closes the connection within ``timeout`` (EOF or reset)."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


class ThreadedBroker:
    """A Broker on its own loop in a daemon thread; start/stop/restart on the same data dir."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.broker: Broker | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.port = 0

    def start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.broker = Broker(self.config)
        ready = threading.Event()
        loop, broker = self.loop, self.broker

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(broker.start())
            ready.set()
            loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(30), "broker did not start"
        self.port = broker.port
        # Restarts must come back on the same port (clients reconnect to it).
        self.config = load_config(None, {"data_dir": self.config.data_dir, "broker.port": self.port})

    def stop(self) -> None:
        assert self.loop is not None and self.broker is not None and self.thread is not None
        asyncio.run_coroutine_threadsafe(self.broker.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def start_threaded_broker(tmp_path: Path, **overrides: Any) -> ThreadedBroker:
    """A started :class:`ThreadedBroker` on port 0, its data in ``tmp_path/data``; ``overrides``
    are config keys."""
    config = load_config(None, {"data_dir": str(tmp_path / "data"), "broker.port": 0, **overrides})
    b = ThreadedBroker(config)
    b.start()
    return b


# ---- a `filemq broker` process ----------------------------------------------------------------


def start_broker_process(data_dir: Path) -> tuple[subprocess.Popen[str], int]:
    """``filemq broker`` on port 0 with ``data_dir``, once it listens: (process, port)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "broker", "--data-dir", str(data_dir), "--port", "0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("filemq broker listening on 127.0.0.1:"), line
    return proc, int(line.split("127.0.0.1:")[1].split(",")[0])


# ---- socket-level clients ---------------------------------------------------------------------


class BlockingClient:
    """A packet-level MQTT client on a blocking loopback socket (bounded by its timeout)."""

    def __init__(self, port: int, connect: Connect) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.decoder = Decoder(server=False)
        self.queue: list[Any] = []
        self.send(connect)
        assert isinstance(self.next(), Connack)

    def send(self, packet: Any) -> None:
        self.sock.sendall(encode(packet))

    def next(self) -> Any:
        while not self.queue:
            data = self.sock.recv(65536)
            assert data, "connection closed by the broker"
            self.decoder.feed(data)
            self.queue.extend(self.decoder.packets())
        return self.queue.pop(0)

    def close(self) -> None:
        self.sock.close()


def ack_one_by_one(sock: socket.socket, client_id: str, ack_until: int, deadline: float) -> tuple[int, int]:
    """CONNECT ``client_id`` (persistent session) on ``sock`` and answer each QoS 1 PUBLISH
    with a PUBACK in a send of its own, until ``ack_until`` have come (the rest of that read
    unacked) or the monotonic ``deadline``.  Returns (messages received, recv calls that
    blocked longer than SLOW_RECV_S)."""
    decoder = Decoder(server=False)
    received = slow = 0
    sock.sendall(encode(Connect(client_id=client_id, clean_session=False, keepalive=60)))
    while time.monotonic() < deadline and received < ack_until:
        started = time.monotonic()
        data = sock.recv(65536)
        if not data:
            break
        if received and time.monotonic() - started > SLOW_RECV_S:
            slow += 1
        decoder.feed(data)
        for packet in decoder.packets():
            if isinstance(packet, Connack):
                assert packet.return_code == 0 and packet.session_present
            elif isinstance(packet, Publish):
                received += 1
                assert packet.qos == 1 and packet.packet_id is not None
                if received <= ack_until:
                    sock.sendall(encode_puback(packet.packet_id))  # one send per PUBACK
    return received, slow


async def backlog(port: int, client_id: str, n: int, prefix: str = "pace") -> None:
    """A persistent QoS 1 subscription of ``client_id`` to ``prefix/#`` with ``n`` messages
    waiting for it."""
    sub = MQTTClient(client_id, port=port, clean_session=False)
    await sub.connect()
    assert await sub.subscribe([(f"{prefix}/#", 1)]) == [1]
    await sub.disconnect()
    pub = MQTTClient(f"{prefix}-pub", port=port, max_inflight=100)
    await pub.connect()
    for start in range(0, n, 100):
        await asyncio.gather(*(pub.publish(f"{prefix}/t", b"%06d" % i, qos=1) for i in range(start, min(start + 100, n))))
    await pub.disconnect()
