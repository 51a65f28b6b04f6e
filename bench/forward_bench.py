"""``filemq bench forward``: runs the store-and-forward scenarios (a) to (d) of
:mod:`bench.forward` and :mod:`bench.forward_mqtt` in one run and prints their rates and
ratios (``--only mqtt-export``: (d) alone, :func:`bench.forward_mqtt.run_export_vs_bridge`).

Progress goes to stderr; ``--json`` prints one JSON object per line on stdout.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.forward import (
    MOSQUITTO,
    MOSQUITTO_SUB,
    SMALL_BRIDGE_BACKLOG,
    Result,
    run_bridge,
    run_devices,
    run_devices_health,
    run_drain,
    run_ingest,
)
from bench.forward_mqtt import run_export_vs_bridge, run_mqtt_export_drain
from bench.harness.processes import say


def run_forward_bench(
    *, records: int, size: int, devices: int, work_dir: str | None, keep: bool, as_json: bool,
    skip_bridge: bool = False, ingest_records: int = 200_000, timeout: float = 900, only: str = "all",
    mosquitto_max_inflight: int | None = None, oracle: str = "puback", oracle_qos: int = 1, repeat: int = 1,
    health_interval_s: float = 30.0, api_interval_s: float | None = 0.5, batch_records: int = 1000,
    health_start: str = "steady",
) -> dict[str, Any]:
    """Run (a), (b), (c) and (d) and print the rates and ratios; returns the summary.

    ``only="mqtt-export"`` runs just (d): the MQTT export drain against the bridge at
    ``SMALL_BRIDGE_BACKLOG`` and ``records`` (bench/forward_mqtt.py). ``only="devices"`` runs
    just (b). (b) runs ``repeat`` pairs without and with health reports every
    ``health_interval_s`` (:func:`run_devices_health`; 0: one run without, as before), the
    first report of each device as ``health_start`` says (:func:`bench.forward._device_load`)."""
    if only == "mqtt-export":
        return run_export_vs_bridge(records=records, size=size, work_dir=work_dir, keep=keep, as_json=as_json,
                                    timeout=timeout, mosquitto_max_inflight=mosquitto_max_inflight,
                                    oracle=oracle, oracle_qos=oracle_qos, repeat=repeat)
    base = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="filemq-bench-forward-"))
    base.mkdir(parents=True, exist_ok=True)
    results: dict[str, Result] = {}
    device_rates: list[float] = []

    def emit(result: Result) -> None:
        results[result.name] = result
        if result.name == "collector_devices":
            device_rates.append(result.rate)
        say(f"{result.name}: {result.records:,} records in {result.seconds:.2f} s = {result.rate:,.0f} records/s"
             f" ({result.note})")
        if as_json:
            print(json.dumps(asdict(result)), flush=True)

    def many_devices() -> dict[str, Any] | None:
        if not health_interval_s:
            emit(run_devices(base / "devices", devices, records, size, timeout, batch_records=batch_records,
                             api_interval_s=api_interval_s))
            return None
        health = run_devices_health(base / "devices", devices=devices, records=records, size=size,
                                    timeout=timeout, repeat=repeat, health_interval_s=health_interval_s,
                                    api_interval_s=api_interval_s, batch_records=batch_records, emit=emit,
                                    health_start=health_start)
        if as_json:
            print(json.dumps(health), flush=True)
        return health

    if only == "devices":
        try:
            health = many_devices()
        finally:
            if not keep:
                shutil.rmtree(base, ignore_errors=True)
        return health or {"name": "summary", "devices_records_per_s": round(statistics.median(device_rates))}
    try:
        emit(run_drain(base / "drain", records, size, timeout))
        if skip_bridge or shutil.which(MOSQUITTO_SUB) is None or not os.path.exists(MOSQUITTO):
            say("[bridge] skipped: mosquitto or mosquitto_sub not installed (apt-get install mosquitto"
                 " mosquitto-clients)" if not skip_bridge else "[bridge] skipped (--skip-bridge)")
        else:
            emit(run_bridge(base / "bridge", records, size, timeout))
            if records > SMALL_BRIDGE_BACKLOG:
                # Context only (not used in the ratio): Mosquitto's rate with a short queue.
                small = run_bridge(base / "bridge-small", SMALL_BRIDGE_BACKLOG, size, timeout)
                small.name = "mosquitto_bridge_drain_small_backlog"
                emit(small)
        if not skip_bridge and os.path.exists(MOSQUITTO):
            emit(run_mqtt_export_drain(base / "export", records, size, timeout, oracle="subscriber"))
        health = many_devices()
        emit(run_ingest(base / "ingest", ingest_records, size, timeout))
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    drain = results["filemq_drain"].rate
    summary: dict[str, Any] = {
        "name": "summary",
        "drain_records_per_s": round(drain),
        "devices_records_per_s": round(statistics.median(device_rates)),
        "ingest_records_per_s": round(results["broker_durable_ingest"].rate),
        "drain_vs_ingest": round(drain / results["broker_durable_ingest"].rate, 2),
    }
    drain_cpu = results["filemq_drain"].cpu_seconds
    if drain_cpu.get("agent"):
        # The agent is the drain's bottleneck; its records per CPU-second is what one free
        # core would sustain, whatever else runs on the machine.
        summary["drain_records_per_agent_cpu_s"] = round(results["filemq_drain"].records / drain_cpu["agent"])
    if "mqtt_export_drain" in results:
        summary["mqtt_export_records_per_s"] = round(results["mqtt_export_drain"].rate)
        if "mosquitto_bridge_drain" in results:
            summary["mqtt_export_vs_bridge"] = round(
                results["mqtt_export_drain"].rate / results["mosquitto_bridge_drain"].rate, 2)
    if "mosquitto_bridge_drain" in results:
        summary["bridge_records_per_s"] = round(results["mosquitto_bridge_drain"].rate)
        summary["drain_vs_bridge"] = round(drain / results["mosquitto_bridge_drain"].rate, 2)
    say(
        f"drain {drain:,.0f}/s (target >= 100,000/s)"
        + (f", {summary['drain_vs_bridge']}x the mosquitto bridge (target >= 1x)" if "drain_vs_bridge" in summary else "")
        + f"; {summary['devices_records_per_s']:,}/s from {devices} devices (target >= 150,000/s);"
        f" drain/ingest {summary['drain_vs_ingest']}x (target >= 1.5x)"
    )
    if health is not None:
        summary["health_cpu_ratio"] = health["cpu_ratio"]
        summary["api_fleet_ms_max"] = health.get("api_fleet_ms_max_with")
    if as_json:
        print(json.dumps(summary), flush=True)
    return summary
