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
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.ackcount import AckCounter
from bench.forward import (
    MOSQUITTO,
    MOSQUITTO_SUB,
    SMALL_BRIDGE_BACKLOG,
    Result,
    count_received,
    fill_agent_log,
    run_bridge,
)
from bench.harness.cpu import cpu_seconds
from bench.harness.processes import free_port, mosquitto_bridge_conf, say, start_cli, stop


def run_mqtt_export_drain(work: Path, records: int, size: int, timeout: float, upstream_extra: str = "",
                          window: int | None = None, oracle: str = "puback", oracle_qos: int = 1) -> Result:
    """The agent's MQTT export draining ``records`` to mosquitto; the rate from the first arrival.

    ``oracle="puback"``: the export connects through :class:`bench.ackcount.AckCounter`, and the
    clock runs from mosquitto's first PUBACK to its ``records``-th (no subscriber upstream).
    ``oracle="subscriber"``: a persistent ``mosquitto_sub`` (QoS ``oracle_qos``) upstream counts
    the messages, from the first to the last it receives."""
    work.mkdir(parents=True, exist_ok=True)
    os.chmod(work.parent, 0o755)
    os.chmod(work, 0o777)
    agent_dir = work / "agent"
    say(f"[export] filling the agent log with {records:,} records of {size} bytes")
    fill_agent_log(agent_dir, records, size)
    port, aport = free_port(), free_port()
    conf = mosquitto_bridge_conf(work / "upstream.conf", port,
                           f"persistence true\npersistence_location {work}/\nautosave_interval 0\n{upstream_extra}")
    devnull = subprocess.DEVNULL
    upstream = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=devnull, stderr=devnull)
    time.sleep(0.3)
    if upstream.poll() is not None:
        raise RuntimeError(f"mosquitto with {conf} exited with {upstream.returncode}")
    agent = None
    counter = AckCounter(port).start() if oracle == "puback" else None
    try:
        sub = None
        if counter is None:
            # %l: one line per message (its length), whatever bytes the payload holds.
            sub = subprocess.Popen(
                [MOSQUITTO_SUB, "-p", str(port), "-q", str(oracle_qos), "-c", "-i", "bench-export-sub",
                 "-t", "sensors/#", "-C", str(records), "-W", str(int(timeout)), "-F", "%l"],
                stdout=subprocess.PIPE, stderr=devnull,
            )
            time.sleep(0.5)  # subscribed
        target = counter.port if counter is not None else port
        config = work / "agent.toml"
        config.write_text("[agent]\nbackoff_initial_ms = 50\nbackoff_max_ms = 250\n[broker]\nsys_interval_s = 0\n"
                          f"[[export]]\nname = \"up\"\nurl = \"mqtt://127.0.0.1:{target}\"\n"
                          + (f"window = {window}\n" if window else ""))
        say(f"[export] starting the agent; timing until {'mosquitto acknowledged' if sub is None else 'the subscriber upstream has'} every message")
        launched = time.monotonic()
        agent = start_cli("agent", "--config", str(config), "--data-dir", str(agent_dir), "--device-id", "bench-1",
                        "--port", str(aport), log_path=work / "agent.log")
        listening = time.monotonic()
        if counter is not None:
            counter.sample_at_first = agent.pid
            counter.wait(records, timeout)
            if counter.first is None or counter.last is None:
                raise RuntimeError("mosquitto acknowledged nothing from the export")
            first, done, received = counter.first, counter.last, min(counter.acks, records)
            cpu = {"agent": cpu_seconds(agent.pid), "upstream_mosquitto": cpu_seconds(upstream.pid),
                   "agent_before_first_ack": counter.sampled_cpu or 0.0}
        else:
            assert sub is not None
            first, received, sub_cpu = count_received(sub, "the export")
            done = time.monotonic()
            cpu = {"agent": cpu_seconds(agent.pid), "upstream_mosquitto": cpu_seconds(upstream.pid),
                   "subscriber": sub_cpu}
        # The destination's PUBACK reaches the proxy (or the subscriber gets the message)
        # before the agent has read that PUBACK: let it catch up before stopping it.
        wait_for_export_lag_0(agent_dir, "up", 15.0)
    finally:
        if counter is not None:
            counter.stop()
        if agent is not None:
            stop(agent)
        stop(upstream)
    if counter is not None:
        cpu["ack_proxy"] = counter.cpu_seconds
    lag = export_lag(agent_dir, "export.up")
    seconds = done - first
    what = "PUBACK" if counter is not None else "message"
    say(f"[export] {received:,} of {records:,} acknowledged; {seconds:.2f} s from the first {what},"
         f" {done - listening:.2f} s from the agent's 'listening' line, {done - launched:.2f} s from its launch;"
         f" agent CPU {cpu['agent']:.2f} s (start-up included)")
    if counter is not None:
        note = (f"agent MQTT export (QoS 1) -> mosquitto, from its first PUBACK to its {records:,}th;"
                f" {done - launched:.2f} s from the agent's launch")
    else:
        note = (f"agent MQTT export (QoS 1) -> mosquitto -> QoS {oracle_qos} subscriber, from the first message"
                f" received; {done - launched:.2f} s from the agent's launch")
    if received < records:
        note += f"; TIMED OUT with {received} of {records} received"
    # The export's offset moves only over what the destination acknowledged: after a clean
    # stop its lag says whether every record was acknowledged, whatever the oracle counted.
    note += "; export.up lag 0 after the agent stopped" if lag == 0 else f"; NOT ALL ACKNOWLEDGED: export.up lag {lag}"
    return Result("mqtt_export_drain", received, seconds, received / seconds, note, cpu)


def wait_for_export_lag_0(data_dir: Path, name: str, timeout: float) -> bool:
    """Poll a running agent's ``exports.json`` (written every second) until export ``name``
    shows no lag; False at ``timeout``."""
    deadline = time.monotonic() + timeout
    path = data_dir / "exports.json"
    while time.monotonic() < deadline:
        try:
            entries = json.loads(path.read_text()).get("exports", [])
        except (OSError, ValueError, AttributeError):
            entries = []
        if any(e.get("name") == name and e.get("lag_records") == 0 for e in entries if isinstance(e, dict)):
            return True
        time.sleep(0.2)
    return False


def export_lag(data_dir: Path, group: str) -> int | None:
    """The lag of consumer group ``group`` in a stopped agent's data dir (None: no such group)."""
    from filemq.ops.status import data_dir_status

    for g in data_dir_status(data_dir)["groups"]:
        if g["name"] == group:
            return int(g["lag"])
    return None


def run_export_vs_bridge(*, records: int, size: int, work_dir: str | None, keep: bool, as_json: bool,
                         timeout: float = 900, mosquitto_max_inflight: int | None = None,
                         oracle: str = "puback", oracle_qos: int = 1, repeat: int = 1) -> dict[str, Any]:
    """The MQTT export drain and the mosquitto bridge on the same backlogs (50,000 and
    ``records``), in this run; prints each result and the summary, returns the summary.

    ``oracle``/``oracle_qos``: how arrival is counted, the same for both (see
    :func:`run_mqtt_export_drain`). ``repeat``: runs of each per size, export and bridge
    alternating; the summary gives the median rates (and every run's).

    ``mosquitto_max_inflight`` sets ``max_inflight_messages`` in every mosquitto of both runs
    (the upstream, the bridge's local and remote); None keeps mosquitto's default (20)."""
    extra = "" if mosquitto_max_inflight is None else f"max_inflight_messages {mosquitto_max_inflight}\n"
    base = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="filemq-bench-export-"))
    base.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"name": "summary_mqtt_export", "mosquitto_max_inflight": mosquitto_max_inflight,
                               "oracle": oracle if oracle == "puback" else f"subscriber qos {oracle_qos}"}

    def emit(result: Result) -> Result:
        say(f"{result.name}: {result.records:,} records in {result.seconds:.2f} s = {result.rate:,.0f} records/s"
             f" ({result.note})")
        if as_json:
            print(json.dumps(asdict(result)), flush=True)
        return result

    try:
        for n in sorted({min(SMALL_BRIDGE_BACKLOG, records), records}):
            exports: list[Result] = []
            bridges: list[Result] = []
            for i in range(repeat):
                # Alternating, so that the machine's load swings touch both alike.
                suffix = f"-{i + 1}" if repeat > 1 else ""
                exports.append(emit(run_mqtt_export_drain(base / f"export-{n}{suffix}", n, size, timeout, extra,
                                                          oracle=oracle, oracle_qos=oracle_qos)))
                bridges.append(emit(run_bridge(base / f"bridge-{n}{suffix}", n, size, timeout,
                                               mosquitto_extra=extra, oracle=oracle, oracle_qos=oracle_qos)))
            export_rate = statistics.median(r.rate for r in exports)
            bridge_rate = statistics.median(r.rate for r in bridges)
            export = min(exports, key=lambda r: abs(r.rate - export_rate))  # CPU figures of the median run
            agent_cpu = export.cpu_seconds.get("agent") or 0.0
            summary[f"export_{n}_records_per_s"] = round(export_rate)
            summary[f"export_{n}_records_per_agent_cpu_s"] = round(n / agent_cpu) if agent_cpu else None
            if export.cpu_seconds.get("agent_before_first_ack"):
                # Start-up (imports, log recovery) excluded: the agent's CPU from the first PUBACK on.
                steady = agent_cpu - export.cpu_seconds["agent_before_first_ack"]
                summary[f"export_{n}_agent_us_per_record"] = round(steady / n * 1e6, 2)
            summary[f"export_{n}_upstream_us_per_record"] = round(
                export.cpu_seconds.get("upstream_mosquitto", 0.0) / n * 1e6, 2)
            summary[f"bridge_{n}_records_per_s"] = round(bridge_rate)
            summary[f"export_vs_bridge_{n}"] = round(export_rate / bridge_rate, 2)
            if repeat > 1:
                summary[f"export_{n}_runs"] = [round(r.rate) for r in exports]
                summary[f"bridge_{n}_runs"] = [round(r.rate) for r in bridges]
                summary[f"export_vs_bridge_{n}_runs"] = [
                    round(e.rate / b.rate, 2) for e, b in zip(exports, bridges, strict=True)]
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    say("; ".join(f"{k} {v}" for k, v in summary.items() if k != "name")
         + " (targets: export >= 50,000/s and faster than the bridge at both sizes)")
    if as_json:
        print(json.dumps(summary), flush=True)
    return summary
