"""``filemq bench fleet``: what health reporting costs the collector, and how fast /api/fleet is.

``--devices`` simulated devices (MQTT connections from two load processes, as ``filemq bench
forward``'s many-devices run) each send their batches to one collector; the run is done twice
in alternation, *without* health reports and *with* them (one at connect, then one every
``--health-interval-s`` while the device sends, as an agent does), ``--repeat`` times. For
each run: the collector's CPU seconds (user + system, /proc) from the moment every device is
connected until every row is landed, divided by the rows landed; the ratio with/without is the health
cost (target < 1.05). After each run with reports, ``/api/fleet`` of the registry then holding
``--devices`` devices is fetched ``--api-samples`` times (median and max wall time, target
< 200 ms) and ``/metrics`` once.

A short run sends few reports per device; ``--health-interval-s`` below the default 30 makes
the reports per record as many as a longer run at 30 s would (the summary says how many
reports per landed record were sent, so the ratio can be read against a real fleet's).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.forward import LandedCounter
from bench.harness.cpu import cpu_seconds
from bench.harness.processes import free_port, load_failure, say, start_cli, stop


@dataclass
class FleetRun:
    health: bool
    devices: int
    records: int
    seconds: float
    collector_cpu_s: float
    cpu_us_per_record: float
    reports_sent: int
    api_fleet_ms_median: float | None = None
    api_fleet_ms_max: float | None = None
    api_fleet_bytes: int | None = None
    metrics_ms: float | None = None


def _load(port: int, devices: range, batches: int, batch_records: int, size: int, health_interval_s: float | None,
          ready: Any, go: Any, done: Any, errors: Any, sent_reports: Any) -> None:
    """One load process: a connection per device sending its pre-encoded batches (window 4),
    and with ``health_interval_s`` a health report when it starts sending (an agent sends one
    right after connecting; the connects are outside the measured span) and every interval
    until its batches are acknowledged."""
    import asyncio

    from filemq.mqtt.client import MQTTClient
    from filemq.ops.fdlimit import raise_nofile_limit
    from filemq.upstream.batch import BatchRecord, encode_batch
    from filemq.upstream.health import encode_health, health_topic

    raise_nofile_limit()
    payload = os.urandom(size)
    now = time.time_ns() // 1000
    prepared = {d: [encode_batch(f"dev-{d}", "main", [BatchRecord(b * batch_records + i, now + i, f"s/{i % 8}",
                                                                  payload, 1) for i in range(batch_records)])
                    for b in range(batches)] for d in devices}
    reports = 0

    def report(d: int, seq: int) -> bytes:
        body = {"agent_version": "bench", "build": "pure", "uptime_s": 1.0, "interval_s": 30,
                "log_bytes": 10 << 20, "disk_free_bytes": 8 << 30, "clients_connected": 3,
                "messages_received": seq * 100, "messages_dropped": 0, "oversized_skipped": 0,
                "exports": [{"name": "collector", "kind": "filemq", "state": "connected", "lag_records": 1000,
                             "lag_bytes": 100_000, "oldest_unacked_age_s": 1.5, "records_acked": seq,
                             "lost_records": 0, "oversized_skipped": 0}]}
        return encode_health(f"dev-{d}", time.time_ns() // 1000, seq, body)

    async def reporter(d: int, client: MQTTClient, stop: asyncio.Event) -> None:
        nonlocal reports
        seq = 1
        assert health_interval_s is not None
        while not stop.is_set():
            client.publish_nowait(health_topic(f"dev-{d}"), report(d, seq), qos=0)
            reports += 1
            seq += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), health_interval_s)

    async def device(d: int, client: MQTTClient) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(reporter(d, client, stop)) if health_interval_s else None
        await asyncio.gather(*(client.publish_nowait(f"filemq/v1/dev-{d}/main", p, qos=1) for p in prepared[d]))
        stop.set()
        if task is not None:
            await task
        await client.disconnect()

    async def main() -> None:
        nonlocal reports
        clients = {d: MQTTClient(f"dev-{d}", port=port, max_inflight=4, keepalive=120) for d in devices}
        # A few connects at a time: the collector closes the oldest half-open socket beyond
        # broker.max_connecting (128), and the connect storm is not what this bench measures.
        gate = asyncio.Semaphore(32)

        async def connect(client: MQTTClient) -> None:
            async with gate:
                for attempt in range(5):
                    try:
                        await client.connect(timeout=60)
                        return
                    except Exception:
                        if attempt == 4:
                            raise
                        await asyncio.sleep(0.2)

        results = await asyncio.gather(*(connect(c) for c in clients.values()), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            errors.put(f"{len(failed)} of {len(results)} devices could not connect, e.g. {failed[0]!r}")
            return
        await ready_wait()
        sent = await asyncio.gather(*(device(d, c) for d, c in clients.items()), return_exceptions=True)
        failed = [r for r in sent if isinstance(r, BaseException)]
        if failed:
            errors.put(f"{len(failed)} devices failed while sending, e.g. {failed[0]!r}")
            return
        sent_reports.put(reports)
        done.set()

    async def ready_wait() -> None:
        ready.set()
        await asyncio.get_running_loop().run_in_executor(None, go.wait)

    asyncio.run(main())


def _get_ms(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as resp:
        body = resp.read()
    return (time.perf_counter() - started) * 1000, len(body)


def run_once(work: Path, devices: int, records: int, batch_records: int, size: int,
             health_interval_s: float | None, api_samples: int, timeout: float) -> FleetRun:
    landing = work / "landing"
    per_device = max(1, records // devices // batch_records)
    total = per_device * batch_records * devices
    port, ops = free_port(), free_port()
    collector = start_cli("collector", "--data-dir", str(work / "collector"), "--landing", str(landing),
                        "--port", str(port), "--collector-id", "bench", "--roll-seconds", "1",
                        "--metrics-port", str(ops), log_path=work / "collector.log")
    ctx = multiprocessing.get_context("spawn")
    go, errors, sent_reports = ctx.Event(), ctx.Queue(), ctx.Queue()
    procs, events = [], []
    run = FleetRun(health_interval_s is not None, devices, total, 0.0, 0.0, 0.0, 0)
    try:
        for part in (range(0, devices // 2), range(devices // 2, devices)):
            ready, done = ctx.Event(), ctx.Event()
            events.append((ready, done))
            p = ctx.Process(target=_load, args=(port, part, per_device, batch_records, size, health_interval_s, ready, go, done,
                                                errors, sent_reports))
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        while not all(ready.is_set() for ready, _ in events):
            failure = load_failure(procs, errors)
            if failure is not None:
                raise RuntimeError(failure)
            if time.monotonic() > deadline:
                raise TimeoutError("load processes did not get ready")
            time.sleep(0.1)
        cpu0 = cpu_seconds(collector.pid)
        start = time.monotonic()
        go.set()
        LandedCounter(landing).wait_for(total, timeout, abort=lambda: load_failure(procs, errors))
        run.seconds = time.monotonic() - start
        run.collector_cpu_s = cpu_seconds(collector.pid) - cpu0
        run.cpu_us_per_record = run.collector_cpu_s / total * 1e6
        for _, done in events:
            done.wait(30)
        run.reports_sent = sum(sent_reports.get(timeout=30) for _ in procs)
        if health_interval_s is not None:
            samples = [_get_ms(f"http://127.0.0.1:{ops}/api/fleet") for _ in range(api_samples)]
            run.api_fleet_ms_median = round(statistics.median(ms for ms, _ in samples), 1)
            run.api_fleet_ms_max = round(max(ms for ms, _ in samples), 1)
            run.api_fleet_bytes = samples[-1][1]
            body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{ops}/api/fleet", timeout=30).read())
            if body["counts"]["total"] != devices:
                raise RuntimeError(f"/api/fleet holds {body['counts']['total']} devices, not {devices}")
            run.metrics_ms = round(_get_ms(f"http://127.0.0.1:{ops}/metrics")[0], 1)
    finally:
        go.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        stop(collector)
    return run


def run_fleet_bench(*, devices: int, records: int, batch_records: int, size: int, health_interval_s: float,
                    repeat: int,
                    api_samples: int, work_dir: str | None, as_json: bool, timeout: float = 600) -> dict[str, Any]:
    base = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="filemq-bench-fleet-"))
    runs: list[FleetRun] = []
    for i in range(repeat):
        for health in (False, True):
            name = f"{'with' if health else 'without'}-health-{i}"
            say(f"[fleet] run {i + 1}/{repeat} {name}: {devices} devices, {records:,} records")
            run = run_once(base / name, devices, records, batch_records, size,
                           health_interval_s if health else None, api_samples, timeout)
            runs.append(run)
            if as_json:
                print(json.dumps({"run": name, **asdict(run)}), flush=True)
            else:
                say(f"[fleet]   {run.records:,} rows in {run.seconds:.1f} s, collector {run.collector_cpu_s:.2f} CPU s"
                     f" = {run.cpu_us_per_record:.2f} µs/row, {run.reports_sent:,} health reports"
                     + (f"; /api/fleet median {run.api_fleet_ms_median} ms, max {run.api_fleet_ms_max} ms,"
                        f" {run.api_fleet_bytes:,} bytes" if health else ""))
    off = statistics.median(r.cpu_us_per_record for r in runs if not r.health)
    on = statistics.median(r.cpu_us_per_record for r in runs if r.health)
    with_health = [r for r in runs if r.health]
    summary = {
        "devices": devices, "records": runs[0].records, "batch_records": batch_records, "health_interval_s": health_interval_s, "repeat": repeat,
        "cpu_us_per_record_without": round(off, 3), "cpu_us_per_record_with": round(on, 3),
        "cpu_ratio": round(on / off, 3) if off else None,
        "reports_per_record": round(statistics.median(r.reports_sent / r.records for r in with_health), 5),
        "api_fleet_ms_median": statistics.median(r.api_fleet_ms_median or 0 for r in with_health),
        "api_fleet_ms_max": max(r.api_fleet_ms_max or 0 for r in with_health),
        "metrics_ms": max(r.metrics_ms or 0 for r in with_health),
        "cpus": os.cpu_count(), "python": sys.version.split()[0],
    }
    if as_json:
        print(json.dumps({"summary": summary}), flush=True)
    else:
        say(f"[fleet] health reports cost x{summary['cpu_ratio']} collector CPU per landed row (target < 1.05) at"
             f" {summary['reports_per_record']} reports per row; /api/fleet at {devices} devices: median"
             f" {summary['api_fleet_ms_median']} ms, max {summary['api_fleet_ms_max']} ms (target < 200 ms)")
    return summary
