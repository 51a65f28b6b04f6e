"""``filemq bench forward --only storm``: a fleet that connects at once, and again after its
collector is killed (issue 30 item 2).

N devices (default 5,000; two load processes) connect together to one ``filemq collector``
started with default settings, each retrying as the agent does (connect timeout 10 s,
full-jitter exponential backoff from 0.5 s, :func:`worker_agent.forwarder.backoff_delay`,
reset once a batch is acknowledged), and each sends one batch and waits for its PUBACK.
Then the collector is killed (SIGKILL) and started again on the same data directory and
port; every device notices, backs off, reconnects and sends a second batch.  Measured:

* seconds from the start until the last device is in (first connect), and from the new
  collector's "listening" line (and from the kill) until the last one is back;
* connection attempts per device, each time (1 = in at the first try);
* records lost: every record of both batches of every device must be in the landed Parquet
  files (``device_id``, ``offset``), counted once the lander has landed them: must be 0.

Baseline in the same run: the same storm against Debian mosquitto with its defaults (it
acknowledges on receipt and lands nothing, so it has no loss count); the ratios compare the
seconds until the last device is in.

Progress goes to stderr; ``--json`` prints one JSON object per line on stdout.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.forward import MOSQUITTO
from bench.harness.processes import (
    descriptor_shortfall,
    free_port,
    mosquitto_bridge_conf,
    say,
    start_cli,
    stop,
)

CONNECT_TIMEOUT_S = 10.0  # worker_agent.forwarder.ForwarderConfig.connect_timeout_s
BACKOFF_INITIAL_S = 0.5  # [agent] backoff_initial_ms
BACKOFF_MAX_S = 60.0  # [agent] backoff_max_ms
BATCH_RECORDS = 10


@dataclass
class StormResult:
    """One storm run."""

    name: str
    devices: int
    first_connect_s: float  # from the start until the last device is in
    first_attempts_mean: float
    first_attempts_max: int
    back_after_ready_s: float  # from the new collector's listening line until the last is back
    back_after_kill_s: float
    restart_s: float  # kill -> the new collector listens
    second_attempts_mean: float
    second_attempts_max: int
    records_sent: int
    records_lost: int
    note: str = ""


def _device_fleet(port: int, devices: range, size: int, ready: Any, go: Any, first_done: Any,
                  out: Any) -> None:
    """One load process: each device connects (agent's retry rule), sends batch 0, waits for
    its connection to drop, reconnects, sends batch 1.  Puts one tuple per device in ``out``:
    (device, first_in, first_attempts, back, second_attempts), wall-clock times; or a string
    (why this process failed)."""
    from filemq.mqtt.codec import Decoder, encode
    from filemq.mqtt.packets import Connack, Connect, Disconnect, Puback, Publish
    from filemq.upstream.batch import BatchRecord, encode_batch
    from worker_agent.forwarder import backoff_delay

    shortfall = descriptor_shortfall(len(devices))
    if shortfall is not None:
        out.put(shortfall)
        return
    payload = os.urandom(size)
    now = time.time_ns() // 1000

    def batch(d: int, n: int) -> bytes:
        return encode_batch(f"dev-{d}", "main", [
            BatchRecord(n * BATCH_RECORDS + i, now + i, "sensors/storm", payload, 1) for i in range(BATCH_RECORDS)])

    batches = {d: (batch(d, 0), batch(d, 1)) for d in devices}

    class Device(asyncio.Protocol):
        """One device's connection, as lean as a device's own: its CONNECT goes out in the
        callback that completes the TCP connect (the agent's MQTT client does the same
        after its own, heavier, set-up); a load process simulating thousands of devices
        on a shared core must not make them look silent."""

        def __init__(self, d: int) -> None:
            self.decoder = Decoder(server=False)
            self.connack: asyncio.Future[Connack] = loop.create_future()
            self.puback: asyncio.Future[None] = loop.create_future()
            self.lost = asyncio.Event()
            self.transport: asyncio.Transport | None = None
            self.connect = encode(Connect(client_id=f"dev-{d}", keepalive=60))

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]
            self.transport.write(self.connect)  # type: ignore[union-attr]

        def data_received(self, data: bytes) -> None:
            self.decoder.feed(data)
            for p in self.decoder.packets():
                if isinstance(p, Connack) and not self.connack.done():
                    self.connack.set_result(p)
                elif isinstance(p, Puback) and not self.puback.done():
                    self.puback.set_result(None)

        def connection_lost(self, exc: Exception | None) -> None:
            self.lost.set()
            for f in (self.connack, self.puback):
                if not f.done():
                    f.set_exception(ConnectionError(f"connection lost: {exc}"))
                    f.exception()

    async def attempt_once(d: int) -> Device:
        dev = Device(d)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await loop.create_connection(lambda: dev, "127.0.0.1", port)
                ack = await dev.connack
        except BaseException:
            if dev.transport is not None:
                dev.transport.abort()
            raise
        if ack.return_code != 0:
            assert dev.transport is not None
            dev.transport.abort()
            raise ConnectionError(f"CONNACK {ack.return_code}")
        return dev

    async def connected(d: int, rng: random.Random, attempt: int) -> tuple[Device, int]:
        """Connect as the forwarder does; returns the connection and the attempts it took."""
        tries = 0
        while True:
            tries += 1
            try:
                return await attempt_once(d), tries
            except Exception:  # noqa: BLE001 - any failed attempt backs off, as the agent's
                await asyncio.sleep(backoff_delay(attempt, BACKOFF_INITIAL_S, BACKOFF_MAX_S, rng))
                attempt += 1

    async def send(dev: Device, payload: bytes, d: int, rng: random.Random, attempt: int) -> tuple[Device, int]:
        """Send until acknowledged (a lost connection: back off, reconnect, send again)."""
        extra = 0
        packet = encode(Publish(topic=f"filemq/v1/dev-{d}/main", payload=payload, qos=1, packet_id=1))
        while True:
            try:
                assert dev.transport is not None
                dev.transport.write(packet)
                await asyncio.wait_for(asyncio.shield(dev.puback), 30)
                return dev, extra
            except Exception:  # noqa: BLE001
                if dev.transport is not None:
                    dev.transport.abort()
                await asyncio.sleep(backoff_delay(attempt, BACKOFF_INITIAL_S, BACKOFF_MAX_S, rng))
                dev, tries = await connected(d, rng, attempt + 1)
                extra += tries

    async def device(d: int) -> tuple[int, float, int, float, int]:
        rng = random.Random(d)
        dev, first_attempts = await connected(d, rng, 0)
        first_in = time.time()
        dev, extra = await send(dev, batches[d][0], d, rng, 0)
        first_attempts += extra
        fleet_in.append(d)
        if len(fleet_in) == len(devices):
            first_done.set()
        await dev.lost.wait()  # the collector is killed
        await asyncio.sleep(backoff_delay(0, BACKOFF_INITIAL_S, BACKOFF_MAX_S, rng))  # acked: attempt 0
        dev, second_attempts = await connected(d, rng, 1)
        back = time.time()
        dev, extra = await send(dev, batches[d][1], d, rng, 0)
        assert dev.transport is not None
        dev.transport.write(encode(Disconnect()))
        dev.transport.close()
        return d, first_in, first_attempts, back, second_attempts + extra

    fleet_in: list[int] = []

    loop: asyncio.AbstractEventLoop

    async def main() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        ready.set()
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        results = await asyncio.gather(*(device(d) for d in devices), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            out.put(f"{len(failed)} of {len(devices)} devices failed, e.g. {failed[0]!r}")
            return
        out.put([r for r in results if not isinstance(r, BaseException)])

    asyncio.run(main())


def landed_keys(landing: Path) -> set[tuple[str, int]]:
    """(device_id, offset) of every landed row."""
    import pyarrow.parquet as pq

    keys: set[tuple[str, int]] = set()
    for path in (landing / "incoming").rglob("*.parquet"):
        table = pq.read_table(path, columns=["device_id", "offset"])
        keys.update(zip(table.column("device_id").to_pylist(), table.column("offset").to_pylist(), strict=True))
    return keys


def _start(target: str, work: Path, port: int, collector_args: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """The server under test, listening: a collector, or the baseline mosquitto."""
    if target == "mosquitto":
        conf = mosquitto_bridge_conf(work / "mosquitto.conf", port)
        proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:  # listening once a connect succeeds
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                return proc
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mosquitto did not start (exit {proc.poll()})") from None
                time.sleep(0.01)
    return start_cli("collector", "--data-dir", str(work / "collector"), "--landing", str(work / "landing"),
                   "--port", str(port), "--collector-id", "storm", "--roll-seconds", "1", *collector_args,
                   log_path=work / "collector.log")


def run_storm(work: Path, devices: int, size: int = 100, timeout: float = 300,
              target: str = "collector", collector_args: tuple[str, ...] = ()) -> StormResult:
    """One storm against a collector with default settings (see the module docstring), or
    (``target="mosquitto"``, the baseline) against Debian mosquitto with its defaults: the
    same devices and batches, acknowledged on receipt; nothing landed, so no loss count."""
    work.mkdir(parents=True, exist_ok=True)
    landing = work / "landing"
    port = free_port()
    collector = _start(target, work, port, collector_args)
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs, events = [], []
    parts = [range(0, devices // 2), range(devices // 2, devices)]
    try:
        for part in parts:
            ready, first_done = ctx.Event(), ctx.Event()
            events.append((ready, first_done))
            p = ctx.Process(target=_device_fleet, args=(port, part, size, ready, go, first_done, out))
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        for ready, _ in events:
            while not ready.wait(0.2):
                if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                    raise RuntimeError("load processes did not start")
        say(f"[storm] {devices} devices connect together to {target} (default settings)")
        started = time.time()
        go.set()
        for _, first_done in events:
            while not first_done.wait(0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError("not every device got its first batch acknowledged")
                if not out.empty():
                    raise RuntimeError(str(out.get()))
        say(f"[storm] all {devices} in, batch 0 acknowledged after {time.time() - started:.2f} s; kill -9 {target}")
        killed = time.time()
        os.kill(collector.pid, signal.SIGKILL)
        collector.wait(10)
        collector = _start(target, work, port, collector_args)
        listening = time.time()
        say(f"[storm] {target} listening again {listening - killed:.2f} s after the kill")
        rows: list[tuple[int, float, int, float, int]] = []
        for _ in procs:
            got = out.get(timeout=max(1.0, deadline - time.monotonic()))
            if isinstance(got, str):
                raise RuntimeError(got)
            rows.extend(got)
        expected = {(f"dev-{d}", o) for d in range(devices) for o in range(2 * BATCH_RECORDS)}
        lost = -1  # (mosquitto lands nothing: not counted)
        while target == "collector":
            keys = landed_keys(landing)
            if expected <= keys or time.monotonic() > deadline:
                lost = len(expected - keys)
                break
            time.sleep(0.5)
    finally:
        go.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        stop(collector)
    first = [r[2] for r in rows]
    second = [r[4] for r in rows]
    last_in = max(r[1] for r in rows)
    last_back = max(r[3] for r in rows)
    return StormResult(
        name=f"storm_{target}_{devices}", devices=devices,
        first_connect_s=round(last_in - started, 2),
        first_attempts_mean=round(statistics.mean(first), 2), first_attempts_max=max(first),
        back_after_ready_s=round(last_back - listening, 2), back_after_kill_s=round(last_back - killed, 2),
        restart_s=round(listening - killed, 2),
        second_attempts_mean=round(statistics.mean(second), 2), second_attempts_max=max(second),
        records_sent=len(expected), records_lost=lost,
        note=f"agent backoff (0.5 s full jitter, x2), connect timeout 10 s, {target} default settings")


def run_storm_bench(*, devices: tuple[int, ...], size: int, work_dir: str | None, keep: bool, as_json: bool,
                    timeout: float = 300) -> list[StormResult]:
    """Per fleet size in ``devices``: the storm against a collector, then the same storm
    against Debian mosquitto (the baseline, skipped when it is not installed); prints one
    line (or JSON object) each and the ratios."""
    base = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="filemq-bench-storm-"))
    base.mkdir(parents=True, exist_ok=True)
    results = []
    targets = ["collector"] + (["mosquitto"] if os.path.exists(MOSQUITTO) else [])
    if len(targets) == 1:
        say("[storm] baseline skipped: mosquitto not installed (apt-get install mosquitto)")
    try:
        for n in devices:
            pair = []
            for target in targets:
                r = run_storm(base / f"storm-{target}-{n}", n, size, timeout, target)
                pair.append(r)
                results.append(r)
                lost = "" if r.records_lost < 0 else f"; {r.records_lost} of {r.records_sent} records lost"
                say(f"{r.name}: first connect: all {n} in after {r.first_connect_s} s ({r.first_attempts_mean} "
                     f"attempts per device, at most {r.first_attempts_max}); after kill -9: listening after "
                     f"{r.restart_s} s, all back {r.back_after_ready_s} s later ({r.second_attempts_mean} attempts, "
                     f"at most {r.second_attempts_max}){lost}")
                if as_json:
                    print(json.dumps(asdict(r)), flush=True)
            if len(pair) == 2:
                ours, theirs = pair
                ratio = {"name": f"storm_{n}_vs_mosquitto",
                         "first_connect": round(ours.first_connect_s / max(theirs.first_connect_s, 0.01), 2),
                         "back_after_ready": round(ours.back_after_ready_s / max(theirs.back_after_ready_s, 0.01), 2)}
                say(f"{ratio['name']}: first connect {ratio['first_connect']}x mosquitto's time, back after "
                     f"restart {ratio['back_after_ready']}x")
                if as_json:
                    print(json.dumps(ratio), flush=True)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    return results
