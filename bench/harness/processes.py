"""The processes a bench starts and stops: brokers under test as real subprocesses on loopback
(filemq, Debian mosquitto and stock amqtt), ``filemq`` commands (agent, collector, broker) for
the forward benches, free ports, and progress lines on stderr.

Brokers: Debian mosquitto and stock amqtt.

Both baselines are run the way a device would run them, with the same load generator as
filemq (:mod:`bench.loadgen`):

* **mosquitto** (Debian 2.0): default persistence (``persistence true`` with a
  ``persistence_location`` in the run's temporary directory; mosquitto writes its store only
  on autosave and at shutdown, so it acknowledges before anything is on disk),
  ``max_inflight_messages 100`` (``filemq bench broker --max-inflight N`` sets it and filemq's
  window to N) and an unlimited queue (``max_queued_messages 0``) so a slow
  subscriber is not silently dropped messages.
* **amqtt**: the stock broker configuration (``amqtt -c``) with only the listener moved to
  a loopback port.

What a caller may rely on: :func:`start_mosquitto` / :func:`start_amqtt` return only once the
broker answered a CONNECT with CONNACK (or raise :class:`BrokerStartError` with the tail of
its log); :meth:`BrokerProcess.stop` always leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.cpu import CLOCK_TICKS, descendants, proc_cpu_ticks_split
from filemq.broker.server import (
    free_port as free_port,  # (the one copy; re-exported for the benches)
)
from filemq.mqtt.codec import Decoder, ProtocolError, encode
from filemq.mqtt.packets import CONNACK_ACCEPTED, Connack, Connect, Disconnect
from filemq.ops.fdlimit import raise_nofile_limit

LOOPBACK = "127.0.0.1"
MOSQUITTO = os.environ.get("FILEMQ_BENCH_MOSQUITTO", "/usr/sbin/mosquitto")
MOSQUITTO_MAX_INFLIGHT = 100  # the baseline's max_inflight_messages unless a run sets both brokers' window


class BrokerStartError(RuntimeError):
    """A broker process exited or did not accept MQTT connections in time."""

    def __init__(self, name: str, detail: str, log_path: Path | None = None) -> None:
        tail = ""
        if log_path is not None and log_path.exists():
            lines = log_path.read_text(errors="replace").splitlines()[-15:]
            tail = "\n  " + "\n  ".join(lines) if lines else ""
        where = f" (log {log_path})" if log_path is not None else ""
        super().__init__(f"{name}: {detail}{where}{tail}")
        self.name = name
        self.log_path = log_path


def mqtt_ping(host: str, port: int, timeout: float = 1.0, client_id: str = "bench-ping") -> bool:
    """True if a CONNECT (clean session) to ``host:port`` gets an accepting CONNACK."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(encode(Connect(client_id=client_id, clean_session=True, keepalive=10)))
            decoder = Decoder(server=False)
            while True:
                data = sock.recv(4096)
                if not data:
                    return False
                decoder.feed(data)
                packet = decoder.next_packet()
                if packet is not None:
                    ok = isinstance(packet, Connack) and packet.return_code == CONNACK_ACCEPTED
                    if ok:
                        with contextlib.suppress(OSError):
                            sock.sendall(encode(Disconnect()))
                    return ok
    except (OSError, ProtocolError):
        return False


@dataclass
class BrokerProcess:
    """A broker running as a child process, listening on ``host:port``; output in ``log_path``."""

    name: str
    host: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    spawned_at: float  # time.monotonic() just before the spawn
    ready_seconds: float = 0.0  # spawn -> first accepted CONNECT
    cleanup: list[Path] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = 20.0, poll_s: float = 0.005) -> float:
        """Poll with CONNECT until accepted; returns seconds since the spawn.

        Raises :class:`BrokerStartError` if the process exits or ``timeout`` passes.
        """
        deadline = time.monotonic() + timeout
        while True:
            if mqtt_ping(self.host, self.port, timeout=1.0):
                self.ready_seconds = time.monotonic() - self.spawned_at
                return self.ready_seconds
            code = self.proc.poll()
            if code is not None:
                raise BrokerStartError(self.name, f"exited with code {code} before accepting connections",
                                       self.log_path)
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerStartError(self.name, f"no CONNACK on {self.host}:{self.port} within {timeout:.0f} s",
                                       self.log_path)
            time.sleep(poll_s)

    def kill9(self) -> None:
        """SIGKILL the process (a crash: nothing flushed) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (clean shutdown), SIGKILL after ``timeout``; returns the exit code.

        The code is the one from SIGTERM handling, or None if SIGKILL had to be used.
        Temporary files registered in ``cleanup`` are removed.
        """
        code: int | None = self.proc.poll()
        if code is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
                code = None
        for path in self.cleanup:
            shutil.rmtree(path, ignore_errors=True)
        self.cleanup.clear()
        return code

    def rss_bytes(self) -> int:
        """Resident set size (VmRSS in /proc/PID/status)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {self.pid}")

    def cpu_seconds(self) -> float:
        """User + system CPU time used so far by the broker: the process with all its threads,
        its live descendants (helper processes), and the children it already reaped
        (/proc/PID/stat utime + stime + cutime + cstime of each)."""
        return sum(self.cpu_split())

    def cpu_split(self) -> tuple[float, float]:
        """:meth:`cpu_seconds` as (user, system): utime + cutime and stime + cstime of the
        same processes. Where a broker's CPU goes says what could cut it: interpreter work
        (user) or system calls (system)."""
        ticks = [proc_cpu_ticks_split(pid) for pid in [self.pid, *descendants(self.pid)]]
        return sum(u for u, _ in ticks) / CLOCK_TICKS, sum(s for _, s in ticks) / CLOCK_TICKS

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn(name: str, argv: Sequence[str], host: str, port: int, log_path: Path,
          env: dict[str, str] | None = None, cwd: Path | None = None) -> BrokerProcess:
    """Start ``argv`` with stdout+stderr to ``log_path``; does not wait for readiness."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        spawned_at = time.monotonic()
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True)
    return BrokerProcess(name, host, port, proc, log_path, spawned_at)


def mosquitto_available() -> bool:
    return os.access(MOSQUITTO, os.X_OK)


def start_mosquitto(workdir: Path, port: int | None = None, *, host: str = LOOPBACK,
                    timeout: float = 10.0, max_inflight: int = MOSQUITTO_MAX_INFLIGHT) -> BrokerProcess:
    """Debian mosquitto with default persistence in ``workdir``; returns once it accepts CONNECT.

    ``max_inflight`` is its ``max_inflight_messages`` (QoS 1/2 deliveries in flight per client)."""
    if not mosquitto_available():
        raise BrokerStartError("mosquitto", f"{MOSQUITTO} not found (apt-get install mosquitto)")
    port = port or free_port(host)
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "mosquitto-store"
    store.mkdir(exist_ok=True)
    conf = workdir / "mosquitto.conf"
    conf.write_text(
        f"listener {port} {host}\n"
        "allow_anonymous true\n"
        "persistence true\n"
        f"persistence_location {store}/\n"
        f"max_inflight_messages {max_inflight}\n"
        # 0 = no limit in mosquitto 2.0: a backlogged subscriber must not lose messages.
        "max_queued_messages 0\n"
        "log_dest stderr\n"
        "log_type error\n"
        "log_type warning\n"
    )
    broker = spawn("mosquitto", [MOSQUITTO, "-c", str(conf)], host, port, workdir / "mosquitto.log")
    broker.wait_ready(timeout)
    return broker


def start_amqtt(workdir: Path, port: int | None = None, *, host: str = LOOPBACK,
                timeout: float = 30.0) -> BrokerProcess:
    """The stock amqtt broker (its default plugins) on ``host:port``; returns once it accepts CONNECT."""
    port = port or free_port(host)
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "amqtt.yaml"
    # The stock default_broker.yaml, with the listener on loopback and the given port.
    conf.write_text(
        "listeners:\n"
        "  default:\n"
        "    type: tcp\n"
        f"    bind: {host}:{port}\n"
        "plugins:\n"
        "  amqtt.plugins.logging_amqtt.EventLoggerPlugin:\n"
        "  amqtt.plugins.logging_amqtt.PacketLoggerPlugin:\n"
        "  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
        "    allow_anonymous: true\n"
        "  amqtt.plugins.sys.broker.BrokerSysPlugin:\n"
        "    sys_interval: 20\n"
    )
    script = ("import sys; from amqtt.scripts.broker_script import main; "
              "sys.argv = ['amqtt', '-c', sys.argv[1]]; main()")
    broker = spawn("amqtt", [sys.executable, "-c", script, str(conf)], host, port, workdir / "amqtt.log")
    broker.wait_ready(timeout)
    return broker


# --------------------------------------------------------------------------- filemq commands


def say(message: str) -> None:
    """A progress line for people, on stderr (stdout is for --json)."""
    print(message, file=sys.stderr, flush=True)


def start_cli(*args: str, log_path: Path) -> subprocess.Popen[bytes]:
    """A ``filemq`` subprocess (``python -m cli ARGS``); waits for its first stdout line (it is
    listening).  ``FILEMQ_BENCH_VERBOSE`` in the environment adds ``-v``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    err = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    proc = subprocess.Popen([sys.executable, "-m", "cli", *(["-v"] if os.environ.get("FILEMQ_BENCH_VERBOSE") else []), *args], stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise RuntimeError(f"filemq {args[0]} did not start (exit {proc.returncode}); see {log_path}")
    return proc


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; returns once ``proc`` is gone."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def mosquitto_bridge_conf(path: Path, port: int, extra: str = "") -> Path:
    """A mosquitto configuration for the forward benches' bridge baselines: loopback listener,
    anonymous, unlimited queues, no persistence; ``extra`` appended."""
    path.write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\nmax_queued_bytes 0\n"
        f"persistence false\n{extra}"
    )
    return path


def descriptor_shortfall(connections: int) -> str | None:
    """In a load process about to open ``connections`` sockets (one per simulated device):
    raise its open-file limit as far as allowed, and say why it cannot go on if that is still
    too low (None if it can)."""
    soft, _ = raise_nofile_limit()
    if 0 <= soft < connections + 64:
        return f"this load process may open only {soft} files (ulimit -n) for {connections} devices"
    return None


def load_failure(procs: list[Any], errors: Any) -> str | None:
    """Why the load processes cannot finish (a reported error on the ``errors`` queue, or one
    died), else None."""
    try:
        return f"devices cannot reach the collector: {errors.get_nowait()}"
    except queue.Empty:
        pass
    for p in procs:
        if not p.is_alive() and p.exitcode not in (0, None):
            return f"a load process died (exit code {p.exitcode})"
    return None
