"""``filemq bench forward``: store-and-forward throughput, with its baselines in the same run.

(a) Backlog drain. N records are put in the agent's log while no collector runs; then the
    collector starts and the clock runs until the lander has landed all N rows in Parquet
    (agent -> collector -> WAL -> landed file, both as real ``filemq`` processes). Baseline in
    the same run: a Mosquitto -> Mosquitto bridge draining the same backlog: the local broker
    (``max_queued_messages 0``) queues N QoS 1 messages for a persistent bridge
    (``cleansession false``) while the remote is down; then the remote starts and the clock
    runs until a subscriber there has all N.
(b) Many devices. ``--devices`` MQTT connections (from two load processes) publish batches
    made with :func:`filemq.upstream.batch.encode_batch` to one collector; the clock runs until every
    row is landed. Run ``--repeat`` times without and with health reports (as agents send them,
    every ``--health-interval-s``, default 30), alternating: the collector's CPU per landed row
    with/without (issue 32: < 1.05) and ``/api/fleet``'s time, sampled while the devices send
    (< 200 ms); ``--only devices`` runs just this part.
(c) The broker's durable ingest rate (QoS 1, fsync always, 4 publishers x 100 in flight)
    measured in the same run, to show a backlog shrinks while devices keep publishing.
(d) The same backlog shipped by an MQTT export to Debian mosquitto (bench/forward_mqtt.py),
    against the bridge baseline of (a); ``--only mqtt-export`` runs just this comparison, at
    50,000 and ``--records``.

Progress goes to stderr; ``--json`` prints one JSON object per line on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.ackcount import AckCounter
from bench.harness.cpu import cpu_seconds, cpu_user_system
from bench.harness.processes import (
    descriptor_shortfall,
    free_port,
    load_failure,
    mosquitto_bridge_conf,
    say,
    start_cli,
    stop,
)
from bench.health_body import report_body

log = logging.getLogger(__name__)

MOSQUITTO = "/usr/sbin/mosquitto"
MOSQUITTO_PUB = "mosquitto_pub"
MOSQUITTO_SUB = "mosquitto_sub"
SMALL_BRIDGE_BACKLOG = 50_000


@dataclass
class Result:
    """One measured scenario."""

    name: str
    records: int
    seconds: float
    rate: float
    note: str = ""
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # per process, during the run
    details: dict[str, Any] = field(default_factory=dict)  # what else a scenario measured


class LandedCounter:
    """Counts rows in ``<landing>/incoming`` by reading each new file's Parquet footer once."""

    def __init__(self, landing: Path) -> None:
        self.incoming = landing / "incoming"
        self.seen: dict[Path, int] = {}

    def count(self) -> int:
        import pyarrow.parquet as pq

        if self.incoming.is_dir():
            for path in self.incoming.rglob("*.parquet"):
                if path not in self.seen:
                    self.seen[path] = pq.ParquetFile(path).metadata.num_rows
        return sum(self.seen.values())

    def wait_for(self, total: int, timeout: float, progress: Callable[[int], None] | None = None,
                 abort: Callable[[], str | None] | None = None) -> float:
        """Seconds until ``total`` rows are landed (raises TimeoutError after ``timeout``, or
        RuntimeError as soon as ``abort`` returns a reason)."""
        start = time.monotonic()
        last_report = start
        while True:
            n = self.count()
            now = time.monotonic()
            if n >= total:
                return now - start
            reason = abort() if abort is not None else None
            if reason is not None:
                raise RuntimeError(f"{reason} ({n} of {total} rows landed)")
            if now - start > timeout:
                raise TimeoutError(f"only {n} of {total} rows landed after {timeout:.0f} s")
            if progress is not None and now - last_report >= 2:
                progress(n)
                last_report = now
            time.sleep(0.05)


# -- (a) backlog drain ---------------------------------------------------------------------------


def fill_agent_log(data_dir: Path, records: int, size: int) -> None:
    """Append ``records`` records of ``size`` bytes to the agent's log (as the broker would),
    and leave the retained snapshot the broker writes when it stops (no retained message,
    covering the whole log), so the agent starts as after a clean stop instead of replaying
    the whole backlog to rebuild retained messages while it drains."""
    from filemq.queue import Queue, QueueConfig
    from filemq.queue.retained import RetainedStore
    from segments import LogConfig

    queue = Queue.open(data_dir, QueueConfig(log=LogConfig(fsync="never")))
    log_ = queue.log
    payload_base = os.urandom(size)
    ts = time.time_ns() // 1000
    for i in range(records):
        log_.append(f"sensors/s{i % 16}", payload_base[: size - 8] + i.to_bytes(8, "big"), qos=1, timestamp_us=ts + i)
        if i % 50_000 == 49_999:
            log_.flush()
    log_.sync()
    retained = RetainedStore(data_dir)
    retained.advance(log_.committed_offset)
    retained.snapshot()
    log_.close()


def run_drain(work: Path, records: int, size: int, timeout: float) -> Result:
    agent_dir, collector_dir, landing = work / "agent", work / "collector", work / "landing"
    say(f"[drain] filling the agent log with {records:,} records of {size} bytes")
    fill_agent_log(agent_dir, records, size)
    cport, aport = free_port(), free_port()
    config = work / "agent.toml"
    config.write_text("[agent]\nbackoff_initial_ms = 50\nbackoff_max_ms = 250\n[broker]\nsys_interval_s = 0\n")
    agent = start_cli("agent", "--config", str(config), "--data-dir", str(agent_dir), "--device-id", "bench-1",
                    "--collector", f"127.0.0.1:{cport}", "--port", str(aport), log_path=work / "agent.log")
    try:
        time.sleep(1.0)  # the agent is up and backing off: the collector is down
        say("[drain] starting the collector; timing until every row is landed")
        agent_cpu = cpu_seconds(agent.pid)
        launched = time.monotonic()
        collector = start_cli("collector", "--data-dir", str(collector_dir), "--landing", str(landing),
                            "--port", str(cport), "--collector-id", "bench", "--roll-seconds", "1",
                            log_path=work / "collector.log")
        listening = time.monotonic()  # _filemq returns on the "listening" line
        try:
            LandedCounter(landing).wait_for(
                records, timeout, lambda n: say(f"[drain]   {n:,} rows landed")
            )
            done = time.monotonic()
            cpu = {"agent": cpu_seconds(agent.pid) - agent_cpu, "collector": cpu_seconds(collector.pid)}
        finally:
            stop(collector)
    finally:
        stop(agent)
    seconds = done - listening
    say(f"[drain] CPU: agent {cpu['agent']:.2f} s ({records / max(cpu['agent'], 1e-9):,.0f} records per"
         f" CPU-second), collector {cpu['collector']:.2f} s (start-up included)")
    say(f"[drain] {done - launched:.2f} s from launching the collector process,"
         f" {seconds:.2f} s from its 'listening' line (used for the rate; the agent's reconnect"
         " backoff is included)")
    return Result("filemq_drain", records, seconds, records / seconds,
                  "agent -> collector -> landed Parquet, from the collector listening to the last row landed",
                  cpu)


def run_bridge(work: Path, records: int, size: int, timeout: float, bridge_timeout: float = 120,
               mosquitto_extra: str = "", oracle: str = "subscriber", oracle_qos: int = 1) -> Result:
    """Mosquitto -> Mosquitto bridge draining a backlog of ``records`` QoS 1 messages.

    Mosquitto slows down as its per-client queue grows, so the drain is time-boxed to
    ``bridge_timeout`` seconds; if it has not finished by then its rate is what it achieved
    (messages received / seconds since the first one), and the note says so.
    ``oracle``: ``"subscriber"`` counts what a persistent ``mosquitto_sub`` (QoS ``oracle_qos``)
    on the remote receives; ``"puback"`` counts the remote's PUBACKs to the bridge through
    :class:`bench.ackcount.AckCounter` (no subscriber).
    """

    work.mkdir(parents=True, exist_ok=True)
    # Started as root, mosquitto drops to its own user: it must reach and write its store.
    os.chmod(work.parent, 0o755)
    os.chmod(work, 0o777)
    local_port, remote_port = free_port(), free_port()
    remote_conf = mosquitto_bridge_conf(
        work / "remote.conf", remote_port,
        f"persistence true\npersistence_location {work}/\nautosave_interval 0\n{mosquitto_extra}",
    )
    counter = AckCounter(remote_port).start() if oracle == "puback" else None
    bridge = (
        f"connection bench-bridge\naddress 127.0.0.1:{counter.port if counter else remote_port}\n"
        "topic sensors/# out 1\ncleansession false\nrestart_timeout 1\nbridge_protocol_version mqttv311\n"
    )
    local_conf = mosquitto_bridge_conf(work / "local.conf", local_port, mosquitto_extra + bridge)
    devnull = subprocess.DEVNULL

    def mosq(conf: Path) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=devnull, stderr=devnull)
        time.sleep(0.3)
        if proc.poll() is not None:
            raise RuntimeError(f"mosquitto with {conf} exited with {proc.returncode}")
        return proc

    if counter is None:
        # A persistent subscriber session on the remote, saved in its store, so messages the
        # bridge delivers are kept for it even before it reconnects.
        remote = mosq(remote_conf)
        subprocess.run([MOSQUITTO_SUB, "-p", str(remote_port), "-q", str(oracle_qos), "-c", "-i", "bench-sub",
                        "-t", "sensors/#", "-W", "1"], stdout=devnull, stderr=devnull, check=False)
        stop(remote)
    local = mosq(local_conf)
    try:
        lines = work / "messages.txt"
        body = "x" * max(0, size - 12)
        with open(lines, "w") as f:
            for i in range(records):
                f.write(f"{body}{i:012d}\n")
        say(f"[bridge] queueing {records:,} QoS 1 messages in the local mosquitto (remote down)")
        with open(lines, "rb") as stdin:
            subprocess.run([MOSQUITTO_PUB, "-p", str(local_port), "-q", "1", "-t", "sensors/s", "-l"],
                           stdin=stdin, stdout=devnull, stderr=devnull, check=True, timeout=timeout)
        say("[bridge] starting the remote mosquitto; timing until "
             + ("it acknowledged every message" if counter else "the subscriber has every message"))
        local_cpu = cpu_seconds(local.pid)
        start = time.monotonic()
        remote = mosq(remote_conf)
        try:
            if counter is not None:
                counter.wait(records, bridge_timeout)
                if counter.first is None:
                    raise RuntimeError("the remote acknowledged nothing from the bridge")
                first, received, end = counter.first, min(counter.acks, records), time.monotonic()
                if received >= records and counter.last is not None:
                    end = counter.last
                cpu = {"local_mosquitto": cpu_seconds(local.pid) - local_cpu,
                       "remote_mosquitto": cpu_seconds(remote.pid)}
            else:
                sub = subprocess.Popen(
                    [MOSQUITTO_SUB, "-p", str(remote_port), "-q", str(oracle_qos), "-c", "-i", "bench-sub",
                     "-t", "sensors/#", "-C", str(records), "-W", str(int(bridge_timeout))],
                    stdout=subprocess.PIPE, stderr=devnull,
                )
                first, received, sub_cpu = count_received(sub, "the bridge")
                end = time.monotonic()
                cpu = {"local_mosquitto": cpu_seconds(local.pid) - local_cpu,
                       "remote_mosquitto": cpu_seconds(remote.pid), "subscriber": sub_cpu}
            seconds = end - start
            from_first = end - first
        finally:
            stop(remote)
    finally:
        if counter is not None:
            counter.stop()
        stop(local)
    what = "PUBACK" if counter else "message"
    say(f"[bridge] {received:,} of {records:,} messages; {seconds:.2f} s from the remote's start,"
         f" {from_first:.2f} s from the first {what} (the baseline uses the latter: mosquitto's"
         " bridge reconnect delay is not counted)")
    note = ("local -> bridge -> remote, from the remote's first PUBACK" if counter else
            f"local -> bridge -> remote -> QoS {oracle_qos} subscriber, from the first message received")
    if received < records:
        note += f"; TIMED OUT after {bridge_timeout:.0f} s with {received} of {records} received"
    return Result("mosquitto_bridge_drain", received, from_first, received / from_first, note, cpu)


def count_received(sub: subprocess.Popen[bytes], source: str) -> tuple[float, int, float]:
    """Read a ``mosquitto_sub`` (one line per message) to its end: the monotonic time of the
    first message, how many arrived and the subscriber's CPU seconds (read at its end of output,
    before it is reaped). Raises when nothing came from ``source``."""
    assert sub.stdout is not None
    first: float | None = None
    received = 0
    for _ in sub.stdout:
        if first is None:
            first = time.monotonic()
        received += 1
    sub_cpu = cpu_seconds(sub.pid)
    sub.wait(30)
    if first is None:
        raise RuntimeError(f"mosquitto_sub received nothing from {source}")
    return first, received, sub_cpu


# -- (b) many devices ------------------------------------------------------------------------------


_GOLDEN = 0.6180339887498949  # spreads the devices' report phases evenly over an interval


def _device_load(port: int, devices: range, batches: int, batch_records: int, size: int,
                 window: int, ready: Any, go: Any, done: Any, errors: Any,
                 health_interval_s: float | None = None, reports_sent: Any = None,
                 health_start: str = "steady", window_end: Any = None) -> None:
    """One load process: a connection per device, each sending its pre-encoded batches.

    With ``health_interval_s``, each device also sends health reports as an agent does
    (QoS 0 on its own topic, :mod:`filemq.upstream.health`) every interval (until its batches
    are acknowledged, or with ``window_end`` until then, see below); the count of those sent after ``go`` (the measured window) goes to
    ``reports_sent``. ``health_start`` says when the first one goes: ``steady`` (a fleet that
    has been running): right after the device's connect, before the clock starts, as an agent
    sends it, and the next at a phase of the interval of its own (spread evenly over the
    devices), so the window holds the reports of ``seconds / interval`` intervals, at the
    steady rate of ``devices / interval`` per second; ``reconnect`` (a fleet that has just
    reconnected): every device's first report as it starts sending, at the start of the window,
    so the window holds one interval's worth of reports however short it is. With
    ``window_end`` (an event the bench sets when its clock stops) every device, reporting or
    not, stays connected, and a reporting one reports, until then, as in a running fleet (no
    disconnects in the window); without it a device stops reporting and disconnects once its
    batches are acknowledged.
    If devices cannot connect (or lose their connection), one line saying how many and why
    goes to ``errors`` and the process ends: the bench fails at once instead of waiting.
    """
    from filemq.mqtt.client import MQTTClient
    from filemq.upstream.batch import BatchRecord, encode_batch
    from filemq.upstream.health import encode_health, health_topic

    shortfall = descriptor_shortfall(len(devices))
    if shortfall is not None:
        errors.put(shortfall)
        return
    payload = os.urandom(size)
    now = time.time_ns() // 1000
    prepared: dict[int, list[bytes]] = {}
    for d in devices:
        prepared[d] = [
            encode_batch(f"dev-{d}", "main", [BatchRecord(b * batch_records + i, now + i, f"sensors/s{i % 8}",
                                                          payload, 1) for i in range(batch_records)])
            for b in range(batches)
        ]
    reports = 0

    def send_report(d: int, client: MQTTClient, seq: int) -> None:
        report = encode_health(f"dev-{d}", time.time_ns() // 1000, seq, report_body(seq))
        client.publish_nowait(health_topic(f"dev-{d}"), report, qos=0)

    window_over = asyncio.Event() if window_end is not None else None  # set once window_end is

    async def reporter(d: int, client: MQTTClient, stop: asyncio.Event, interval: float) -> None:
        nonlocal reports
        seq = 1
        if health_start == "steady":
            seq = 2  # (the first followed the connect)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval * ((d * _GOLDEN) % 1.0))
        while not stop.is_set() and not (window_over is not None and window_over.is_set()):
            send_report(d, client, seq)
            reports += 1
            seq += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def device(d: int, client: MQTTClient) -> None:
        stop = asyncio.Event()
        task = (asyncio.create_task(reporter(d, client, stop, health_interval_s))
                if health_interval_s else None)
        try:
            futures = [client.publish_nowait(f"filemq/v1/dev-{d}/main", p, qos=1) for p in prepared[d]]
            await asyncio.gather(*futures)
            if window_over is not None:
                await window_over.wait()
        finally:
            stop.set()
            if task is not None:
                await task
        await client.disconnect()

    def report(what: str, results: list[BaseException | None]) -> bool:
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            errors.put(f"{len(failed)} of {len(results)} devices {what}, e.g. {failed[0]!r}")
        return bool(failed)

    async def main() -> None:
        clients = {d: MQTTClient(f"dev-{d}", port=port, max_inflight=window, keepalive=120) for d in devices}
        # A few connects at a time, each tried up to 5 times: on a busy machine a burst of
        # thousands of CONNECTs can have sockets closed by the collector's admission control
        # (broker.max_connecting), and the connect storm is not what this run measures
        # (bench forward --only storm is).
        gate = asyncio.Semaphore(32)

        async def connect(d: int, client: MQTTClient) -> None:
            async with gate:
                for attempt in range(5):
                    try:
                        await client.connect(timeout=30)
                        if health_interval_s and health_start == "steady":
                            send_report(d, client, 1)  # as an agent's, before the clock
                        return
                    except Exception:
                        if attempt == 4:
                            raise
                        await asyncio.sleep(0.2)

        connected = await asyncio.gather(*(connect(d, c) for d, c in clients.items()), return_exceptions=True)
        if report("could not connect to the collector", [r if isinstance(r, BaseException) else None
                                                           for r in connected]):
            await asyncio.gather(*(c.disconnect(timeout=1) for c in clients.values()), return_exceptions=True)
            return
        ready.set()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, go.wait)
        if window_over is not None:
            over = window_over
            loop.run_in_executor(None, window_end.wait).add_done_callback(lambda _: over.set())
        sent = await asyncio.gather(*(device(d, c) for d, c in clients.items()), return_exceptions=True)
        if not report("failed while sending", sent):
            if reports_sent is not None:
                reports_sent.put(reports)
            done.set()

    asyncio.run(main())


DEVICES_HINT = ("; the collector's log says how many connections it serves ('serving up to N device"
                " connections'): raise its --max-connections or the file-descriptor limit (ulimit -n)")


def _sample_api(url: str, interval: float, warm: Any, go: Any, stop: Any, out: Any) -> None:
    """A process of its own (no GIL shared with the bench's landing counter): one GET of ``url``
    before ``go`` (the first request of a collector builds the body: its time is reported apart,
    as ``cold``), then one every ``interval`` s from ``go`` until ``stop``; puts
    ``(wall times in ms, cold ms, failures, bytes of the last answer)`` (gzip accepted, as by
    the /fleet page and ``filemq fleet``)."""
    import urllib.request

    ms: list[float] = []
    failures, size, cold = 0, 0, None
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})  # as the page and `filemq fleet`
    while not stop.is_set():
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                size = len(resp.read())
            took = (time.perf_counter() - started) * 1000
            if cold is None:
                cold = took
            else:
                ms.append(took)
        except OSError:
            failures += 1
        if not warm.is_set():
            warm.set()
            go.wait()
        else:
            stop.wait(interval)
    out.put((ms, cold, failures, size))


def run_devices(work: Path, devices: int, records: int, size: int, timeout: float,
                collector_args: tuple[str, ...] = (), *, batch_records: int = 1000,
                health_interval_s: float | None = None, api_interval_s: float | None = None,
                health_start: str = "steady") -> Result:
    """(b): ``devices`` connections send ``records`` rows (at least a batch each) to one
    collector; the clock and the collector's CPU seconds run from the moment all are connected
    until every row is landed. With ``health_interval_s`` the devices also send health reports
    (:func:`_device_load`, ``health_start`` as there: ``steady`` keeps every device connected
    until the clock stops, with or without reports); with ``api_interval_s`` the collector's
    ``/api/fleet`` is fetched that often while they send. The figures beyond the rate are in the result's ``details``."""
    landing, data = work / "landing", work / "collector"
    per_device = max(1, records // devices // batch_records)
    total = per_device * batch_records * devices
    port = free_port()
    ops = free_port() if api_interval_s else None
    collector = start_cli("collector", "--data-dir", str(data), "--landing", str(landing), "--port", str(port),
                        "--collector-id", "bench", "--roll-seconds", "1", *collector_args,
                        *(("--metrics-port", str(ops)) if ops else ()), log_path=work / "collector.log")
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    window_end = ctx.Event() if health_start == "steady" else None
    errors = ctx.Queue()
    reports_sent = ctx.Queue()
    procs = []
    sampler, sampler_warm, sampler_stop, sampled = None, ctx.Event(), ctx.Event(), ctx.Queue()
    details: dict[str, Any] = {"health_interval_s": health_interval_s, "batch_records": batch_records,
                               "health_start": health_start if health_interval_s else None}
    try:
        halves = [range(0, devices // 2), range(devices // 2, devices)]
        waits = []
        events = []  # kept referenced until the children are done (spawn unpickles them late)
        for part in halves:
            ready, done = ctx.Event(), ctx.Event()
            events.append((ready, done))
            p = ctx.Process(target=_device_load,
                            args=(port, part, per_device, batch_records, size, 4, ready, go, done, errors,
                                  health_interval_s, reports_sent, health_start, window_end))
            p.start()
            procs.append(p)
            waits.append(ready)
        say(f"[devices] preparing {devices} devices x {per_device} batches of {batch_records} records"
             + (f", health reports every {health_interval_s:g} s" if health_interval_s else ", no health reports"))
        deadline = time.monotonic() + timeout
        while not all(ready.is_set() for ready in waits):
            failure = load_failure(procs, errors)
            if failure is not None:
                raise RuntimeError(failure + DEVICES_HINT)
            if time.monotonic() > deadline:
                raise TimeoutError("load processes did not get ready")
            waits[0].wait(0.1)
        if ops and api_interval_s:
            sampler = ctx.Process(target=_sample_api, args=(f"http://127.0.0.1:{ops}/api/fleet", api_interval_s,
                                                            sampler_warm, go, sampler_stop, sampled))
            sampler.start()
            if not sampler_warm.wait(60):
                raise TimeoutError("the /api/fleet sampler did not make its first request")
        say(f"[devices] {devices} connections up; sending {total:,} records")
        details["loadavg_start"] = round(os.getloadavg()[0], 2)
        user0, system0 = cpu_user_system(collector.pid)
        start = time.monotonic()
        go.set()
        LandedCounter(landing).wait_for(total, timeout, lambda n: say(f"[devices]   {n:,} rows landed"),
                                        abort=lambda: load_failure(procs, errors))
        seconds = time.monotonic() - start
        user1, system1 = cpu_user_system(collector.pid)
        if window_end is not None:
            window_end.set()  # (the devices report and stay connected until here)
        cpu = user1 - user0 + system1 - system0
        # System time (socket and disk work in the kernel) moves most between runs here.
        details["collector_user_s"] = round(user1 - user0, 2)
        details["collector_system_s"] = round(system1 - system0, 2)
        details["loadavg_end"] = round(os.getloadavg()[0], 2)
        if sampler is not None:
            sampler_stop.set()
            ms, cold, failures, size = sampled.get(timeout=60)
            details.update(_latencies(ms), api_fleet_failures=failures, api_fleet_bytes=size,
                           api_fleet_cold_ms=None if cold is None else round(cold, 1),
                           api_fleet_ms_all=[round(x, 1) for x in ms])
        for _, done in events:
            done.wait(30)
        details["health_reports"] = sum(reports_sent.get(timeout=30) for _ in procs)
        if ops and health_interval_s:
            # The body may be up to its build interval old (collector.ops): ask until it shows
            # every device with a report, for 15 s at most.
            check_by = time.monotonic() + 15
            while True:
                body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{ops}/api/fleet", timeout=30).read())
                reported = sum(1 for d in body["devices"] if d.get("last_report"))
                if body["counts"]["total"] == devices and reported == devices:
                    break
                if time.monotonic() > check_by:
                    raise RuntimeError(f"/api/fleet holds {body['counts']['total']} devices, {reported} with a"
                                       f" report, not {devices}")
                time.sleep(0.5)
    finally:
        sampler_stop.set()
        go.set()
        if window_end is not None:
            window_end.set()
        if sampler is not None:
            procs.append(sampler)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        stop(collector)
    return Result("collector_devices", total, seconds, total / seconds,
                  f"{devices} devices, batches of {batch_records}, window 4, landed Parquet"
                  + (f", health reports every {health_interval_s:g} s" if health_interval_s else ""),
                  {"collector": cpu}, details)


def _latencies(ms: list[float]) -> dict[str, Any]:
    """Median, 99th percentile and maximum of request times (ms), and how many."""
    if not ms:
        return {"api_fleet_samples": 0}
    p99 = statistics.quantiles(ms, n=100, method="inclusive")[98] if len(ms) > 1 else ms[0]
    return {"api_fleet_samples": len(ms), "api_fleet_ms_p50": round(statistics.median(ms), 1),
            "api_fleet_ms_p99": round(p99, 1), "api_fleet_ms_max": round(max(ms), 1)}


def run_devices_health(work: Path, *, devices: int, records: int, size: int, timeout: float, repeat: int,
                       health_interval_s: float, api_interval_s: float | None, batch_records: int = 1000,
                       emit: Callable[[Result], None] | None = None, health_start: str = "steady") -> dict[str, Any]:
    """What health reporting costs the collector (issue 32): :func:`run_devices` ``repeat``
    times without and with reports, alternating (ABBA: without-with, then with-without, ...,
    so a drift of the machine's load falls on both alike), ``/api/fleet`` sampled in every run.
    Returns the summary: the collector's CPU µs per landed row without and with (medians) and
    their ratio (target < 1.05), the ratio of each pair, the reports sent per landed row, the
    CPU µs a report costs (the medians' difference per report), /api/fleet p50/p99/max while
    the devices send, and the load averages. ``health_start``: :func:`_device_load`."""
    runs: list[tuple[bool, Result]] = []
    for i in range(repeat):
        order = (False, True) if i % 2 == 0 else (True, False)
        for health in order:
            name = f"{'with' if health else 'without'}-health-{i}"
            say(f"[devices] pair {i + 1}/{repeat}: {name}")
            result = run_devices(work / name, devices, records, size, timeout, batch_records=batch_records,
                                 health_interval_s=health_interval_s if health else None,
                                 api_interval_s=api_interval_s, health_start=health_start)
            result.name = "collector_devices_health" if health else "collector_devices"
            runs.append((health, result))
            d = result.details
            say(f"[devices]   {result.records:,} rows in {result.seconds:.1f} s, collector"
                 f" {result.cpu_seconds['collector']:.2f} CPU s (user {d['collector_user_s']}) ="
                 f" {_us_per_row(result):.3f} µs/row,"
                 f" {d['health_reports']:,} health reports; /api/fleet p50 {d.get('api_fleet_ms_p50')} ms,"
                 f" p99 {d.get('api_fleet_ms_p99')} ms, max {d.get('api_fleet_ms_max')} ms over"
                 f" {d.get('api_fleet_samples', 0)} requests while they send (the first, before: {d.get('api_fleet_cold_ms')}"
                 f" ms); load average {d['loadavg_start']}-{d['loadavg_end']}")
            if emit is not None:
                emit(result)
    without = [r for h, r in runs if not h]
    with_ = [r for h, r in runs if h]
    off = statistics.median(_us_per_row(r) for r in without)
    on = statistics.median(_us_per_row(r) for r in with_)
    reports = statistics.median(r.details["health_reports"] for r in with_)
    rows = with_[0].records
    summary: dict[str, Any] = {
        "name": "health_cost", "devices": devices, "records": rows, "batch_records": batch_records,
        "health_interval_s": health_interval_s, "health_start": health_start, "repeat": repeat,
        "cpu_us_per_row_without": round(off, 3), "cpu_us_per_row_with": round(on, 3),
        "cpu_ratio": round(on / off, 3) if off else None,
        "user_cpu_ratio": _ratio(statistics.median(r.details["collector_user_s"] / r.records for r in with_),
                                 statistics.median(r.details["collector_user_s"] / r.records for r in without)),
        "pair_ratios": [round(_us_per_row(b) / _us_per_row(a), 3) for a, b in zip(without, with_, strict=True)
                        if _us_per_row(a)],
        "reports_per_row": round(reports / rows, 6),
        "cpu_us_per_report": round((on - off) * rows / reports, 1) if reports else None,
        "seconds_median": round(statistics.median(r.seconds for _, r in runs), 1),
        "loadavg": [r.details["loadavg_start"] for _, r in runs] + [runs[-1][1].details["loadavg_end"]],
        "cpus": os.cpu_count(), "python": sys.version.split()[0],
    }
    for label, group in (("with", with_), ("without", without)):
        samples = [ms for r in group for ms in r.details.pop("api_fleet_ms_all", [])]
        summary.update({f"{k}_{label}": v for k, v in _latencies(samples).items()})
        colds = [r.details["api_fleet_cold_ms"] for r in group if r.details.get("api_fleet_cold_ms") is not None]
        summary[f"api_fleet_cold_ms_max_{label}"] = max(colds, default=None)
    say(f"[devices] health reports ({health_start}) cost x{summary['cpu_ratio']} collector CPU per landed row"
         " (target < 1.05;"
         f" pairs {summary['pair_ratios']}; user CPU alone x{summary['user_cpu_ratio']}) at {summary['reports_per_row']} reports per row"
         f" (~{summary['cpu_us_per_report']} µs per report); /api/fleet at {devices} devices while they send:"
         f" p50 {summary.get('api_fleet_ms_p50_with')} ms, p99 {summary.get('api_fleet_ms_p99_with')} ms,"
         f" max {summary.get('api_fleet_ms_max_with')} ms over {summary.get('api_fleet_samples_with')} requests"
         " (target < 200 ms)")
    return summary


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _us_per_row(result: Result) -> float:
    return result.cpu_seconds["collector"] / result.records * 1e6


# -- (c) the broker's durable ingest rate --------------------------------------------------------


def _ingest_load(port: int, publishers: int, inflight: int, count: int, size: int, out: Any) -> None:
    from filemq.mqtt.client import MQTTClient

    payload = os.urandom(size)

    async def one(i: int, n: int) -> None:
        client = MQTTClient(f"ingest-{i}", port=port, max_inflight=inflight)
        await client.connect()
        futures = [client.publish_nowait(f"sensors/s{i}", payload, qos=1) for _ in range(n)]
        await asyncio.gather(*futures)
        await client.disconnect()

    async def main() -> float:
        start = time.monotonic()
        await asyncio.gather(*(one(i, count // publishers) for i in range(publishers)))
        return time.monotonic() - start

    out.put(asyncio.run(main()))


def run_ingest(work: Path, records: int, size: int, timeout: float) -> Result:
    port = free_port()
    broker = start_cli("broker", "--data-dir", str(work / "broker"), "--port", str(port), "--fsync", "always",
                     log_path=work / "broker.log")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    try:
        publishers, inflight = 4, 100
        count = records - records % publishers
        say(f"[ingest] {publishers} publishers x {inflight} in flight, {count:,} QoS 1 messages, fsync always")
        p = ctx.Process(target=_ingest_load, args=(port, publishers, inflight, count, size, out))
        p.start()
        seconds = float(out.get(timeout=timeout))
        p.join(30)
    finally:
        stop(broker)
    return Result("broker_durable_ingest", count, seconds, count / seconds,
                  "filemq broker, QoS 1, fsync=always, 4 x 100 in flight")


# -- the command ---------------------------------------------------------------------------------
