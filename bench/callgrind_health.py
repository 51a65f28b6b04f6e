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
    work = Path(tempfile.mkdtemp(prefix="cg-health-"))
    config = load_config(None, {"data_dir": str(work / "data"), "collector.landing": str(work / "landing"),
                                "collector.port": 0, "collector.collector_id": "cg", "log.fsync": "never",
                                "log.min_free_bytes": 0, "collector.roll_seconds": 3600})
    wire = [publish_bytes(health_topic(f"dev-{i % devices}"),
                          encode_health(f"dev-{i % devices}", 1_000_000 + i, i + 1, report_body(i)), 0, False, None)
            for i in range(ENCODED)]
    collector = Collector(config)
    await collector.start()
    clients = [MQTTClient(f"dev-{d}", port=collector.port) for d in range(devices)]
    for c in clients:
        await c.connect()
    for d, c in enumerate(clients):
        await c.publish(f"filemq/v1/dev-{d}/main", encode_batch(f"dev-{d}", "main", [
            BatchRecord(i, 1, "t", b"x" * 100, 1) for i in range(10)]), qos=1)
    # In rounds of one report per device, each round taken by the door before the next: a
    # device's report arrives alone, as it does every interval (not in a run of PUBLISHes).
    for first in range(0, reports, devices):
        for i in range(first, min(first + devices, reports)):
            writer = clients[i % devices]._writer
            assert writer is not None
            writer.write(wire[i])
        for _ in range(60_000):
            if collector.stats.health_reports >= min(first + devices, reports):
                break
            await asyncio.sleep(0.001)
    assert collector.stats.health_reports == reports, collector.stats
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
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        loaded, idle = _ir(Path(path), reports), _ir(Path(path), 0)
        print(f"{name} reports={reports} Ir={loaded:,} idle={idle:,} per report={(loaded - idle) / reports:,.0f}",
              flush=True)


if __name__ == "__main__":
    main()
