"""systemd readiness and watchdog (filemq/ops/sdnotify.py, filemq/ops/service.py; docs/DEPLOYMENT.md).

The tests bind the ``NOTIFY_SOCKET`` datagram socket themselves, as systemd does, and read
what a real ``filemq broker|agent|collector`` process sends (sd_notify(3)): ``READY=1`` with a
``STATUS=`` once it listens, ``WATCHDOG=1`` at half of ``WATCHDOG_USEC``, ``STOPPING=1`` on
SIGTERM. ``systemd-analyze verify`` checks the unit files the docs include.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from filemq.ops import sdnotify
from filemq.ops.service import EXIT_OK, serve_until_signalled

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "docs" / "systemd"
log = logging.getLogger("test.sdnotify")


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(20.0)
    yield sock, path
    sock.close()


def messages_until(sock: socket.socket, wanted: str, limit: int = 200) -> list[dict[str, str]]:
    """Datagrams (as KEY=VALUE dicts) up to and including the first that sets ``wanted``."""
    got: list[dict[str, str]] = []
    for _ in range(limit):
        data = sock.recv(4096).decode()
        fields = dict(line.split("=", 1) for line in data.split("\n") if line)
        got.append(fields)
        if wanted in fields:
            return got
    raise AssertionError(f"no {wanted} in {limit} datagrams: {got}")


def test_notify_speaks_the_datagram_protocol_to_a_path_and_an_abstract_socket(
        notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    assert sdnotify.notify("READY=1", "STATUS=up\nand running", env={"NOTIFY_SOCKET": path})
    assert sock.recv(4096) == b"READY=1\nSTATUS=up and running"
    name = f"filemq-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as abstract:
        abstract.bind("\0" + name)
        abstract.settimeout(5.0)
        assert sdnotify.notify("WATCHDOG=1", env={"NOTIFY_SOCKET": "@" + name})
        assert abstract.recv(4096) == b"WATCHDOG=1"
    # Not under systemd, or systemd gone: a no-op, never an error.
    assert not sdnotify.notify("READY=1", env={})
    assert not sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": path + ".gone"})


def test_watchdog_interval_is_half_of_watchdog_usec_for_this_process_only() -> None:
    me = str(os.getpid())
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "4000000"}) == 2.0
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": me}) == 2.0
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}) is None
    assert sdnotify.watchdog_interval({}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "soon"}) is None


class Idle:
    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def test_a_wedged_event_loop_stops_the_watchdog_pings(notify_socket: tuple[socket.socket, str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The pings come from the event loop: while it is blocked, none is sent (systemd restarts)."""
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a ping every 0.05 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    wedge_s = 0.6
    arrivals: list[tuple[float, dict[str, str]]] = []

    def receive() -> None:  # like systemd: read every datagram as it arrives
        for _ in range(1000):
            data = sock.recv(4096).decode()
            arrivals.append((time.monotonic(), dict(x.split("=", 1) for x in data.split("\n"))))
            if "STOPPING" in arrivals[-1][1]:
                return

    reader = threading.Thread(target=receive)
    reader.start()
    wedged: list[float] = []

    def wedge() -> None:
        wedged.append(time.monotonic())
        time.sleep(wedge_s)  # the wedge: nothing else runs on the loop meanwhile
        wedged.append(time.monotonic())

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, wedge)
        loop.call_later(1.2, stop.set)
        return await serve_until_signalled(Idle, name="thing", where="-", describe=lambda s: "thing up",
                                           log=log, stop=stop, status=lambda s: "backlog 7 records")

    assert asyncio.run(main()) == EXIT_OK
    reader.join(timeout=20)
    kinds = [m for _, m in arrivals]
    assert kinds[0] == {"READY": "1", "STATUS": "backlog 7 records"}
    assert kinds[-1] == {"STOPPING": "1", "STATUS": "thing shutting down"}
    pings = [t for t, m in arrivals if "WATCHDOG" in m]
    assert all(m == {"WATCHDOG": "1", "STATUS": "backlog 7 records"} for m in kinds[1:-1])
    assert len(pings) >= 4, pings
    # No ping while the loop was wedged: the gap spans the whole wedge. (A ping sent just before
    # the wedge is stamped when the reader thread gets to it: 0.1 s of slack at the start, not
    # 0.01 s, for a loaded machine; one was stamped 12 ms into the wedge at load average 10.)
    assert not [t for t in pings if wedged[0] + 0.1 < t < wedged[1] - 0.01]
    assert max(b - a for a, b in zip(pings, pings[1:], strict=False)) >= wedge_s - 0.05


def _command(name: str, tmp_path: Path) -> list[str]:
    base = [sys.executable, "-m", "cli", name, "--data-dir", str(tmp_path / "data"), "--port", "0"]
    if name == "agent":
        # An unreachable collector: the agent retries with backoff and still serves locally.
        return [*base, "--device-id", "dev-1", "--collector", "127.0.0.1:9", "--sys-interval-s", "0"]
    if name == "collector":
        return [*base, "--landing", str(tmp_path / "landing")]
    return base


@pytest.mark.parametrize("name", ["broker", "agent", "collector"])
def test_process_reports_ready_pings_the_watchdog_and_reports_stopping(
        name: str, tmp_path: Path, notify_socket: tuple[socket.socket, str]) -> None:
    """`Type=notify` + `WatchdogSec=`: READY=1 after recovery and listening, STATUS= with the
    backlog, WATCHDOG=1 every WATCHDOG_USEC/2, STOPPING=1 on SIGTERM, exit 0."""
    sock, path = notify_socket
    env = dict(os.environ, PYTHONPATH=str(REPO), NOTIFY_SOCKET=path, WATCHDOG_USEC="400000")
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen(_command(name, tmp_path), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = messages_until(sock, "READY")
        assert first[-1]["READY"] == "1"
        assert "backlog" in first[-1]["STATUS"], first
        # READY=1 comes after listening: the ready line is already printed.
        assert proc.stdout is not None
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
        started = time.monotonic()
        for _ in range(3):
            ping = messages_until(sock, "WATCHDOG")[-1]
            assert ping["WATCHDOG"] == "1" and "backlog" in ping["STATUS"]
        assert time.monotonic() - started < 3 * 0.2 + 5.0
        proc.send_signal(signal.SIGTERM)
        assert messages_until(sock, "STOPPING")[-1]["STOPPING"] == "1"
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_documented_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """docs/systemd/*.service (included in docs/DEPLOYMENT.md) are valid Type=notify units."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (no systemd on this machine)")
    units = sorted(UNITS.glob("*.service"))
    assert [u.name for u in units] == ["filemq-agent.service", "filemq-broker.service",
                                       "filemq-collector.service"]
    deployment = (REPO / "docs" / "DEPLOYMENT.md").read_text()
    for unit in units:
        text = unit.read_text()
        assert "Type=notify" in text and "WatchdogSec=" in text and "NotifyAccess=main" in text
        assert text in deployment, f"{unit.name} is not included verbatim in DEPLOYMENT.md"
        # verify needs the ExecStart binary to exist: point it at a stand-in.
        fake = tmp_path / "bin" / "filemq"
        fake.parent.mkdir(exist_ok=True)
        fake.write_text("#!/bin/sh\n")
        fake.chmod(0o755)
        copy = tmp_path / unit.name
        copy.write_text(text.replace("/opt/filemq/bin/filemq", str(fake)))
        done = subprocess.run([analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True,
                              timeout=60)
        problems = [line for line in done.stderr.splitlines() if unit.name in line or "Unknown" in line]
        if done.returncode != 0 and "System has not been booted with systemd" in done.stderr:
            pytest.skip(f"systemd-analyze cannot run here: {done.stderr.strip()}")
        assert done.returncode == 0 and not problems, done.stderr
