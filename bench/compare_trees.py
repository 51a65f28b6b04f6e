"""Broker CPU per message of two (or more) filemq source trees and mosquitto, in one run.

    PYTHONPATH=$PWD python -m bench.compare_trees fanout 4 before=/tmp/old-tree after=$PWD
    MSGS=40000 PYTHONPATH=$PWD python -m bench.compare_trees ingest 3 a=/tree/a b=/tree/b
    RATE=1000 PYTHONPATH=$PWD python -m bench.compare_trees everyday 4 before=/tmp/old-tree after=$PWD

Each tree's ``cli.py broker`` (``fsync = "always"``, fresh data dir, ``PYTHONPATH`` = the tree)
and mosquitto run the `filemq bench broker` ingest or fanout load in alternation, ``reps``
times; each line gives rate and broker CPU per PUBACK / delivery (user + system, threads and
helper processes), the summary the best run of each and its ratio to mosquitto's. On a
shared machine only ratios within one run mean something (docs/PERFORMANCE.md). ``MSGS``
overrides the messages per run (ingest 200,000; fanout 20,000 x the 10 subscribers).
``PROTOCOL=5`` runs every broker with MQTT 5 load clients (trees that speak MQTT 5 only), and
``V5_PROPERTIES=1`` adds a content type and a user property to every PUBLISH (as
``filemq bench broker --protocol 5 --v5-properties``). ``SUBSCRIBER_CLIENT=single|nagle|paho``,
``PUBLISHER_CLIENT=single|nagle`` and ``MAX_INFLIGHT=N`` are the bench's ``--subscriber-client``,
``--publisher-client`` and ``--max-inflight`` (the window of every broker in the run),
``SUBSCRIBERS=N`` and ``PUBLISHERS=N`` the bench's ``--subscribers`` and ``--publishers`` (10 and 4); ``NO_MOSQUITTO=1`` runs the trees only.
``everyday`` is ``--scenario everyday`` at one rate: ``RATE`` msg/s over ``SENSORS`` sensors (1000, 50)
for ``SECONDS`` (15); its lines add the PUBACK p50/p99. The summary also gives
each broker's median, which on a loaded machine says more than the best run.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.everyday import SensorLoad, run_sensors
from bench.everyday import figures as everyday_figures
from bench.harness.brokers import BrokerBenchOptions
from bench.harness.loads import V5_PROPERTIES, fanout_run, ingest_run
from bench.harness.processes import LOOPBACK, BrokerProcess, free_port, spawn, start_mosquitto


def _start(tree: Path | None, work: Path, window: int | None) -> BrokerProcess:
    if tree is None:
        return start_mosquitto(work) if window is None else start_mosquitto(work, max_inflight=window)
    port = free_port()
    argv = [sys.executable, str(tree / "cli.py"), "broker", "--data-dir", str(work / "data"),
            "--host", LOOPBACK, "--port", str(port), "--fsync", "always"]
    if window is not None:
        argv += ["--max-inflight", str(window)]
    broker = spawn(tree.name, argv, LOOPBACK, port, work / "broker.log", env=dict(os.environ, PYTHONPATH=str(tree)),
                   cwd=tree)
    broker.wait_ready(30)
    return broker


def compare(scenario: str, reps: int, trees: dict[str, Path]) -> list[str]:
    window = int(os.environ["MAX_INFLIGHT"]) if os.environ.get("MAX_INFLIGHT") else None
    opts = BrokerBenchOptions(max_seconds=10, subscriber_client=os.environ.get("SUBSCRIBER_CLIENT", "loadgen"),
                              publisher_client=os.environ.get("PUBLISHER_CLIENT", "loadgen"), max_inflight=window,
                              subscribers=int(os.environ.get("SUBSCRIBERS", "10")),
                              publishers=int(os.environ.get("PUBLISHERS", "4")))
    messages = int(os.environ.get("MSGS", "0")) or (200_000 if scenario == "ingest" else 20_000)
    protocol = int(os.environ.get("PROTOCOL", "4"))
    props = V5_PROPERTIES if protocol == 5 and os.environ.get("V5_PROPERTIES") == "1" else None
    runs: dict[str, list[tuple[float, float]]] = {}
    lines: list[str] = []
    named: dict[str, Path | None] = dict(trees) if os.environ.get("NO_MOSQUITTO") == "1" else {
        **trees, "mosquitto": None}
    with tempfile.TemporaryDirectory(prefix="filemq-compare-") as d:
        for rep in range(reps):
            for name, tree in named.items():
                work = Path(d) / f"{name}-{rep}"
                work.mkdir()
                extra = ""
                with _start(tree, work, window) as broker:
                    cpu0 = broker.cpu_seconds()
                    if scenario == "everyday":
                        load = SensorLoad(broker.host, broker.port, int(os.environ.get("SENSORS", "50")),
                                          float(os.environ.get("RATE", "1000")),
                                          float(os.environ.get("SECONDS", "15")))
                        ed = run_sensors(load, broker)
                        fig = everyday_figures(ed)
                        n, rate, errors = ed.acked, fig["rate"], ed.errors
                        extra = f" PUBACK p50 {fig['puback_p50_ms']} p99 {fig['puback_p99_ms']} ms"
                        cpu0 = broker.cpu_seconds() - ed.broker_cpu_seconds  # the sensors' run only
                    elif scenario == "ingest":
                        result = ingest_run(broker, opts, messages, "bench/ingest", protocol=protocol,
                                             properties=props)
                        n, rate, errors = result.acked, result.ack_rate, result.errors
                    else:
                        result = fanout_run(broker, opts, messages, protocol=protocol, properties=props)
                        n, rate, errors = result.delivered, result.delivery_rate, result.errors
                    cpu = broker.cpu_seconds() - cpu0
                us = 1e6 * cpu / max(n, 1)
                runs.setdefault(name, []).append((us, rate))
                line = f"{scenario} {name:10} run {rep}: {rate:9,.0f}/s {us:6.2f} us/msg{extra} {errors[:1]}"
                lines.append(line)
                sys.stdout.write(line + "\n")
    base = runs.get("mosquitto")
    for name, figures in runs.items():
        us = min(u for u, _ in figures)
        rate = max(r for _, r in figures)
        median = statistics.median(u for u, _ in figures)
        vs = "" if base is None else (f"  cpu ratio vs mosquitto {min(u for u, _ in base) / us:.2f}  "
                                      f"rate ratio {rate / max(r for _, r in base):.2f}")
        lines.append(f"SUMMARY {scenario} {name:10} best {us:6.2f} us/msg ({rate:9,.0f}/s), median {median:6.2f}{vs}")
    return lines


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] not in ("ingest", "fanout", "everyday"):
        sys.exit(__doc__)
    trees = {name: Path(path).resolve() for name, path in (a.split("=", 1) for a in argv[2:])}
    extra = 0 if os.environ.get("NO_MOSQUITTO") == "1" else 1
    for line in compare(argv[0], int(argv[1]), trees)[-len(trees) - extra:]:
        sys.stdout.write(line + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
