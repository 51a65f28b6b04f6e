"""Instruction counts (valgrind callgrind "Ir") of the collector's work for one health report
(issue 32): everything a report costs a running collector, in one process, which neither
machine load nor socket timing moves.

    PYTHONPATH=$PWD python -m bench.callgrind_health REPORTS name=/tree [name=/tree ...]
    DEVICES=500 PYTHONPATH=$PWD python -m bench.callgrind_health 2000 main=$PWD

A real :class:`collector.server.Collector` (WAL with ``fsync never``, lander, fleet registry)
starts on loopback; ``DEVICES`` (100) devices connect and send one batch of 10 records each
(so the registry holds them, as in a fleet); then ``REPORTS`` health reports, pre-encoded
PUBLISH packets (QoS 0), are written in rounds of one per device, each round taken by the door
before the next (a report arrives alone, as at every interval); then the collector stops (the
lander lands the fleet events, the registry is saved). Prints the Ir with ``REPORTS`` reports and with none
and the difference per report: the door (MQTT decode, CRC and JSON check), the registry, the
WAL record and its commit, the lander's fleet_events row and the share of the saves.
With ``ROWS`` (0), the devices also send that many rows (batches of 1,000 records of 100
bytes, one per device per round, with the reports) in both runs, and a third run without
them gives the Ir per landed row, so a report can be read as a number of rows.
``PYTHONHASHSEED=0``; valgrind ~50x slower (2,000 reports: about a minute per run). A tree
measured needs bench/health_body.py (copy it into an older one).
"""
from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

ENCODED = 4000  # reports always encoded (sent or not), so encoding is the same in both runs


async def _run(reports: int) -> None:
    from bench.health_body import report_body
    from collector.server import Collector
    from filemq.common.config import load_config
    from filemq.mqtt.client import MQTTClient
    from filemq.mqtt.codec import publish_bytes
    from filemq.upstream.batch import BatchRecord, encode_batch
    from filemq.upstream.health import encode_health, health_topic

    devices = int(os.environ.get("DEVICES", "100"))
    rows = int(os.environ.get("ROWS", "0"))  # encoded always; sent unless SEND_ROWS=0
    send_rows = os.environ.get("SEND_ROWS", "1") == "1"
    work = Path(tempfile.mkdtemp(prefix="cg-health-"))
    config = load_config(None, {"data_dir": str(work / "data"), "collector.landing": str(work / "landing"),
                                "collector.port": 0, "collector.collector_id": "cg", "log.fsync": "never",
                                "log.min_free_bytes": 0, "collector.roll_seconds": 3600})
    wire = [publish_bytes(health_topic(f"dev-{i % devices}"),
                          encode_health(f"dev-{i % devices}", 1_000_000 + i, i + 1, report_body(i)), 0, False, None)
            for i in range(ENCODED)]
    per_device = rows // devices // 1000
    batches = [[encode_batch(f"dev-{d}", "main", [BatchRecord(10 + b * 1000 + i, 1, f"s/{i % 8}", b"x" * 100, 1)
                                                  for i in range(1000)]) for b in range(per_device)]
               for d in range(devices)]
    collector = Collector(config)
    await collector.start()
    clients = [MQTTClient(f"dev-{d}", port=collector.port) for d in range(devices)]
    for c in clients:
        await c.connect()
    for d, c in enumerate(clients):
        await c.publish(f"filemq/v1/dev-{d}/main", encode_batch(f"dev-{d}", "main", [
            BatchRecord(i, 1, "t", b"x" * 100, 1) for i in range(10)]), qos=1)
    # In rounds of one report (and with ROWS one batch) per device, each round taken by the
    # door before the next: a device's report arrives alone, as it does every interval.
    sent = per_device if send_rows else 0
    acks: list[asyncio.Future[None]] = []
    for r in range(max(-(-reports // devices), sent)):
        first = r * devices
        for i in range(first, min(first + devices, reports)):
            writer = clients[i % devices]._writer
            assert writer is not None
            writer.write(wire[i])
        if r < sent:
            acks += [c.publish_nowait(f"filemq/v1/dev-{d}/main", batches[d][r], qos=1) for d, c in enumerate(clients)]
        for _ in range(60_000):
            if collector.stats.health_reports >= min(first + devices, reports):
                break
            await asyncio.sleep(0.001)
        await asyncio.gather(*acks)
    assert collector.stats.health_reports == reports, collector.stats
    rows_sent = sent * devices * 1000
    for _ in range(120_000):  # every row landed (the lander rolls by size; the rest at stop)
        if collector.lander is not None and collector.lander.stats.rows_landed + collector.lander.stats.buffered_rows \
                >= rows_sent + devices * 10:
            break
        await asyncio.sleep(0.001)
    lander = collector.lander
    assert lander is not None
    for _ in range(60_000):  # the lander has read them from the WAL (it lands them at stop)
        if lander.stats.buffered_events + lander.stats.events_landed >= reports + devices:
            break
        await asyncio.sleep(0.001)
    for c in clients:
        await c.disconnect()
    await collector.stop()
    assert lander.stats.events_landed >= reports + devices, lander.stats


def _ir(tree: Path, reports: int) -> int:
    from bench.valgrind import callgrind_ir  # (the outer process only: see bench/valgrind.py)

    return callgrind_ir(__file__, tree, reports, system_malloc=False)


def main() -> None:
    if sys.argv[1] == "--inner":
        sys.path.insert(0, os.environ["PYTHONPATH"])
        asyncio.run(_run(int(sys.argv[2])))
        return
    reports = int(sys.argv[1])
    assert reports <= ENCODED, f"at most {ENCODED} reports"
    rows = int(os.environ.get("ROWS", "0"))
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        loaded, idle = _ir(Path(path), reports), _ir(Path(path), 0)
        line = f"{name} reports={reports} Ir={loaded:,} idle={idle:,} per report={(loaded - idle) / reports:,.0f}"
        if rows:
            os.environ["SEND_ROWS"] = "0"
            try:
                quiet = _ir(Path(path), 0)
            finally:
                del os.environ["SEND_ROWS"]
            sent = rows // int(os.environ.get("DEVICES", "100")) // 1000 * int(os.environ.get("DEVICES", "100")) * 1000
            line += (f" rows={sent:,} per row={(idle - quiet) / sent:,.0f}"
                     f" (a report costs what {(loaded - idle) / reports / ((idle - quiet) / sent):,.1f} rows do)")
        print(line, flush=True)


if __name__ == "__main__":
    main()
