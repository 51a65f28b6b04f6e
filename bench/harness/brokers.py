"""The brokers of a ``filemq bench broker`` run: its options (:class:`BrokerBenchOptions`),
starting ``filemq broker`` and the mosquitto baseline with the run's settings, and each
scenario's working directory."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness.processes import (
    LOOPBACK,
    MOSQUITTO_MAX_INFLIGHT,
    BrokerProcess,
    free_port,
    spawn,
    start_mosquitto,
)
from filemq.common.config import BrokerSection
from filemq.mqtt.packets import PROTOCOL_LEVEL

Progress = Callable[[str], None]
CLI_PATH = Path(__file__).resolve().parents[2] / "cli.py"


@dataclass
class BrokerBenchOptions:
    """Knobs of ``filemq bench broker``; ``messages`` None = each scenario's default."""

    messages: int | None = None
    publishers: int = 4
    inflight: int = 100
    size: int = 100
    subscribers: int = 10
    rate: float = 5000.0
    kill_rounds: int = 200
    backlog_mb: int = 1024
    idle_clients: int = 1000
    idle_seconds: float = 10.0
    max_seconds: float = 15.0  # per broker per load run: a slow baseline is cut short, its rate still counts
    repeat: int = 2  # ingest/fanout: runs per broker, alternating; the best counts
    fsync: str = "always"
    seed: int | None = None
    workdir: Path | None = None
    keep: bool = False
    baselines: bool = True
    protocol: int = PROTOCOL_LEVEL  # 5: ingest and fanout with MQTT 5 clients (bench.throughput)
    v5_properties: bool = False  # MQTT 5 PUBLISHes carry a content type and a user property
    subscriber_client: str = "loadgen"  # fanout subscribers: "loadgen" (bulk acks), "single" (one send
    # per PUBACK), "nagle" (the same without TCP_NODELAY) or "paho" (bench.paho_sub)
    publisher_client: str = "loadgen"  # ingest/fanout publishers: "loadgen" (the PUBLISHes a read of
    # PUBACKs frees in one send), "single" (one send per PUBLISH) or "nagle" (that without TCP_NODELAY)
    max_inflight: int | None = None  # both brokers' in-flight window; None = each broker's own default
    sensors: int = 50  # everyday: sensor loops, one PUBLISH in flight each
    everyday_rates: tuple[float, ...] = (1000.0, 100.0, 10.0, 0.0)  # everyday: msg/s in all; 0 = idle
    everyday_seconds: float = 15.0  # everyday: seconds per run
    sensor_size: int = 40  # everyday: payload bytes (a small JSON reading)
    # idle and startup in one run share one backlog (bench.broker.backlog_data_dir)
    shared_backlog_dir: Path | None = field(default=None, repr=False)


def filemq_argv(data_dir: Path, port: int, fsync: str = "always", host: str = LOOPBACK,
                max_inflight: int | None = None) -> list[str]:
    """The ``filemq broker`` command line, run through this interpreter (no PATH needed);
    ``max_inflight`` None = the broker's default window."""
    argv = [sys.executable, str(CLI_PATH), "broker", "--data-dir", str(data_dir), "--host", host,
            "--port", str(port), "--fsync", fsync]
    return argv + (["--max-inflight", str(max_inflight)] if max_inflight is not None else [])


def start_filemq(data_dir: Path, port: int | None = None, *, fsync: str = "always",
                 log_path: Path | None = None, wait: bool = True, timeout: float = 30.0,
                 max_inflight: int | None = None) -> BrokerProcess:
    """Spawn ``filemq broker`` on ``data_dir``; with ``wait``, return once it answers CONNECT."""
    port = port or free_port()
    log_path = log_path or data_dir.parent / f"{data_dir.name}-broker.log"
    broker = spawn("filemq", filemq_argv(data_dir, port, fsync, max_inflight=max_inflight), LOOPBACK, port,
                   log_path)
    if wait:
        broker.wait_ready(timeout)
    return broker


@contextlib.contextmanager
def workdir(opts: BrokerBenchOptions, name: str) -> Iterator[Path]:
    """A fresh directory for one scenario under ``opts.workdir`` (or the temporary directory),
    removed afterwards unless ``opts.keep``."""
    root = opts.workdir or Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"filemq-bench-{name}-", dir=root))
    try:
        yield path
    finally:
        if not opts.keep:
            shutil.rmtree(path, ignore_errors=True)


def windows(opts: BrokerBenchOptions) -> dict[str, int]:
    """The in-flight windows a run's brokers use: ``--max-inflight`` for both, else filemq's
    default (``[broker] max_inflight``) and the mosquitto baseline's configured one."""
    if opts.max_inflight is not None:
        return {"filemq_max_inflight": opts.max_inflight, "mosquitto_max_inflight": opts.max_inflight}
    return {"filemq_max_inflight": BrokerSection().max_inflight, "mosquitto_max_inflight": MOSQUITTO_MAX_INFLIGHT}


def windows_text(opts: BrokerBenchOptions) -> str:
    w = windows(opts)
    return f"in-flight window filemq {w['filemq_max_inflight']}, mosquitto {w['mosquitto_max_inflight']}"


def start_mosquitto_for(opts: BrokerBenchOptions, workdir: Path) -> BrokerProcess:
    """The mosquitto baseline with the run's in-flight window."""
    return start_mosquitto(workdir, max_inflight=windows(opts)["mosquitto_max_inflight"])
