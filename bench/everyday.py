"""`filemq bench broker --scenario everyday`: a device's everyday load, against mosquitto in the same run.

A device's broker is almost never saturated. Its everyday load is a few dozen sensor loops,
each sending one small QoS 1 PUBLISH at a time, in a send of its own (``TCP_NODELAY``), and
waiting for the PUBACK before the next, at a few to a few dozen messages a second. What costs
there is per wake-up and per commit, not per message, so this scenario measures the broker's
CPU per message (user + system, all threads) at such rates, its share of one core, and the
PUBACK latency a sensor sees, for filemq and Debian mosquitto alternately.

A rate of 0 is the idle case: the sensors stay connected and publish nothing; the figure is then
the share of a core each broker spends on them (issue 29's "idle is idle").

The sensors run in one helper process (:func:`sensors_main`, a ``selectors`` loop): each sensor
keeps its own schedule (``rate`` per second, a random phase), sends a 40-byte JSON reading when
it is due and its last PUBLISH is acknowledged, and never has more than one in flight, as a
plain sensor loop does. A PUBACK that comes late delays that sensor's next reading, never
queues several.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import selectors
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.harness.processes import BrokerProcess
from bench.harness.summary import percentile_ms
from bench.loadgen import RawClient

Progress = Callable[[str], None]
PUBACK = 0x40


@dataclass(frozen=True)
class SensorLoad:
    """One everyday run: ``sensors`` loops publishing ``rate`` msg/s in all for ``seconds``."""

    host: str
    port: int
    sensors: int = 50
    rate: float = 1000.0  # msg/s over all sensors; 0 = connected and silent
    seconds: float = 15.0
    payload_size: int = 40
    seed: int = 0


@dataclass
class SensorResult:
    """What the sensors saw; ``cpu_*`` are filled by the caller (the broker's CPU over the run)."""

    sent: int = 0
    acked: int = 0
    seconds: float = 0.0
    latencies_us: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    broker_user_seconds: float = 0.0
    broker_cpu_seconds: float = 0.0


def _publish(topic: bytes, packet_id: int, payload: bytes) -> bytes:
    """A QoS 1 PUBLISH (3.1.1): fixed header, topic, packet id, payload (MQTT 3.3)."""
    body_len = 2 + len(topic) + 2 + len(payload)
    assert body_len < 128, "the everyday PUBLISH is small: one length byte"
    return bytes((0x32, body_len)) + struct.pack(">H", len(topic)) + topic + struct.pack(">H", packet_id) + payload


def _reading(i: int, seq: int, size: int) -> bytes:
    """A sensor's JSON reading padded to ``size`` bytes (``{"t":..,"v":..}``)."""
    raw = json.dumps({"s": i, "n": seq, "v": round(20 + (seq % 50) / 10, 1)}, separators=(",", ":")).encode()
    return raw.ljust(size, b" ")[:max(size, len(raw))]


def _sensor_loop(load: SensorLoad, ready: Any, go: Any, out: Any) -> None:
    rng = random.Random(load.seed)
    clients = [RawClient.connect(load.host, load.port, f"everyday-sensor-{i}", clean_session=True,
                                 keepalive=60, nodelay=True) for i in range(load.sensors)]
    ready.set()
    go.wait()
    sel = selectors.DefaultSelector()
    period = load.sensors / load.rate if load.rate > 0 else float("inf")
    start = time.monotonic()
    due = [start + rng.random() * period if load.rate > 0 else float("inf") for _ in clients]
    sent_at = [0.0] * len(clients)
    seq = [0] * len(clients)
    inflight = [False] * len(clients)
    topics = [f"sensors/{i}/reading".encode() for i in range(len(clients))]
    bufs = [b""] * len(clients)
    for i, c in enumerate(clients):
        c.sock.setblocking(False)
        sel.register(c.sock, selectors.EVENT_READ, i)
    result = SensorResult()
    end = start + load.seconds
    while True:
        now = time.monotonic()
        if now >= end and not any(inflight):
            break
        if now >= end + 5.0:
            result.errors.append(f"{sum(inflight)} PUBACKs still missing 5 s after the run")
            break
        for i in range(len(clients)):
            if not inflight[i] and due[i] <= now < end:
                seq[i] += 1
                pid = seq[i] % 65535 + 1
                try:
                    clients[i].sock.send(_publish(topics[i], pid, _reading(i, seq[i], load.payload_size)))
                except OSError as exc:
                    result.errors.append(f"sensor {i}: {exc}")
                    due[i] = float("inf")
                    continue
                sent_at[i] = now
                inflight[i] = True
                result.sent += 1
                # The next reading is due one period after this one was due; a sensor that fell
                # more than a period behind starts over from now (it never bursts to catch up).
                due[i] = due[i] + period if due[i] + period > now else now + period
        wake = min([d for i, d in enumerate(due) if not inflight[i]] + [end + 5.0])
        timeout = max(0.0, min(wake, end if now < end else end + 5.0) - time.monotonic())
        for key, _ in sel.select(timeout):
            i = key.data
            try:
                data = clients[i].sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError as exc:
                result.errors.append(f"sensor {i}: {exc}")
                sel.unregister(clients[i].sock)
                inflight[i] = False
                due[i] = float("inf")
                continue
            if not data:
                result.errors.append(f"sensor {i}: the broker closed the connection")
                sel.unregister(clients[i].sock)
                inflight[i] = False
                due[i] = float("inf")
                continue
            buf = bufs[i] + data
            t = time.monotonic()
            while len(buf) >= 4 and buf[0] >> 4 == PUBACK >> 4:
                buf = buf[4:]
                if inflight[i]:
                    inflight[i] = False
                    result.acked += 1
                    result.latencies_us.append(int((t - sent_at[i]) * 1e6))
            bufs[i] = buf
    result.seconds = time.monotonic() - start
    for c in clients:
        c.close()
    out.put(result)


def run_sensors(load: SensorLoad, broker: BrokerProcess) -> SensorResult:
    """Run ``load`` against ``broker`` in a helper process; the broker's CPU is taken from the
    moment every sensor is connected to the last PUBACK (connects are not the everyday load)."""
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_sensor_loop, args=(load, ready, go, out), daemon=True)
    proc.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the sensors could not connect within 60 s")
        time.sleep(0.5)  # let connect-time work (session files, timers) settle before counting
        user0, sys0 = broker.cpu_split()
        go.set()
        result: SensorResult = out.get(timeout=load.seconds + 60)
        user1, sys1 = broker.cpu_split()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    result.broker_user_seconds = user1 - user0
    result.broker_cpu_seconds = result.broker_user_seconds + sys1 - sys0
    return result


def figures(result: SensorResult) -> dict[str, Any]:
    """The per-run figures: CPU per message (us; per second when nothing was sent), share of a core."""
    cpu = result.broker_cpu_seconds
    out: dict[str, Any] = {
        "acked": result.acked, "rate": round(result.acked / result.seconds, 1) if result.seconds else 0.0,
        "cpu_pct": round(100 * cpu / result.seconds, 2) if result.seconds else 0.0,
        "user_pct": round(100 * result.broker_user_seconds / result.seconds, 2) if result.seconds else 0.0,
        "puback_p50_ms": percentile_ms(result.latencies_us, 0.5, per_ms=1000),
        "puback_p99_ms": percentile_ms(result.latencies_us, 0.99, per_ms=1000),
    }
    if result.acked:
        out["cpu_us_per_msg"] = round(1e6 * cpu / result.acked, 1)
        out["user_us_per_msg"] = round(1e6 * result.broker_user_seconds / result.acked, 1)
    if result.errors:
        out["errors"] = result.errors[:4]
    return out
