"""Instruction counts (valgrind callgrind "Ir") of `filemq broker` for a fixed load, per
source tree: the measure of small CPU differences that machine load does not disturb.

    PYTHONPATH=$PWD python -m bench.callgrind_broker N name=/tree [name=/tree ...]
    SCENARIO=fanout PYTHONPATH=$PWD python -m bench.callgrind_broker N name=/tree ...
    PROTOCOL=5 V5_PROPERTIES=1 PYTHONPATH=$PWD python -m bench.callgrind_broker N name=/tree ...

Runs each tree's broker (``fsync = "always"``, fresh data dir) under ``valgrind
--tool=callgrind`` (``apt-get install valgrind``), sends the `filemq bench broker` ingest load
of N QoS 1 PUBLISHes (or, with ``SCENARIO=fanout``, N PUBLISHes to its 10 subscribers), stops
the broker with SIGINT and prints the total instruction count.  Run it with N=0 too and
subtract: what remains is the load's.  Each run takes about a minute (valgrind is ~50x slower).
``PROTOCOL=5`` sends the load with MQTT 5 clients, and ``V5_PROPERTIES=1`` adds a content type
and a user property to every PUBLISH (as ``filemq bench broker --protocol 5 --v5-properties``).
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.brokers import BrokerBenchOptions
from bench.harness.loads import V5_PROPERTIES, fanout_run, ingest_run
from bench.harness.processes import LOOPBACK, free_port, spawn
from bench.valgrind import callgrind_prefix, callgrind_total
from filemq.mqtt.packets import PROTOCOL_LEVEL

SCENARIO = os.environ.get("SCENARIO", "ingest")
PROTOCOL = int(os.environ.get("PROTOCOL", str(PROTOCOL_LEVEL)))
PROPERTIES = V5_PROPERTIES if os.environ.get("V5_PROPERTIES") == "1" else None


def run(tree: Path, n: int, work: Path) -> int:
    port = free_port()
    out = work / "cg.out"
    argv = [*callgrind_prefix(out), sys.executable,
            str(tree / "cli.py"), "broker", "--data-dir", str(work / "data"), "--host", LOOPBACK,
            "--port", str(port), "--fsync", "always"]
    broker = spawn(tree.name, argv, LOOPBACK, port, work / "broker.log",
                   env=dict(os.environ, PYTHONPATH=str(tree), PYTHONMALLOC="malloc"), cwd=tree)
    try:
        broker.wait_ready(600)
        if n:
            opts = BrokerBenchOptions(max_seconds=600)
            if SCENARIO == "ingest":
                r = ingest_run(broker, opts, n, "bench/ingest", protocol=PROTOCOL, properties=PROPERTIES)
                assert r.acked == n, (r.acked, r.errors)
            else:
                r = fanout_run(broker, opts, n, protocol=PROTOCOL, properties=PROPERTIES)
                print(f"  delivered {r.delivered:,}", flush=True)
    finally:
        broker.proc.send_signal(signal.SIGINT)
        broker.proc.wait(600)
    return callgrind_total(out)


def main() -> None:
    if PROPERTIES is not None and PROTOCOL != 5:
        sys.exit("V5_PROPERTIES=1 needs PROTOCOL=5")
    n = int(sys.argv[1])
    for arg in sys.argv[2:]:
        name, path = arg.split("=", 1)
        with tempfile.TemporaryDirectory(prefix="cg-") as d:
            t0 = time.time()
            ir = run(Path(path), n, Path(d))
            print(f"{name} N={n} Ir={ir:,} ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
