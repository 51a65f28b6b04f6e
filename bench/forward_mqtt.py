"""``filemq bench forward``'s MQTT export drain, against Mosquitto's own bridge in the same run.

A backlog of N records of ``size`` bytes sits in the agent's log while the upstream Debian
mosquitto is down; mosquitto starts with a persistent QoS 1 subscriber session already saved
in its store, then the agent (one MQTT export, QoS 1, the default window) starts and the clock
runs until ``mosquitto_sub`` there has received all N. As for the bridge baseline
(:func:`bench.forward.run_bridge`), the rate is counted from the first message received, so
neither side's connect or reconnect delay is in it; the note also gives the time from the
agent's start.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.forward import (
    MOSQUITTO,
    MOSQUITTO_SUB,
    SMALL_BRIDGE_BACKLOG,
    Result,
    _filemq,
    _mosquitto_conf,
    _say,
    _stop,
    count_received,
    cpu_seconds,
    fill_agent_log,
    free_port,
    run_bridge,
)


def run_mqtt_export_drain(work: Path, records: int, size: int, timeout: float, upstream_extra: str = "",
                          window: int | None = None) -> Result:
    """The agent's MQTT export draining ``records`` to mosquitto; the rate from the first arrival."""
    work.mkdir(parents=True, exist_ok=True)
    os.chmod(work.parent, 0o755)
    os.chmod(work, 0o777)
    agent_dir = work / "agent"
    _say(f"[export] filling the agent log with {records:,} records of {size} bytes")
    fill_agent_log(agent_dir, records, size)
    port, aport = free_port(), free_port()
    conf = _mosquitto_conf(work / "upstream.conf", port,
                           f"persistence true\npersistence_location {work}/\nautosave_interval 0\n{upstream_extra}")
    devnull = subprocess.DEVNULL
    upstream = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=devnull, stderr=devnull)
    time.sleep(0.3)
    if upstream.poll() is not None:
        raise RuntimeError(f"mosquitto with {conf} exited with {upstream.returncode}")
    agent = None
    try:
        # %l: one line per message (its length), whatever bytes the payload holds.
        sub = subprocess.Popen(
            [MOSQUITTO_SUB, "-p", str(port), "-q", "1", "-c", "-i", "bench-export-sub", "-t", "sensors/#",
             "-C", str(records), "-W", str(int(timeout)), "-F", "%l"],
            stdout=subprocess.PIPE, stderr=devnull,
        )
        time.sleep(0.5)  # subscribed
        config = work / "agent.toml"
        config.write_text("[agent]\nbackoff_initial_ms = 50\nbackoff_max_ms = 250\n[broker]\nsys_interval_s = 0\n"
                          f"[[export]]\nname = \"up\"\nurl = \"mqtt://127.0.0.1:{port}\"\n"
                          + (f"window = {window}\n" if window else ""))
        _say("[export] starting the agent; timing until the subscriber upstream has every message")
        launched = time.monotonic()
        agent = _filemq("agent", "--config", str(config), "--data-dir", str(agent_dir), "--device-id", "bench-1",
                        "--port", str(aport), log_path=work / "agent.log")
        listening = time.monotonic()
        first, received = count_received(sub, "the export")
        done = time.monotonic()
        cpu = {"agent": cpu_seconds(agent.pid), "upstream_mosquitto": cpu_seconds(upstream.pid)}
    finally:
        if agent is not None:
            _stop(agent)
        _stop(upstream)
    seconds = done - first
    _say(f"[export] {received:,} of {records:,} messages; {seconds:.2f} s from the first message,"
         f" {done - listening:.2f} s from the agent's 'listening' line, {done - launched:.2f} s from its launch;"
         f" agent CPU {cpu['agent']:.2f} s (start-up included)")
    note = (f"agent MQTT export (QoS 1) -> mosquitto -> subscriber, from the first message received;"
            f" {done - launched:.2f} s from the agent's launch")
    if received < records:
        note += f"; TIMED OUT with {received} of {records} received"
    return Result("mqtt_export_drain", received, seconds, received / seconds, note, cpu)


def run_export_vs_bridge(*, records: int, size: int, work_dir: str | None, keep: bool, as_json: bool,
                         timeout: float = 900, mosquitto_max_inflight: int | None = None) -> dict[str, Any]:
    """The MQTT export drain and the mosquitto bridge on the same backlogs (50,000 and
    ``records``), in this run; prints each result and the summary, returns the summary.

    ``mosquitto_max_inflight`` sets ``max_inflight_messages`` in every mosquitto of both runs
    (the upstream, the bridge's local and remote); None keeps mosquitto's default (20)."""
    extra = "" if mosquitto_max_inflight is None else f"max_inflight_messages {mosquitto_max_inflight}\n"
    base = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="filemq-bench-export-"))
    base.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"name": "summary_mqtt_export", "mosquitto_max_inflight": mosquitto_max_inflight}

    def emit(result: Result) -> Result:
        _say(f"{result.name}: {result.records:,} records in {result.seconds:.2f} s = {result.rate:,.0f} records/s"
             f" ({result.note})")
        if as_json:
            print(json.dumps(asdict(result)), flush=True)
        return result

    try:
        for n in sorted({min(SMALL_BRIDGE_BACKLOG, records), records}):
            export = emit(run_mqtt_export_drain(base / f"export-{n}", n, size, timeout, extra))
            bridge = emit(run_bridge(base / f"bridge-{n}", n, size, timeout, mosquitto_extra=extra))
            agent_cpu = export.cpu_seconds.get("agent") or 0.0
            summary[f"export_{n}_records_per_s"] = round(export.rate)
            summary[f"export_{n}_records_per_agent_cpu_s"] = round(n / agent_cpu) if agent_cpu else None
            summary[f"bridge_{n}_records_per_s"] = round(bridge.rate)
            summary[f"export_vs_bridge_{n}"] = round(export.rate / bridge.rate, 2)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    _say("; ".join(f"{k} {v}" for k, v in summary.items() if k != "name")
         + " (targets: export >= 50,000/s and faster than the bridge at both sizes)")
    if as_json:
        print(json.dumps(summary), flush=True)
    return summary
