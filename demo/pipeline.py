"""The end-to-end demo behind ``filemq demo``: the whole pipeline on loopback, with faults.

:func:`run_demo` starts a collector and an agent as ``filemq`` subprocesses in a work
directory, runs simulated sensors that publish JSON readings with QoS 1 through the real
:class:`~filemq.mqtt.client.MQTTClient`, cuts the uplink (stops the collector), cuts the
device's power (``kill -9`` of the agent) mid-stream, restarts both, cuts the power again
while the agent drains its backlog over a metered uplink, waits until everything has drained
and landed, runs ``filemq ingest --once`` and compares the curated table with the *oracle*:
the set of messages whose PUBACK a sensor received.

What a caller may rely on:

* :func:`run_demo` never raises for a failed phase: it returns a :class:`DemoResult` whose
  ``ok`` is false and whose ``failed_phase``/``error``/``log_file`` say what went wrong and
  where to look; the work directory is kept whenever the demo did not succeed.
* Every wait is bounded (:class:`DemoOptions` timeouts); every process the demo started is
  stopped before it returns (SIGTERM, then SIGKILL of that process group).
* Other parts are driven only through their command lines. At the end it prints the fleet
  (``filemq fleet``) and checks that the ``fleet_events`` table holds every connect and
  disconnect the collector landed exactly once, in the order of the demo's cuts. A ``filemq`` command that does
  not exist yet is reported as ``not yet available: filemq <command>`` and the demo runs
  whatever it can without it (``DemoResult.missing``).
* Progress goes to the ``progress`` callback (never printed here): ``kind="phase"`` for a
  line worth keeping (a phase began or ended), ``kind="status"`` for a live status line
  that the next one replaces.

Reading the curated table needs pyarrow (the ``collector``/``spark`` extras); it is imported
only when the demo reaches that point, so a device install can still import this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from filemq.mqtt.client import MQTTClient, MQTTClientError

log = logging.getLogger(__name__)

DEVICE_ID = "demo-device-1"
PAYLOAD_SCHEMA = "temperature double, humidity double"
REQUIRED_COMMANDS = ("collector", "agent", "status", "ingest")

ProgressKind = Literal["phase", "status"]


@dataclass(frozen=True, slots=True)
class DemoProgress:
    """One progress report: a line to keep (``phase``) or a live line to replace (``status``)."""

    kind: ProgressKind
    phase: str
    message: str


ProgressCallback = Callable[[DemoProgress], None]


@dataclass(slots=True)
class DemoOptions:
    """How long and how big the demo runs. :meth:`quick` is the shortened run for tests."""

    work_dir: Path | None = None
    keep: bool = False
    sensors: int = 5
    rate_per_sensor: float = 10.0  # messages per second per sensor
    online_s: float = 8.0  # everything up
    uplink_down_s: float = 8.0  # collector stopped, sensors keep publishing to the agent
    power_off_s: float = 2.0  # agent killed: the device is dark
    agent_back_s: float = 8.0  # agent restarted, collector still down
    drain_cut_after_s: float = 3.0  # collector restarted: the backlog drains, until the flicker
    flicker_off_s: float = 1.0  # agent killed again, mid-drain
    uplink_back_s: float = 8.0  # agent back after the flicker, sensors still publishing
    # The uplink is metered (agent --rate-limit-bytes-per-s) at this multiple of the sensors'
    # byte rate, so the backlog takes seconds to drain and the flicker hits it mid-way.
    uplink_speedup: float = 3.0
    batch_records: int = 100  # small batches: several in flight during the drain
    start_timeout_s: float = 30.0
    settle_timeout_s: float = 15.0  # in-flight publishes after the sensors stop
    drain_timeout_s: float = 120.0
    ingest_timeout_s: float = 300.0
    stop_timeout_s: float = 15.0
    roll_seconds: int = 1  # the collector lands a file at least every second
    seed: int = 1
    filemq_command: Sequence[str] | None = None  # how to run `filemq` (default: next to python)

    @classmethod
    def quick(cls, **overrides: Any) -> DemoOptions:
        """A shortened run (~10 s of publishing) with the same phases, for tests."""
        values: dict[str, Any] = {
            "sensors": 3,
            "online_s": 2.0,
            "uplink_down_s": 2.0,
            "power_off_s": 1.0,
            "agent_back_s": 2.0,
            "drain_cut_after_s": 1.0,
            "flicker_off_s": 0.5,
            "uplink_back_s": 2.0,
        }
        values.update(overrides)
        return cls(**values)


@dataclass(slots=True)
class PhaseResult:
    """How one phase went: ``status`` is ``ok``, ``failed``, ``not yet available: ...`` or ``skipped: ...``."""

    name: str
    seconds: float
    status: str = "ok"


@dataclass(slots=True)
class DemoResult:
    """The demo's summary; counts are ``None`` when the phase that measures them did not run.

    ``lost`` is the number of acknowledged messages missing from the curated table (or, when
    the ingest could not run, from the landed files); ``duplicates_removed`` is landed rows
    minus curated rows; ``resent_by_qos1`` counts messages stored twice at the device (QoS 1
    is at-least-once: a message whose PUBACK died with the agent is resent and stored again
    under a new offset, so it is a distinct row).
    """

    work_dir: str
    published: int = 0
    acknowledged: int = 0
    landed_rows: int | None = None
    landing_files: int | None = None
    table_rows: int | None = None
    duplicates_removed: int | None = None
    dropped_at_collector: int | None = None
    duplicate_keys_in_table: int | None = None
    resent_by_qos1: int | None = None
    unacknowledged_but_stored: int | None = None
    lost: int | None = None
    lost_sample: list[str] = field(default_factory=list)
    ingest_summary: dict[str, Any] | None = None
    # The fleet (collector/fleet.py): the collector's /api/fleet table at the end, and the
    # fleet_events table against the fleet events the collector landed.
    fleet: list[str] = field(default_factory=list)
    fleet_connects: int | None = None
    fleet_disconnects: int | None = None
    fleet_health_reports: int | None = None
    fleet_events_landed: int | None = None
    fleet_events_in_table: int | None = None
    phases: list[PhaseResult] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    failed_phase: str | None = None
    error: str | None = None
    log_file: str | None = None
    log_tail: list[str] = field(default_factory=list)
    seconds: float = 0.0
    work_dir_kept: bool = True

    @property
    def complete(self) -> bool:
        """True if every phase ran (nothing missing, nothing failed)."""
        return not self.missing and self.failed_phase is None

    @property
    def ok(self) -> bool:
        """True if every phase ran and no acknowledged message is missing from the table."""
        return self.complete and self.lost == 0 and self.table_rows is not None and not self.duplicate_keys_in_table

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["phases"] = [{"name": p.name, "seconds": round(p.seconds, 2), "status": p.status} for p in self.phases]
        out["seconds"] = round(self.seconds, 2)
        return out


class DemoError(Exception):
    """A phase failed; ``log_file`` is the file a person should look at first."""

    def __init__(self, phase: str, reason: str, log_file: Path | None = None) -> None:
        self.phase = phase
        self.reason = reason
        self.log_file = log_file
        where = f" (see {log_file})" if log_file else ""
        super().__init__(f"phase {phase!r} failed: {reason}{where}")


NO_JAVA = "Java not found (no java on PATH, no JAVA_HOME): Spark needs Java 17, e.g. apt-get install openjdk-17-jre-headless"


def java_available() -> bool:
    """True if Spark can find a Java runtime (``JAVA_HOME`` or ``java`` on the PATH)."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return True
    return shutil.which("java") is not None


def default_filemq_command() -> list[str]:
    """The ``filemq`` console script next to this interpreter, else ``python -m cli``."""
    script = Path(sys.executable).parent / "filemq"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "cli"]


def run_demo(options: DemoOptions, progress: ProgressCallback | None = None) -> DemoResult:
    """Run the whole demo (see the module docstring); returns its summary, never raises
    for a failed phase. Removes a temporary work directory only if the demo succeeded and
    ``options.keep`` is false."""
    created = options.work_dir is None
    work_dir = Path(tempfile.mkdtemp(prefix="filemq-demo-")) if options.work_dir is None else options.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    demo = _Demo(options, work_dir, progress or (lambda _p: None))
    result = asyncio.run(demo.run())
    if created and result.ok and not options.keep:
        shutil.rmtree(work_dir, ignore_errors=True)
        result.work_dir_kept = False
    return result


def format_summary(result: DemoResult) -> list[str]:
    """Lines a person can check at a glance (the CLI echoes them)."""

    def num(value: int | None) -> str:
        return "-" if value is None else f"{value:,}"

    lines = []
    if result.ok:
        lines.append(f"filemq demo: OK, lost: 0 of {result.acknowledged:,} acknowledged messages")
    elif result.failed_phase is not None:
        lines.append(f"filemq demo: FAILED in phase {result.failed_phase!r}: {result.error}")
        if result.log_file:
            lines.append(f"  look at: {result.log_file} (every process's log is in {Path(result.log_file).parent})")
            lines.extend(f"  | {line}" for line in result.log_tail)
    elif result.missing:
        lines.append("filemq demo: INCOMPLETE, not yet available: " + ", ".join(f"filemq {c}" for c in result.missing))
    else:
        lines.append(f"filemq demo: FAILED, lost: {num(result.lost)} acknowledged messages")
    files = f" in {result.landing_files:,} files" if result.landing_files is not None else ""
    rows = [
        ("messages published", num(result.published), "handed to the MQTT client by the sensors"),
        ("acknowledged", num(result.acknowledged), "PUBACK received: the oracle"),
        ("landed rows", num(result.landed_rows), f"in Parquet landing files{files}, incl. duplicates"),
        ("rows in curated table", num(result.table_rows), "one per (device_id, stream, offset)"),
        ("dropped at collector", num(result.dropped_at_collector), "re-sent records the collector already had"),
        ("duplicates removed", num(result.duplicates_removed), "by the ingest: landed rows - table rows"),
        ("re-sent by QoS 1", num(result.resent_by_qos1), "stored twice at the device after the power cut"),
        ("lost", num(result.lost), "acknowledged but not in the table"),
    ]
    for label, value, note in rows:
        lines.append(f"  {label:<22}{value:>10}   {note}")
    if result.table_rows is None and result.lost is not None:
        lines.append("  (no curated table: lost is checked against the landed files)")
    if result.lost_sample:
        lines.append("  missing ids (first ones): " + ", ".join(result.lost_sample))
    if result.fleet_events_in_table is not None:
        later = (result.fleet_events_landed or 0) - result.fleet_events_in_table
        lines.append(f"  {'fleet_events':<22}{num(result.fleet_events_in_table):>10}   "
                     f"{num(result.fleet_connects)} connects, {num(result.fleet_disconnects)} disconnects, "
                     f"{num(result.fleet_health_reports)} health reports, each once"
                     + (f" ({later:,} more reports landed after the ingest began)" if later > 0 else ""))
    if result.fleet:
        lines.append("  the fleet (filemq fleet):")
        lines.extend(f"    {line}" for line in result.fleet)
    lines.append("  phases: " + ", ".join(_phase_text(p) for p in result.phases))
    kept = "" if result.work_dir_kept else " (removed; --keep keeps it)"
    lines.append(f"  total {result.seconds:.1f} s, work dir {result.work_dir}{kept}")
    return lines


def _phase_text(phase: PhaseResult) -> str:
    if phase.status == "ok":
        return f"{phase.name} {phase.seconds:.1f} s"
    return f"{phase.name} ({phase.status})"


# ---------------------------------------------------------------------------- processes


class _Service:
    """One ``filemq`` subprocess (collector or agent) that can be stopped, killed and restarted."""

    def __init__(self, name: str, argv: list[str], log_file: Path, port: int) -> None:
        self.name = name
        self.argv = argv
        self.log_file = log_file
        self.port = port
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    async def start(self, timeout: float, phase: str) -> None:
        self.starts += 1
        with self.log_file.open("ab") as out:
            out.write(f"\n=== filemq demo: start #{self.starts}: {' '.join(self.argv)}\n".encode())
            out.flush()
            # Its own session: a kill of its process group never reaches the demo itself.
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.returncode is not None:
                raise DemoError(phase, f"{self.name} exited with code {self.proc.returncode} at start", self.log_file)
            if await _port_open(self.port):
                return
            if time.monotonic() > deadline:
                raise DemoError(phase, f"{self.name} did not accept connections on port {self.port} "
                                       f"within {timeout:.0f} s", self.log_file)
            await asyncio.sleep(0.1)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def stop(self, timeout: float) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit code."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return None if proc is None else proc.returncode
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout):
                return await proc.wait()
        except TimeoutError:
            log.warning("%s did not stop within %.0f s of SIGTERM; killing it", self.name, timeout)
            return await self.kill()

    async def kill(self) -> int:
        """SIGKILL: what a power cut does to the process."""
        proc = self.proc
        assert proc is not None
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        return await proc.wait()


async def _port_open(port: int) -> bool:
    try:
        async with asyncio.timeout(1.0):
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all bound at once, so the kernel cannot repeat one).

    A small race remains (another process may take one before the service binds); the
    start-up check then reports it with the service's log.
    """
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


async def _run_command(argv: list[str], timeout: float, log_file: Path | None = None) -> tuple[int, str, str]:
    """Run a command to completion (bounded); returns (exit code, stdout, stderr).

    With ``log_file``, stderr goes there (appended) instead of being captured.
    """
    with contextlib.ExitStack() as stack:
        err: Any = asyncio.subprocess.PIPE
        if log_file is not None:
            err = stack.enter_context(log_file.open("ab"))
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=err,
            start_new_session=True,
        )
        try:
            async with asyncio.timeout(timeout):
                out, errb = await proc.communicate()
        except (TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
    return proc.returncode or 0, out.decode(errors="replace"), (errb or b"").decode(errors="replace")


def _last_json_object(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                value = json.loads(line)
                if isinstance(value, dict):
                    return value
    return None


# ---------------------------------------------------------------------------- sensors


class _Sensors:
    """Simulated sensors: QoS 1 publishers that reconnect; the oracle is what got a PUBACK."""

    def __init__(self, count: int, rate: float, port: int, seed: int) -> None:
        self.count = count
        self.interval = 1.0 / rate
        self.port = port
        self.rng = random.Random(seed)
        self.published = 0
        self.acked: set[str] = set()
        self.failed = 0
        self.reconnects = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._clients: list[MQTTClient] = []
        self._pending: set[asyncio.Future[None]] = set()

    def start(self) -> None:
        for i in range(1, self.count + 1):
            client = MQTTClient(f"demo-sensor-{i}", "127.0.0.1", self.port, keepalive=10, max_inflight=50)
            self._clients.append(client)
            self._tasks.append(asyncio.create_task(self._run(i, client), name=f"demo-sensor-{i}"))

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def _run(self, index: int, client: MQTTClient) -> None:
        sensor = f"s{index}"
        topic = f"sensors/{sensor}/env"
        temperature = 20.0 + self.rng.uniform(-2, 2)
        humidity = 45.0 + self.rng.uniform(-5, 5)
        seq = 0
        next_at = time.monotonic()
        first = True
        while not self._stop.is_set():
            if not client.connected:
                try:
                    await client.connect(timeout=2.0)
                    if not first:
                        self.reconnects += 1
                    first = False
                except (OSError, TimeoutError, MQTTClientError) as exc:
                    log.debug("sensor %s: connect failed: %s", sensor, exc)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.2):
                            await self._stop.wait()
                    continue
                next_at = time.monotonic()
            # A device app that cannot reach the broker skips readings; while connected it
            # publishes at its rate and lets the client keep up to max_inflight unacked.
            seq += 1
            temperature += self.rng.uniform(-0.2, 0.2)
            humidity = min(100.0, max(0.0, humidity + self.rng.uniform(-0.5, 0.5)))
            msg_id = f"{sensor}-{seq:07d}"
            payload = json.dumps(
                {"id": msg_id, "sensor": sensor, "seq": seq, "temperature": round(temperature, 2),
                 "humidity": round(humidity, 2)},
                separators=(",", ":"),
            ).encode()
            future = client.publish_nowait(topic, payload, qos=1)
            self.published += 1
            self._pending.add(future)
            future.add_done_callback(functools.partial(self._done, msg_id=msg_id))
            next_at += self.interval
            delay = next_at - time.monotonic()
            if delay < -1.0:
                next_at = time.monotonic()  # fell behind (a reconnect): do not burst to catch up
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, delay)):
                    await self._wait_stop_or_close(client)

    async def _wait_stop_or_close(self, client: MQTTClient) -> None:
        stop = asyncio.ensure_future(self._stop.wait())
        closed = asyncio.ensure_future(client.closed.wait())
        try:
            await asyncio.wait({stop, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            closed.cancel()

    def _done(self, future: asyncio.Future[None], msg_id: str) -> None:
        self._pending.discard(future)
        if future.cancelled() or future.exception() is not None:
            self.failed += 1
        else:
            self.acked.add(msg_id)

    async def stop(self, settle_timeout: float) -> None:
        """Stop publishing, give in-flight publishes ``settle_timeout`` to be acked, disconnect."""
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        deadline = time.monotonic() + settle_timeout
        while self._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for client in self._clients:
            with contextlib.suppress(Exception):
                await client.disconnect(timeout=2.0)


# ---------------------------------------------------------------------------- the demo


class _Demo:
    def __init__(self, options: DemoOptions, work_dir: Path, progress: ProgressCallback) -> None:
        self.options = options
        self.dir = work_dir
        self.progress = progress
        self.filemq = list(options.filemq_command or default_filemq_command())
        self.result = DemoResult(work_dir=str(work_dir))
        self.logs = work_dir / "logs"
        self.sensors: _Sensors | None = None
        self.services: list[_Service] = []
        self.phase_started = 0.0
        self.metrics_port = 0
        self._drops_unknown = False
        self.current_phase = ""

    # ---------------------------------------------------------------- reporting

    def _say(self, message: str) -> None:
        self.progress(DemoProgress("phase", self.current_phase, message))

    def _status(self, detail: str = "") -> None:
        elapsed = time.monotonic() - self.phase_started
        parts = [f"[{self.current_phase} {elapsed:4.1f}s]"]
        if self.sensors is not None and not self.sensors.stopped:
            s = self.sensors
            parts.append(f"published {s.published:,} acked {len(s.acked):,} in flight {s.in_flight:,}")
        if detail:
            parts.append(detail)
        self.progress(DemoProgress("status", self.current_phase, " ".join(parts)))

    @contextlib.contextmanager
    def _phase(self, name: str, what: str) -> Iterator[None]:
        self.current_phase = name
        self.phase_started = time.monotonic()
        self._say(f"{name}: {what}")
        entry = PhaseResult(name, 0.0)
        self.result.phases.append(entry)
        try:
            yield
        except BaseException:
            entry.status = "failed"
            raise
        finally:
            entry.seconds = time.monotonic() - self.phase_started
        self._say(f"{name}: done in {entry.seconds:.1f} s")

    def _not_available(self, name: str, command: str) -> None:
        self.result.phases.append(PhaseResult(name, 0.0, f"not yet available: filemq {command}"))
        self._say(f"{name}: not yet available: filemq {command}")

    async def _sleep_with_status(self, seconds: float, detail: Callable[[], str] = lambda: "") -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self._status(detail())
            await asyncio.sleep(min(0.5, left))

    # ---------------------------------------------------------------- run

    async def run(self) -> DemoResult:
        started = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        main_task = asyncio.current_task()
        handles_sigterm = False
        if main_task is not None:
            # SIGTERM (a CI timeout, `kill`) cancels like Ctrl-C does, so the cleanup below
            # still stops the collector, the agent and Spark; they run in their own sessions
            # and would otherwise outlive the demo.
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signal.SIGTERM, main_task.cancel)
                handles_sigterm = True
        try:
            await self._run_phases()
        except asyncio.CancelledError:
            self.result.failed_phase = self.current_phase
            self.result.error = "interrupted (SIGINT/SIGTERM); every process the demo started was stopped"
            self._say(f"{self.current_phase}: interrupted")
        except DemoError as exc:
            self.result.failed_phase = exc.phase
            self.result.error = exc.reason
            self.result.log_file = str(exc.log_file) if exc.log_file else None
            self.result.log_tail = _tail(exc.log_file, 12) if exc.log_file else []
            self._say(str(exc))
        finally:
            if self.sensors is not None:
                with contextlib.suppress(Exception):
                    await self.sensors.stop(0.0)
            for service in self.services:
                with contextlib.suppress(Exception):
                    await service.stop(self.options.stop_timeout_s)
            if handles_sigterm:
                loop.remove_signal_handler(signal.SIGTERM)
        self.result.seconds = time.monotonic() - started
        return self.result

    async def _run_phases(self) -> None:
        opts = self.options
        d = self.dir
        self.current_phase = "check"
        missing = await self._missing_commands()
        self.result.missing = missing
        if missing:
            self._say("not yet available: " + ", ".join(f"filemq {c}" for c in missing))
        if "collector" in missing or "agent" in missing:
            for name, command in (("start", "collector" if "collector" in missing else "agent"),):
                self._not_available(name, command)
            return
        collector_port, agent_port, self.metrics_port = _free_ports(3)
        # The default reconnect backoff grows to 60 s: right for a fleet, too slow for a demo
        # whose collector is down for seconds. No flag for it, so a config file.
        # ~130 bytes per record in a batch (topic, JSON payload, offset, timestamp, qos).
        uplink_rate = max(4096, int(opts.sensors * opts.rate_per_sensor * 130 * opts.uplink_speedup))
        agent_config = d / "agent.toml"
        agent_config.write_text("[agent]\nbackoff_initial_ms = 200\nbackoff_max_ms = 1000\n")
        collector = _Service(
            "collector",
            [*self.filemq, "collector", "--data-dir", str(d / "collector"), "--landing", str(d / "landing"),
             "--host", "127.0.0.1", "--port", str(collector_port), "--roll-seconds", str(opts.roll_seconds),
             "--metrics-port", str(self.metrics_port)],
            self.logs / "collector.log", collector_port,
        )
        agent = _Service(
            "agent",
            [*self.filemq, "agent", "--data-dir", str(d / "agent"), "--device-id", DEVICE_ID,
             "--collector", f"127.0.0.1:{collector_port}", "--host", "127.0.0.1", "--port", str(agent_port),
             "--config", str(agent_config), "--batch-records", str(opts.batch_records),
             "--rate-limit-bytes-per-s", str(uplink_rate), "--health-interval-s", "2"],
            self.logs / "agent.log", agent_port,
        )
        self.services = [agent, collector]

        with self._phase("start", "collector and agent on loopback"):
            await collector.start(opts.start_timeout_s, "start")
            await agent.start(opts.start_timeout_s, "start")
            self._say(f"start: collector on 127.0.0.1:{collector_port}, agent (device {DEVICE_ID}) "
                      f"on 127.0.0.1:{agent_port}, logs in {self.logs}")

        self.sensors = sensors = _Sensors(opts.sensors, opts.rate_per_sensor, agent_port, opts.seed)
        with self._phase("online", f"{opts.sensors} sensors x {opts.rate_per_sensor:g} msg/s, QoS 1, all up"):
            sensors.start()
            await self._sleep_with_status(opts.online_s)
            self._check_alive("online", collector, agent)

        with self._phase("uplink cut", "collector stopped (SIGTERM); the agent keeps storing"):
            await self._count_collector_drops()
            code = await collector.stop(opts.stop_timeout_s)
            self._say(f"uplink cut: collector exited with code {code}")
            await self._sleep_with_status(opts.uplink_down_s, lambda: "collector down")
            self._check_alive("uplink cut", agent)

        with self._phase("power cut", "kill -9 of the agent mid-stream, then restart it"):
            # Cut while a publish is on the wire when we can (bounded): that is the case where
            # a sensor cannot know whether its message was stored.
            deadline = time.monotonic() + 2.0
            while sensors.in_flight == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            acked_before = len(sensors.acked)
            await agent.kill()
            self._say(f"power cut: agent killed (SIGKILL) with {sensors.in_flight} publishes in flight, "
                      f"{acked_before:,} acked so far")
            await self._sleep_with_status(opts.power_off_s, lambda: "device dark")
            await agent.start(opts.start_timeout_s, "power cut")
            self._say("power cut: agent restarted; sensors reconnect and resend what was not acked")
            await self._sleep_with_status(opts.agent_back_s, lambda: "collector still down")
            self._check_alive("power cut", agent)

        with self._phase("uplink back", "collector restarted; the backlog drains over the metered link"):
            await collector.start(opts.start_timeout_s, "uplink back")
            await self._sleep_with_status(opts.drain_cut_after_s, lambda: "draining while publishing")
            self._check_alive("uplink back", collector, agent)

        with self._phase("power flicker", "kill -9 of the agent while it forwards, then restart it"):
            lag = await self._group_lag(self.dir / "agent", "export.collector")
            await agent.kill()
            self._say(f"power flicker: agent killed (SIGKILL) mid-drain, forwarder lag {_opt(lag)} records; "
                      "it resends what it had not yet recorded as acknowledged")
            await self._sleep_with_status(opts.flicker_off_s, lambda: "device dark")
            await agent.start(opts.start_timeout_s, "power flicker")
            await self._sleep_with_status(opts.uplink_back_s, lambda: "draining while publishing")
            await sensors.stop(opts.settle_timeout_s)
            self.result.published = sensors.published
            self.result.acknowledged = len(sensors.acked)
            self._check_alive("power flicker", collector, agent)
            self._say(f"power flicker: sensors stopped: {sensors.published:,} published, "
                      f"{len(sensors.acked):,} acknowledged, {sensors.reconnects} reconnects")

        if "status" in missing:
            self._not_available("drain", "status")
            # Without status there is no way to know the backlog drained; give it a fixed time.
            await asyncio.sleep(10.0)
        else:
            with self._phase("drain", "wait for forwarder lag 0 and everything landed"):
                await self._wait_drained(agent, collector)
                await self._count_collector_drops()
                await self._fleet_table()

        java = java_available()
        if "ingest" in missing:
            self._not_available("ingest", "ingest")
        elif not java:
            self.result.phases.append(PhaseResult("ingest", 0.0, f"skipped: {NO_JAVA}"))
            self._say(f"ingest: skipped: {NO_JAVA}")
        else:
            with self._phase("ingest", "filemq ingest --once (Spark)"):
                await self._ingest()

        ingest_ran = "ingest" not in missing and java
        with self._phase("verify", "compare the curated table with the oracle"):
            await asyncio.to_thread(self._verify, sensors.acked, ingest_ran=ingest_ran)
        if "ingest" not in missing and not java:
            # Everything up to the landing was checked; the table was not: still a failure.
            raise DemoError("ingest", NO_JAVA)

    def _check_alive(self, phase: str, *services: _Service) -> None:
        for service in services:
            if not service.running:
                code = service.proc.returncode if service.proc else None
                raise DemoError(phase, f"{service.name} exited unexpectedly with code {code}", service.log_file)

    async def _missing_commands(self) -> list[str]:
        async def probe(command: str) -> bool:
            try:
                code, _out, _err = await _run_command([*self.filemq, command, "--help"], 60.0)
            except (OSError, TimeoutError):
                return False
            return code == 0

        found = await asyncio.gather(*(probe(c) for c in REQUIRED_COMMANDS))
        return [c for c, ok in zip(REQUIRED_COMMANDS, found, strict=True) if not ok]

    async def _group_lag(self, data_dir: Path, group: str) -> int | None:
        """The named group's lag from ``filemq status DIR --json``; None if not readable yet."""
        try:
            code, out, err = await _run_command([*self.filemq, "status", str(data_dir), "--json"], 30.0)
        except (OSError, TimeoutError) as exc:
            log.debug("status %s: %s", data_dir, exc)
            return None
        if code != 0:
            log.debug("status %s exited %d: %s", data_dir, code, err.strip())
            return None
        status = _last_json_object(out)
        if status is None:
            return None
        for entry in status.get("groups", []):
            if isinstance(entry, dict) and entry.get("name") == group:
                lag = entry.get("lag")
                return int(lag) if isinstance(lag, int) else None
        return None

    async def _count_collector_drops(self) -> None:
        """Add the running collector's duplicate-records counter (its metrics restart at 0
        with the process, so it is read before each stop). Informative: a failed scrape
        leaves the figure unknown, it does not fail the demo."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            text = await asyncio.to_thread(_http_get, url, 5.0)
        except OSError as exc:
            log.info("collector metrics at %s not readable: %s", url, exc)
            self._drops_unknown = True
            return
        value = _metric(text, "filemq_collector_duplicate_records_dropped_total")
        if value is None or self._drops_unknown:
            self._drops_unknown = True
            self.result.dropped_at_collector = None
            return
        self.result.dropped_at_collector = (self.result.dropped_at_collector or 0) + int(value)

    async def _fleet_table(self) -> None:
        """The collector's fleet from ``filemq fleet`` (informative: a failed read leaves it out
        of the summary, it does not fail the demo)."""
        argv = [*self.filemq, "fleet", "--url", f"http://127.0.0.1:{self.metrics_port}"]
        try:
            code, out, err = await _run_command(argv, 60.0)
        except (OSError, TimeoutError) as exc:
            log.info("filemq fleet: %s", exc)
            return
        if code != 0:
            log.info("filemq fleet exited %d: %s", code, err.strip())
            return
        self.result.fleet = out.rstrip("\n").splitlines()

    async def _wait_drained(self, agent: _Service, collector: _Service) -> None:
        deadline = time.monotonic() + self.options.drain_timeout_s
        forwarder: int | None = None
        lander: int | None = None
        while True:
            self._check_alive("drain", agent, collector)
            forwarder = await self._group_lag(self.dir / "agent", "export.collector")
            if forwarder == 0:
                lander = await self._group_lag(self.dir / "collector", "lander")
                if lander == 0:
                    self._say("drain: forwarder lag 0, lander lag 0")
                    return
            self._status(f"forwarder lag {_opt(forwarder)} lander lag {_opt(lander)}")
            if time.monotonic() > deadline:
                blame = agent if forwarder != 0 else collector
                raise DemoError("drain", f"backlog not drained within {self.options.drain_timeout_s:.0f} s "
                                         f"(forwarder lag {_opt(forwarder)}, lander lag {_opt(lander)})",
                                blame.log_file)
            await asyncio.sleep(0.5)

    async def _ingest(self) -> None:
        d = self.dir
        log_file = self.logs / "ingest.log"
        argv = [*self.filemq, "ingest", "--landing", str(d / "landing"), "--table", str(d / "table"),
                "--checkpoint", str(d / "checkpoint"), "--once", "--payload", "json",
                "--payload-schema", PAYLOAD_SCHEMA, "--json"]
        with log_file.open("ab") as out:
            out.write(f"\n=== filemq demo: {' '.join(argv)}\n".encode())
        task = asyncio.create_task(_run_command(argv, self.options.ingest_timeout_s, log_file))
        try:
            while not task.done():
                self._status("Spark is running the ingest (starting a JVM takes a while)")
                await asyncio.wait({task}, timeout=0.5)
        finally:
            if not task.done():  # interrupted: _run_command kills Spark when cancelled
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await task
        try:
            code, out_text, _ = task.result()
        except TimeoutError:
            raise DemoError("ingest", f"did not finish within {self.options.ingest_timeout_s:.0f} s",
                            log_file) from None
        if code != 0:
            raise DemoError("ingest", f"filemq ingest exited with code {code}", log_file)
        self.result.ingest_summary = _last_json_object(out_text)

    # ---------------------------------------------------------------- verification

    def _verify(self, acked: set[str], *, ingest_ran: bool) -> None:
        try:
            import pyarrow.dataset as ds
        except ImportError:
            raise DemoError("verify", "pyarrow is not installed: pip install 'filemq[collector]'") from None

        from collector.landing import visible_files

        landing = self.dir / "landing" / "incoming"
        if landing.exists():
            landed = ds.dataset(str(landing), format="parquet", partitioning="hive").to_table(
                columns=["device_id", "stream", "offset", "payload"])
            self.result.landing_files = len(visible_files(landing, "*.parquet"))
        else:
            landed = None
            self.result.landing_files = 0
        self.result.landed_rows = 0 if landed is None else landed.num_rows

        table_dir = self.dir / "table"
        if ingest_ran:
            if not table_dir.exists():
                raise DemoError("verify", f"the ingest wrote no table at {table_dir}", self.logs / "ingest.log")
            table = ds.dataset(str(table_dir), format="parquet", partitioning="hive").to_table(
                columns=["device_id", "stream", "offset", "payload"])
        else:
            # No ingest yet: check the landed files instead, deduplicated here by the same key.
            table = landed
        rows = _rows(table)
        keys = Counter((r[0], r[1], r[2]) for r in rows)
        if ingest_ran:
            self.result.table_rows = len(rows)
            self.result.duplicate_keys_in_table = sum(n - 1 for n in keys.values() if n > 1)
            self.result.duplicates_removed = self.result.landed_rows - len(rows)
        ids: Counter[str] = Counter()
        seen_keys: set[tuple[str, str, int]] = set()
        for device_id, stream, offset, payload in rows:
            if (device_id, stream, offset) in seen_keys:
                continue
            seen_keys.add((device_id, stream, offset))
            msg_id = _message_id(payload)
            if msg_id is not None and device_id == DEVICE_ID:
                ids[msg_id] += 1
        missing = sorted(acked - ids.keys())
        self.result.lost = len(missing)
        self.result.lost_sample = missing[:5]
        self.result.resent_by_qos1 = sum(n - 1 for n in ids.values() if n > 1)
        self.result.unacknowledged_but_stored = len(ids.keys() - acked)
        if missing:
            raise DemoError("verify", f"{len(missing):,} acknowledged messages are missing, e.g. {missing[:3]}",
                            self.logs / "agent.log")
        if self.result.duplicate_keys_in_table:
            raise DemoError("verify", f"{self.result.duplicate_keys_in_table:,} duplicate (device_id, stream, "
                                      "offset) keys in the curated table", self.logs / "ingest.log")
        if ingest_ran:
            self._verify_fleet_events(ds)

    def _verify_fleet_events(self, ds: Any) -> None:
        """fleet_events holds every connect, disconnect and health report the collector landed,
        each once, and the device's connects and disconnects alternate, starting with a connect."""
        landing = self.dir / "landing" / "fleet_events" / "incoming"
        if not landing.exists():
            return
        columns = ["device_id", "stream", "offset", "topic"]
        landed = _keyed(ds.dataset(str(landing), format="parquet", partitioning="hive").to_table(columns=columns))
        table_dir = self.dir / "fleet_events"
        if not table_dir.exists():
            raise DemoError("verify", f"the ingest wrote no fleet_events table at {table_dir}",
                            self.logs / "ingest.log")
        rows = _keyed(ds.dataset(str(table_dir), format="parquet", partitioning="hive").to_table(columns=columns))
        keys = Counter(r[:3] for r in rows)
        unique_landed = {r[:3]: r[3] for r in landed}
        self.result.fleet_events_landed = len(landed)
        self.result.fleet_events_in_table = len(rows)
        events = [r[3] for r in sorted(rows, key=lambda r: r[2]) if r[0] == DEVICE_ID]
        lifecycle = [e for e in events if e in ("connect", "disconnect")]
        self.result.fleet_connects = lifecycle.count("connect")
        self.result.fleet_disconnects = lifecycle.count("disconnect")
        self.result.fleet_health_reports = events.count("health")
        twice = sum(n - 1 for n in keys.values() if n > 1)
        in_table = {r[:3]: r[3] for r in rows}
        # Health reports keep landing while the ingest runs (the agent is still connected): the
        # table holds what had landed when it started; every connect and disconnect had.
        unknown = [k for k, event in in_table.items() if unique_landed.get(k) != event]
        absent = [k for k, event in unique_landed.items() if event != "health" and k not in in_table]
        if twice or unknown or absent:
            raise DemoError("verify", f"fleet_events does not hold each landed event once ({twice} twice, "
                                      f"{len(unknown)} never landed, {len(absent)} connects/disconnects missing)",
                            self.logs / "ingest.log")
        expected = ["connect", "disconnect"] * (len(lifecycle) // 2) + ["connect"] * (len(lifecycle) % 2)
        # Online, cut (collector stopped), back, flicker (agent killed), back again: at least so many.
        if lifecycle != expected or self.result.fleet_connects < 3 or self.result.fleet_disconnects < 2:
            raise DemoError("verify", f"fleet_events of {DEVICE_ID}: connects and disconnects {lifecycle} "
                                      "do not follow the demo's cuts", self.logs / "collector.log")


def _rows(table: Any) -> list[tuple[str, str, int, bytes]]:
    if table is None:
        return []
    columns = [table.column(name).to_pylist() for name in ("device_id", "stream", "offset", "payload")]
    return list(zip(*columns, strict=True))


def _keyed(table: Any) -> list[tuple[str, str, int, str]]:
    columns = [table.column(name).to_pylist() for name in ("device_id", "stream", "offset", "topic")]
    return list(zip(*columns, strict=True))


def _message_id(payload: bytes | str | None) -> str | None:
    if payload is None:
        return None
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    msg_id = value.get("id") if isinstance(value, dict) else None
    return msg_id if isinstance(msg_id, str) else None


def _http_get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # loopback only
        body: bytes = response.read()
    return body.decode(errors="replace")


def _metric(text: str, name: str) -> float | None:
    """The value of an unlabelled metric in Prometheus text format."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            with contextlib.suppress(ValueError):
                return float(line.split()[1])
    return None


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line.rstrip() for line in text.splitlines()[-lines:]]


def _opt(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"
