"""Real `filemq broker` / `filemq collector` processes for the availability tests
(tests/test_admission.py, tests/test_fairness.py), and their resident memory."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filemq.broker.server import free_port

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def service(kind: str, tmp_path: Path, *extra: str,
            ws_port: int | None = None) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """``filemq broker`` or ``filemq collector`` with default settings on a free port (and a
    WebSocket listener on ``ws_port``); yields (port, process), which is killed after."""
    port = free_port()
    listen = ["--port", str(port)] if ws_port is None else \
        ["--listener", f"127.0.0.1:{port}", "--listener", f"127.0.0.1:{ws_port},protocol=websockets"]
    args = [sys.executable, "-m", "cli", kind, "--data-dir", str(tmp_path / kind), *listen, *extra]
    if kind == "collector":
        args += ["--landing", str(tmp_path / "landing")]
    proc = subprocess.Popen(args, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        assert "listening" in proc.stdout.readline()
        yield port, proc
    finally:
        proc.kill()
        proc.wait(10)


def rss_mb(pid: int) -> float:
    """The resident set of process ``pid`` in MiB (/proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")
